"""Masks as functions (``spdsl.propagate.masks``) on real runs: Hugging Face models on padded
(right and left), packed and sliding-window batches (one left-padded, one packed) in SDPA and
eager attention, ALiBi in SDPA and written out, and a mask made with ``tril``: loss and every
parameter gradient equal single-device PyTorch (fp32) at SP 2 and 4, and no value the rank's
program makes, forward or backward, holds ``S^2 / P`` elements or more (every op's output is
watched at the dispatcher; the kernel's own blocks are bounded by
``masked_attn.BLOCK_ELEMENTS``, set small here).
One launch of gloo ranks per degree."""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("transformers")

from tests.dist import spawn

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

S = 1024       # S^2/P above any value whose size is not the sequence's (the gradient bucket)
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4
CASES = ["llama/sdpa/pad_right", "llama/sdpa/pad_left", "llama/sdpa/packed",
         "llama/eager/pad_right", "llama/eager/pad_left", "llama/eager/packed",
         "mistral/sdpa/window", "mistral/eager/window", "qwen2/sdpa/window",
         "qwen3/eager/window", "phi3/sdpa/window", "qwen2/sdpa/pad_right,remat=full",
         "mistral/eager/window,remat=full", "mistral/eager/window_pad_left",
         "mistral/sdpa/window_packed",
         "alibi/sdpa", "alibi/written_out", "gpt2like/tril"]


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op returns while the mode is on."""

    def __init__(self) -> None:
        super().__init__()
        self.most, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.most:
                self.most, self.op = t.numel(), str(func)
        return out


def _setup(name: str):
    """(model, loss function of the batch, batch, remat) for one case."""
    from spdsl.models.toys import AlibiNet, GPT2Like
    from tests.hf.cases import loss_fn
    from tests.hf.families import batch, build, packed, padded
    case, _, opts = name.partition(",")
    remat = opts.removeprefix("remat=") or None
    family, attn, *data = case.split("/")
    torch.manual_seed(0)
    if family in ("alibi", "gpt2like"):
        model = AlibiNet(AlibiNet.Config(written_out=attn == "written_out")) \
            if family == "alibi" else GPT2Like(GPT2Like.Config(max_seq_len=S))
        ids = torch.randint(0, 256, (1, S), generator=torch.Generator().manual_seed(1))
        return model, lambda m: m, (ids, ids), remat
    data = data[0]
    if data.startswith("window"):     # a window of 64 in a sequence of 1,024
        extra = {"use_sliding_window": True, "max_window_layers": 0} \
            if family.startswith("qwen") else {}
        model = build(family, attn, sliding_window=64, **extra)
        if data.endswith("pad_left"):   # eager: the padding's rows average every value
            return model, lambda m: loss_fn(m, ("input_ids", "labels", "attention_mask")), \
                padded(2, S, "left"), remat
        if data.endswith("packed"):     # the window inside each document
            return model, lambda m: loss_fn(m, ("input_ids", "labels", "position_ids")), \
                packed(S, (200, 500, 324)), remat
        return model, lambda m: loss_fn(m, ("input_ids", "labels")), batch(2, S), remat
    if data == "packed":
        names, xs = ("input_ids", "labels", "position_ids"), packed(S, (200, 500, 324))
    else:
        names, xs = ("input_ids", "labels", "attention_mask"), padded(2, S, data[4:])
    return build(family, attn), lambda m: loss_fn(m, names), xs, remat


def _run(name: str, world: int) -> dict:
    import spdsl
    ref, make_fn, xs, remat = _setup(name)
    model = copy.deepcopy(ref)
    loss_ref = make_fn(ref)(*xs)
    loss_ref.backward()
    step = spdsl.sp_shard(seq=world, remat=remat)(make_fn(model))
    plan = spdsl.plan(step, *xs)
    watch = _Largest()
    with watch:
        loss = step(*xs)
        loss.backward()
    grad = 0.0
    n = 0
    top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, pname
            continue
        scale = max(float(q.grad.abs().max()), 1e-3 * top)
        grad = max(grad, float((p.grad - q.grad).abs().max()) / scale)
        n += 1
    return {"loss": abs(loss.item() - loss_ref.item()) / abs(loss_ref.item()), "grad": grad,
            "n_grads": n, "most": watch.most, "op": watch.op,
            "masks": sorted({a.mask for a in plan.attention})}


def _all(rank: int, world: int) -> dict:
    from spdsl.kernels import masked_attn
    masked_attn.BLOCK_ELEMENTS = 1 << 14      # blocks of 2-16 query rows at these sizes
    out = {}
    for name in CASES:
        try:
            out[name] = _run(name, world)
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = {"error": traceback.format_exc()[-3000:]}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"sp{w}")
def results(request):
    return request.param, spawn(_all, request.param, timeout=1800)


@pytest.mark.parametrize("name", CASES)
def test_exact_and_no_quadratic_value(results, name):
    world, per_rank = results
    for r, res in enumerate(per_rank):
        out = res[name]
        assert "error" not in out, f"sp{world} rank {r}: {out['error']}"
        where = f"sp{world} rank {r} {name}"
        assert out["n_grads"] > 0
        assert out["loss"] <= LOSS_RTOL, f"{where}: loss rel err {out['loss']:.2e}"
        assert out["grad"] <= GRAD_RTOL, f"{where}: grad rel err {out['grad']:.2e}"
        assert out["most"] < S * S // world, \
            f"{where}: {out['op']} made a tensor of {out['most']} elements (S^2/P = " \
            f"{S * S // world})"
        assert all(m.startswith("function of") for m in out["masks"]), out["masks"]
