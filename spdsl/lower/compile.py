"""``compile=True``: the rank's local program through ``torch.compile`` as one graph.

The local graph is compiled with ``fullgraph=True``: collectives, kernels and all, no graph
breaks, so Inductor sees (and can overlap) every collective with the compute around it. A
graph break can still come from user code that traced fine but that Dynamo cannot capture
(a data-dependent output shape, an opaque Python call); Dynamo's own message then points into
generated code (``<eval_with_key>.3, line 41``). :class:`CompiledLocal` turns it into a
:class:`~spdsl.ShardingError` naming the local node, its module and the user's source line.

The one break allowed is a token-wise block (a mixture of experts' experts,
``spdsl.lower.tokenwise``), which runs eagerly on the rank's real values: a program that holds
one compiles the pieces between them, and a break anywhere else is still an error.
"""

from __future__ import annotations

from typing import Any

import torch

from spdsl._torch import dynamo_unsupported, graph_break_reasons
from spdsl.errors import ShardingError
from spdsl.lower import tokenwise
from spdsl.propagate.source import module_of, source_of


class CompiledLocal:
    """``torch.compile(local, fullgraph=True)`` that reports graph breaks as ShardingErrors.

    Attribute access falls through to the uncompiled local graph (``spdsl_remat``, ``graph``).

    Example::

        local = CompiledLocal(local_gm)
        outs = local(*state, *local_inputs)    # first call compiles; a break raises
    """

    def __init__(self, gm: torch.nn.Module, **options: Any) -> None:
        self.gm = gm
        # token-wise blocks (mixture-of-experts experts) run eagerly on the rank's real values
        # (spdsl.lower.tokenwise): Dynamo breaks the graph at each call, by design, and
        # compiles what lies between; any other break is still an error (``_first_call``)
        self.token_wise = False
        for m in gm.modules():
            calls = [n for n in m.graph.nodes if n.target is tokenwise.run] \
                if isinstance(m, torch.fx.GraphModule) else []
            for n in calls:
                n.target = _eager_token_wise()
            if calls:
                m.recompile()
                self.token_wise = True
        self.compiled = torch.compile(gm, fullgraph=not self.token_wise, **options)
        self._checked = False

    def __call__(self, *args: Any) -> Any:
        if self.token_wise and not self._checked:
            return self._first_call(*args)
        try:
            return self.compiled(*args)
        except dynamo_unsupported() as e:
            raise graph_break_error(self.gm, e) from e

    def _first_call(self, *args: Any) -> Any:
        """Compile with breaks allowed, then check that Dynamo broke only at token-wise calls."""
        before = graph_break_reasons()
        out = self.compiled(*args)
        self._checked = True
        other = [reason for reason, n in graph_break_reasons().items()
                 if n > before.get(reason, 0) and not _token_wise_break(reason)]
        if other:
            raise ShardingError(
                rule="no graph breaks", value=other[0].strip().splitlines()[0],
                detail="the rank's program broke somewhere else than at a token-wise block, "
                       "which torch.compile would run eagerly",
                fix="drop compile=True, or write that computation with tensor ops")
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["gm"], name)


_EAGER: list = []


def _eager_token_wise():
    """``tokenwise.run`` that Dynamo does not trace into: it breaks the graph there."""
    if not _EAGER:
        _EAGER.append(torch.compiler.disable(
            tokenwise.run, reason="spdsl.lower.tokenwise.run: a token-wise block runs eagerly"))
    return _EAGER[0]


def _token_wise_break(reason: str) -> bool:
    return "spdsl.lower.tokenwise.run" in reason


def compile_local(gm: torch.nn.Module, **options: Any) -> CompiledLocal:
    """Compile one rank's local program as a single graph (see :class:`CompiledLocal`)."""
    remat = getattr(getattr(gm, "spdsl_remat", None), "remat", None)
    if getattr(remat, "offload", False):
        # offload works through saved-tensor hooks and SAC's cache, which run between autograd
        # and the kernels; a compiled graph saves its tensors inside one fused autograd node,
        # unpacked all at once at the start of its backward, so nothing would be gained
        raise ShardingError(
            rule="offload under compile", value=f"remat={remat.describe()}",
            detail="activation offload runs in eager execution only",
            fix="drop compile=True, or drop offload (Remat(mode, offload=False)); "
                "recompute_collectives=True keeps the least on the device under compile")
    return CompiledLocal(gm, **options)


def offending_node(gm: torch.nn.Module, err: BaseException) -> torch.fx.Node | None:
    """The node of ``gm`` (or of a submodule remat made) whose line Dynamo stopped at."""
    by_file = {}
    for mod in gm.modules():
        code = getattr(getattr(mod, "forward", None), "__code__", None)
        if isinstance(mod, torch.fx.GraphModule) and code is not None:
            by_file[code.co_filename] = (mod, code.co_firstlineno)
    for frame in reversed(list(getattr(err, "real_stack", None) or [])):
        hit = by_file.get(frame.filename)
        if hit is None or frame.lineno is None:
            continue
        mod, first = hit
        # the lookup Dynamo itself uses to keep node metadata (output_graph.py)
        idx = (getattr(mod, "_lineno_map", None) or {}).get(frame.lineno - first)
        if idx is not None:
            return list(mod.graph.nodes)[idx]
    return None


def graph_break_error(gm: torch.nn.Module, err: BaseException) -> ShardingError:
    """A ShardingError for Dynamo's graph-break error ``err`` while compiling ``gm``."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    node = offending_node(gm, err)
    if node is None:
        where, what = "", "the local program"
    else:
        where = source_of(node) or "(no source line recorded)"
        mod = module_of(node)
        where += f" ({mod})" if mod else ""
        target = getattr(node.target, "__name__", str(node.target))
        what = f"local node {node.name} = {target}(...)"
    return ShardingError(
        rule="no graph breaks",
        detail=f"torch.compile(fullgraph=True) cannot capture {what}: {reason}",
        where=where,
        fix="rewrite that line without the construct Dynamo names (data-dependent shapes, "
            ".item(), opaque Python calls), or pass compile=False to run it eagerly")
