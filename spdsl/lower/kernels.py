"""Kernel swaps: spdsl's kernels put into one rank's local graph where its ops match.

The pass runs on the local graph right after lowering (before remat splits it into
checkpointed layers) and rewrites, in place (fp32 difference from the ops it replaces, CPU):

- SDPA inside ``ulysses_attention``/``local_attention`` (no mask, no dropout): the same call with
  ``kernel=True``, which runs ``spdsl.kernels.flash_attn`` (~1e-7: another summation order);
- ``x * rsqrt(mean(x^2, -1) + eps) [type_as] * w``: ``spdsl.kernels.rms_norm`` (bitwise);
- ``x * cos + cat(-x2, x1) * sin [type_as]``: ``spdsl.kernels.rope`` (bitwise);
- ``mm(h, W^T)`` -> row selections -> ``log_softmax`` -> NLL (``nll_mean`` when split): the
  fused linear + cross-entropy, its (sum, count) all-reduced then divided, so the split mean
  stays exact (~1e-7: chunked sums). The rewrite is remat's loss tiling
  (``spdsl.lower.loss``), reused so that there is one implementation of it;
- ``silu(a) * b``, opt-in only: ``spdsl.kernels.swiglu`` (bitwise).

In bf16 the norm and RoPE kernels round once where the model code rounds twice.

``kernels=`` (on ``sp_shard``/``shard``) chooses: ``"auto"`` swaps where the kernel backend
would run Triton (CUDA tensors, see :func:`spdsl.kernels.use_triton`) — on CPU the references
are plain PyTorch that Inductor already fuses, and the reference attention builds the
``[S, S]`` scores SDPA avoids, so nothing is swapped there; ``"on"`` (alias ``"triton"``)
swaps every match and lets each kernel pick its backend when it runs; ``"off"`` swaps nothing;
a collection of names (``{"flash_attn", "swiglu"}``) swaps exactly those. SwiGLU is outside
``"auto"``/``"on"``: remat's MLP tiling matches only aten row-wise ops, and a swapped MLP would
no longer tile. Each swap is recorded on its node; :func:`kernel_report` lists them for the plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

import spdsl.kernels as K
from spdsl.lower import kernel_match as M
from spdsl.lower.shapes import fill_shapes
from spdsl.propagate.source import module_of, source_of

ALL = ("flash_attn", "rms_norm", "rope", "fused_linear_cross_entropy", "swiglu")
DEFAULT = ("flash_attn", "rms_norm", "rope", "fused_linear_cross_entropy")
_MODES = ("auto", "on", "triton", "off")


@dataclass(frozen=True)
class KernelChoice:
    """A resolved ``kernels=`` value: a mode and the kernel names it may swap in.

    Example::

        >>> KernelChoice.of("on").names == frozenset(DEFAULT)
        True
        >>> KernelChoice.of({"rope"}).active(torch.device("cpu"))
        frozenset({'rope'})
    """

    mode: str
    names: frozenset[str]

    @staticmethod
    def of(value: str | Iterable[str] | KernelChoice | None) -> KernelChoice:
        if value is None:
            value = "auto"
        if isinstance(value, KernelChoice):
            return value
        if isinstance(value, str):
            if value not in _MODES:
                raise ValueError(f"kernels={value!r}: use one of {_MODES} or a set of kernel "
                                 f"names from {ALL}")
            mode = "on" if value == "triton" else value
            return KernelChoice(mode, frozenset() if mode == "off" else frozenset(DEFAULT))
        names = frozenset(value)
        unknown = sorted(names - set(ALL))
        if unknown:
            raise ValueError(f"kernels: unknown kernel name(s) {unknown}; known: {ALL}")
        return KernelChoice("on", names)

    def active(self, device: torch.device) -> frozenset[str]:
        """The names to swap for tensors on ``device`` ("auto": only where Triton would run)."""
        if self.mode == "auto" and not K.use_triton(torch.empty(0, device=device)):
            return frozenset()
        return self.names


def swap_kernels(gm: torch.fx.GraphModule, kernels: str | Iterable[str] | KernelChoice | None,
                 state: list, inputs: list) -> torch.fx.GraphModule:
    """Swap spdsl kernels into the local graph ``gm`` (in place; also returned).

    ``state``/``inputs``: specs of the graph's inputs (``spdsl.lower.local.local_specs``), used
    for one fake forward that gives every node its local shape and device.

    Example::

        local = lower(prop, rank, group, out_placements)
        local = swap_kernels(local, "on", *local_specs(entry, args, kwargs, parts, rank))
        kernel_report(local)   # [{"kernel": "rms_norm", "node": "rms_norm", ...}, ...]
    """
    choice = KernelChoice.of(kernels)
    specs = list(state) + list(inputs)
    device = next((torch.device(s.device) for s in specs if s.dtype.is_floating_point),
                  torch.device("cpu"))
    names = choice.active(device)
    gm.spdsl_kernels = []
    if not names:
        return gm
    fill_shapes(gm, specs)      # one fake forward: local shapes and devices in meta["val"]
    found: list[M.Match] = []
    if "fused_linear_cross_entropy" in names:
        found += M.swap_losses(gm)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or getattr(node, "_erased", False):
            continue
        for name in ("flash_attn", "rope", "rms_norm", "swiglu"):
            if name in names:
                m = M.MATCHERS[name](gm.graph, node)
                if m is not None:
                    found.append(m)
                    break
    for m in found:
        gm.spdsl_kernels.append(_record(m))
    gm.graph.lint()
    gm.recompile()
    return gm


def _record(m: M.Match) -> dict:
    rec = {"kernel": m.kernel, "node": m.node.name, "replaces": m.replaces,
           "module": module_of(m.node), "source": source_of(m.node),
           "backend": _backend(m.node)}
    m.node.meta["spdsl_kernel"] = rec
    return rec


def _backend(node: torch.fx.Node) -> str:
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    t = next((v for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point),
             None)
    if t is None:
        return "reference"
    try:
        return "triton" if K.use_triton(t) else "reference"
    except RuntimeError:          # SPDSL_KERNELS=triton without the interpreter: says so at run
        return "triton"


def kernel_report(local) -> list[dict]:
    """Every kernel swapped into a local graph: ``kernel``, ``node``, ``replaces`` (the aten
    ops it stands for), ``module``, ``source`` (the user's line), ``backend`` at swap time.

    Works on the swapped graph, and on what remat or ``torch.compile`` made of it.

    Example::

        step = spdsl.sp_shard(seq=4, kernels="on")(model)
        step(ids, ids)
        entry = next(iter(step._cache.values()))
        for r in kernel_report(entry.local):
            print(r["kernel"], r["source"], r["module"])   # rms_norm spdsl/models/llama.py:150 norm
    """
    local = getattr(local, "_orig_mod", local)      # torch.compile's OptimizedModule
    local = getattr(local, "gm", local)             # spdsl.lower.compile.CompiledLocal
    seen, out = set(), []
    for mod in local.modules() if isinstance(local, torch.nn.Module) else []:
        graph = getattr(mod, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        for n in graph.nodes:
            rec = n.meta.get("spdsl_kernel")
            if rec is not None and id(rec) not in seen:
                seen.add(id(rec))
                out.append(dict(rec))
    return out
