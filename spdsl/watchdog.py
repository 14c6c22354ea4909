"""A collective that never completes becomes an error: every wait of spdsl's collectives is
watched, and one that outlasts the bound ends the process with what it was waiting in.

Ranks that issue different collectives (or a rank that stopped) wait for each other for ever:
gloo's default timeout is 30 minutes, NCCL's can be longer, and the job holds every device
while saying nothing. Each rank numbers the collectives it issues; a daemon thread looks at the
wait in progress once a second, and when one has lasted ``timeout()`` seconds
(``SPDSL_COLLECTIVE_TIMEOUT``, default 600; ``set_timeout``) it writes one paragraph to stderr
and exits the process with status ``HANG_EXIT``: the collective's number on this rank, its
kind, bytes, group and direction, the op of the program it belongs to (``site``) and the
rank's Python stack. Each rank of a hung job writes
its own, so the first number at which their kinds differ names the divergence::

    spdsl: rank 1 waited 600 s in collective #57 (all_reduce, 4 B, group 2, backward) for
      h = x.sum(1) (model.py:41) ...
    spdsl: rank 0 waited 600 s in collective #57 (all_gather, 8.0 KiB, group 2, backward) for
      y = attn(q, k, v) (model.py:57) ...

The process cannot raise instead: the wait blocks inside the backend, where no Python
exception reaches it. A rank whose peer ended first (gloo: "Connection closed by peer") raises
``CollectiveError`` with the same description instead.

Under ``debug=True`` (``set_check_order(True)``) each collective is first compared across its
group (an all-gather of three integers: number, kind, bytes, issued by ``spdsl.collectives``
and judged by ``check_order``), and a difference raises a ``ShardingError`` on every rank
before the mismatched collective is issued, naming the op.
An all-to-all with uneven splits (a window's halo, a ragged batch) moves different bytes on
different ranks by design: its bytes are not compared, its number and kind are; so are a ring
attention's exchanges' (``send_recv``: one step's send and receive, ``spdsl.collectives.ring``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

import torch

import spdsl.env as env

HANG_EXIT = 124
KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter", "send_recv")

_bound = [float(env.value("SPDSL_COLLECTIVE_TIMEOUT"))]
_check = [False]


def timeout() -> float:
    return _bound[0]


def set_timeout(seconds: float) -> None:
    """The longest a collective may wait before the process ends with a report (seconds)."""
    if seconds <= 0:
        raise ValueError("the collective timeout must be positive")
    _bound[0] = float(seconds)


def set_check_order(on: bool) -> None:
    """Compare every collective across its group before issuing it (``debug=True``)."""
    _check[0] = bool(on)


class _Waiting:
    def __init__(self) -> None:
        self.count = 0
        self.now: tuple | None = None        # (number, kind, bytes, group, direction, op, since)
        self.thread: threading.Thread | None = None
        self.op: tuple | None = None         # the op of the collective issued last (_op_here)
        self.main = threading.main_thread().ident


_STATE = _Waiting()


def checks_order() -> bool:
    """Whether each collective is compared across its group before it is issued."""
    return _check[0]


def issued(kind: str, nbytes: int, group: str) -> int:
    """Number the collective about to be issued (0: not numbered). Under ``torch.compile``
    nothing (a compiled graph mutates no Python state; its waits are the graph's), nor on fake
    tensors (the memory planner's run of a program: no data moves, and the order check's
    values would be fake too)."""
    if torch.compiler.is_compiling() or _faking():
        return 0
    _STATE.count += 1
    _STATE.op = _op_here(sys._getframe(1))
    return _STATE.count


def last_op() -> tuple | None:
    """The op of the collective issued last (``issued``), for a wait that comes after others
    were issued (``watched``'s ``op``)."""
    return _STATE.op


def _faking() -> bool:
    from spdsl._torch import fake_mode_active
    return fake_mode_active()


def wait(t: torch.Tensor, number: int, kind: str, nbytes: int, group: str):
    """``wait_tensor(t)``, watched."""
    from spdsl._torch import functional_collectives as fc
    if torch.compiler.is_compiling():
        return fc.wait_tensor(t)
    return watched(lambda: fc.wait_tensor(t), number, kind, nbytes, group)


def watched(block, number: int, kind: str, nbytes: int, group: str, op: tuple | None = None):
    """``block()``, a wait on the collective ``issued`` numbered ``number``, watched: past the
    bound the process ends with the report; a backend that gives up raises ``CollectiveError``.
    ``op``: the op it belongs to (default: that of the collective issued last)."""
    from spdsl._torch import backward_task_id
    _ensure_thread()
    direction = "backward" if backward_task_id() >= 0 else "forward"
    _STATE.now = now = (number, kind, nbytes, group, direction,
                        _STATE.op if op is None else op, time.monotonic())
    try:
        return block()
    except RuntimeError as e:       # the backend gave up (a peer gone: its watchdog, a crash)
        op = describe(now[-2])
        raise CollectiveError(f"spdsl: rank {_rank()}: {_what(now)}"
                              f"{f' for {op}' if op else ''} failed after "
                              f"{time.monotonic() - now[-1]:.0f} s: "
                              f"{str(e).strip().splitlines()[0]}") from e
    finally:
        _STATE.now = None


class CollectiveError(RuntimeError):
    """A collective the backend failed (a rank gone, a connection closed), with what it was."""


def _what(now: tuple) -> str:
    number, kind, nbytes, group, direction, _, _ = now
    return f"collective #{number} ({kind}, {_size(nbytes)}, group {group}, {direction})"


def _ensure_thread() -> None:
    if _STATE.thread is None or not _STATE.thread.is_alive():
        _STATE.thread = threading.Thread(target=_watch, name="spdsl-watchdog", daemon=True)
        _STATE.thread.start()


def _watch() -> None:
    while True:
        time.sleep(min(1.0, _bound[0] / 4))
        now = _STATE.now
        if now is not None and time.monotonic() - now[-1] > _bound[0] \
                and _STATE.now is now:                 # still the same wait
            _report(now)
            os._exit(HANG_EXIT)


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rank() -> str:
    import torch.distributed as dist
    return str(dist.get_rank()) if dist.is_available() and dist.is_initialized() else "?"


def _report(now: tuple) -> None:
    since = now[-1]
    frame = sys._current_frames().get(_STATE.main)
    # the frames of the program, not of torch's wait
    frames = [f for f in traceback.extract_stack(frame) if os.sep + "torch" + os.sep
              not in f.filename] if frame is not None else []
    stack = "".join(traceback.format_list(frames[-6:]))
    op = describe(now[-2])
    sys.stderr.write(
        f"spdsl: rank {_rank()} waited {time.monotonic() - since:.0f} s in {_what(now)}"
        f"{f' for {op}' if op else ''} without it completing: the ranks issued different "
        f"collectives, or a rank stopped. Compare "
        f"the ranks' lines: the first number whose kinds differ is where they diverged "
        f"(debug=True raises there). Bound: SPDSL_COLLECTIVE_TIMEOUT={_bound[0]:g} s.\n"
        f"{stack}")
    sys.stderr.flush()


def order_entry(number: int, kind: str, nbytes: int) -> torch.Tensor:
    """What the order check compares across the group for the collective ``issued`` numbered:
    its number, kind and bytes (-1: bytes not compared, an uneven all-to-all)."""
    return torch.tensor([number, KINDS.index(kind), nbytes], dtype=torch.int64)


def check_order(mine: torch.Tensor, every: torch.Tensor) -> None:
    """Raise a ``ShardingError`` naming the difference unless every rank of the group is about
    to issue the same collective: ``every`` holds the group's ``order_entry`` rows in rank
    order, ``mine`` this rank's."""
    from spdsl.errors import ShardingError
    every = every.view(-1, 3)
    if bool((every == mine).all()):
        return
    issued_by = "; ".join(f"rank {r} of the group: #{int(n)} {KINDS[int(k)]}"
                          + (f" of {_size(int(b))}" if b >= 0 else "")
                          for r, (n, k, b) in enumerate(every.tolist()))
    raise ShardingError(
        rule="collective order",
        detail=f"the ranks are about to issue different collectives ({issued_by})"
        + (f", this rank's for {op}" if (op := describe(_STATE.op)) else ""),
        fix="every rank must run the same program: the same inputs' shapes (a batch that "
            "differs per rank), the same Python branches on values; the plan's collective "
            "list is the order every rank must follow")


# -- the op a collective belongs to ------------------------------------------------------------
# Found on the issuing thread when a collective is issued (the watchdog's thread reads no other
# thread's frames), kept as (a weak reference to the graph module, a line of its code) and
# described only when a report needs it. In forward, the lowered graph's frame is on the stack
# (the node it runs has the program's line as its ``stack_trace``); in backward, the
# collective's autograd node carries what its forward found (``tag``).
SITE = "spdsl_site"
_GRAPHS: dict[str, Any] = {}         # a graph module's code file name -> a weak reference to it


def _op_here(frame) -> tuple | None:
    """The op of a collective issued now, from ``frame`` (its issuer's) outwards."""
    import weakref

    from spdsl._torch import backward_task_id
    if backward_task_id() >= 0:                            # backward
        from spdsl._torch import current_autograd_node
        node = current_autograd_node()
        meta = getattr(node, "metadata", None) if node is not None else None
        return meta.get(SITE) if isinstance(meta, dict) else None
    f = frame
    for _ in range(32):
        if f is None:
            return None
        name = f.f_code.co_filename
        if name.startswith("<eval_with_key>"):
            ref = _GRAPHS.get(name)
            if ref is None or ref() is None:    # once per graph module: its frame's self
                gm = f.f_locals.get("self")
                if not isinstance(gm, torch.fx.GraphModule):
                    return None
                ref = _GRAPHS[name] = weakref.ref(gm)
            return ref, f.f_lineno - f.f_code.co_firstlineno
        f = f.f_back
    return None


def tag(t: torch.Tensor) -> None:
    """Record on ``t``'s autograd node (a collective's, in forward) the op it is issued for:
    its backward's collective is reported with it."""
    if torch.compiler.is_compiling():       # Dynamo would trace the grad_fn read
        return
    fn = t.grad_fn
    if fn is not None:
        op = _op_here(sys._getframe(1))
        if op is not None:
            fn.metadata[SITE] = op


def describe(op: tuple | None) -> str:
    """``v3 = x.sum(1) (model.py:12), in layers.3.attention``: the program's line of an op
    ``_op_here`` found, and the module the plan lists its collectives under (the plan's
    ``module`` column)."""
    if op is None:
        return ""
    ref, line = op
    gm = ref()
    lines = getattr(gm, "_lineno_map", None) or {}
    idx = lines.get(line)
    if idx is None:
        return ""
    for i, node in enumerate(gm.graph.nodes):
        if i == idx:
            text, module = _describe(node), node.meta.get("spdsl_module")
            return f"{text}, in {module}" if text and module else text
    return ""


def _describe(node, depth: int = 0) -> str:
    """``code (file:line)`` of the innermost frame of the program in ``node``'s stack trace
    (source registered with ``linecache``, ``<...>``, counts: a program built from a string);
    for a call a pass placed (a parameter's gather), the op that reads it."""
    import linecache

    from spdsl.errors import STACK_FRAME, in_libraries
    best = None
    for path, line, _fn in STACK_FRAME.findall(node.meta.get("stack_trace") or ""):
        generated = path.startswith(("<eval_with_key>", "<frozen"))
        if not generated and not in_libraries(path):
            best = path, int(line)
    if best is None:
        for user in list(node.users)[:4] if depth < 3 else ():
            found = _describe(user, depth + 1)
            if "(" in found:
                return found
        return node.meta.get("spdsl_origin") or node.name
    path, line = best
    code = linecache.getline(path, line).strip()
    where = f"{os.path.basename(path)}:{line}"
    return f"{code} ({where})" if code else where
