"""Tiling: run a per-token region of the local graph in sequence chunks.

A feed-forward block is a function of each token alone, so it can run on chunks of the
sequence: forward keeps only the block's input, and backward recomputes one chunk at a time
(ALST's TiledMLP). The ``[tokens, ffn]`` intermediates then never exist for more than one chunk.
Exact: every output row is computed from the same row of input by the same ops; only the weight
gradient is summed in chunks (fp32 rounding order, ~1e-7 relative).

A region qualifies when it sits under one child module of a numbered layer, holds at least two
matmuls, uses only per-token ops, and has one sequence-shaped input and one output of the same
shape. Weight-side nodes (``t(W)``, the gradient all-reduce marker) stay outside it, so a
replicated weight's gradient is still all-reduced once, not once per chunk.
"""

from __future__ import annotations

import math
import operator

import torch

from spdsl.remat import policy as _policy
from spdsl.remat.segments import layer_of

aten = torch.ops.aten
ROWWISE = {
    aten.mm.default, aten.addmm.default, aten.reshape.default, aten.view.default,
    aten._unsafe_view.default, aten.silu.default, aten.gelu.default, aten.relu.default,
    aten.sigmoid.default, aten.tanh.default, aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor,
    aten.div.Tensor, aten.neg.default, aten._to_copy.default, aten.clone.default,
    aten.detach.default, aten.pow.Tensor_Scalar, aten.mul.Scalar, aten.add.Scalar,
    operator.getitem,
}
_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


class _TiledRowsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, region, chunks: int, dim: int, x: torch.Tensor, *ws: torch.Tensor):
        ctx.region, ctx.chunks, ctx.dim = region, chunks, dim
        ctx.save_for_backward(x, *ws)
        _policy._IN_TILE[0] += 1
        try:
            # .forward: module hooks (ModTracker, MemTracker) must not see per-chunk calls
            return torch.cat([region.forward(xc, *ws) for xc in x.chunk(chunks, dim)], dim)
        finally:
            _policy._IN_TILE[0] -= 1

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, *ws = ctx.saved_tensors
        dim = ctx.dim
        dx = torch.empty_like(x) if ctx.needs_input_grad[3] else None
        dws: list[torch.Tensor | None] = [None] * len(ws)
        wd = [w.detach().requires_grad_(ctx.needs_input_grad[4 + i]) for i, w in enumerate(ws)]
        start = 0
        for xc, gc in zip(x.chunk(ctx.chunks, dim), grad.chunk(ctx.chunks, dim)):
            xc = xc.detach().requires_grad_(dx is not None)
            with torch.enable_grad():
                yc = ctx.region.forward(xc, *wd)
            wants = ([xc] if dx is not None else []) + [w for w in wd if w.requires_grad]
            got = list(torch.autograd.grad(yc, wants, gc))
            if dx is not None:
                dx.narrow(dim, start, xc.shape[dim]).copy_(got.pop(0))
            for i, w in enumerate(wd):
                if w.requires_grad:
                    g = got.pop(0)
                    dws[i] = g if dws[i] is None else dws[i].add_(g)
            start += xc.shape[dim]
        return (None, None, None, dx, *dws)


class TiledRows(torch.nn.Module):
    """``region(x, *ws)`` evaluated on ``chunks`` slices of ``x`` along ``dim``."""

    def __init__(self, region: torch.fx.GraphModule, chunks: int, dim: int) -> None:
        super().__init__()
        self.region, self.chunks, self.dim = region, chunks, dim

    def forward(self, x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
        if self.chunks <= 1:
            return self.region(x, *ws)
        return _TiledRowsFn.apply(self.region, self.chunks, self.dim, x, *ws)


def _data_dependent(gm: torch.fx.GraphModule, n_state: int) -> set[torch.fx.Node]:
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    dep = set(phs[n_state:])
    for n in gm.graph.nodes:
        if n.op == "call_function" and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def mlp_regions(gm: torch.fx.GraphModule, n_state: int) -> list[dict]:
    """Candidate per-token regions: ``{"nodes", "x", "ws", "y", "dim", "ffn_bytes"}``."""
    dep = _data_dependent(gm, n_state)
    groups: dict[str, list[torch.fx.Node]] = {}
    for n in gm.graph.nodes:
        path = n.meta.get("spdsl_module", "")
        layer = layer_of(path)
        if n.op != "call_function" or layer is None or n not in dep or path == layer:
            continue
        child = layer + "." + path[len(layer) + 1:].split(".")[0]
        groups.setdefault(child, []).append(n)
    found = []
    for nodes in groups.values():
        r = _region(nodes, dep)
        if r is not None:
            found.append(r)
    return found


def _region(nodes: list[torch.fx.Node], dep: set) -> dict | None:
    inside = set(nodes)
    if any(n.target not in ROWWISE for n in nodes):
        return None
    if sum(n.target in (aten.mm.default, aten.addmm.default) for n in nodes) < 2:
        return None
    ext = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside and a not in ext:
                ext.append(a)
    xs = [a for a in ext if a in dep]
    outs = [n for n in nodes if any(u not in inside for u in n.users)]
    if len(xs) != 1 or len(outs) != 1:
        return None
    x, y = xs[0], outs[0]
    xv, yv = x.meta.get("val"), y.meta.get("val")
    if not isinstance(xv, torch.Tensor) or not isinstance(yv, torch.Tensor) or \
            xv.shape != yv.shape or xv.dim() < 2:
        return None
    dim = 1 if xv.dim() >= 3 else 0          # [B, S, D] or [T, D]
    biggest = max(v.numel() * v.element_size() for v in
                  (n.meta.get("val") for n in nodes) if isinstance(v, torch.Tensor))
    return {"nodes": nodes, "x": x, "ws": [a for a in ext if a is not x], "y": y, "dim": dim,
            "ffn_bytes": biggest, "seq": xv.shape[dim], "outer": math.prod(xv.shape[:dim])}


def _chunk_shape(shape, outer: int) -> list[int]:
    """-1 at the dim that holds the sequence factor: the first whose leading product exceeds
    the product of the dims before the sequence (row-major flattening keeps it there)."""
    shape = list(shape)
    for i in range(len(shape)):
        if math.prod(shape[: i + 1]) > outer:
            shape[i] = -1
            return shape
    raise ValueError(f"no sequence dim in {shape}")


def tile_region(gm: torch.fx.GraphModule, region: dict, chunks: int, name: str) -> None:
    """Replace ``region`` in ``gm`` by a :class:`TiledRows` submodule call, in place."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {region["x"]: g.placeholder("x")}
    for i, w in enumerate(region["ws"]):
        env[w] = g.placeholder(f"w{i}")
    for n in region["nodes"]:
        new = g.node_copy(n, lambda a: env[a])
        if n.target in _VIEWS:
            # a chunk of a [B, S, D] input along S is not contiguous when B > 1: a view of it
            # may not exist, a reshape copies where it must
            new.target = aten.reshape.default
            new.args = (new.args[0], _chunk_shape(n.args[1], region["outer"])) + new.args[2:]
        env[n] = new
    g.output(env[region["y"]])
    sub = torch.fx.GraphModule(gm, g)
    gm.add_submodule(name, TiledRows(sub, min(chunks, region["seq"]), region["dim"]))
    with gm.graph.inserting_before(region["y"]):
        call = gm.graph.call_module(name, (region["x"], *region["ws"]))
    call.meta.update({k: region["y"].meta[k] for k in ("spdsl_module", "val")
                      if k in region["y"].meta})
    region["y"].replace_all_uses_with(call)
    for n in reversed(region["nodes"]):
        gm.graph.erase_node(n)
