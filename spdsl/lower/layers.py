"""The layer a local node belongs to, read off the module path the lowering stamps on it
(``meta["spdsl_module"]``): per-layer checkpointing splits the graph by it
(``spdsl.remat.segments``), and the gradient buckets are placed in the layer that first
reads their parameters (``spdsl.lower.grad_buckets.bucket_gradient_reduces``)."""

from __future__ import annotations

import re

_LAYER = re.compile(r"^((?:[^.]+\.)*?\d+)(?:\.|$)")


def layer_of(module_path: str) -> str | None:
    """``"layers.3.attention.wq"`` -> ``"layers.3"``; None outside numbered layers.

    Example::

        >>> layer_of("model.layers.12.mlp"), layer_of("lm_head")
        ('model.layers.12', None)
    """
    m = _LAYER.match(module_path or "")
    return m.group(1) if m else None
