"""DeepSpeed AutoSP (deepspeed 0.19.8): the DeepCompile pass ``autosp`` under ``engine.compile()``.

Used as its source prescribes (``deepspeed/compile/passes/sp_compile.py``):

- ``deepspeed.initialize`` with ``compile.deepcompile`` and ``passes: ["autosp"]``,
  ``sequence_parallel_size = P``, ZeRO stage 0 (AutoSP composes with 0/1 only) and
  ``gradient_clipping: 0`` (its default 1.0 would rescale the update and break parity);
- ``engine.compile()`` (AutoSP forces ``fullgraph=True``);
- every step, ``prepare_autosp_inputs(input_ids, labels, position_ids)`` marks the sequence dim
  dynamic and tags the three global tensors; the pass then slices them inside the graph
  (``S -> S // P`` downstream of the tags) and wraps each SDPA with four all-to-alls.

The model is ``PositionalLoss`` with plain SDPA: positions must be a tagged *input*. On the
unmodified model (positions from ``torch.arange(S)`` inside ``forward``) AutoSP shards q to
``S // P`` but not the RoPE table and fails to compile ("The size of tensor a ((s38//2)) must
match the size of tensor b (s38)" at ``q * cos``). kv heads are replicated when fewer than P,
since AutoSP requires q and kv head counts divisible by P.

The loss it returns is each rank's *local* mean; DeepSpeed then reduces gradients over the
sequence-data-parallel group. How that compares with the global mean is what the parity
columns report (``loss_of_rank``: the value rank 0 returns).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch._functorch import partitioners

from .model import PositionalLoss, build_llama, kv_repeat, repeated_kv, sdpa
from .systems import RunConfig, Unavailable


def ds_config(cfg: RunConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "compile": {"deepcompile": True, "passes": ["autosp"]},
        "sequence_parallel_size": cfg.world,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0,
        "steps_per_print": 10**9,
    }


class AutoSPTrainer:
    def __init__(self, cfg: RunConfig) -> None:
        import deepspeed

        self.cfg = cfg
        self.llama = build_llama(cfg.model, cfg.seed)
        attend = repeated_kv(sdpa, kv_repeat(self.llama.cfg, cfg.world))
        module = PositionalLoss(self.llama, attend, reduction="mean")
        opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt,
                                                    config=ds_config(cfg))
        # engine.compile() replaces torch's min-cut partitioner process-wide (AutoSP's
        # "long-context checkpointing" execs a patched solve_min_cut into the module). Keep
        # that patch to AutoSP's own steps so the other compiled systems in this process
        # partition with stock PyTorch.
        stock = partitioners.solve_min_cut
        self.engine.compile()
        self._min_cut = partitioners.solve_min_cut
        partitioners.solve_min_cut = stock

    @contextlib.contextmanager
    def _own_partitioner(self):
        saved = partitioners.solve_min_cut
        partitioners.solve_min_cut = self._min_cut
        try:
            yield
        finally:
            partitioners.solve_min_cut = saved

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
        from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

        # Fresh tensors: prepare_autosp_inputs tags them in place (an attribute and a dynamic
        # dim), which must not leak into the batches other systems reuse.
        ids, lab = input_ids.clone(), labels.clone()
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1).clone()
        ids, lab, pos, _ = prepare_autosp_inputs(ids, lab, pos, seq_dim=1)
        with self._own_partitioner():
            loss = self.engine(ids, lab, pos)
            self.engine.backward(loss)
        # Each rank holds the mean over its own shard; report their mean (what a mean-of-means
        # trainer optimizes). Parity against the global mean shows where that differs.
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / self.cfg.world

    def optimizer_step(self) -> None:
        self.engine.step()


def build(cfg: RunConfig, compiled: bool) -> AutoSPTrainer:
    assert compiled, "AutoSP is a compiler pass: compiled only"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed  # noqa: F401
        from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs  # noqa: F401
    except ImportError as e:
        raise Unavailable(f"deepspeed (with AutoSP) is not installed: {e}")
    return AutoSPTrainer(cfg)
