"""Hugging Face parity cases run on every rank of one launch (``tests.dist.spawn``): loss and
every parameter gradient of ``sp_shard(seq=world)`` against single-device PyTorch on the same
weights and batch (fp32), and the all-to-alls the process group really ran.

All-to-alls are counted by the profiler's ``gloo:all_to_all`` events, which the gloo process
group emits for each collective it executes (eager or compiled), not from spdsl's plan.
"""

from __future__ import annotations

import copy
import os
import sys
import traceback
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

import spdsl
from tests.hf.families import ATTN, LAYERS, MATRIX, batch, build, packed, padded, unsupported

# a gradient that is zero in exact arithmetic (a key bias: softmax is shift-invariant) is
# rounding noise on both sides; its error is measured against this share of the model's
# largest gradient instead of its own
GRAD_FLOOR = 1e-3


@dataclass(frozen=True)
class Case:
    family: str
    attn: str = "sdpa"
    data: str = "plain"            # plain | pad_right | pad_left | packed | packed_seq_idx
    compile: bool = False
    remat: str | None = None

    @property
    def name(self) -> str:
        extra = "".join([",compile" if self.compile else "",
                         f",remat={self.remat}" if self.remat else ""])
        return f"{self.family}/{self.attn}/{self.data}{extra}"


def inputs(data: str):
    """(positional names, tensors) of the loss function for one kind of batch."""
    if data == "plain":
        ids, labels = batch()
        return ("input_ids", "labels"), (ids, labels)
    if data in ("pad_right", "pad_left"):
        return ("input_ids", "labels", "attention_mask"), padded(side=data[4:])
    if data == "packed":
        return ("input_ids", "labels", "position_ids"), packed()
    if data == "packed_seq_idx":
        # the document index of every token as well, as DataCollatorWithFlattening(
        # return_seq_idx=True) passes it: the causal_conv1d_fn mixer's halo carries the
        # indices too (causal-conv1d's kernel restarts at documents; the torch fallback of
        # transformers 5.17 ignores them, 5.2x refuses them without the kernel)
        ids, labels, pos = packed()
        return ("input_ids", "labels", "position_ids", "seq_idx"), (
            ids, labels, pos, (pos == 0).cumsum(1).to(torch.int32) - 1)
    raise ValueError(data)


def loss_fn(model, names):
    if not names:                   # a plain PyTorch model: model(ids, labels) -> loss
        return model

    def f(*xs):
        return model(**dict(zip(names, xs)), use_cache=False).loss
    return f


def grad_errors(model, ref) -> dict:
    out = {"grad": 0.0, "worst": "", "n_grads": 0, "missing": [], "extra": []}
    ref_grads = [q.grad for q in ref.parameters() if q.grad is not None]
    top = max(float(g.abs().max()) for g in ref_grads)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            if p.grad is not None:
                out["extra"].append(name)
            continue
        if p.grad is None:
            out["missing"].append(name)
            continue
        scale = max(float(q.grad.abs().max()), GRAD_FLOOR * top)
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # sharded state
        err = float((g - q.grad).abs().max()) / scale
        if err >= out["grad"]:
            out["grad"], out["worst"] = err, name
        out["n_grads"] += 1
    return out


def _tied_plain_model() -> torch.nn.Module:
    """A plain PyTorch language model whose output projection is its input embedding."""
    from spdsl.models.llama import Llama, LlamaConfig
    return Llama(LlamaConfig.tiny().replace(tie_embeddings=True, n_layers=2))


def run_case(case: Case, world: int) -> dict:
    names, xs = inputs(case.data)
    if case.family == "plain_tied":
        torch.manual_seed(0)
        ref = _tied_plain_model()
        names = ()
    else:
        ref = build(case.family, case.attn)
    model = copy.deepcopy(ref)
    loss_ref = loss_fn(ref, names)(*xs)
    loss_ref.backward()
    step = spdsl.sp_shard(seq=world, compile=case.compile, remat=case.remat)(
        loss_fn(model, names))
    step(*xs).backward()        # builds (traces, plans, lowers, compiles) outside the profiler
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss = step(*xs)
        loss.backward()
    out = grad_errors(model, ref)
    out["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
    out["loss_value"] = loss.item()
    out["all_to_all"] = sum(1 for e in prof.events() if e.name == "gloo:all_to_all")
    return out


def dropout_trains(world: int, steps: int = 30) -> dict:
    """GPT-2 with every dropout at 0.1 trains under sp_shard: loss goes down."""
    model = build("gpt2", "sdpa", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    torch.manual_seed(0)
    ids = torch.arange(32).remainder(8).repeat(2, 1) + 1        # a pattern to learn
    step = spdsl.sp_shard(seq=world)(loss_fn(model, ("input_ids", "labels")))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = step(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"first": losses[0], "last": sum(losses[-5:]) / 5}


# the tested matrix: every family in every attention it has on a plain batch and on a padded
# batch (right padding in one attention, left in the other), packed batches on a spread of
# families (every cell: docs/hf.md, written by python -m tests.hf.matrix)
TEST_CASES = [Case(f, a) for f in MATRIX for a in ATTN[f]] + [
    Case(f, a, side) for f in MATRIX
    for a, side in zip(ATTN[f] * 2, ("pad_right", "pad_left"))] + [
    Case("qwen2", "sdpa", "packed"), Case("gpt_neox", "eager", "packed"),
    Case("phi3", "sdpa", "packed"), Case("gptj", "eager", "packed"),
    Case("llama", "eager", "packed"), Case("gpt2", "sdpa", "packed"),
    Case("gemma3", "sdpa", "packed"), Case("deepseek_v2", "eager", "packed"),
    Case("gemma2", "eager", "packed"), Case("bloom", "eager", "packed"),
    Case("lfm2", "sdpa", "packed"), Case("lfm2", "sdpa", "packed_seq_idx"),
]
# compiled (tied embeddings: GPT-2, Gemma, a plain PyTorch model) and checkpointed
# (the padded case: a mask function, spdsl.propagate.masks, inside the compiled program)
COMPILED_CASES = [Case("gpt2", "sdpa", compile=True), Case("gemma", "eager", compile=True),
                  Case("plain_tied", compile=True), Case("llama", "sdpa", "pad_left", compile=True)]
REMAT_CASES = [Case("llama", "eager", "pad_right", remat="full"),
               Case("qwen3", "sdpa", remat="auto"), Case("gpt_neox", "eager", remat="full"),
               Case("qwen2", "sdpa", "packed", remat="auto")]


def matrix_cases() -> list[Case]:
    """Every family in each attention it has, on a plain batch; padded (right and left) and
    packed batches for every family in one attention each."""
    out = []
    for f in MATRIX:
        for a in ATTN[f]:
            out.append(Case(f, a))
        out.append(Case(f, ATTN[f][-1], "pad_right"))
        out.append(Case(f, ATTN[f][0], "pad_left"))
        out.append(Case(f, ATTN[f][0], "packed"))
    return out


def run_all(rank: int, world: int, cases: list[Case], extras: bool = True) -> dict:
    torch.manual_seed(0)
    results = {}
    for case in cases:
        if os.environ.get("SPDSL_HF_VERBOSE"):
            print(f"rank {rank}: {case.name}", file=sys.stderr, flush=True)
        why = "" if case.family == "plain_tied" else unsupported(case.family, case.attn,
                                                                  case.data)
        if why:
            results[case.name] = {"skip": why}
            continue
        try:
            results[case.name] = run_case(case, world)
        except Exception:  # noqa: BLE001 - reported per case
            results[case.name] = {"error": traceback.format_exc()[-3000:]}
    if extras:
        try:
            results["dropout"] = dropout_trains(world)
        except Exception:  # noqa: BLE001
            results["dropout"] = {"error": traceback.format_exc()[-3000:]}
    return results


EXPECTED_ALL_TO_ALL = 4 * LAYERS      # per layer and head group: q/k/v in and out, fwd and bwd


def one_per_family(cases: list) -> list:
    """The first plain-batch case of each family: what runs at SP 4, where every case runs at
    SP 2 (the same code at a larger degree; a fresh machine's suite stays within its time)."""
    out, seen = [], set()
    for c in cases:
        family = c.name.split("/")[0]
        if family not in seen and c.name.split("/")[2].startswith("plain"):
            seen.add(family)
            out.append(c)
    return out


def expected_all_to_alls(name: str, world: int) -> int:
    """Per layer, one exchange in and one out, forward and backward, for each of the head
    groups a rank pipelines its Ulysses attention in (``spdsl.lower.ops.head_groups``; one
    unless ``SPDSL_ULYSSES_GROUPS`` says more), and a halo each way for a split convolution
    (LFM2's, ``Family.halo_layers``; given ``seq_idx``, its halo too, in forward). Hugging
    Face models gather their (integer) labels for the in-model shift; spdsl's own Llama
    shifts them by a halo exchange, one more gloo all-to-all in forward."""
    from spdsl.lower.ops import head_groups
    from tests.hf.families import FAMILIES, HEADS
    fam = FAMILIES.get(name.split("/")[0])
    kw = fam.kwargs if fam is not None else {}
    hq = kw.get("num_attention_heads", kw.get("n_head", HEADS))
    hk = kw.get("num_key_value_heads") or hq
    groups = len(head_groups(hq, hk, world))
    per_layer = EXPECTED_ALL_TO_ALL // LAYERS
    layers = fam.attention_layers if fam is not None else LAYERS
    halos = 2 * fam.halo_layers if fam is not None else 0     # gloo: halos go as all-to-alls
    if name.endswith("/packed_seq_idx"):    # the document indices' halo, forward only
        halos += fam.halo_layers
    return per_layer * layers * groups + halos + (1 if name.startswith("plain_tied") else 0)
