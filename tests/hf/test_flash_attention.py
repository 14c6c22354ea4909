"""Hugging Face's ``flash_attention_2``/``_3`` under ``sp_shard``: the kernel call
(``flash_attn_func``, ``flash_attn_varlen_func`` for packed rows) is captured as one node and
split by heads, Ulysses all-to-alls around it, every rank the whole sequence of its heads.

Without CUDA the kernels are CPU stand-ins of the same signatures computed with sdpa
(``tests.hf.varlen.flash_attn_on_cpu``), installed as the ``flash_attn`` package (FA3:
``flash_attn_interface``); Hugging Face runs its own flash path to them. What is not exercised
here: the CUDA kernels themselves and Hugging Face's ``is_flash_attn_2_available()`` (answered
True by the stand-in, False on any CPU), nor ``from_pretrained``'s check of the implementation
(the config is switched after building, as the implementation would be loaded on a GPU).

One process: Hugging Face takes the flash path (the stand-ins are called, the varlen one for
packed rows, and give sdpa's loss); the SP 2 plan captures each call as ``mixer.flash_attention
.heads`` with the all-to-all bytes of the sdpa model's plan (the Ulysses floor). One launch at
SP 2, plain and packed batches: loss and every parameter gradient equal one device running the
same stand-in (fp32), four all-to-alls per layer counted at the process group (q/k/v in, the
output out, forward and backward), and each rank's kernel call gets half of every head's
tensors (half the heads, the whole sequence).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import spdsl

transformers = pytest.importorskip("transformers")

from tests.dist import spawn
from tests.hf.cases import grad_errors
from tests.hf.families import LAYERS, batch, build
from tests.hf.hybrid_cases import _MixerCalls, mixer_strategies
from tests.hf.varlen import FLASH_CALLS, flash_attn_on_cpu, varlen_batch

DOCS = (5, 14, 13)                 # one packed row of three documents, 32 tokens


def _model(impl: str = "flash_attention_2", seed: int = 0):
    model = build("llama", "sdpa", seed=seed)
    model.config._attn_implementation = impl      # as from_pretrained(attn_implementation=)
    return model


def _step(model, data: str):
    """(loss function, its tensors) of a plain batch of two rows or a packed row given the
    documents' bounds, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``."""
    if data == "plain":
        ids, labels = batch()
        return (lambda ids, labels: model(input_ids=ids, labels=labels, use_cache=False).loss,
                (ids, labels))
    ids, labels, pos, cu, _ = varlen_batch(sum(DOCS), DOCS)

    def loss(ids, labels, pos, cu):
        return model(input_ids=ids, labels=labels, position_ids=pos, cu_seq_lens_q=cu,
                     cu_seq_lens_k=cu, max_length_q=max(DOCS), max_length_k=max(DOCS),
                     use_cache=False).loss
    return loss, (ids, labels, pos, cu)


@pytest.mark.parametrize("version", [2, 3])
def test_hugging_face_takes_its_flash_path(version):
    with flash_attn_on_cpu(version):
        flash, ref = _model(f"flash_attention_{version}"), _model("sdpa")
        for data, fn in (("plain", "flash_attn_func"), ("varlen", "flash_attn_varlen_func")):
            calls = FLASH_CALLS[fn]
            f, xs = _step(flash, data)
            got = f(*xs)
            assert FLASH_CALLS[fn] == calls + LAYERS, (data, FLASH_CALLS)
            # sdpa on the same row: the packed one by its position ids (documents apart)
            want = ref(input_ids=xs[0], labels=xs[1], use_cache=False,
                       **({"position_ids": xs[2]} if data == "varlen" else {})).loss
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("data", ["plain", "varlen"])
def test_plan_splits_the_kernel_by_heads_at_the_ulysses_floor(data):
    with flash_attn_on_cpu(2):
        f, xs = _step(_model(), data)
        plan = spdsl.plan(spdsl.sp_shard(seq=2)(f), *xs)
    form = "flash_attention" if data == "plain" else "flash_attention_varlen"
    assert mixer_strategies(plan) == [f"mixer.{form}.heads"] * LAYERS
    # forward all-to-all bytes: the analytic Ulysses floor of sdpa attention on the same row
    # (q, k, v in and the output out once each, spdsl.inspect.plan.Attention)
    ref = _model("sdpa")
    ids, labels = xs[:2]
    kw = {} if data == "plain" else {"position_ids": xs[2]}
    sdpa = spdsl.plan(spdsl.sp_shard(seq=2)(
        lambda ids, labels: ref(input_ids=ids, labels=labels, use_cache=False, **kw).loss),
        ids, labels)
    assert len(sdpa.attention) == LAYERS
    fwd = sum(c.bytes for c in plan.collectives if c.kind == "all_to_all")
    assert fwd == sum(a.floor for a in sdpa.attention), (fwd, [a.floor for a in sdpa.attention])


def _job(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    out = {}
    with flash_attn_on_cpu(2):
        for data in ("plain", "varlen"):
            ref = _model()
            model = copy.deepcopy(ref)
            f_ref, xs = _step(ref, data)
            loss_ref = f_ref(*xs)
            loss_ref.backward()
            step = spdsl.sp_shard(seq=world)(_step(model, data)[0])
            step(*xs).backward()            # builds the step outside the profiler
            model.zero_grad(set_to_none=True)
            with profile(activities=[ProfilerActivity.CPU]) as prof, _MixerCalls() as calls:
                loss = step(*xs)
                loss.backward()
            res = grad_errors(model, ref)
            res["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
            res["all_to_all"] = sum(1 for e in prof.events() if e.name == "gloo:all_to_all")
            res["calls"] = calls.calls
            out[data] = res
    return out


@pytest.fixture(scope="module")
def sp2():
    return spawn(_job, 2, timeout=900)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("data", ["plain", "varlen"])
def test_exact_at_sp2(sp2, data):
    for r, res in enumerate(sp2):
        out = res[data]
        assert out["missing"] == [] and out["extra"] == [] and out["n_grads"] > 0, out
        assert out["loss"] <= 1e-6, f"rank {r}: loss rel err {out['loss']:.2e}"
        assert out["grad"] <= 1e-5, f"rank {r}: grad rel err {out['grad']:.2e} ({out['worst']})"
        assert out["all_to_all"] == 4 * LAYERS, f"rank {r}: {out['all_to_all']} all-to-alls"
        # each kernel call: half the heads of the whole sequence
        forms = {"plain": "flash_attention", "varlen": "flash_attention_varlen"}
        assert [c[0] for c in out["calls"]] == [forms[data]] * LAYERS
        assert all(big * 2 == whole for _, big, whole in out["calls"]), out["calls"]
