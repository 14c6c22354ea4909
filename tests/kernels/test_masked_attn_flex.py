"""``spdsl.kernels.masked_attn_flex`` (FlexAttention from a mask program) against the block
kernel and the dense ``[S, S]`` computation: forward and every gradient, boolean and additive
masks (rows that keep no key included), GQA, odd lengths, programs as FX graphs of aten ops;
the block masks it builds; the chooser. On CPU FlexAttention runs eagerly (dense math); the
compiled CUDA kernel is the ``gpu`` case."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spdsl.kernels import masked_attn as M
from spdsl.kernels import masked_attn_flex as X
from spdsl.kernels.backend import kernel_backend, masked_attn_backend, masked_attn_kernel
from tests._util import assert_close
from tests.kernels.test_masked_attn import _dense, _masks

NAMES = ["padding", "padding+causal", "documents", "window", "alibi", "hf_additive"]
RTOL, ATOL = 1e-5, 1e-5          # fp32: both sides sum in fp32, in different orders


def _qkv(b, h, hk, s, d, dtype=torch.float32, device="cpu"):
    return [torch.randn(b, n, s, d, dtype=dtype, device=device, requires_grad=True)
            for n in (h, hk, hk)]


def _check(name, fn, leaves, causal, b, h, hk, s, d=8, scale=0.3):
    key = fn if isinstance(fn, str) else M.register_mask_program(fn, "case")
    q, k, v = _qkv(b, h, hk, s, d)
    with masked_attn_kernel("flex"):
        out = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal, scale=scale)
    with masked_attn_kernel("blocks"):
        blocks = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal, scale=scale)
    program = M.mask_program(key) if key else None
    dense = _dense(q, k, v, program(*leaves) if program else None, causal, scale)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    for ref, what in ((blocks, "blocks"), (dense, "dense")):
        assert_close(out, ref, rtol=RTOL, atol=ATOL, name=f"{name} out vs {what}")
        for x, y, n in zip(grads, torch.autograd.grad(ref, (q, k, v), g), "qkv"):
            assert_close(x, y, rtol=RTOL, atol=ATOL, name=f"{name} d{n} vs {what}")


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hk", [4, 2], ids=["mha", "gqa"])
def test_forward_and_every_gradient(name, hk):
    torch.manual_seed(0)
    b, h, s = 2, 4, 19
    fn, leaves, causal = _masks(b, h, s)[name]
    _check(name, fn, leaves, causal, b, h, hk, s)


@pytest.mark.parametrize("name", ["padding+causal", "hf_additive", "alibi"])
def test_programs_as_aten_graphs(name):
    """The programs ``spdsl.propagate.masks`` registers: FX graphs of aten ops, leaf dtypes."""
    torch.manual_seed(1)
    b, h, s = 2, 4, 23
    fn, leaves, causal = _masks(b, h, s)[name]
    key = M.register_mask_program(make_fx(fn)(*leaves), "fx",
                                  leaf_dtypes=tuple(t.dtype for t in leaves))
    _check(name, key, leaves, causal, b, h, 2, s)


@pytest.mark.parametrize("causal", [False, True])
def test_no_program(causal):
    torch.manual_seed(2)
    _check("none", "", [], causal, 1, 2, 1, 17)


def test_left_padded_additive_rows_average_every_key():
    """A row every entry of which is ``finfo.min`` (HF's left padding) is the mean of v, as the
    dense softmax gives it, not a zero row; its neighbours are untouched."""
    torch.manual_seed(3)
    b, h, s = 2, 4, 19
    fn, leaves, causal = _masks(b, h, s)["hf_additive"]
    key = M.register_mask_program(fn, "hf")
    q, k, v = _qkv(b, h, h, s, 8)
    out = X.flex_masked_attn(q, k, v, leaves, key, causal, 0.3)
    # batch 0's first three keys are padding: query i < 3 keeps none of its keys 0..i, and
    # its row (causal inside the program: finfo.min too) is finfo.min over all 19 keys
    mean = v[0].mean(1, keepdim=True).expand(h, 3, 8)
    assert_close(out[0, :, :3], mean, rtol=1e-5, atol=1e-6, name="dead rows")
    assert_close(out[0, :, 3], v[0, :, 3], rtol=1e-5, atol=1e-6, name="first kept row")


@pytest.mark.compile
@pytest.mark.parametrize("name", ["hf_additive", "documents"])
def test_traced_whole_by_dynamo(name):
    """What CUDA compiles, traced by Dynamo in one graph (block masks, both calls, the aten
    program) and run by AOT autograd's eager backend: forward only, as FlexAttention has no
    compiled CPU backward (Inductor itself runs in the ``gpu`` case)."""
    torch.manual_seed(5)
    b, h, s = 2, 4, 150
    fn, leaves, causal = _masks(b, h, s)[name]
    key = M.register_mask_program(make_fx(fn)(*leaves), "fx",
                                  leaf_dtypes=tuple(t.dtype for t in leaves))
    q, k, v = (torch.randn(b, n, s, 16) for n in (h, 2, 2))
    flex = torch.compile(X._flex, dynamic=False, backend="aot_eager", fullgraph=True)
    out = flex(q, k, v, M.typed_leaves(key, leaves), M.mask_program(key), causal, 0.3)
    with masked_attn_kernel("blocks"):
        ref = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal, scale=0.3)
    assert_close(out, ref, rtol=RTOL, atol=ATOL, name=name)


def test_block_masks_cover_the_mask_and_skip_blocks(monkeypatch):
    """The eager CPU path reads only the mask_mod; the block masks the compiled kernel reads
    are checked here: every kept entry in a listed block, the leaves' batch/head extents,
    and blocks skipped."""
    made = []

    def create(mask_mod, B, H, *args, **kwargs):
        bm = create_block_mask(mask_mod, B, H, *args, **kwargs)
        made.append((mask_mod, B, H, bm))
        return bm

    create_block_mask = X.create_block_mask
    monkeypatch.setattr(X, "create_block_mask", create)
    b, h, s = 2, 4, 300
    for name, extents in (("padding+causal", (b, 1)), ("alibi", (1, h)),
                          ("hf_additive", (b, 1))):
        fn, leaves, causal = _masks(b, h, s)[name]
        key = M.register_mask_program(fn, name)
        q, k, v = (torch.randn(b, h, s, 8) for _ in range(3))
        made.clear()
        X.flex_masked_attn(q, k, v, leaves, key, causal, 0.3)
        mask_mod, mb, mh, bm = made[0]
        assert (mb, mh) == extents, name
        idx = torch.meshgrid(*(torch.arange(n) for n in (mb, mh, s, s)), indexing="ij")
        keep = torch.vmap(mask_mod)(*(t.flatten() for t in idx))
        keep = keep.view(mb, mh, s, s)
        blocks = bm.to_dense().bool()                               # [mb, mh, 3, 3]
        covered = blocks.repeat_interleave(128, 2).repeat_interleave(128, 3)[..., :s, :s]
        assert not bool((keep & ~covered).any()), f"{name}: a kept entry in a skipped block"
        if causal or name == "hf_additive":
            assert not bool(blocks[..., 0, 2].any()), f"{name}: the block above the diagonal"
    # hf_additive's second call: only batch 0's first query block has rows that keep nothing
    assert made[1][3].to_dense().bool()[:, 0, :, 0].tolist() == [[True, False, False],
                                                                  [False, False, False]]


def test_chooser(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("SPDSL_MASKED_ATTN", raising=False)
    assert masked_attn_backend(cpu) == "blocks"
    with masked_attn_kernel("flex"):
        assert masked_attn_backend(cpu) == "flex"
        with masked_attn_kernel("auto"):
            assert masked_attn_backend(cpu) == "blocks"
    monkeypatch.setenv("SPDSL_MASKED_ATTN", "flex")
    assert masked_attn_backend(cpu) == "flex"
    monkeypatch.setenv("SPDSL_MASKED_ATTN", "fast")
    with pytest.raises(ValueError, match="SPDSL_MASKED_ATTN='fast'"):
        masked_attn_backend(cpu)
    with pytest.raises(ValueError, match="not one of auto, flex, blocks"), \
            masked_attn_kernel("triton"):
        pass
    monkeypatch.setenv("SPDSL_MASKED_ATTN", "auto")
    cuda = SimpleNamespace(device=torch.device("cuda"))     # what the chooser reads of q
    assert masked_attn_backend(cuda) == "flex"
    with kernel_backend("reference"):           # plain PyTorch everywhere: the block loop
        assert masked_attn_backend(cuda) == "blocks"
    assert masked_attn_backend(torch.empty(1, device="meta")) == "blocks"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["padding+causal", "hf_additive"])   # compiles: ~30 s each
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["torch.bfloat16"])
def test_flex_matches_blocks_gpu(name, dtype):
    """The compiled FlexAttention kernel on CUDA against the block kernel, bf16, S past one
    128-block and not a multiple of it, GQA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(4)
    b, h, hk, s, d = 2, 8, 2, 333, 64
    fn, leaves, causal = _masks(b, h, s)[name]
    leaves = [t.cuda() for t in leaves]
    key = M.register_mask_program(fn, name)
    q, k, v = _qkv(b, h, hk, s, d, dtype=dtype, device="cuda")
    assert masked_attn_backend(q) == "flex"
    out = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal)
    with masked_attn_kernel("blocks"):
        ref = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal)
    g = torch.randn_like(out)
    assert_close(out, ref, rtol=2e-2, atol=2e-2, name=f"{name} out")
    for x, y, n in zip(torch.autograd.grad(out, (q, k, v), g),
                       torch.autograd.grad(ref, (q, k, v), g), "qkv"):
        assert_close(x, y, rtol=5e-2, atol=5e-2, name=f"{name} d{n}")
