"""Per-layer checkpointing of a local graph: split it by layer, checkpoint each layer.

The lowering stamps every local node with the module path it came from
(``meta["spdsl_module"] == "layers.3.feed_forward.w1"``). The layer of a node is the path up
to its first numeric component (``layers.3``; ``model.layers.3`` for Hugging Face models).
Nodes before the first layer (embedding, RoPE tables) and after the last (final norm, head,
loss) are left alone; nodes between layers join the layer before them. Each layer becomes a
submodule (``torch.fx.passes.split_module``) run under non-reentrant ``checkpoint``: its input
is kept, and backward recomputes it one layer at a time, with a SAC policy deciding what of it
was saved anyway.
"""

from __future__ import annotations

import functools

import torch
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from spdsl.lower.layers import layer_of  # noqa: F401 - also read from here by remat, cli
from spdsl.remat.offload import Offloader
from spdsl.remat.policy import SavePolicy


def layer_partition(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """Partition index per node: 0 before the layers, 1..L per layer, L+1 after."""
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_module")]
    layered = [i for i, n in enumerate(calls) if layer_of(n.meta.get("spdsl_module", ""))]
    if not layered:
        return {}
    last = layered[-1]
    order: dict[str, int] = {}
    part, out = 0, {}
    for i, n in enumerate(calls):
        layer = layer_of(n.meta.get("spdsl_module", ""))
        if layer is not None:
            part = order.setdefault(layer, len(order) + 1)
        elif i > last:
            part = len(order) + 1
        out[n] = part
    return out


class Checkpointed(torch.nn.Module):
    """One layer's submodule run under checkpoint, with an optional SAC policy; with an
    ``offload`` (:class:`~spdsl.remat.offload.Offloader`), what it keeps lives on the host."""

    def __init__(self, inner: torch.nn.Module, policy=None, offload=None, index: int = 0) -> None:
        super().__init__()
        self.inner, self.policy, self.offload, self.index = inner, policy, offload, index

    def forward(self, *args):
        if not torch.is_grad_enabled():
            return self.inner(*args)
        if self.offload is not None:
            ctx = functools.partial(self.offload.sac_contexts, self.policy or SavePolicy(),
                                    self.index)
            with self.offload.layer(self.index):
                return checkpoint(self.inner, *args, use_reentrant=False, context_fn=ctx)
        if self.policy is None:
            return checkpoint(self.inner, *args, use_reentrant=False)
        ctx = functools.partial(create_selective_checkpoint_contexts, self.policy)
        return checkpoint(self.inner, *args, use_reentrant=False, context_fn=ctx)


def checkpoint_layers(gm: torch.fx.GraphModule, policy, offload: bool = False
                      ) -> torch.fx.GraphModule:
    """``gm`` with each numbered layer run under ``checkpoint`` (``policy``: a SAC policy;
    ``offload``: what the layers keep lives on the host, see ``spdsl.remat.offload``).

    Example::

        local = checkpoint_layers(local, SavePolicy())     # per-layer "full" checkpointing
    """
    parts = layer_partition(gm)
    if not parts:
        return gm
    last = max(parts.values())

    def which(node: torch.fx.Node) -> int:
        return parts.get(node, 0)

    split = split_module(gm, gm, which, keep_original_order=True)
    off = Offloader() if offload else None
    for name, sub in list(split.named_children()):
        idx = int(name.rsplit("_", 1)[-1])
        if 0 < idx < last or (idx == last and _has_layer(sub)):
            setattr(split, name, Checkpointed(sub, policy, off, idx))
    split.spdsl_offload = off
    return split


def _has_layer(sub: torch.nn.Module) -> bool:
    g = getattr(sub, "graph", None)
    return g is not None and any(layer_of(n.meta.get("spdsl_module", "")) for n in g.nodes
                                 if n.op in ("call_function", "call_module"))
