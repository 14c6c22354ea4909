"""TRL's ``SFTTrainer`` with packing at SP 4: spdsl (``spdsl.hf.sequence_parallel``) against
ALST (DeepSpeed-Ulysses through accelerate's ``ParallelismConfig(sp_backend="deepspeed")``,
the Trainer's own sequence parallelism), and the same job in one process.

The job of ``examples/sft_trl.py`` (a tiny Llama, documents packed into rows of ``--len``
tokens, position ids restarting) without evaluation. Each run prints and writes (``--out``,
JSON) its logged numbers, the median wall time of an optimizer step after the first (the
first traces spdsl's programs), and the largest per-rank peak of the CPU allocator over the
whole ``trainer.train()`` (``spdsl.memory.measure``: c10's own counters, profiled; not
spdsl's planner). ``--against`` compares the logged numbers with a one-process run's.

    python bench/trainer_sft.py --system one --out /tmp/sft_one.json
    torchrun --standalone --nproc_per_node=4 bench/trainer_sft.py --system spdsl --out /tmp/sft_spdsl.json --against /tmp/sft_one.json
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node=4 bench/trainer_sft.py --system alst --out /tmp/sft_alst.json --against /tmp/sft_one.json   # deepspeed 0.19.8's venv

Results: ``bench/results/trainer_sft_sp4.json`` and bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

_TIMINGS = ("runtime", "per_second", "epoch")
VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def build(a, world: int):
    import transformers
    from sft_trl import documents, tokenizer
    from trl import SFTConfig, SFTTrainer
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=a.len)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    extra = {}
    if a.system == "alst":
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig
        extra = {"parallelism_config": ParallelismConfig(
                     sp_size=world, sp_backend="deepspeed",
                     sp_handler=DeepSpeedSequenceParallelConfig(
                         sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")),
                 "deepspeed": {"train_micro_batch_size_per_gpu": "auto",
                               "gradient_accumulation_steps": "auto",
                               "gradient_clipping": "auto", "zero_optimization": {"stage": 0},
                               "steps_per_print": 10**9}}
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, seed=0, data_seed=0,
        per_device_train_batch_size=a.batch, gradient_accumulation_steps=2,
        max_steps=a.steps, learning_rate=5e-3, warmup_steps=2, lr_scheduler_type="cosine",
        max_grad_norm=0.5, logging_steps=1, eval_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, packing=True, padding_free=True, max_length=a.len,
        include_num_input_tokens_seen="all", bf16=False, gradient_checkpointing=False, **extra)
    return SFTTrainer(model=transformers.LlamaForCausalLM(cfg), args=args,
                      processing_class=tokenizer(a.vocab),
                      train_dataset=documents(16 * a.steps * a.batch, a.len, a.vocab, seed=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--system", choices=("one", "spdsl", "alst"), required=True)
    p.add_argument("--len", type=int, default=1024, help="tokens a packed row")
    p.add_argument("--batch", type=int, default=1, help="packed rows per micro-batch")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--drop-varlen", action="store_true",
                   help="alst: drop the collator's 1-D varlen tensors, which ALST refuses")
    p.add_argument("--out")
    p.add_argument("--against")
    a = p.parse_args()
    from spdsl.memory.measure import allocator_span, mark, track_cpu_allocations
    track_cpu_allocations()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and a.system == "alst":    # DeepSpeed's own groups know only its init
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
    elif world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    torch.set_num_threads(1 if world > 1 else torch.get_num_threads())
    trainer = build(a, world)
    if a.system == "alst" and a.drop_varlen:
        # ALST's data loader adapter gathers every tensor of a batch as [batch, seq]; the
        # padding-free collator's cu_seq_lens_* are 1-D (IndexError in its refill). SDPA finds
        # the documents from the position ids without them.
        collate = trainer.data_collator
        trainer.data_collator = lambda rows: {k: v for k, v in collate(rows).items()
                                              if k not in VARLEN}
    if a.system == "spdsl":
        import spdsl
        trainer = spdsl.hf.sequence_parallel(trainer, seq=world)
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.start)
    clock = Clock()
    trainer.add_callback(clock)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        mark()
        trainer.train()
        mark()
    before, peak, _ = allocator_span(prof)
    peaks = [before + peak]
    if world > 1:
        import torch.distributed as dist
        every = [None] * world
        dist.all_gather_object(every, before + peak)
        peaks = every
    logs = [{k: v for k, v in e.items() if not any(t in k for t in _TIMINGS)}
            for e in trainer.state.log_history]
    if int(os.environ.get("RANK", "0")) != 0:
        return
    out = {"system": a.system, "ranks": world, "len": a.len, "batch": a.batch,
           "hidden": a.hidden, "layers": a.layers, "vocab": a.vocab,
           "step_s_median": statistics.median(clock.times[1:]), "step_s": clock.times,
           "peak_bytes_per_rank": peaks, "logs": logs, "torch": torch.__version__}
    print(json.dumps({k: v for k, v in out.items() if k != "logs"}))
    if a.against:
        with open(a.against) as f:
            ref = json.load(f)["logs"]
        diff = {}
        for key in ("loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy",
                    "num_tokens", "num_input_tokens_seen", "train_loss"):
            pairs = list(zip([e[key] for e in ref if key in e], [e[key] for e in logs if key in e]))
            if pairs:
                diff[key] = max(abs(x - y) / max(abs(x), 1e-30) for x, y in pairs)
        out["worst_relative_difference"] = diff
        print(json.dumps(diff))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
