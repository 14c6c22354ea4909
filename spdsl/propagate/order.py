"""One order of the traced program on every rank.

Every rank traces the user's function on its own, and a collective pairs the ranks' calls by
their order. Python can order the same work differently in each process: iterating a ``set``
of strings follows the string hashes, which ``PYTHONHASHSEED`` randomizes per process (so
under ``torchrun``, per rank). Hugging Face's Gemma 3 computes its rotary tables with
``for layer_type in set(config.layer_types)``: rank 0 may trace the sliding layers' table first
and rank 1 the full layers' one. Each rank's program is right on its own, but an exchange placed
on one table pairs with the other table's on the next rank, and the step trains on a mix
(measured: loss off by 1.7e-3 and gradients by 137% at SP 2, against 1e-7 with one order).

:func:`structure_keys` names each node by what it computes, not by where it stands (the op,
its constants and the keys of its inputs; state and inputs by their position); the ranks
compare one digest of the sequence (two small all-reduces per build), and where it differs
every rank merges the nodes that compute the same value (:func:`merge_equal`) and takes the
order of the mesh's first rank (:func:`follow`). A rank whose program
holds other work (Python that branched differently per rank) gets a :class:`ShardingError`
before any exchange instead of a hang or a wrong step.

Example::

    keys = structure_keys(traced.graph)      # one key per node, the same on every rank
    follow(traced.graph, keys_of_rank_0)     # this rank's nodes, in rank 0's order
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict, deque

import torch

from spdsl._torch import OpOverload
from spdsl.errors import ShardingError
from spdsl.propagate.liveness import view_family

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# fresh memory: two of them are two buffers, whatever their equal keys say
_UNINITIALIZED = frozenset({"empty", "empty_like", "new_empty", "new_empty_strided",
                            "empty_strided", "empty_permuted"})


def structure_keys(gm: torch.fx.GraphModule) -> list[str]:
    """A key per node of ``gm`` (in its order) naming the value it computes: equal keys on two
    ranks are the same op on the same inputs, whatever the nodes are called."""
    keys: dict[torch.fx.Node, str] = {}
    n_ph = 0
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            text = f"placeholder {n_ph}"
            n_ph += 1
        elif node.op == "get_attr":
            text = "get_attr " + _attr_text(gm, node.target)
        else:
            args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _Ref(keys[n]))
            text = f"{node.op} {_target_text(node.target)} {_ADDRESS.sub('', repr(args))}"
        keys[node] = hashlib.sha1(text.encode()).hexdigest()[:20]
    return [keys[n] for n in gm.graph.nodes]


def merge_equal(gm: torch.fx.GraphModule) -> int:
    """Keep one of each set of nodes that compute the same value (equal keys, no side effect,
    no random draw); the number removed. Run on every rank alike where their orders differ:
    two equal nodes (the same positions read by two rotary tables, say) would otherwise be
    matched to the other rank's in either way, and an input could land after its use."""
    written: set[torch.fx.Node] = set()       # written in place: not a value of its key alone
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, OpOverload) and \
                node.target._schema.is_mutable and node.args and \
                isinstance(node.args[0], torch.fx.Node):
            written |= view_family(node.args[0])
    first: dict[str, torch.fx.Node] = {}
    removed = 0
    for node, key in zip(list(gm.graph.nodes), structure_keys(gm)):
        if node.op != "call_function" or node in written or \
                node.is_impure(impure_random=True) or \
                getattr(node.target, "_opname", "") in _UNINITIALIZED:
            continue
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
            removed += 1
        else:
            first[key] = node
    if removed:
        gm.recompile()
    return removed


def digest(keys: list[str]) -> int:
    """The sequence of keys as one signed 63-bit integer (an all-reduce compares it)."""
    return int(hashlib.sha1(" ".join(keys).encode()).hexdigest()[:15], 16)


def follow(gm: torch.fx.GraphModule, order: list[str]) -> bool:
    """Move ``gm``'s nodes into ``order`` (another rank's :func:`structure_keys`); False if
    they already stand so. Nodes of equal keys compute the same value, so which of them takes
    which place does not matter as long as every input comes before its use."""
    mine = structure_keys(gm)
    if mine == order:
        return False
    if Counter(mine) != Counter(order):
        ours, theirs = Counter(mine), Counter(order)
        raise _different_programs(sum((ours - theirs).values()), sum((theirs - ours).values()),
                                  _first_other(gm, mine, theirs))
    pool: dict[str, deque] = defaultdict(deque)
    for node, key in zip(gm.graph.nodes, mine):
        pool[key].append(node)
    placed: set[torch.fx.Node] = set()
    prev = None
    for key in order:
        candidates = pool[key]
        # of equal nodes, the first whose inputs already stand
        node = next((n for n in candidates if all(a in placed for a in n.all_input_nodes)),
                    candidates[0])
        candidates.remove(node)
        if prev is None:
            first = next(iter(gm.graph.nodes))
            if node is not first:
                first.prepend(node)
        else:
            prev.append(node)
        placed.add(node)
        prev = node
    try:
        gm.graph.lint()
    except RuntimeError as e:
        raise _different_programs(0, 0, str(e).splitlines()[0]) from e
    gm.recompile()
    return True


class _Ref:
    """A node inside another node's arguments: printed as its key."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"%{self.key}"


def _target_text(target) -> str:
    if isinstance(target, str):
        return target
    name = getattr(target, "name", None)            # OpOverload: "aten::mm"
    if callable(name):
        return f"{name()}.{getattr(target, '_overloadname', '')}"
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', repr(target))}"


def _attr_text(gm: torch.fx.GraphModule, target: str) -> str:
    """A constant or submodule by its content: lifted constants are numbered in the order they
    were met, which is what differs."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    if isinstance(obj, torch.Tensor):
        data = obj.detach()
        if data.device.type == "meta" or data.numel() > 4096:
            return f"tensor {tuple(data.shape)} {data.dtype}"
        raw = data.cpu().contiguous().view(-1).view(torch.uint8) if data.numel() else data
        return f"tensor {tuple(data.shape)} {data.dtype} " + \
            hashlib.sha1(bytes(raw.tolist())).hexdigest()
    if isinstance(obj, torch.fx.GraphModule):
        return "graph " + " ".join(structure_keys(obj))
    return type(obj).__qualname__


def _first_other(gm: torch.fx.GraphModule, mine: list[str], theirs: Counter) -> str:
    for node, key in zip(gm.graph.nodes, mine):
        if theirs[key] == 0:
            trace = node.meta.get("stack_trace", "") or ""
            lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
            return f"{node.format_node()}" + (f" ({lines[-2]})" if len(lines) >= 2 else "")
    return ""


def _different_programs(more: int, fewer: int, where: str) -> ShardingError:
    detail = ("the ranks traced different programs" +
              (f": this rank has {more} operations the first rank has not, and lacks {fewer} "
               "of its" if more or fewer else ": the first rank's order does not fit this "
                                                 "rank's program") +
              "; their exchanges would pair different tensors")
    return ShardingError(
        rule="one program on every rank", detail=detail, where=where,
        fix="make the function's Python the same on every rank (no branch on the rank, the "
            "host or the time); for iteration over sets, set PYTHONHASHSEED to one value for "
            "every rank (export PYTHONHASHSEED=0 before torchrun)")
