"""The output projection fused into Ulysses attention pipelined by head groups.

With ``G > 1`` head groups (``spdsl.lower.ops.head_groups``) each group's output goes back to
the sequence split while the next group attends, but the last group's exchange has nothing
left to hide behind: the model's output projection waits for all of them. The projection is
linear over heads, ``o @ Wo = sum_g o_g @ Wo[rows of g]``, so it can start on the groups that
are back: :func:`fuse_output_projection` finds, in a rank's lowered program, a pipelined
attention whose only use is the projection, written as ATen lowers ``o_proj(out.transpose(1,
2).reshape(B, S, H * D))``::

    ulysses_attention -> [views back to B, H, S, D]* -> transpose(1, 2) | permute(0, 2, 1, 3)
        -> [clone | contiguous | reshape | view]* -> mm / addmm

and gives the attention node the projection's operands (``project=(wt, bias)``). The op then
projects group ``i - 1``'s output while group ``i``'s is in flight, and the last group's
exchange hides behind the others' shares (``spdsl.lower.ops.project_heads``). Exact up to
the order of the fp32 sums (G matrix products added instead of one). The exchanges are the
same ones; the plan lists them as before.

Nothing is fused with one head group (the default: there is no pipeline to extend), where
anything else reads the attention's output, its transposed form or the flat activations, or
with ``SPDSL_FUSE_PROJECTION=0``. Memory: each group's share keeps its input and the
model's weight operand (held anyway), not its copy of the group's rows of the weight, which
backward takes again (``spdsl.lower.ops._Share``): the same bytes as the unfused projection.
"""

from __future__ import annotations

import torch

import spdsl.env as env
from spdsl.lower import ops
from spdsl.lower.shapes import fill_shapes

aten = torch.ops.aten

# ``SPDSL_FUSE_PROJECTION=0``: leave the projection where the model has it (read at each
# program's build)
FUSE = env.on("SPDSL_FUSE_PROJECTION")
_ATTENTION = {ops.ulysses_attention: 8, ops.ulysses_attention_fn: 7}   # op -> index of parts
_VIEWS = {aten.clone.default, aten.contiguous.default, aten.reshape.default, aten.view.default,
          aten._unsafe_view.default}


def fuse_output_projection(gm: torch.fx.GraphModule, state: list, inputs: list) -> int:
    """Fuse the output projection into each pipelined Ulysses attention of ``gm`` that feeds
    one (in place; see the module docstring). ``state``/``inputs``: the specs of the program's
    inputs, for the local shapes where the program has none yet. Returns how many were fused.

    Example::

        local = swap_kernels(lower(prop, rank, group, outs), "auto", state, ins)
        fuse_output_projection(local, state, ins)      # 2: both layers' attention
    """
    sites = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _ATTENTION
             and n.kwargs.get("project") is None and n.args[_ATTENTION[n.target]] > 1]
    if not sites or ops.ULYSSES_GROUPS < 2 or not FUSE:
        return 0
    if any("val" not in n.meta for n in gm.graph.nodes if n.op == "call_function"):
        fill_shapes(gm, list(state) + list(inputs))
    fused = 0
    for node in sites:
        q, k = node.args[0].meta["val"], node.args[1].meta["val"]
        if len(ops.head_groups(q.shape[1], k.shape[1], node.args[_ATTENTION[node.target]])) < 2:
            continue
        found = _projection(node)
        if found is None:
            continue
        mm, chain, wt, bias = found
        with gm.graph.inserting_before(mm):
            new = gm.graph.call_function(node.target, node.args,
                                         {**node.kwargs, "project": (wt, bias)})
        new.meta = {**node.meta, "val": mm.meta["val"], "attention_val": node.meta["val"]}
        mm.replace_all_uses_with(new)
        for dead in [mm, *reversed(chain), node]:
            gm.graph.erase_node(dead)
        fused += 1
    if fused:
        gm.graph.lint()
        gm.recompile()
    return fused


def _projection(node: torch.fx.Node):
    """(the ``mm``/``addmm`` node, the view chain from the attention to it, its ``[H * D,
    D_model]`` operand, its bias or None) where ``node``'s output reaches nothing else: views
    back to the attention's ``[B, H, S, D]`` (eager attention's batched matmul), the swap of
    heads and sequence, views to ``[B * S, H * D]``."""
    b, h, s, d = node.meta["val"].shape
    x, chain, swapped = node, [], False
    while len(x.users) == 1:
        (user,) = x.users
        if not swapped and _swaps(user) and tuple(x.meta["val"].shape) == (b, h, s, d):
            swapped = True
        elif user.target not in _VIEWS:
            break
        chain.append(user)
        x = user
    else:
        return None
    if not swapped or tuple(x.meta["val"].shape) != (b * s, h * d) or \
            user.kwargs.get("beta", 1) != 1 or user.kwargs.get("alpha", 1) != 1:
        return None
    if user.target is aten.mm.default and user.args[0] is x:
        wt, bias = user.args[1], None
    elif user.target is aten.addmm.default and user.args[1] is x:
        wt, bias = user.args[2], user.args[0]
        if tuple(bias.meta["val"].shape) != (wt.meta["val"].shape[-1],):
            return None
    else:
        return None
    if wt.meta["val"].dim() != 2 or wt.meta["val"].shape[0] != h * d:
        return None
    return user, chain, wt, bias


def _swaps(n: torch.fx.Node) -> bool:
    """``transpose(1, 2)`` or ``permute(0, 2, 1, 3)`` of a 4-D value."""
    if n.target is aten.transpose.int:
        return sorted(a % 4 for a in n.args[1:3]) == [1, 2]
    return n.target is aten.permute.default and [a % 4 for a in n.args[1]] == [0, 2, 1, 3]
