"""Hugging Face causal LMs named on a command line: ``hf:DIR`` (a directory with a
``config.json``, as ``save_pretrained`` writes it) or ``hf:NAME`` for a built-in tiny config
(``TINY``). Nothing is downloaded: the model is built from its config (``from_config``), on
the meta device when planning.

The model is wrapped as ``HFCausalLM``, called like spdsl's own models: ``model(ids, labels)``
returns the loss, ``model(ids)`` the logits.

Example::

    python -m spdsl plan hf:llama-tiny --seq 4096 --sp 4
    python -m spdsl memory --model hf:/path/to/Llama-3.1-8B --sp 8 --max-seq
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any

import torch
from torch import nn

from spdsl.modelspec.cli import UsageError

_LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
               "max_position_embeddings": 131072}
# the shapes of spdsl.models.llama's LlamaConfig.tiny: dim 64, 2 layers, 4 q / 2 kv heads
TINY = {"llama-tiny": ("llama", _LLAMA_LIKE),
        "qwen2-tiny": ("qwen2", _LLAMA_LIKE),
        "mistral-tiny": ("mistral", {**_LLAMA_LIKE, "sliding_window": None})}


def is_hf_config(config: Any) -> bool:
    """A ``transformers`` config (without importing transformers)."""
    return any(c.__module__ == "transformers.configuration_utils" for c in type(config).__mro__)


def hf_config(name: str) -> Any:
    """The config ``hf:NAME`` names: a directory holding ``config.json`` (or that file), or
    one of ``TINY``.

    Example::

        cfg = hf_config("llama-tiny")      # transformers.LlamaConfig, 2 layers of width 64
    """
    try:
        import transformers
    except ImportError:
        raise UsageError(f"hf:{name} needs transformers: pip install 'spdsl[hf]'") from None
    path = os.path.dirname(name) if name.endswith(".json") and os.path.isfile(name) else name
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
            raise UsageError(f"hf:{name}: cannot read {os.path.join(path, 'config.json')} "
                             f"({type(e).__name__}: {_first_line(e)})") from None
    if name in TINY:
        family, kwargs = TINY[name]
        return transformers.AutoConfig.for_model(family, **kwargs)
    raise UsageError(
        f"hf:{name}: no directory {name!r} with a config.json, and not a built-in tiny config "
        f"({', '.join(TINY)}); nothing is downloaded: save the config on a machine with "
        "network (AutoConfig.from_pretrained(NAME).save_pretrained(DIR)) and name DIR")


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM called as ``model(ids, labels)`` (the loss) or ``model(ids)``
    (the logits), without a KV cache: ``DynamicCache`` is no tensor, and a training step has
    no use for it.

    Example::

        with torch.device("meta"):
            model = HFCausalLM(hf_config("llama-tiny"))
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM
        self.lm = AutoModelForCausalLM.from_config(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        with _one_document_per_row():
            out = self.lm(input_ids=ids, labels=labels, use_cache=False)
        return out.logits if labels is None else out.loss


@contextlib.contextmanager
def _one_document_per_row():
    # No position ids are passed, so HF makes them an arange: one document per row, which its
    # packed-sequence check (find_packed_sequence_indices) would find by reading their values.
    # On the meta device the values cannot be read, and the check fails; its answer is known.
    mu = sys.modules.get("transformers.masking_utils")
    found = getattr(mu, "find_packed_sequence_indices", None)
    if found is None:
        yield
        return
    mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = found


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]
