"""ALST's Hugging Face integration (deepspeed 0.19.8): ``UlyssesSPAttentionHF`` on an HF model.

What an HF user picks instead of spdsl, set up as DeepSpeed's source and its ALST tutorial
prescribe (``deepspeed/runtime/sequence_parallel/ulysses_sp.py``):

- ``UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa",
  sequence_parallel_size=P, micro_batch_size=B, seq_length_is_variable=True)``: builds the
  sequence-parallel groups (its ``mpu``) and replaces HF's ``"sdpa"`` attention function by a
  wrapper that runs the all-to-alls around SDPA (q, k, v: sequence -> heads; o: back; kv heads
  repeated up to P first when fewer) and all-gathers ``position_ids`` in every layer so the
  causal SDPA sees global positions;
- ``deepspeed.initialize(model, optimizer, config, mpu=mpu)``, ZeRO stage 0, gradient clipping
  0 (its default 1.0 rescales updates): the engine averages gradients over the
  sequence-data-parallel group;
- ``UlyssesSPDataLoaderAdapter``: gathers the batch, shifts the labels (``shift_labels``) and
  gives each rank its contiguous slice of ``input_ids``, ``position_ids``, ``shift_labels``.
  This is data loading: it runs before the step (``prepare``), outside the timed region, as
  every system's batch preparation does;
- the loss as the tutorial writes it: each rank's HF ``loss_function`` on its shard with
  ``shift_labels``, then ``torch.distributed.nn.functional.all_gather`` of the losses and of
  the valid-token counts, and ``sum(loss_r * count_r) / sum(count_r)`` (differentiable: the
  gather's backward sums over ranks, which the engine's average then divides back);
  ``engine.backward(loss)``, ``engine.step()``.

Two things the harness does around it, neither of which changes what ALST computes:

- ``register_with_transformers`` rebinds ``ALL_ATTENTION_FUNCTIONS["sdpa"]`` for the whole
  process. The wrapper is swapped in only around ALST's own steps, so the HF reference and spdsl
  in the same process run stock SDPA attention (as ``autosp.py`` does with its partitioner
  patch).
- On CPU nothing else was needed: gloo supports the all-to-all, all-gather and all-reduce it
  issues, and ``deepspeed.initialize`` runs with ``DS_ACCELERATOR=cpu``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .hf_model import build_hf_llama
from .systems import RunConfig, Unavailable


def ds_config(cfg: RunConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0},
        "gradient_clipping": 0,
        "steps_per_print": 10**9,
    }


class ALSTTrainer:
    def __init__(self, cfg: RunConfig, checkpoint: bool = False,
                 llama: torch.nn.Module | None = None) -> None:
        import deepspeed
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.cfg = cfg
        # the parameters compared; ``llama``: another HF causal LM (bench/mask_measure.py)
        self.llama = build_hf_llama(cfg.model, cfg.seed, cfg.hf_family) if llama is None \
            else llama
        if checkpoint:   # HF's own activation checkpointing, as ALST's recipes enable it
            self.llama.gradient_checkpointing_enable({"use_reentrant": False})
        self._functions = ALL_ATTENTION_FUNCTIONS
        stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        if parallel_state_sp._SEQUENCE_PARALLEL_GROUP is not None:
            # a second ALST model in this process (bench/longest.py): its mpu asserts that
            # the groups are new, so let it build its own
            parallel_state_sp._release_sequence_parallel_groups()
        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=self.llama, core_attn_implementation="sdpa",
            sequence_parallel_size=cfg.world, micro_batch_size=cfg.batch,
            seq_length_is_variable=True)
        self._ulysses = ALL_ATTENTION_FUNCTIONS["sdpa"]
        ALL_ATTENTION_FUNCTIONS["sdpa"] = stock
        self.group = mpu.get_sequence_parallel_group()
        self.sp_rank = dist.get_rank(self.group)
        opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)
        self.engine, _, _, _ = deepspeed.initialize(model=self.llama, optimizer=opt,
                                                    config=ds_config(cfg), mpu=mpu)
        # The gradient this recipe leaves is P times the single-device one: the all-gather's
        # backward sums every rank's gradient for this rank's loss (P x its share), and the
        # engine then *sums* over the SP group (it divides by the data-parallel size,
        # seq_dp_world_size / sequence_parallel_size = 1). The harness reports the error as
        # measured and, beside it, after dividing by this factor.
        self.grad_scale = cfg.world

    @contextlib.contextmanager
    def _ulysses_attention(self):
        saved = self._functions["sdpa"]
        self._functions["sdpa"] = self._ulysses
        try:
            yield
        finally:
            self._functions["sdpa"] = saved

    def prepare(self, input_ids: torch.Tensor, labels: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> tuple[dict]:
        """This rank's shard of the global batch, through ALST's own data adapter;
        ``position_ids`` default to ``arange`` (given: packed documents)."""
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        pos = torch.arange(input_ids.shape[1]).expand(input_ids.shape[0], -1).clone() \
            if position_ids is None else position_ids.clone()
        batch = {"input_ids": input_ids.clone(), "labels": labels.clone(), "position_ids": pos}
        # Every rank holds the same global batch, so the first micro-batch (rank 0's sample,
        # sharded for this rank) is the step's; the adapter yields one per SP rank.
        adapter = UlyssesSPDataLoaderAdapter([batch], sp_rank=self.sp_rank, sp_group=self.group,
                                             sp_world_size=self.cfg.world, device="cpu")
        return (next(adapter),)

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def forward_backward(self, mb: dict) -> float:
        from torch.distributed.nn.functional import all_gather

        shift_labels = mb["shift_labels"]
        with self._ulysses_attention():
            out = self.engine(input_ids=mb["input_ids"], position_ids=mb["position_ids"],
                              use_cache=False)
            loss = self.llama.loss_function(logits=out.logits, labels=None,
                                            shift_labels=shift_labels,
                                            vocab_size=self.llama.config.vocab_size)
            # The tutorial's differentiable weighted aggregation over the SP ranks.
            losses = all_gather(loss, group=self.group)
            good = (shift_labels != -100).view(-1).sum()
            goods = all_gather(good, group=self.group)
            total = sum(losses[r] * goods[r] for r in range(self.cfg.world) if goods[r] > 0)
            loss = total / max(sum(goods), 1)
            if getattr(out, "aux_loss", None) is not None:
                # MoE (--moe): the router's load-balancing loss as a hand-written sequence
                # split has it: each rank's from its own tokens, averaged over the ranks. The
                # single-device loss multiplies two means over every token, so this one is
                # close but not equal (the loss error column shows by how much).
                aux = all_gather(out.aux_loss, group=self.group)
                loss = loss + self.llama.router_aux_loss_coef * sum(aux) / len(aux)
            self.engine.backward(loss)
        return loss.item()

    def optimizer_step(self) -> None:
        self.engine.step()


def build_checkpoint(cfg: RunConfig, compiled: bool) -> ALSTTrainer:
    """ALST with HF's gradient checkpointing (``gradient_checkpointing_enable``)."""
    return build(cfg, compiled, checkpoint=True)


def build(cfg: RunConfig, compiled: bool, checkpoint: bool = False) -> ALSTTrainer:
    if compiled:
        raise Unavailable("ALST's HF integration is run eager here (as its tutorial does)")
    try:
        import deepspeed.comm
        import deepspeed.runtime.sequence_parallel.ulysses_sp
    except ImportError as e:
        raise Unavailable(f"deepspeed is not installed ({e}); pip install the bench extra")
    deepspeed.comm.init_distributed(dist_backend="gloo")
    return ALSTTrainer(cfg, checkpoint)
