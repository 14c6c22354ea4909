"""Write the Hugging Face matrix (family x attention x SP degree x batch, compiled and
checkpointed runs) to ``docs/hf.md``: each cell is ``exact`` with the worst relative error of
the loss and every gradient, or the error the run raised.

    python -m tests.hf.matrix            # 48 min on 2 CPU cores at a load average of 10-14

One launch of gloo ranks per SP degree runs every case of that degree (``tests.hf.cases``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from tests.dist import spawn
from tests.hf.cases import (
    COMPILED_CASES,
    EXPECTED_ALL_TO_ALL,
    REMAT_CASES,
    Case,
    expected_all_to_alls,
    run_all,
)
from tests.hf.families import ATTN, FAMILIES, MATRIX

DATA = ("plain", "pad_right", "pad_left", "packed")
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def cases() -> list[Case]:
    return [Case(f, a, d) for f in FAMILIES for a in ATTN[f] for d in DATA]


def cell(per_rank: list[dict], name: str, world: int) -> str:
    if not per_rank or name not in per_rank[0]:
        return "not run"
    outs = [r[name] for r in per_rank]
    if "skip" in outs[0]:
        return "skipped: " + outs[0]["skip"]
    err = next((o["error"] for o in outs if "error" in o), None)
    if err is not None:
        last = [line for line in err.strip().splitlines() if line.strip()][-1]
        return "error: " + last.replace("|", "/")[:140]
    loss = max(o["loss"] for o in outs)
    grad = max(o["grad"] for o in outs)
    a2a = {o["all_to_all"] for o in outs}
    ok = loss <= LOSS_RTOL and grad <= GRAD_RTOL and not any(o["missing"] for o in outs)
    note = "" if a2a == {expected_all_to_alls(name, world)} else f", {sorted(a2a)} all-to-alls"
    return f"{'exact' if ok else 'NOT exact'} ({max(loss, grad):.0e}{note})"


def untested(family: str, attn: str) -> str:
    """Families outside the tested matrix: what planning them (one process, fake tensors)
    says, for every cell."""
    import spdsl
    from tests.hf.cases import inputs, loss_fn
    from tests.hf.families import build
    names, xs = inputs("plain")
    try:
        spdsl.plan(spdsl.sp_shard(seq=2)(loss_fn(build(family, attn), names)), *xs)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return "error: " + str(e).splitlines()[0].replace("|", "/")[:140]
    return "plans (not run)"


def load(path: str, degrees: list[int]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {w: [] for w in degrees}
    # oldest first: a later rerun of a case replaces its earlier result
    for name in sorted(os.listdir(path), key=lambda n: os.path.getmtime(os.path.join(path, n))):
        w = int(name[2:].split("_")[0])
        if w not in out:
            continue
        with open(os.path.join(path, name)) as fh:
            per_rank = json.load(fh)
        if not out[w]:
            out[w] = [{} for _ in per_rank]
        for mine, theirs in zip(out[w], per_rank):
            mine.update(theirs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--degrees", default="2,4")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "hf.md"))
    ap.add_argument("--from", dest="saved", default=None,
                    help="render results saved by the tests (SPDSL_HF_RESULTS=dir) instead of "
                         "running the matrix; cases they did not run read 'not run'")
    args = ap.parse_args()
    degrees = [int(d) for d in args.degrees.split(",")]
    import transformers
    results = load(args.saved, degrees) if args.saved else {}
    for w in degrees if not args.saved else []:
        extra = REMAT_CASES + (COMPILED_CASES if w == 2 else [])
        results[w] = spawn(run_all, w, cases() + extra, False, timeout=7200)
        print(f"sp{w} done", file=sys.stderr)
    source = "the saved results of `pytest tests/hf` (`SPDSL_HF_RESULTS=dir`, then " \
        "`python -m tests.hf.matrix --from dir`)" if args.saved else "`python -m tests.hf.matrix`"
    lines = [
        "# Hugging Face models under `sp_shard`",
        "",
        (f"Generated from {source} on {datetime.date.today()} "
        f"(transformers {transformers.__version__}, torch {torch.__version__}, CPU, gloo). "
        "Tiny random configs (`tests/hf/families.py`: hidden 64, 4 query heads, 2 layers, "
        "sequence 32, fp32, dropout off). Each cell: loss and every parameter gradient of "
        "`sp_shard(seq=P)(loss_fn)` against single-device PyTorch on the same weights and "
        f"batch; `exact` means loss <= {LOSS_RTOL:g} and every gradient <= {GRAD_RTOL:g} "
        "relative (to the parameter's largest gradient, floored at 1e-3 of the model's), "
        "with the worst of the two in brackets; the process group ran "
        f"{EXPECTED_ALL_TO_ALL} all-to-alls per step per Ulysses head group (2 per layer "
        "forward, 2 backward; one group unless SPDSL_ULYSSES_GROUPS says more) unless a count "
        "is shown."),
        "",
        ("Batches: `plain` (no mask), `pad_right`/`pad_left` (a 2-D `attention_mask`, one row "
        "padded by a quarter), `packed` (three documents in one row, `position_ids` restarting "
        "at each, no attention across them)."),
        "",
        ("Dropout is off in the matrix. With dropout on, sequence-parallel training is not "
        "bitwise single-device training: each rank draws dropout masks for its own local piece "
        "(its tokens; its heads inside attention) from its own generator. Every element is "
        "still dropped with probability p (with the same seed on every rank the pieces repeat "
        "one mask pattern); `tests/hf/test_hf_parity.py::test_dropout_trains` checks that a "
        "GPT-2 with every dropout at 0.1 trains (loss at least halves in 30 steps)."),
        "",
    ]
    for w in degrees:
        lines += [f"## SP {w}", "", "| family | attention | " + " | ".join(DATA) + " |",
                  "|---|---|" + "---|" * len(DATA)]
        for f in FAMILIES:
            for a in ("sdpa", "eager"):
                if a not in ATTN[f]:
                    row = ["n/a: transformers has no SDPA path for this model"] * len(DATA)
                elif f not in MATRIX:
                    row = [untested(f, a)] * len(DATA)
                else:
                    row = [cell(results[w], Case(f, a, d).name, w) for d in DATA]
                lines.append(f"| {f} | {a} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["## Compiled and checkpointed", "", "| case | SP | result |", "|---|---|---|"]
    for w in degrees:
        for c in REMAT_CASES + (COMPILED_CASES if w == 2 else []):
            if cell(results[w], c.name, w) != "not run":
                lines.append(f"| {c.name} | {w} | {cell(results[w], c.name, w)} |")
    lines += attention_section()
    lines += ["", "## Known gaps", "",
              ("- `not run`: the case is outside the tested subset (`tests/hf/cases.py`: "
              "`TEST_CASES`); `python -m tests.hf.matrix` without `--from` runs every cell."),
              ("- OPT runs in `eval()` mode here: with every dropout at 0 it computes the "
              "training loss and gradients as one program. Its training mode draws layerdrop "
              "in Python (`torch.rand([]) < p`, even with `layerdrop=0.0`) and runs in "
              "segments, traced once per path of draws and replayed after (docs/breaks.md); "
              "`tests/hf/test_opt_layerdrop.py` "
              "checks it at SP 2 and 4 with `layerdrop=0.5`."),
              ("- `skipped:` the installed transformers builds no such model (Gemma 2 has no "
              "SDPA attention from transformers 5.23 on). The extras allow "
              "`transformers>=5.17,<6`; `.ci/run` runs the tested subset on the newest release "
              "and again at SP 2 on 5.17.0."),
              "", "## What each family exercises", "", "| family | exercises |", "|---|---|"]
    lines += [f"| {f.name} | {f.exercises} |" for f in FAMILIES.values()]
    lines.append("| plain_tied | a plain PyTorch Llama (`spdsl/models/llama.py`) tying its input "
                 "and output embeddings |")
    lines += hybrid_section()
    with open(args.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(args.out)


def attention_section() -> list[str]:
    """Each Hugging Face ``attn_implementation`` and what ``sp_shard`` does with it
    (``spdsl.propagate.hf_attention``; ``tests/propagate/test_hf_attention.py`` checks the rows
    against it)."""
    return [
        "", "## Attention implementations", "",
        "| `attn_implementation` | under `sp_shard` | tested by |", "|---|---|---|",
        ("| `sdpa` | split: `scaled_dot_product_attention` by Ulysses, ring or hybrid (the cost "
         "model's choice, [plan.md](plan.md)) | the tables above |"),
        ("| `eager` | split: the softmax of `q @ k^T` recognised as one attention "
         "(`spdsl.propagate.forms`) | the tables above |"),
        ("| `flash_attention_2` | with `flash_attn` and a CUDA device: each kernel call "
         "(`flash_attn_func`; `flash_attn_varlen_func` for packed rows given `cu_seq_lens_q/k`, "
         "every rank passing the whole sequence's bounds) captured as one node and split by "
         "heads, Ulysses all-to-alls around it (kv heads fewer than the ranks: run whole on "
         "every rank; a plain batch of one row: Hugging Face reads the position ids to tell "
         "packed from plain, a graph break in each layer, run in segments as "
         "[breaks.md](breaks.md) says, unless `cu_seq_lens_q/k` are passed); without: "
         "refused, one line | `tests/hf/test_flash_attention.py`: Llama "
         "at SP 2, plain and packed, loss and gradients exact, 4 all-to-alls a layer, on CPU "
         "stand-ins of the kernels (sdpa inside, `tests/hf/varlen.py`); the CUDA kernels "
         "themselves are not run here |"),
        ("| `flash_attention_3` | as `flash_attention_2` (split by heads; refused, one line, "
         "without the kernels of `flash_attn_interface`) | Hugging Face's flash path and the "
         "plan, on the stand-ins |"),
        ("| `flex_attention` | refused, one line: Hugging Face compiles it with "
         "`torch.compile`, which FX cannot trace | `tests/propagate/test_hf_attention.py` |"),
        ("| `flash_attention_4`, `paged\\|...`, hub kernels (`kernels-community/...`) | refused, "
         "one line: kernels opaque to the tracer | `tests/propagate/test_hf_attention.py` |")]


HYBRIDS_SP4 = os.path.join(ROOT, "bench", "results", "hybrid_parity_sp4_all.json")


def hybrid_section(path: str = HYBRIDS_SP4) -> list[str]:
    """The hybrids' table: every case of ``tests/hf/test_hybrid_parity.py`` at SP 4, as
    ``SPDSL_HYBRID_SP4=all`` wrote it (``bench/results/hybrid_parity_sp4_all.json``)."""
    with open(path) as fh:
        rows = json.load(fh)
    families = list(dict.fromkeys(name.split("/")[0] for name in rows))
    data = ("plain", "pad_right", "packed", "varlen")
    lines = [
        "", "## Hybrids (linear attention and state-space layers) and mixture of experts", "",
        "The hybrids' sequence mixers are split over the sequence (by heads or by passing states:",
        "[mixers.md](mixers.md)); their parity runs in `tests/hf/test_hybrid_parity.py` (every case at",
        "SP 2 on transformers 5.25 and 5.17, a subset at SP 4). Every case at SP 4, transformers 5.25",
        "(`SPDSL_HYBRID_SP4=all python -m pytest tests/hf/test_hybrid_parity.py -k sp4`; raw:",
        "`bench/results/hybrid_parity_sp4_all.json`): the worst of the loss and every gradient, and the",
        "mixers' strategy. `varlen`: packed with the documents' bounds passed to the mixers (the GPU",
        "kernels' path, on CPU through `tests/hf/varlen.py`). Gated DeltaNet's gradients are compared",
        "within 1e-4 or twice the rounding floor of Hugging Face's chunked function (`*`).", "",
        "| family | " + " | ".join(data) + " | mixers |", "|---|" + "---|" * len(data) + "---|"]
    for f in families:
        cells, strategies = [], set()
        for d in data:
            v = rows.get(f"{f}/{d}")
            if v is None:
                cells.append("-")
                continue
            ok = v["loss"] <= LOSS_RTOL and v["grad"] <= max(GRAD_RTOL, 2 * v["floor"])
            err = max(v["loss"], v["grad"])
            cells.append(f"{'exact' if ok else 'NOT exact'} "
                         f"({err:.0e}{'*' if v['grad'] > GRAD_RTOL else ''})")
            strategies |= {" ".join(s.split(".")[1:3]) for s in v["strategies"] or []}
        lines.append(f"| {f} | " + " | ".join(cells) + " | " + ", ".join(sorted(strategies)) + " |")
    return lines + [
        "", "Mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek-V3, DeepSeek-V3.2,",
        "gpt-oss, Qwen3-Next, Jamba, Granite 4 hybrid, Kimi-Linear, MiniMax) and their experts implementations:",
        "[moe.md](moe.md) (`tests/hf/test_moe_parity.py`: SP 2 and 4 on transformers 5.25, SP 2 on 5.17).",
        ""]


if __name__ == "__main__":
    main()
