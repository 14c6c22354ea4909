"""``sequence_parallel(trainer, seq=N)``: a Hugging Face ``Trainer`` whose steps run under
``spdsl.sp_shard``.

The job's ranks form a ``dp x sp`` mesh (``dp`` = ranks / ``seq``): the ``seq`` ranks of a
data-parallel group share one batch and split its sequence. What changes, and why each logged
number stays the number of the same job without sequence parallelism (one process at dp 1,
DDP at dp > 1):

- data: accelerate prepares the train and eval loaders for the data-parallel degree, so the
  sp ranks of a group load the same rows in the same order (the sampler's seed is the same
  everywhere; accelerate broadcasts the generator's state) and the groups take turns, as DDP
  ranks do.
- the model: its loss runs through ``sp_shard`` while the Trainer computes a loss (training
  and evaluation); ``generate`` and other calls run the plain model. accelerate does not wrap
  it in DDP: spdsl already gives every rank the whole gradient (reduced over dp and sp), and
  DDP would reduce it again. Its parameters and buffers are broadcast from rank 0 once, as
  DDP would have.
- ``num_items_in_batch``: each rank counts its group's rows, summed over the data-parallel
  ranks only (not over sp ranks, which hold the same rows); spdsl's loss is already the
  global sum over that count on every rank, so it is not scaled by the number of processes.
- gathers (``num_input_tokens_seen``, eval losses) and ``total_flos``: over the data-parallel
  ranks only, so a token, an eval row and a batch's flops are counted once.
- ``grad_norm``: ``clip_grad_norm_`` on the whole gradient, which every rank holds (on the
  DTensor gradients under ``shard_state=True``: the norm over every rank).
- evaluation at dp > 1: the filler rows accelerate adds to the last batch of an uneven set
  do not count in the loss (``_Layout.real_rows``).
- checkpoints: the Trainer's own; under ``shard_state=True`` the weights are gathered whole
  and the model's and optimizer's shards are also saved with ``spdsl.save_checkpoint``, which
  reshards on resume to any number of ranks and ``seq`` (``spdsl.hf.trainer_state``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import spdsl.collectives as C
from spdsl._torch import swapped
from spdsl.annotate.api import sp_shard
from spdsl.annotate.mesh import mesh as make_mesh
from spdsl.errors import ShardingError
from spdsl.hf.fused import VARLEN_KWARGS, fused_output, token_sums
from spdsl.hf.pad import pad_batch
from spdsl.hf.trainer_state import (
    ResumingShards,
    check_resumable,
    gathering_save_pretrained,
    has_sharded_state,
    holds_shards,
    load_state,
    save_state,
    whole_state_dict,
)


def sequence_parallel(trainer, *, seq: int, **options: Any):
    """Make a constructed ``transformers.Trainer`` (or a subclass, TRL's ``SFTTrainer``
    included) train and evaluate with sequence parallelism over ``seq`` ranks; call it before
    ``trainer.train()``. With more ranks than ``seq`` the rest is data parallel: 8 ranks at
    ``seq=4`` are dp 2 x sp 4. Every logged number is the one the same job logs without
    sequence parallelism (docs/trainer.md).

    ``options`` are ``spdsl.sp_shard``'s (``remat``, ``compile``, ``attention``, ``debug``,
    ...). It returns ``trainer`` itself, its class a subclass of its own made for it. In one
    process that subclass changes nothing but the resuming of a checkpoint that
    ``shard_state=True`` wrote on several ranks, so the same script runs with and without
    torchrun. Every rank must build the same trainer (same model, data and arguments).

    Example::

        trainer = Trainer(model=model, args=TrainingArguments(...), train_dataset=data)
        trainer = spdsl.hf.sequence_parallel(trainer, seq=4)   # torchrun --nproc_per_node=4
        trainer.train()                                        # logs == one process's logs
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return _attach(trainer, ResumingShards, "ResumingShards")
    _check(trainer, seq, world, options)
    layout = _Layout.of(seq, world)
    _broadcast_state(trainer.model)
    if layout.dp > 1:
        options = {**options, "batch": "local"}        # each dp group loads its own rows
    runner = _SequenceParallelLoss(trainer.model, seq, layout.mesh, options)
    return _attach(trainer, _SequenceParallelTrainer, "SequenceParallel", runner, layout)


def _attach(trainer, mixin: type, prefix: str, runner: _SequenceParallelLoss | None = None,
            layout: _Layout | None = None):
    """``trainer`` with ``mixin``'s methods before its own class's, and with ``runner`` its
    model's forward and ``layout`` its accelerator's data-parallel view. The one place the
    integration changes objects the user built (the trainer, its model, arguments and
    accelerator): ``tools/counts.py`` lists each line as a ``foreign_patches`` site. The
    trainer's class becomes a subclass made for it, its namespace holding the trainer's
    sequence-parallel state when the class is made."""
    cls = type(trainer)
    sharded = runner is not None and has_sharded_state(trainer.model)
    state = {} if runner is None else {
        "_spdsl_loss": runner, "_spdsl_layout": layout, "_spdsl_sharded": sharded}
    trainer.__class__ = type(f"{prefix}{cls.__name__}", (mixin, cls), state)
    if runner is None:
        return trainer
    trainer.model.forward = runner.forward
    trainer.accelerator.prepare_model = _without_ddp(trainer.accelerator.prepare_model)
    trainer.accelerator.prepare_data_loader = _loader_per_group(trainer.accelerator, layout)
    trainer.accelerator.gather = layout.gather
    # counted per dp group and summed over dp here (_get_num_items_in_batch), never over sp
    trainer.args.average_tokens_across_devices = False
    if sharded:
        trainer.model.save_pretrained = gathering_save_pretrained(trainer.model)
    return trainer


@dataclass(frozen=True)
class _Layout:
    """The job's ``dp x sp`` ranks: the mesh, and this rank's data-parallel group."""

    dp: int
    mesh: DeviceMesh
    dp_rank: int
    dp_group: Any                   # None at dp 1

    @classmethod
    def of(cls, seq: int, world: int) -> _Layout:
        dp = world // seq
        if dp == 1:
            return cls(1, make_mesh(sp=seq), 0, None)
        mesh = make_mesh(dp=dp, sp=seq)
        return cls(dp, mesh, mesh.get_local_rank("dp"), mesh.get_group("dp"))

    def gather(self, data):
        """accelerate's ``gather`` over the data-parallel ranks (0-d tensors stacked, the rest
        concatenated on dim 0); at dp 1, ``data`` itself."""
        if self.dp == 1:
            return data
        from accelerate.utils import recursively_apply

        def one(t: torch.Tensor) -> torch.Tensor:
            t = t.reshape(1) if t.dim() == 0 else t.contiguous()
            return torch.cat(C.gather_each(t, group=self.dp_group))
        return recursively_apply(one, data, error_on_other_type=True)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp > 1:
            C.reduce_(t, group=self.dp_group)
        return t

    def real_rows(self, inputs: dict, trainer) -> dict:
        """An evaluation batch with the labels of accelerate's filler rows set to -100.

        At dp > 1 the last evaluation step of a set that dp x batch does not divide is filled
        up with rows from the start of the set (``even_batches``), and ``gather_for_metrics``
        keeps the first ``remainder`` rows in dp-rank order. The step's loss is one mean over
        every dp group's rows, so the filler rows must not count in it: with them masked it
        is the one-process loss of the real rows."""
        state = trainer.accelerator.gradient_state
        if self.dp == 1 or not state.end_of_dataloader or state.remainder <= 0:
            return inputs
        per = trainer.args.per_device_eval_batch_size
        real = min(max(state.remainder - self.dp_rank * per, 0), per)
        keys = [k for k in ("labels", "shift_labels") if torch.is_tensor(inputs.get(k))]
        if any(inputs[k].shape[0] != per for k in keys):
            raise ShardingError(
                rule="uneven evaluation set", value=f"{state.remainder} rows left over",
                detail=f"at dp={self.dp} the last evaluation batch is filled up with rows of the "
                       "set, and a batch of packed rows (padding_free) does not say which are",
                fix=f"make the evaluation set a multiple of dp x per_device_eval_batch_size "
                    f"({self.dp * per}), or set dataloader_drop_last=True")
        if real == per:
            return inputs
        inputs = dict(inputs)
        for k in keys:
            inputs[k] = inputs[k].clone()
            inputs[k][real:] = -100
        return inputs


class _SequenceParallelTrainer:
    """The Trainer methods that differ under sequence parallelism (mixed in before the
    user's Trainer class)."""

    _spdsl_loss: _SequenceParallelLoss
    _spdsl_layout: _Layout
    _spdsl_sharded: bool

    def compute_loss_context_manager(self):
        stack = super().compute_loss_context_manager()
        stack.enter_context(self._spdsl_loss.active())
        return stack

    def _get_num_items_in_batch(self, batch_samples: list, device):
        # the rows of this rank's dp group, summed over the dp groups (the sp ranks of a group
        # hold the same rows: not over them)
        count = super()._get_num_items_in_batch(batch_samples, device)
        return self._spdsl_layout.sum(count) if torch.is_tensor(count) else count

    def store_flos(self) -> None:
        # every sp rank counted its group's whole batch: add each group's once. On the
        # accelerator's device: NCCL reduces no CPU tensor (float64 it does)
        flos = torch.tensor(float(self.current_flos), dtype=torch.float64,
                            device=self.args.device)
        self.state.total_flos += self._spdsl_layout.sum(flos).item()
        self.current_flos = 0

    def get_total_train_batch_size(self, args) -> int:
        # one batch per data-parallel group, not per rank (logged and used for the sample count)
        return self._train_batch_size * args.gradient_accumulation_steps * self._spdsl_layout.dp

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return super().prediction_step(model, self._spdsl_layout.real_rows(inputs, self),
                                       prediction_loss_only, ignore_keys=ignore_keys)

    # shard_state=True: whole weights in the Hugging Face files, the shards of the weights and
    # the optimizer state in spdsl's resharding checkpoint (spdsl.hf.trainer_state)
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._spdsl_sharded:
            return super().save_model(output_dir, _internal_call)
        state = whole_state_dict(self.model)            # a collective: on every rank
        self._save(output_dir if output_dir is not None else self.args.output_dir,
                   state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._spdsl_sharded:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_state(self, output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._spdsl_sharded and not holds_shards(checkpoint):
            with _unindexed_cpu(self.args):
                return super()._load_optimizer_and_scheduler(checkpoint)
        load_state(self, checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if not self._spdsl_sharded:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # the weights' shards load with the optimizer state (load_state), once it exists
        check_resumable(resume_from_checkpoint)


class _SequenceParallelLoss:
    """The model's forward while the Trainer computes a loss: the loss of ``sp_shard`` over
    the original forward; any other call runs the original forward."""

    def __init__(self, model: torch.nn.Module, seq: int, sp_mesh, options: dict) -> None:
        self.original = model.forward
        self.seq = seq
        self.on = False
        original = self.original

        def loss(**inputs) -> torch.Tensor:
            return original(**inputs).loss

        self.step = sp_shard(seq=seq, mesh=sp_mesh, **options)(loss)
        # TRL's fused LM head (SFTTrainer): its sums, spdsl.hf.fused
        self.fused_step = sp_shard(seq=seq, mesh=sp_mesh, **options)(token_sums(original))
        # the original's signature: the Trainer keeps the dataset columns forward names
        self.forward = functools.wraps(self.original)(
            lambda *args, **kwargs: self._forward(*args, **kwargs))

    @contextlib.contextmanager
    def active(self):
        self.on, before = True, self.on
        try:
            yield
        finally:
            self.on = before

    def _forward(self, *args, **kwargs):
        if not self.on or args or kwargs.get("labels") is None:
            return self.original(*args, **kwargs)
        inputs = pad_batch({k: v for k, v in kwargs.items() if k not in VARLEN_KWARGS},
                           self.seq)
        if inputs.pop("fused_lm_head", False):
            if inputs.get("output_router_logits"):
                raise NotImplementedError(
                    "spdsl.hf.sequence_parallel: TRL's fused LM head with router logits (the "
                    "MoE auxiliary loss) is not supported yet")
            return fused_output(self.fused_step(**inputs))
        from transformers.modeling_outputs import CausalLMOutput
        # logits stay split over the ranks inside the step; only the exact loss comes back
        return CausalLMOutput(loss=self.step(**inputs))


def _check(trainer, seq: int, world: int, options: dict) -> None:
    if not isinstance(seq, int) or seq < 1 or world % seq:
        raise ShardingError(
            rule="sequence parallel degree", detail=f"seq={seq!r} with {world} ranks",
            fix=f"give a degree that divides the number of ranks ({world}), e.g. seq={world}")
    if "batch" in options or "mesh" in options:
        raise ShardingError(
            rule="trainer mesh", detail="sequence_parallel builds the dp x sp mesh itself",
            fix="leave out mesh= and batch=: the data-parallel degree is ranks / seq")
    accel = trainer.accelerator
    other = [name for name, on in (
        ("DeepSpeed", trainer.is_deepspeed_enabled), ("FSDP", trainer.is_fsdp_enabled),
        ("accelerate's ParallelismConfig", getattr(accel, "parallelism_config", None)),
        ("torch.nn.DataParallel (n_gpu > 1)", trainer.args.n_gpu > 1)) if on]
    if other:
        raise ShardingError(
            rule="one sequence parallelism", detail=f"the Trainer already uses {other[0]}",
            fix="build the Trainer without it: spdsl shards the sequence and gives every rank "
                "the whole gradient itself")
    if trainer.model_wrapped is not trainer.model:
        raise ShardingError(
            rule="unwrapped model", detail="the Trainer's model is already wrapped "
                                           f"({type(trainer.model_wrapped).__name__})",
            fix="call spdsl.hf.sequence_parallel before trainer.train()")
    if getattr(trainer.args, "loss_type", None) == "dft":
        raise NotImplementedError(
            "spdsl.hf.sequence_parallel: TRL's loss_type='dft' weights each token's loss by its "
            "probability, which needs the per-token log-probabilities; use loss_type='nll'")
    # exact metrics would need every rank to gather the [batch, seq, vocab] logits the step
    # keeps split (and the Trainer to hold them for the whole evaluation set): the memory
    # sequence parallelism is there to save, so refused rather than done silently
    if (trainer.compute_metrics is not None or trainer.preprocess_logits_for_metrics is not None
            ) and not trainer.args.prediction_loss_only:
        raise NotImplementedError(
            "spdsl.hf.sequence_parallel: compute_metrics / preprocess_logits_for_metrics need "
            "the logits, which stay split over the sp ranks; evaluate with eval_loss only "
            "(compute_metrics=None, or prediction_loss_only=True)")


def _broadcast_state(model: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank (DDP's guarantee at construction)."""
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            C.broadcast_(t.data)


def _without_ddp(prepare_model):
    """accelerate's ``prepare_model`` without the DDP wrapper (device placement and mixed
    precision unchanged)."""
    def prepare(model, device_placement=None, evaluation_mode=False):
        return prepare_model(model, device_placement=device_placement, evaluation_mode=True)
    return prepare


def _loader_per_group(accel, layout: _Layout):
    """accelerate's ``prepare_data_loader`` for the data-parallel ranks: the sp ranks of a
    group load the same rows. Batches are not dispatched from rank 0 (each rank reads its
    own copy)."""
    from accelerate.data_loader import prepare_data_loader

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        if device_placement is None:
            device_placement = accel.device_placement
        prepared = prepare_data_loader(
            data_loader, accel.device, num_processes=layout.dp, process_index=layout.dp_rank,
            split_batches=accel.split_batches, put_on_device=device_placement,
            rng_types=accel.rng_types.copy(), dispatch_batches=False,
            even_batches=accel.even_batches, use_seedable_sampler=accel.use_seedable_sampler,
            data_seed=accel.dataloader_config.data_seed, non_blocking=accel.non_blocking,
            use_stateful_dataloader=accel.use_stateful_dataloader)
        accel._dataloaders.append(prepared)
        return prepared
    return prepare


@contextlib.contextmanager
def _unindexed_cpu(args):
    """``args.device`` as plain ``cpu`` where it is an indexed CPU device (``cpu:0``, CPU
    ranks): on several ranks transformers 5.17 loads the optimizer's file onto
    ``args.device``, a location ``torch.load`` cannot restore (it raises); 5.18 and later
    load it onto ``cpu`` there themselves."""
    device = args.device
    if device.type != "cpu" or device.index is None:
        yield
        return
    with swapped(args, "_setup_devices", torch.device("cpu")):   # the cached property's value
        yield

