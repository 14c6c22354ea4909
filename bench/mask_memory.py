"""Planned per-rank peak of one training step at SP 8 for every batch and attention form, with
masks as functions (``spdsl.propagate.masks``) and without them (``SPDSL_MASK_FUNCTIONS=0``,
the dense ``[B, 1, S, S]`` mask and written-out scores), against the plain batch:

    python bench/mask_memory.py                                   # 4K .. 128K tokens, ~10 min
    python bench/mask_memory.py --seqs 4096 16384 --cases plain padded

Model: a Hugging Face Llama (hidden 64, 8 query / 2 kv heads, 2 layers, fp32), remat "full",
AdamW; ALiBi: ``spdsl.models.toys.AlibiNet`` (hidden 64, 8 heads, 2 layers), SDPA with its
float bias. Batches: plain (SDPA, causal), right-padded (``attention_mask``, a quarter padding
in row 1 of 2... here one row, its last quarter), packed (``position_ids`` restarting every
1,024 tokens), sliding window (Mistral, window 512), eager attention (plain batch), ALiBi.
The planner simulates the step on fake tensors (no memory used, no process group). Writes
``bench/results/mask_memory.json``; ``bench/MEMORY.md`` quotes the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CASES = ("plain", "padded", "packed", "window", "eager", "alibi")
SP = 8


def _hf(attn: str, **extra):
    import transformers
    kind = "mistral" if "sliding_window" in extra else "llama"
    cfg = transformers.AutoConfig.for_model(
        kind, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20, **extra)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float()


def step_of(case: str, seq: int):
    """(sharded step, its arguments) for one case at ``seq`` tokens."""
    import spdsl
    ids = torch.randint(1, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    if case == "alibi":
        from spdsl.models.toys import AlibiNet
        torch.manual_seed(0)
        model = AlibiNet(AlibiNet.Config(n_heads=8))
        return spdsl.sp_shard(seq=SP, remat="full")(model), (ids, ids)
    model = _hf("eager" if case == "eager" else "sdpa",
                **({"sliding_window": 512} if case == "window" else {}))
    if case == "padded":
        mask = torch.ones(1, seq, dtype=torch.long)
        mask[:, -seq // 4:] = 0

        def fn(i, lab, m):
            return model(input_ids=i, labels=lab, attention_mask=m, use_cache=False).loss
        return spdsl.sp_shard(seq=SP, remat="full")(fn), (ids, ids, mask)
    if case == "packed":
        pos = torch.arange(seq).remainder(1024).unsqueeze(0)

        def fn(i, lab, p):
            return model(input_ids=i, labels=lab, position_ids=p, use_cache=False).loss
        return spdsl.sp_shard(seq=SP, remat="full")(fn), (ids, ids, pos)

    def fn(i, lab):
        return model(input_ids=i, labels=lab, use_cache=False).loss
    return spdsl.sp_shard(seq=SP, remat="full")(fn), (ids, ids)


def planned(case: str, seq: int, functions: bool) -> dict:
    import spdsl
    os.environ["SPDSL_MASK_FUNCTIONS"] = "1" if functions else "0"
    t = time.perf_counter()
    step, args = step_of(case, seq)
    plan = spdsl.plan(step, *args)
    mem = plan.memory
    return {"case": case, "seq": seq, "functions": functions, "peak": mem.peak,
            "masks": sorted({a.mask for a in plan.attention}),
            "seconds": round(time.perf_counter() - t, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+",
                    default=[4096, 8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--dense-up-to", type=int, default=16384,
                    help="plan the dense masks (before) up to this length (they take longer)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "mask_memory.json"))
    a = ap.parse_args()
    rows = []
    for seq in a.seqs:
        for case in a.cases:
            for functions in (True, False):
                if not functions and (case == "plain" or seq > a.dense_up_to):
                    continue
                r = planned(case, seq, functions)
                rows.append(r)
                print(f"{case:7} {seq:7,} {'function' if functions else 'dense':8} "
                      f"{r['peak'] / 2**20:10.1f} MiB  ({r['seconds']} s)", file=sys.stderr,
                      flush=True)
    plain = {r["seq"]: r["peak"] for r in rows if r["case"] == "plain"}
    print(f"\nplanned per-rank peak at SP {SP}, remat full (MiB; ratio to the plain batch)")
    print("| tokens | " + " | ".join(a.cases) + " |")
    print("|---" * (len(a.cases) + 1) + "|")
    for seq in a.seqs:
        cells = []
        for case in a.cases:
            f = next(r for r in rows if r["case"] == case and r["seq"] == seq and r["functions"])
            d = next((r for r in rows if r["case"] == case and r["seq"] == seq
                      and not r["functions"]), None)
            cell = f"{f['peak'] / 2**20:,.1f} ({f['peak'] / plain[seq]:.2f}x)"
            if d is not None:
                cell += f"; dense {d['peak'] / 2**20:,.1f}"
            cells.append(cell)
        print(f"| {seq:,} | " + " | ".join(cells) + " |")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"sp": SP, "remat": "full", "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
