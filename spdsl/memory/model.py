"""Planned memory of one step of a model built from its configuration, on the meta device: what
``python -m spdsl memory`` prints for one length and what the longest-sequence search
(``spdsl.memory.search``) simulates at each length and depth.

The step is built by the caller's sequence-parallel transform, ``shard=spdsl.sp_shard``: the
memory planner sits below the front end that traces (``tests/test_imports.py``) and takes it as
an argument, as :func:`spdsl.memory.plan_memory` takes a function already wrapped.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch

from spdsl.memory.planner import plan_memory
from spdsl.memory.report import MemoryPlan
from spdsl.memory.workspace import kernel_workspace
from spdsl.modelspec import model_class_for, with_layers
from spdsl.pipeline import planning_group
from spdsl.remat.segments import layer_of

# the sequence-parallel transform: spdsl.sp_shard, called as shard(seq=, remat=, kernels=,
# attention=, shard_state=)(model)
Shard = Callable[..., Callable[[torch.nn.Module], Callable]]


def model_plan(cfg, seq: int, sp: int, remat, *, shard: Shard,
               dtype: torch.dtype = torch.bfloat16, batch: int = 1, optimizer: str = "adamw",
               state_shards: int = 1, kernels: str = "auto", attention="auto", dp: int = 1,
               optimizer_on_host: bool = False, pinned_host: bool | None = None,
               ) -> MemoryPlan:
    """Planned memory of one step of the model ``cfg`` builds (``spdsl.modelspec``: e.g.
    ``Llama`` for a ``LlamaConfig``), on the meta device, at global length ``seq``, called as
    ``model(ids, labels)``, wrapped by ``shard`` (``spdsl.sp_shard``).

    ``kernels="triton"`` plans the step a GPU runs: spdsl's Triton kernels (flash attention,
    RMSNorm, RoPE, fused linear cross-entropy) swapped in, each allocating what its kernel
    allocates (their fake implementations), where the CPU references would materialise fp32
    norm temporaries or (attention) ``[S, S]`` scores. ``"auto"``: what runs here (CPU: none).
    ``attention``: as ``sp_shard(attention=...)`` (``"ring"``, ``("hybrid", 8)``, ...).

    State split over every rank (``state_shards == dp * sp``) plans the sharded program itself
    (``sp_shard(shard_state=True)`` over a fake process group of ``dp * sp`` ranks): each
    rank's parameter rows, the gathers of the layer in flight, the whole gradients of the
    parameter being reduced and then only its reduce-scattered rows. Any other split divides
    the replicated program's state afterwards (``MemoryPlan.with_state_shards``), which keeps
    the replicated program's whole gradients of finished layers: an over-count.
    ``optimizer``/``optimizer_on_host``: ``spdsl.memory.simulate``. ``pinned_host``: offloaded
    copies counted as CUDA's pinned allocator takes them (default: planning the GPU run,
    ``kernels="triton"``). ``batch`` is per dp replica.

    Example::

        plan = model_plan(LlamaConfig.llama3_8b(), 131072, 8, "full", kernels="triton",
                          shard=spdsl.sp_shard)
        print(plan)
    """
    if pinned_host is None:
        pinned_host = kernels == "triton"
    world = dp * sp
    sharded = state_shards > 1 and state_shards == world
    with torch.device("meta"):
        model = model_class_for(cfg)(cfg).to(dtype)
    ids = torch.empty(batch * (dp if sharded else 1), seq, dtype=torch.long, device="meta")
    how = {"optimizer": optimizer, "optimizer_on_host": optimizer_on_host,
           "pinned_host": pinned_host}
    with _kernels(kernels) as choice, \
            (planning_group(world) if sharded else contextlib.nullcontext()):
        step = shard(seq=sp, remat=remat, kernels=choice, attention=attention,
                     shard_state=sharded)(model)
        plan = plan_memory(step, ids, ids, **how)
    if not sharded:
        plan = plan.with_state_shards(state_shards, gathered_bytes(model))
    if kernels == "triton":
        plan = plan.with_extra(kernel_workspace(cfg, batch * seq // sp, sp, dtype),
                               "kernel workspace")
    return plan


@contextlib.contextmanager
def _kernels(kernels: str):
    if kernels != "triton":
        yield kernels
        return
    from spdsl.kernels import ring_attn
    from spdsl.kernels.backend import kernel_backend
    # fake tensors never launch a kernel: the interpreter flag only lets the backend choose
    # Triton (and so the custom ops' fake kernels) for CPU-device fakes; ring attention's
    # mask-free pieces run the block recurrence on a GPU, not the CPU's fused kernel
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    fused, ring_attn.FUSED[0] = ring_attn.FUSED[0], False
    try:
        with kernel_backend("triton"):
            yield "on"
    finally:
        ring_attn.FUSED[0] = fused
        if old is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = old


def gathered_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """Whole-parameter bytes a state-sharded step holds for a moment, (forward, backward):
    the largest unit (a numbered layer, the embedding, the head) gathered in forward; in
    backward its weights gathered again plus its whole gradients before the reduce-scatter."""
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = layer_of(name) or name.split(".")[0]
        units[unit] = units.get(unit, 0) + p.numel() * p.element_size()
    big = max(units.values(), default=0)
    return big, 2 * big


def bytes_per_token_per_layer(cfg, sp: int, remat, *, shard: Shard, seq: int = 65536,
                              dtype: torch.dtype = torch.bfloat16, kernels: str = "auto",
                              host: bool = False, attention="auto") -> float:
    """Activation bytes one layer keeps from forward to backward, per token a rank holds:
    the difference between 2- and 1-layer models, so embedding and loss cancel out.

    Example::

        bytes_per_token_per_layer(LlamaConfig.llama3_8b(), 8, "none",
                                  shard=spdsl.sp_shard) / 4096      # in units of h
    """
    kw = {"shard": shard, "dtype": dtype, "optimizer": "none", "kernels": kernels,
          "attention": attention}
    one = model_plan(with_layers(cfg, 1), seq, sp, remat, **kw)
    two = model_plan(with_layers(cfg, 2), seq, sp, remat, **kw)
    if host:        # what a layer holds on the host (offload)
        return (two.host - one.host) / (seq // sp)
    return (two.saved_activations - one.saved_activations) / (seq // sp)
