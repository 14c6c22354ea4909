"""What a traced graph's output depends on, and erasing the rest: the passes that rewrite
attention leave the ops they replaced (attention weights a module returns and its caller
drops), which no longer reach the output; seeded random ops and in-place updates of graph
inputs stay, as the user's program runs them."""

from __future__ import annotations

import torch

from spdsl._torch import OpOverload


def live_nodes(g: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes the output depends on (attention weights a module returns and its caller drops,
    ``nn.MultiheadAttention``'s averaged weights, are not)."""
    live: set[torch.fx.Node] = set()
    for n in reversed(g.nodes):
        if n.op != "call_function" or any(u in live for u in n.users) or _effect(n) or \
                _writes_read(n, live):
            live.add(n)
    return live


def _writes_read(n: torch.fx.Node, live: set) -> bool:
    """An in-place write into a temporary that a live node reads, through any of its views:
    DeepSeek-V2 builds its keys as ``new_empty`` filled by ``copy_`` into two slices, and
    attention reads the ``new_empty``, not the copies."""
    t = n.target
    if not isinstance(t, OpOverload) or not t._schema.is_mutable or not n.args or \
            not isinstance(n.args[0], torch.fx.Node):
        return False
    return any(u in live for a in view_family(n.args[0]) for u in a.users)


def view_family(n: torch.fx.Node) -> set[torch.fx.Node]:
    """The tensor ``n`` is a view of, and every view taken of it: what a write into one of
    them changes."""
    base = n
    while base.op == "call_function" and isinstance(base.target, OpOverload) and \
            base.target.is_view and base.args and isinstance(base.args[0], torch.fx.Node):
        base = base.args[0]
    family, todo = set(), [base]
    while todo:
        a = todo.pop()
        if a in family:
            continue
        family.add(a)
        todo += [u for u in a.users if u.op == "call_function" and
                 isinstance(u.target, OpOverload) and u.target.is_view]
    return family


def _effect(n: torch.fx.Node) -> bool:
    """Seeded random ops (the stream must advance as in the user's program) and in-place
    updates of graph inputs (running statistics) are kept even when nothing reads them; an
    in-place op on a temporary (Falcon's ``scores /= math.sqrt(d)``) is not."""
    t = n.target
    if not isinstance(t, OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in t.tags:
        return True
    if not t._schema.is_mutable:
        return False
    base = n.args[0] if n.args else None
    while isinstance(base, torch.fx.Node) and base.op == "call_function" and \
            isinstance(base.target, OpOverload) and base.target.is_view:
        base = base.args[0]
    return not isinstance(base, torch.fx.Node) or base.op != "call_function"


def sweep(g: torch.fx.Graph) -> None:
    """Erase what no longer reaches the output: the written-out attention's leftovers (its
    weights, which a module may return and its caller drop)."""
    live = live_nodes(g)
    for n in reversed(list(g.nodes)):
        if n not in live and not n.users:
            g.erase_node(n)
