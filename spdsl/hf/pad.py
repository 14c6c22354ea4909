"""Right-pad a Hugging Face batch to a sequence length the sp ranks divide.

A causal LM's real tokens never attend to tokens after them, so tokens appended on the right
change none of their outputs; their labels are -100 (no loss, not counted in
``num_items_in_batch``, which the Trainer counts before the batch gets here) and their
attention mask is 0. The loss and every gradient are those of the unpadded batch.
"""

from __future__ import annotations

import torch

from spdsl.errors import ShardingError

IGNORE_INDEX = -100
# what an appended token holds, per input name; the rest get 0 (a token id, a type id)
_FILL = {"labels": IGNORE_INDEX, "shift_labels": IGNORE_INDEX, "attention_mask": 0}


def sequence_length(inputs: dict) -> int | None:
    """The sequence length of a batch: dim 1 of ``input_ids`` (else of ``labels``)."""
    for name in ("input_ids", "labels", "inputs_embeds"):
        x = inputs.get(name)
        if torch.is_tensor(x) and x.dim() >= 2:
            return x.shape[1]
    return None


def pad_batch(inputs: dict, multiple: int) -> dict:
    """``inputs`` with every sequence-shaped tensor padded on the right to a multiple of
    ``multiple`` tokens (unchanged when it already is one).

    Example::

        batch = pad_batch({"input_ids": ids, "labels": labels}, 4)   # [2, 30] -> [2, 32]
    """
    n = sequence_length(inputs)
    if n is None or n % multiple == 0:
        return inputs
    extra = -n % multiple
    out = dict(inputs)
    for name, x in inputs.items():
        if not torch.is_tensor(x) or x.dim() < 2 or x.shape[1] != n:
            continue
        if x.dim() > 3 or (name == "attention_mask" and x.dim() > 2):
            raise ShardingError(
                rule="divisible sequence", where=f"input {name!r}",
                detail=f"{n} tokens do not split over {multiple} ranks, and a {x.dim()}-D "
                       f"{name!r} cannot be padded here",
                fix=f"pad the batch to a multiple of {multiple} tokens in the data collator "
                    f"(e.g. DataCollatorForLanguageModeling(..., pad_to_multiple_of={multiple}))")
        if name == "position_ids":
            # positions continue the row's last one: the appended tokens extend its last document
            step = torch.arange(1, extra + 1, device=x.device, dtype=x.dtype)
            tail = x[:, -1:] + step
        else:
            tail = x.new_full((x.shape[0], extra, *x.shape[2:]), _FILL.get(name, 0))
        out[name] = torch.cat([x, tail], dim=1)
    return out
