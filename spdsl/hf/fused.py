"""TRL's fused LM head (``model(..., fused_lm_head=True)``: ``SFTTrainer``'s loss and its
entropy and token-accuracy metrics) under ``sp_shard``.

TRL computes per-token log-probabilities, entropies and top-1 hits in a chunked kernel that
writes into slices of its buffers in place, which spdsl does not trace. What ``SFTTrainer``
reads of those per-token fields are their sums over the tokens, so the sharded step computes
the same quantities from the model's logits in plain PyTorch (each rank's logits are its own
tokens': ``[B, S/P, V]``) and returns their exact global sums; the output's per-token fields
hold those sums as ``[1, 1]`` tensors. A loss that weights tokens one by one (TRL's ``dft``)
needs the fields themselves: not supported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
# the kwargs of varlen attention kernels (flash attention): spdsl finds packed documents from
# the restarting position ids, and their ints (max lengths) would make a program per batch
VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def token_sums(forward: Callable) -> Callable:
    """A function of the fused head's inputs returning the loss and the sums of the per-token
    fields ``SFTTrainer`` reads (log-probabilities, entropies, top-1 hits, valid labels)."""
    def sums(**inputs) -> dict[str, torch.Tensor]:
        labels = inputs.pop("labels")
        shift_labels = inputs.pop("shift_labels", None)
        num_items = inputs.pop("num_items_in_batch", None)
        logits = forward(**inputs).logits
        if shift_labels is None:        # position i predicts label i + 1, as the model's loss
            logits, targets = logits[:, :-1], labels[:, 1:]
        else:
            targets = shift_labels
        logits = logits.float()
        vocab = logits.shape[-1]
        nll = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1),
                              ignore_index=IGNORE_INDEX, reduction="none")
        valid = targets.reshape(-1) != IGNORE_INDEX
        logp = torch.log_softmax(logits.reshape(-1, vocab), dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        # argmax takes the first maximum: TRL's hit is the label strictly above every
        # earlier logit and at least every later one
        hit = logits.reshape(-1, vocab).argmax(-1) == targets.reshape(-1)
        count = valid.sum()
        log_probs = -nll.sum()
        denominator = count.clamp(min=1) if num_items is None else num_items
        return {"loss": -log_probs / denominator, "log_probs": log_probs,
                "entropy": torch.where(valid, entropy, 0.0).sum().detach(),
                "is_top1": (hit & valid).sum(), "label_mask": count}
    return sums


def fused_output(sums: dict[str, torch.Tensor]):
    """TRL's ``FusedCausalLMOutput`` with each per-token field summed (shape ``[1, 1]``)."""
    from trl.trainer.utils import FusedCausalLMOutput
    fields = {k: v.reshape(1, 1) for k, v in sums.items() if k != "loss"}
    return FusedCausalLMOutput(loss=sums["loss"], **fields)
