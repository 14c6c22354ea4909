"""Ring attention's exchange and its op: ``Ring`` passes a tensor to the next rank of a ring
(point to point), and ``torch.ops.spdsl.ring_attn`` (+ ``ring_attn_backward``) runs the steps of
:mod:`spdsl.kernels.ring_attn` with it.

The op is one node for FX and ``torch.compile`` (its fake gives the shapes, its backward is the
second op), so the exchange runs eagerly inside it, compiled or not. Each step's send and
receive are posted together (``batch_isend_irecv``) before the step computes and waited after,
so the transfer overlaps the step's attention. Each exchange is a collective of
``spdsl.watchdog`` (kind ``send_recv``): numbered where posted, its wait watched with the bound
(a ring whose neighbour never sends ends with the report), compared across the ring's group
under the order check (number and kind: the pieces of a ring may differ in bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import spdsl.watchdog as watchdog
from spdsl._torch import process_group
from spdsl.collectives.raw import _issued
from spdsl.kernels import ring_attn as kernel

KIND = "send_recv"     # the watchdog's name of one exchange: a send and a receive


class _Received:
    def __init__(self, works, buf: torch.Tensor, watch: tuple) -> None:
        self.works, self.buf, self.watch = works, buf, watch

    def wait(self) -> torch.Tensor:
        number, nbytes, group, op = self.watch
        watchdog.watched(self._wait, number, KIND, nbytes, group, op)
        self.works = ()     # the works hold the sent tensor: it goes now, not at the next shift
        return self.buf

    def _wait(self) -> None:
        for w in self.works:
            w.wait()


class Ring:
    """The neighbours of ``rank`` in the ring of ``parts`` ranks over the process group named
    ``group``, and the exchange with them (``spdsl.kernels.ring_attn.Exchange``).

    Example (each rank's ``x`` to the next rank, the previous rank's received)::

        got = Ring(dist.group.WORLD.group_name, 4, dist.get_rank()).shift(x, 7).wait()
    """

    def __init__(self, group: str, parts: int, rank: int) -> None:
        self.group, self.pg = group, process_group(group)
        self.next = dist.get_global_rank(self.pg, (rank + 1) % parts)
        self.prev = dist.get_global_rank(self.pg, (rank - 1) % parts)

    def shift(self, x: torch.Tensor, tag: int) -> _Received:
        """Send ``x`` to the next rank, receive the previous rank's into a new buffer."""
        x = x.contiguous()
        buf = torch.empty_like(x)
        nbytes = x.numel() * x.element_size()
        number = _issued(KIND, nbytes, self.group, even=False)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, self.next, self.pg, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.pg, tag)])
        return _Received(works, buf, (number, nbytes, self.group, watchdog.last_op()))


def _ring(group: str, parts: int, rank: int) -> Ring | None:
    return Ring(group, parts, rank) if parts > 1 else None


@torch.library.custom_op("spdsl::ring_attn", mutates_args=())
def _ring_attn_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  leaves: list[torch.Tensor], program: str, causal: bool, scale: float,
                  layout: str, parts: int, rank: int, group: str,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel.forward(q, k, v, leaves, program, causal, scale, layout, parts, rank,
                          _ring(group, parts, rank))


@_ring_attn_op.register_fake
def _(q, k, v, leaves, program, causal, scale, layout, parts, rank, group):
    b, h, s_q, _ = q.shape
    return (q.new_empty((b, h, s_q, v.shape[-1])),
            q.new_empty((b, h, s_q, 2), dtype=torch.promote_types(q.dtype, torch.float32)))


@torch.library.custom_op("spdsl::ring_attn_backward", mutates_args=())
def _ring_attn_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                           v: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
                           leaves: list[torch.Tensor], program: str, causal: bool, scale: float,
                           layout: str, parts: int, rank: int, group: str,
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel.backward(dout, q, k, v, out, stats, leaves, program, causal, scale, layout,
                           parts, rank, _ring(group, parts, rank))


@_ring_attn_backward_op.register_fake
def _(dout, q, k, v, out, stats, leaves, program, causal, scale, layout, parts, rank, group):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, leaves, program, causal, scale, layout, parts, rank, group = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, stats, *leaves)
    ctx.args = (program, causal, scale, layout, parts, rank, group)


def _backward_rule(ctx, dout, dstats):
    q, k, v, out, stats, *leaves = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _ring_attn_backward_op(dout, q, k, v, out, stats, leaves, *ctx.args)
    return (dq, dk, dv, [None] * len(leaves)) + (None,) * 7


_ring_attn_op.register_autograd(_backward_rule, setup_context=_setup_context)


def ring_attn_program(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      leaves: list[torch.Tensor], program: str, causal: bool, scale: float,
                      layout: str, parts: int, rank: int, group: str) -> torch.Tensor:
    """The op on a registered mask program (``program``, "" for none): the output, its
    autograd node tagged with the op of the program that runs it (``spdsl.watchdog.tag``), so
    that its backward's exchanges are reported with it."""
    out, _ = torch.ops.spdsl.ring_attn(q, k, v, leaves, program, causal, scale, layout, parts,
                                       rank, group)
    watchdog.tag(out)
    return out


def ring_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: str, parts: int,
              rank: int, mask_fn=None, leaves: list[torch.Tensor] = (), causal: bool = False,
              scale: float | None = None, layout: str = "contiguous") -> torch.Tensor:
    """Attention over the whole sequence for this rank's piece of the queries, its keys and
    values passing around the ring of ``parts`` ranks of the process group named ``group``
    (see :mod:`spdsl.kernels.ring_attn`). ``mask_fn(*leaves)`` as in
    :func:`spdsl.kernels.masked_attn.masked_attn`, with global leaves.

    Example (4 ranks, each holding a quarter of a causal sequence)::

        pg = dist.group.WORLD
        o = ring_attn(q_piece, k_piece, v_piece, group=pg.group_name, parts=4,
                      rank=dist.get_rank(), causal=True)
    """
    from spdsl.kernels.masked_attn import register_mask_program
    if layout not in kernel.LAYOUTS:
        raise ValueError(f"layout must be one of {kernel.LAYOUTS}, not {layout!r}")
    key = mask_fn if isinstance(mask_fn, str) or mask_fn is None else \
        register_mask_program(mask_fn, getattr(mask_fn, "__name__", "mask"))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return ring_attn_program(q, k, v, list(leaves), key or "", bool(causal), scale, layout,
                             parts, rank, group)
