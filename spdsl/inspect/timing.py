"""Exposed and hidden communication of one step, from a cost model of the program that runs.

``plan.timing()`` walks the rank's final local program (``spdsl.inspect.program``: the same
calls ``plan.collectives`` lists, in order) on two resources, the rank's compute and its link,
and reports for every transfer how long it takes and how much of it the compute waits for
(**exposed**); the rest ran while the rank computed (**hidden**). What can hide what is what
the program does:

==========================  ===============================================================
call                        overlaps with
==========================  ===============================================================
Ulysses, G head groups      group i + 1's q/k/v exchange with group i's attention, group
                            i's output exchange with group i + 1's attention (backward
                            mirrors it); the last group's output exchange with the other
                            groups' shares of the output projection, where it is fused in
                            (``spdsl.lower.project``); one group (the default): nothing
gradient bucket             the rest of backward: started when its last gradient is known,
                            waited when backward ends (``SPDSL_GRAD_OVERLAP``; compiled
                            steps and ``SPDSL_GRAD_OVERLAP=0`` wait where it starts)
ring / hybrid step          the block attention of the piece it already has
everything else             nothing: waited where it is issued
==========================  ===============================================================

The model's figures are the plan's device model (``spdsl.propagate.attention_choice.
device_model``: the same ``Links`` the attention choice priced; a meta-device plan is one for
CUDA accelerators): a transfer takes ``latency + bytes on the wire /
bandwidth`` (all-to-all, reduce-scatter, all-gather: ``(P - 1) / P`` of the buffer; ring
all-reduce twice that; send/recv and halo the buffer), the fast links inside a node and the
slow ones across; one transfer at a time per rank. Compute is matmul and attention FLOPs at
``flops_per_s`` (backward twice forward for matmuls, 2.5 times for attention, whose backward
recomputes the scores; checkpointed layers run their forward again; causal attention and mask
programs count half the scores). Elementwise work is not counted: the model says what the
links cost against the FLOPs, not the step's wall time. The profiler measures the same
shares on a run (``bench/overlap.py``).

Example::

    plan = spdsl.plan(spdsl.sp_shard(seq=4)(model), ids, ids)
    t = plan.timing()                      # the plan's device model (its attention choice's)
    t.exposed_s, t.hidden_s, t.exposed_share
    print(t)                               # per purpose: seconds, exposed, hidden, behind what
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

import torch

from spdsl.inspect.flops import (
    ATTENTION_BWD,
    MATMUL_BWD,
    flops_of,
    is_attention,
    projection_flops,
    ring_slowdown,
)
from spdsl.inspect.plan import Collective
from spdsl.inspect.program import Event
from spdsl.propagate.attention_choice import Links


@dataclass(frozen=True)
class Transfer:
    """One collective in one pass: ``seconds`` on the link, ``exposed`` of them waited for by
    the compute; ``behind``: what the rest ran under ("" where nothing can)."""

    collective: Collective
    phase: str            # forward | backward | recompute
    seconds: float
    exposed: float
    behind: str = ""

    @property
    def hidden(self) -> float:
        return max(0.0, self.seconds - self.exposed)


@dataclass(frozen=True)
class Timing:
    """The modelled step of one rank: ``compute_s`` (FLOPs at the links' rate; ``flops``
    splits them into matmul and attention, forward, backward and recomputation together),
    ``step_s`` = compute + what it waited for; ``transfers`` in the order they run."""

    links: Links
    compute_s: float
    step_s: float
    comm_s: float
    transfers: tuple[Transfer, ...] = field(default_factory=tuple)   # () read from JSON
    flops: dict = field(default_factory=dict)     # matmul | attention -> the step's FLOPs

    @property
    def exposed_s(self) -> float:
        return self.step_s - self.compute_s

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.comm_s - self.exposed_s)

    @property
    def exposed_share(self) -> float:
        """Exposed communication as a share of the modelled step."""
        return self.exposed_s / self.step_s if self.step_s else 0.0

    def by_purpose(self) -> dict[str, tuple[float, float, str]]:
        """purpose -> (seconds, exposed seconds, what hid the rest: each thing once, in the
        order first met, joined by "and")."""
        out: dict[str, tuple[float, float, str]] = {}
        for t in self.transfers:
            s, e, b = out.get(t.collective.purpose, (0.0, 0.0, ""))
            if t.behind and t.behind not in b.split(" and "):
                b = f"{b} and {t.behind}" if b else t.behind
            out[t.collective.purpose] = (s + t.seconds, e + t.exposed, b)
        return out

    def summary(self) -> str:
        """One line: communication, exposed (share of the step), hidden."""
        return (f"{_ms(self.comm_s)} a step, {_ms(self.exposed_s)} exposed "
                f"({100 * self.exposed_share:.1f}% of a {_ms(self.step_s)} step), "
                f"{_ms(self.hidden_s)} hidden")

    def to_dict(self) -> dict:
        """The figures without the transfers (the plan's JSON ``timing``)."""
        return {"links": dataclasses.asdict(self.links), "compute_s": self.compute_s,
                "step_s": self.step_s, "comm_s": self.comm_s, "flops": dict(self.flops)}

    @classmethod
    def from_dict(cls, d: dict) -> Timing:
        return cls(Links(**d["links"]), d["compute_s"], d["step_s"], d["comm_s"],
                   flops=dict(d.get("flops", {})))

    def __str__(self) -> str:
        ln = self.links
        lines = [f"communication (cost model: {ln.intra_bytes_per_s / 1e9:g} GB/s inside a node "
                 f"of {ln.node_ranks}, {ln.inter_bytes_per_s / 1e9:g} GB/s across, "
                 f"{ln.latency_s * 1e6:g} us, {ln.flops_per_s / 1e12:g} TFLOP/s): "
                 + self.summary()]
        for purpose, (s, e, behind) in self.by_purpose().items():
            hid = f", {_ms(s - e)} hidden behind {behind}" if s - e >= 5e-7 and behind else ""
            lines.append(f"  {purpose:10} {_ms(s)}, {_ms(e)} exposed{hid}")
        return "\n".join(lines)


def _ms(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms" if s >= 5e-7 else "0 ms"


@dataclass(frozen=True)
class Schedule:
    """What :func:`simulate` reads of a plan's program (its top-level graph): its events
    (``program_events``),
    the plan's collectives of each call event (``None`` for ops), those outside the
    program (the input gradient's gathers, run after backward), each axis's ranks, and how
    gradient buckets run."""

    program: torch.fx.GraphModule
    events: tuple[Event, ...]
    collectives: tuple[Collective | None, ...]
    after: tuple[Collective, ...]
    sizes: dict[str, int]
    links: Links                # the plan's device model (spdsl.pipeline.device_of)
    buckets_overlap: bool
    before: tuple[Collective, ...] = ()     # run by the call before the program (the check)


def simulate(schedule: Schedule, links: Links | None = None) -> Timing:
    """The modelled step of ``schedule`` under ``links`` (default: the plan's device model,
    the one its attention choice priced)."""
    links = links or schedule.links
    return _Sim(schedule, links).run()


class _Sim:
    def __init__(self, sched: Schedule, links: Links) -> None:
        self.s, self.links = sched, links
        self.now = self.link = self.compute = 0.0
        self.flops = {"matmul": 0.0, "attention": 0.0}
        self.out: list[Transfer] = []

    # -- the two resources ------------------------------------------------------------------

    def _seconds(self, c: Collective, nbytes: int) -> float:
        p = self.s.sizes.get(c.axis, max(self.s.sizes.values(), default=1))
        if p <= 1 or nbytes <= 0:
            return 0.0
        wire = {"all_to_all": (p - 1) / p, "reduce_scatter": (p - 1) / p,
                "all_gather": p - 1, "all_reduce": 2 * (p - 1) / p}.get(c.kind, 1.0)
        bw = self.links.intra_bytes_per_s if p <= self.links.node_ranks else \
            self.links.inter_bytes_per_s
        return self.links.latency_s + nbytes * wire / bw

    def _issue(self, c: Collective, nbytes: int, phase: str) -> tuple[float, float, str]:
        t = self._seconds(c, nbytes)
        start = max(self.now, self.link)
        self.link = start + t
        return (self.link, t, phase)

    def _wait(self, pending: list, c: list[Collective], behind: str = "") -> None:
        """Wait for ``pending`` transfers (``(end, seconds, phase)``) of ``c``; the stall is
        charged to the latest ones first, each at most its own seconds."""
        if not pending:
            return
        stall = max(0.0, max(p[0] for p in pending) - self.now)
        self.now += stall
        charged = []
        for (end, t, phase), coll in sorted(zip(pending, c), key=lambda x: -x[0][0]):
            e = min(t, stall) if stall > 1e-15 else 0.0    # below: float noise, not a wait
            stall -= e
            charged.append(Transfer(coll, phase, t, e, behind if t > e else ""))
        self.out += reversed(charged)

    def _sync(self, c: Collective, nbytes: int, phase: str) -> None:
        if nbytes:
            self._wait([self._issue(c, nbytes, phase)], [c])

    def _work(self, flops: float, kind: str, slower: float = 1.0) -> None:
        seconds = flops * slower / self.links.flops_per_s
        self.flops[kind] += flops
        self.now += seconds
        self.compute += seconds

    # -- the program ------------------------------------------------------------------------

    def run(self) -> Timing:
        events = list(zip(self.s.events, self.s.collectives))
        units = _units(events)
        for c in self.s.before:
            self._sync(c, c.bytes, "forward")
        for u in units:
            self._forward(u)
        order, parent = _layout(self.s.program)     # once: 259 buckets of 3,300 nodes at 8B
        buckets = [(u, _ready(u, self.s.program, order, parent)) for u in units
                   if _is_bucket(u)]
        started: list = []
        by_top: dict = {}            # one pass, not one per top (3,009 of them at 8B)
        for u in units:
            by_top.setdefault(u[0][0].top, []).append(u)
        for top in sorted(by_top, reverse=True):
            mine = by_top[top]
            for u in mine:                   # a checkpointed layer: its forward again
                if u[0][0].region is not None:
                    self._forward(u, again=True)
            for u in reversed(mine):
                self._backward(u)
            for b in [b for b in buckets if b[1] >= top]:     # its last gradient is known
                buckets.remove(b)
                c = b[0][0][1]
                if self.s.buckets_overlap:
                    started.append((self._issue(c, c.bytes_bwd, "backward"), c))
                else:
                    self._sync(c, c.bytes_bwd, "backward")
        for c in self.s.after:
            self._sync(c, c.bytes_bwd, "backward")
        self._wait([p for p, _ in started], [c for _, c in started], "backward compute")
        return Timing(self.links, self.compute, self.now, sum(t.seconds for t in self.out),
                      tuple(self.out), dict(self.flops))

    def _forward(self, unit: list, again: bool = False) -> None:
        e = unit[0][0]
        calls = [c for ev, c in unit if c is not None and ev.recomputed == again]
        flops = flops_of(e)
        if e.call is None:
            self._work(flops, "attention" if is_attention(e.node) else "matmul")
            return
        phase = "recompute" if again else "forward"
        if _is_bucket(unit):
            return
        if is_attention(e.node):
            self._attention(e.node, calls, flops, 1.0, phase,
                            (lambda c: c.bytes_bwd) if again else (lambda c: c.bytes))
        else:
            for c in calls:
                self._sync(c, c.bytes_bwd if again else c.bytes, phase)

    def _backward(self, unit: list) -> None:
        e = unit[0][0]
        if not e.grad:
            return
        flops = flops_of(e)
        if e.call is None:
            bwd = ATTENTION_BWD if is_attention(e.node) else MATMUL_BWD
            if getattr(e.module, "chunks", 1) > 1:     # a tiled MLP runs each chunk again
                bwd += 1.0
            self._work(flops * bwd, "attention" if is_attention(e.node) else "matmul")
            return
        if _is_bucket(unit):
            return
        calls = [c for ev, c in unit if c is not None and not ev.recomputed]
        if is_attention(e.node):        # the output's gradient in first, q/k/v's out last
            self._attention(e.node, _mirror(calls), flops, ATTENTION_BWD, "backward",
                            lambda c: c.bytes_bwd)
        else:
            for c in reversed(calls):
                self._sync(c, c.bytes_bwd, "backward")

    def _attention(self, node: torch.fx.Node, calls: list[Collective], flops: float,
                   factor: float, phase: str, size) -> None:
        """Ulysses (its head groups pipelined) or a ring: ``calls`` in the order the op
        issues them (forward) or receives the gradients (backward). An output projection
        fused in (``spdsl.lower.project``) runs a group's share at a time: forward, group
        i - 1's share while group i's output is in flight; backward, the shares' gradients
        first, each group's output gradient sent as its share's is known."""
        pf = projection_flops(node)
        proj = pf * (MATMUL_BWD if phase == "backward" else 1.0)
        work = (flops - pf) * factor
        at = [i for i, c in enumerate(calls) if c.kind == "send_recv"]
        if at:
            ring = calls[at[0]:at[-1] + 1]
            before, after = calls[:at[0]], calls[at[-1] + 1:]
            for c in before:
                self._sync(c, size(c), phase)
            r = len(ring) + 1
            for j in range(r):
                p = self._issue(ring[j], size(ring[j]), phase) if j < len(ring) else None
                self._work(work / r, "attention", ring_slowdown(node, self.links))
                if p is not None:
                    self._wait([p], [ring[j]], "ring block compute")
            for c in after:
                self._sync(c, size(c), phase)
            return
        g = max(1, len(calls) // 2)
        if g == 1:          # one exchange in, attention, one out: nothing overlaps
            if phase == "backward":
                self._work(proj, "matmul")
            for c in calls[:1]:
                self._sync(c, size(c), phase)
            self._work(work, "attention")
            for c in calls[1:]:
                self._sync(c, size(c), phase)
            if phase != "backward":
                self._work(proj, "matmul")
            return
        ins, outs = _in_out(calls)
        behind = "head-group attention"
        if proj and phase == "backward":       # the output gradients come out of the shares
            self._attention_back_projected(ins, outs, work, proj, size, phase)
            return
        pending = [self._issue(ins[0], size(ins[0]), phase)]
        back = []
        for i in range(g):
            if i + 1 < g:
                pending.append(self._issue(ins[i + 1], size(ins[i + 1]), phase))
            self._wait([pending[i]], [ins[i]], behind)
            self._work(work / g, "attention")
            back.append(self._issue(outs[i], size(outs[i]), phase))
            if proj and i:
                self._wait([back[i - 1]], [outs[i - 1]], behind)
                self._work(proj / g, "matmul")
        if proj:
            self._wait([back[-1]], [outs[-1]], "the output projection")
            self._work(proj / g, "matmul")
            return
        self._wait(back, outs, behind)

    def _attention_back_projected(self, ins, outs, work, proj, size, phase) -> None:
        """Backward of pipelined Ulysses with the output projection fused in, in autograd's
        order: two shares' gradients (each sending its group's output gradient), then for
        each group its attention backward and q/k/v gradients out, and the next share's."""
        g = len(ins)
        pending, back = [], []

        def share(j: int) -> None:
            self._work(proj / g, "matmul")
            pending.append(self._issue(ins[j], size(ins[j]), phase))
        share(0)
        if g > 1:
            share(1)
        for i in range(g):
            self._wait([pending[i]], [ins[i]], "the output projection" if i == 0
                       else "head-group attention")
            self._work(work / g, "attention")
            back.append(self._issue(outs[i], size(outs[i]), phase))
            if i + 2 < g:
                share(i + 2)
        self._wait(back, outs, "head-group attention")


def _units(events: list) -> list[list]:
    """Consecutive events of one node (its collectives and their recomputed copies)."""
    units: list[list] = []
    for ev, c in events:
        if units and units[-1][0][0].node is ev.node and ev.call is not None:
            units[-1].append((ev, c))
        else:
            units.append([(ev, c)])
    return units


def _is_bucket(unit: list) -> bool:
    c = unit[0][1]
    return c is not None and c.purpose == "gradient"


def _layout(top: torch.fx.GraphModule) -> tuple[dict, dict]:
    """Each top-level node's index, and the top-level node that runs each subgraph."""
    from spdsl.remat.segments import Checkpointed
    order = {n: i for i, n in enumerate(top.graph.nodes)}
    parent = {}
    for m in top.graph.nodes:
        if m.op == "call_module":
            sub = top.get_submodule(m.target)
            sub = sub.inner if isinstance(sub, Checkpointed) else sub
            if isinstance(sub, torch.fx.GraphModule):
                parent[sub.graph] = m
    return order, parent


def _ready(unit: list, top: torch.fx.GraphModule, order: dict, parent: dict) -> int:
    """The top-level index whose backward completes the bucket's last gradient: the first
    use of its values (the bucket sits after the placeholders, inside the first layer's
    graph where remat split the program into layers); ``order``, ``parent``: ``_layout``."""
    node = unit[0][0].node
    items = [g for g in node.users if g.target is operator.getitem] or [node]
    users = [u for g in items for u in g.users]
    if node.graph is top.graph:
        return min((order[u] for u in users if u in order), default=unit[0][0].top)
    m = parent.get(node.graph)
    if m is None:
        return unit[0][0].top
    if any(u.op != "output" for u in users):
        return order[m]
    out = next(u for u in users if u.op == "output").args[0]
    out = out if isinstance(out, (tuple, list)) else (out,)
    ks = {k for k, a in enumerate(out) if a in items}
    later = [u for g in m.users if g.target is operator.getitem and g.args[1] in ks
             for u in g.users]
    return min((order[u] for u in later if u in order), default=order[m])


def _in_out(calls: list[Collective]) -> tuple[list, list]:
    """A pipelined Ulysses op's calls, in issue order (group 1's in, then each group's out
    after the next group's in: ``spdsl.lower.calls``), as (ins, outs) by group."""
    g = len(calls) // 2
    return ([calls[0]] + [calls[1 + 2 * i] for i in range(g - 1)],
            [calls[2 + 2 * i] for i in range(g - 1)] + [calls[-1]])


def _mirror(calls: list[Collective]) -> list[Collective]:
    """Backward receives the gradients in the reverse roles: each group's output gradient in,
    q/k/v gradients out (a ring's calls simply reversed)."""
    if len(calls) <= 2 or any(c.kind == "send_recv" for c in calls):
        return list(reversed(calls))
    ins, outs = _in_out(calls)
    return [outs[0]] + [c for i in range(len(ins) - 1) for c in (outs[i + 1], ins[i])] + \
        [ins[-1]]
