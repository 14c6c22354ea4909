"""``spdsl.kernels.masked_attn`` against the dense ``[S, S]`` computation it replaces: forward
and every gradient, boolean and additive masks, GQA, blocks smaller than the sequence."""

from __future__ import annotations

import itertools

import pytest
import torch

from spdsl.kernels import masked_attn as M
from spdsl.kernels import masked_attn_keys as K
from spdsl.kernels import masked_attn_keys_cpu as KC
from spdsl.kernels import masked_attn_keys_workspace as KW
from tests._util import assert_close

TOL = {torch.float32: (2e-5, 2e-6), torch.float64: (1e-12, 1e-13)}


def _dense(q, k, v, mask, causal, scale):
    h = q.shape[1]
    k, v = M._grouped(k, h), M._grouped(v, h)
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, -1).nan_to_num(0.0), v)


def _masks(b, h, s):
    qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    valid = torch.ones(b, s, dtype=torch.bool)
    valid[-1, -s // 3:] = False                                     # right padding
    valid[0, :3] = False          # and left: rows that keep no key (an additive mask: all)
    doc = torch.tensor([0] * (s // 3) + [1] * (s - s // 3 - 2) + [2] * 2).view(1, 1, 1, s)
    rows = torch.stack([(torch.arange(s) >= s // 2).long(),                 # 2 documents
                        (torch.arange(s) // 5).long()])[-b:].view(b, 1, 1, s)  # of 5 tokens
    slopes = torch.linspace(-0.5, -0.1, h).view(1, h, 1, 1)
    right = valid.clone()
    right[0, :3] = True                                             # no left padding
    zero, low = torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1, 1), torch.finfo(torch.float32).min)
    minf = torch.finfo(torch.float32).min
    return {
        "padding": (lambda kv: kv, [valid.view(b, 1, 1, s)], False),
        "padding+causal": (lambda qi, ki, kv: (ki <= qi) & kv, [qp, kp, valid.view(b, 1, 1, s)],
                           False),
        "documents": (lambda dq, dk: dq == dk, [doc.transpose(-1, -2), doc], True),
        # each batch row its own documents (HF: position_ids restarting), padding besides
        "documents+padding": (lambda qi, ki, dq, dk, kv: (ki <= qi) & (dq == dk) & kv,
                              [qp, kp, rows.transpose(-1, -2), rows, valid.view(b, 1, 1, s)],
                              False),
        "window": (lambda qi, ki: (ki <= qi) & (qi - ki < 5), [qp, kp], False),
        # windows of about half the row (wide enough for the fused kernel at 37 tokens):
        # written as a difference with a constant, and as Hugging Face's overlay (the
        # window's start a per-query value, a constant True term), with padding
        "sliding": (lambda qi, ki, kv: (ki <= qi) & (qi - ki < s // 2 + 1) & kv,
                    [qp, kp, valid.view(b, 1, 1, s)], False),
        "hf_sliding": (lambda t, ki, lo, qi, kv: t & (ki > lo) & (ki <= qi) & kv,
                       [torch.ones(1, 1, 1, 1, dtype=torch.bool), kp, qp - (s // 2 + 1), qp,
                        right.view(b, 1, 1, s)], False),
        "alibi": (lambda sl, qi, ki: sl * (qi - ki).abs(), [slopes, qp, kp], True),
        "hf_additive": (lambda qi, ki, kv: torch.where((ki <= qi) & kv, 0.0, minf),
                        [qp, kp, valid.view(b, 1, 1, s)], False),
        # Hugging Face's eager masks, their 0 and finfo.min as leaves: right padding only
        # (every row keeps a key), a plain batch, a packed one
        "hf_additive_right": (lambda qi, ki, kv, z, m: torch.where((ki <= qi) & kv, z, m),
                              [qp, kp, right.view(b, 1, 1, s), zero, low], False),
        "hf_eager_plain": (lambda ki, qi, z, m: torch.where(ki <= qi, z, m),
                           [kp, qp, zero, low], False),
        "hf_eager_packed": (lambda qi, ki, dq, dk, z, m: torch.where((ki <= qi) & (dq == dk), z,
                                                                     m),
                            [qp, kp, rows.transpose(-1, -2), rows, zero, low], False),
        # left padding: rows 0-2 of batch 0 keep no key, so average every value
        "hf_eager_left": (lambda qi, ki, kv, z, m: torch.where((ki <= qi) & kv, z, m),
                          [qp, kp, valid.view(b, 1, 1, s), zero, low], False),
        "hf_eager_packed_left": (lambda qi, ki, dq, dk, kv, z, m: torch.where(
            (ki <= qi) & (dq == dk) & kv, z, m),
            [qp, kp, rows.transpose(-1, -2), rows, valid.view(b, 1, 1, s), zero, low], False),
        # a window inside packed documents (the 5-token ones shorter than it: whole)
        "documents+window": (lambda qi, ki, dq, dk, kv: (ki <= qi) & (qi - ki < 8) & (dq == dk)
                             & kv, [qp, kp, rows.transpose(-1, -2), rows,
                                    valid.view(b, 1, 1, s)], False),
        "hf_eager_packed_window_left": (lambda qi, ki, dq, dk, kv, z, m: torch.where(
            (ki <= qi) & (qi - ki < 8) & (dq == dk) & kv, z, m),
            [qp, kp, rows.transpose(-1, -2), rows, valid.view(b, 1, 1, s), zero, low], False),
        "hf_eager_window_left": (lambda qi, ki, kv, z, m: torch.where(
            (ki <= qi) & (qi - ki < s // 2 + 1) & kv, z, m),
            [qp, kp, valid.view(b, 1, 1, s), zero, low], False),
    }


@pytest.mark.parametrize("name", ["padding", "padding+causal", "documents", "window", "alibi",
                                  "hf_additive", "sliding"])
@pytest.mark.parametrize("block", [None, 4])
def test_forward_and_every_gradient(name, block, monkeypatch):
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 19, 8
    if block:        # a block smaller than the sequence: several blocks, spans that differ
        monkeypatch.setattr(M, "BLOCK_ELEMENTS", block * b * h * 5)
        monkeypatch.setattr(M, "KEY_BLOCK", 5)
    fn, leaves, causal = _masks(b, h, s)[name]
    q = torch.randn(b, h, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hk, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hk, s, d, dtype=torch.float64, requires_grad=True)
    out = M.masked_attn(q, k, v, mask_fn=fn, leaves=leaves, causal=causal, scale=0.3)
    ref = _dense(q, k, v, fn(*leaves), causal, 0.3)
    g = torch.randn_like(out)
    rtol, atol = TOL[torch.float64]
    assert_close(out, ref, rtol=rtol, atol=atol, name=f"{name} out")
    grads = torch.autograd.grad(out, (q, k, v), g)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    for x, y, n in zip(grads, refs, "qkv"):
        assert_close(x, y, rtol=rtol, atol=atol, name=f"{name} d{n}")


def test_fp32_against_sdpa_with_its_mask():
    torch.manual_seed(1)
    b, h, s, d = 1, 2, 64, 16
    qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    fn = lambda qi, ki: (ki <= qi) & (qi - ki < 9)
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    out = M.masked_attn(q, k, v, mask_fn=fn, leaves=[qp, kp])
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=fn(qp, kp))
    assert_close(out, ref, rtol=1e-5, atol=1e-6, name="out")
    g = torch.randn_like(out)
    for x, y in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert_close(x, y, rtol=1e-4, atol=1e-5, name="grad")


def test_working_memory_is_bounded_by_the_block(monkeypatch):
    rows, cols = M.block_sizes(1, 1, 131072, 131072)
    assert rows * cols <= M.BLOCK_ELEMENTS

    def ws(s, backward=False):
        q = torch.empty(1, 1, s, 64, device="meta")
        return M.workspace_bytes(q, q, q, causal=True, backward=backward)
    # causal alone runs on ATen's fused kernel: its tiles, a constant, and per row the
    # log-sum-exp (4 bytes): linear, never S^2 (one head: no copies of its results)
    grow = (1 << 20) - (1 << 17)
    assert ws(1 << 20) - ws(1 << 17) == grow * 4
    assert ws(1 << 20, True) - ws(1 << 17, True) == grow * 4
    # the block kernel (any mask the fused kernel cannot take): a constant in the sequence
    # forward (a block of scores, its mask, per-row values of one block); backward adds the
    # row sums
    monkeypatch.setattr(K, "split", lambda *a, **kw: None)
    assert ws(1 << 17) == ws(1 << 20) < 2 * 4 * M.BLOCK_ELEMENTS
    assert ws(1 << 20, True) - ws(1 << 17, True) == 4 * grow


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["padding+causal", "hf_additive", "documents",
                                  "documents+padding", "sliding", "sliding_uneven",
                                  "hf_eager_left", "documents+window"])
def test_planned_scratch_against_the_allocator(kind):
    """``workspace_bytes`` (what the memory planner adds for the kernel) against the bytes the
    allocator hands out beyond the op's inputs and outputs: never below, at most 15% above
    (documents: planned as one as long as the row, here the longest is 2/3 and 1/2 of it;
    windows: two blocks of half the row, and a block of 1,799 rows after one of 249; a window
    of 300 in two documents of half the row)."""
    from spdsl.memory.measure import measure_step
    torch.manual_seed(0)
    b, h, hk, s, d = 1, 4, 1, 2048, 8
    if kind == "sliding_uneven":
        qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
        valid = torch.ones(1, 1, 1, s, dtype=torch.bool)
        valid[..., :3] = False
        fn, leaves, causal = (lambda qi, ki, kv: (ki <= qi) & (qi - ki < 1800) & kv,
                              [qp, kp, valid], False)
    elif kind == "documents+window":     # two documents of 1,024, a window of 300 in each
        qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
        doc = (torch.arange(s) >= s // 2).long().view(1, 1, 1, s)
        fn, leaves, causal = (lambda qi, ki, dq, dk: (ki <= qi) & (qi - ki < 300) & (dq == dk),
                              [qp, kp, doc.transpose(-1, -2), doc], False)
    else:
        fn, leaves, causal = _masks(b, h, s)[kind]
    key = M.register_mask_program(fn)
    q, k, v = torch.randn(b, h, s, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    out, stats = torch.ops.spdsl.masked_attn(q, k, v, leaves, key, causal, 0.3)
    g = torch.randn_like(out)
    fwd = measure_step(lambda: torch.ops.spdsl.masked_attn(q, k, v, leaves, key, causal, 0.3))
    bwd = measure_step(lambda: torch.ops.spdsl.masked_attn_backward(
        g, q, k, v, out, stats, leaves, key, causal, 0.3))
    scratch_fwd = fwd.peak - (out.numel() + stats.numel()) * 4
    scratch_bwd = bwd.peak - (q.numel() + k.numel() + v.numel()) * 4
    plan_fwd = M.workspace_bytes(q, k, v, leaves, key, causal)
    plan_bwd = M.workspace_bytes(q, k, v, leaves, key, causal, backward=True)
    assert scratch_fwd <= plan_fwd <= 1.15 * scratch_fwd, (plan_fwd, scratch_fwd)
    assert scratch_bwd <= plan_bwd <= 1.15 * scratch_bwd, (plan_bwd, scratch_bwd)


def _traced(fn, leaves):
    """The program as spdsl's mask recogniser hands it over: an FX graph of ATen ops."""
    from torch.fx.experimental.proxy_tensor import make_fx
    return make_fx(fn)(*leaves)


def _fused_against_dense_and_blocks(q, k, v, fn, leaves, key, causal, name, monkeypatch):
    """The op's output and gradients (q, k, v) on the route it takes, checked against the
    dense computation and the block kernel (``split`` patched to None after)."""
    out = M.masked_attn(q, k, v, mask_fn=key or None, leaves=leaves, causal=causal, scale=0.3)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = _dense(q, k, v, fn(*leaves) if fn is not None else None, causal, 0.3)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    monkeypatch.setattr(K, "split", lambda *a, **kw: None)           # the block kernel
    blk = M.masked_attn(q, k, v, mask_fn=key or None, leaves=leaves, causal=causal, scale=0.3)
    blks = torch.autograd.grad(blk, (q, k, v), g)
    rtol, atol = TOL[q.dtype]
    for x, y, z, n in zip((out, *grads), (ref, *refs), (blk, *blks), ["out", "dq", "dk", "dv"]):
        assert_close(x, y, rtol=rtol, atol=atol, name=f"{name} {n} vs dense")
        assert_close(x, z, rtol=rtol, atol=atol, name=f"{name} {n} vs blocks")
    return out, grads


@pytest.mark.parametrize("name", ["padding", "padding+causal", "causal", "documents",
                                  "documents+padding", "hf_additive_right", "hf_eager_plain",
                                  "hf_eager_packed", "hf_eager_left", "hf_eager_packed_left",
                                  "hf_eager_window_left", "documents+window",
                                  "hf_eager_packed_window_left"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_path_for_causal_and_key_masks(name, dtype, monkeypatch):
    """Causal x a key-side boolean row, and packed documents (one kernel call each), run on
    ATen's fused kernel (``masked_attn_keys``): forward and every gradient equal to the
    dense computation and to the block kernel, left-padding rows (keeping no key) zero, or
    with an additive mask the mean of every value (their gradients in closed form), GQA."""
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 37, 8
    masks = _masks(b, h, s)
    fn, leaves, causal = (masks[name] if name != "causal" else (None, [], True))
    key = M.register_mask_program(_traced(fn, leaves)) if fn is not None else ""
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    fused = K.split(q, k, v, leaves, key, causal)
    assert fused is not None
    assert (fused.documents is not None) == ("documents" in name or "packed" in name)
    assert (fused.window is not None) == ("window" in name)
    assert fused.additive == name.startswith("hf_")
    assert (fused.averaged is not None) == name.endswith("_left")
    if fused.averaged is not None:          # the rows where the dense mask keeps no key
        dense = fn(*leaves)
        nothing = ~(dense == 0).expand(b, 1, s, s).any(-1, keepdim=True)
        assert torch.equal(fused.averaged.expand(b, 1, s, 1), nothing)
        assert nothing[0, 0, :3].all()
    if name == "documents":         # one row of ids, every batch row alike
        assert fused.documents == ((0, s // 3, s - 2, s),)
    if name == "documents+padding":
        assert fused.documents == ((0, s // 2, s), tuple(range(0, s, 5)) + (s,))
    out, grads = _fused_against_dense_and_blocks(q, k, v, fn, leaves, key, causal, name,
                                                 monkeypatch)
    rtol, atol = TOL[dtype]
    if name == "padding+causal":    # rows 0-2 of batch 0 keep no key: zeros, no gradient
        assert out[0, :, :3].abs().max() == 0 and grads[0][0, :, :3].abs().max() == 0
    if name.endswith("_left"):       # additive: those rows are every value's mean
        mean = M._grouped(v, h)[0].mean(1, keepdim=True).expand(h, 3, d)
        assert_close(out[0, :, :3], mean, rtol=rtol, atol=atol, name=f"{name} averaged rows")


@pytest.mark.parametrize("name", ["sliding", "hf_sliding"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fused_path_for_sliding_windows(name, dtype, monkeypatch):
    """A sliding window (half the row here) runs as blocks of two causal calls of the fused
    kernel, the keys before a block read backwards: forward and every gradient equal to the
    dense computation and to the block kernel, rows whose window keeps no key (left padding)
    zero, GQA; the width read from the constant, or from the window's start."""
    torch.manual_seed(0)
    b, h, hk, s, d = 2, 4, 2, 37, 8
    fn, leaves, causal = _masks(b, h, s)[name]
    key = M.register_mask_program(_traced(fn, leaves))
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    fused = K.split(q, k, v, leaves, key, causal)
    assert fused is not None and fused.window == s // 2 + 1 and fused.causal
    # the planner: the constant is in the program, a window's start is a value
    assert K.split(q, k, v, leaves, key, causal, values=False).window == \
        (s // 2 + 1 if name == "sliding" else 0)
    out, grads = _fused_against_dense_and_blocks(q, k, v, fn, leaves, key, causal, name,
                                                 monkeypatch)
    if name == "sliding":           # rows 0-2 of batch 0 keep no key: zeros, no gradient
        assert out[0, :, :3].abs().max() == 0 and grads[0][0, :, :3].abs().max() == 0


def test_window_widths_and_rows_keeping_nothing():
    """Every block of the window's split, and which rows of a padded batch keep no key in
    their window: a row whose whole window is padding, not only the row's first keys (an
    eager window averages every value there). A window too narrow for calls of a worthwhile
    size, or without the triangle, stays on the block kernel."""
    s = 40
    for w in (17, 20, 39, 40):
        blocks = list(KC._window_blocks(s, w))
        assert blocks[0][0] == 0 and blocks[-1][1] == s
        assert all(e0 == a1 for (_, e0, _), (a1, _, _) in itertools.pairwise(blocks))
        assert all(e - a == w - 1 for a, e, _ in blocks[1:])
        assert all(c == max(0, a - (w - 1)) for a, _, c in blocks)
    qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    zero, low = torch.zeros(1, 1, 1, 1), torch.full((1, 1, 1, 1), torch.finfo(torch.float32).min)
    eager = lambda qi, ki, kv, z, m: torch.where((ki <= qi) & (qi - ki < 20) & kv, z, m)
    keep = torch.ones(1, 1, 1, s, dtype=torch.bool)
    hole = keep.clone()
    hole[..., 5:26] = False                     # rows 24, 25 see 20 padded keys only
    key = M.register_mask_program(_traced(eager, [qp, kp, keep, zero, low]))
    q = torch.randn(1, 2, s, 8)
    assert K.split(q, q, q, [qp, kp, keep, zero, low], key, False).window == 20
    holed = K.split(q, q, q, [qp, kp, hole, zero, low], key, False)
    assert holed.window == 20
    assert holed.averaged.flatten().nonzero().flatten().tolist() == [24, 25]
    short = hole.clone()
    short[..., 6] = True                        # 5..25 less key 6: every window keeps one
    assert K.split(q, q, q, [qp, kp, short, zero, low], key, False).averaged is None
    for fn in (lambda qi, ki: (ki <= qi) & (qi - ki < 5),         # narrow
               lambda qi, ki: qi - ki < 20):                        # no triangle
        key = M.register_mask_program(_traced(fn, [qp, kp]))
        assert K.split(q, q, q, [qp, kp], key, False) is None
    # a window as long as the row: the plain triangle
    key = M.register_mask_program(_traced(lambda qi, ki: (ki <= qi) & (qi - ki < s), [qp, kp]))
    for values in (True, False):            # the planner reads the constant too
        whole = K.split(q, q, q, [qp, kp], key, False, values=values)
        assert whole.causal and whole.window is None and whole.bias is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_window_in_reduced_precision(dtype):
    """bf16 / fp16: the two calls' halves merged in fp32, so the windowed output is as close to
    the float64 computation as one SDPA call with the dense mask."""
    torch.manual_seed(0)
    s, w = 300, 100
    qp, kp = torch.arange(s).view(1, 1, s, 1), torch.arange(s).view(1, 1, 1, s)
    fn = lambda qi, ki: (ki <= qi) & (qi - ki < w)
    key = M.register_mask_program(_traced(fn, [qp, kp]))
    q, k, v = (torch.randn(1, 4, s, 16) for _ in range(3))
    ref = _dense(q.double(), k.double(), v.double(), fn(qp, kp), False, 0.25)
    x = [t.to(dtype) for t in (q, k, v)]
    assert K.split(*x, [qp, kp], key, False).window == w
    out = M.masked_attn(*x, mask_fn=key, leaves=[qp, kp], causal=False, scale=0.25)
    one = torch.nn.functional.scaled_dot_product_attention(*x, attn_mask=fn(qp, kp), scale=0.25)
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() <= 1.5 * (one.double() - ref).abs().max()


@pytest.mark.parametrize("s", [700, 2048])
def test_window_scratch_unknown_width_is_the_most_of_any(s):
    """The planner, which does not see a window's width (Hugging Face's is a value), counts
    the largest scratch of any width: checked against every width, with and without a key
    row."""
    q = torch.empty(1, 4, s, 8, device="meta")
    row = torch.zeros(1, 1, 1, s, device="meta")
    for bias in (None, row):
        for backward in (False, True):
            most = max(KW._window_bytes(q, K.KeyMask(True, bias, window=w), backward)
                       for w in range(2, s + 1))
            assert KW._window_bytes(q, K.KeyMask(True, bias, window=0), backward) == most


@pytest.mark.parametrize("name", ["window", "alibi", "hf_additive"])
def test_other_masks_stay_on_the_block_kernel(name):
    b, h, s = 2, 4, 19
    fn, leaves, causal = _masks(b, h, s)[name]
    key = M.register_mask_program(_traced(fn, leaves))
    q = torch.randn(b, h, s, 8)
    assert K.split(q, q, q, leaves, key, causal) is None


def test_documents_that_are_not_runs_stay_on_the_block_kernel():
    """An id that comes back after another (its tokens see each other across the gap), or
    query ids other than the key's: not block-diagonal, the block kernel's."""
    b, h, s = 1, 2, 12
    fn, leaves, causal = _masks(b, h, s)["documents"]
    key = M.register_mask_program(_traced(fn, leaves))
    q = torch.randn(b, h, s, 8)
    assert K.split(q, q, q, leaves, key, causal).documents == ((0, 4, 10, 12),)
    back = torch.tensor([0] * 4 + [1] * 4 + [0] * 4).view(1, 1, 1, s)
    assert K.split(q, q, q, [back.transpose(-1, -2), back], key, causal) is None
    other = leaves[1].roll(1, -1)
    assert K.split(q, q, q, [leaves[0], other], key, causal) is None
    # on fake tensors (the planner) the program and the shapes decide: by documents
    assert K.split(q, q, q, leaves, key, causal, values=False).documents == ()


def test_additive_rows_keeping_no_key():
    """An additive mask's row that keeps no key (left padding) averages every key, causal ones
    included, when every score plus the masked value is the masked value: on the fused kernel
    with those rows in closed form; where scores could move it (fp16's min, scores near its
    spacing), on the block kernel. Masked values above fp16's min, or a kept value other than
    0, are not a mask the kernel can take."""
    b, h, s = 2, 4, 19
    masks = _masks(b, h, s)
    fn, leaves, causal = masks["hf_additive_right"]
    key = M.register_mask_program(_traced(fn, leaves))
    q = torch.randn(b, h, s, 8)
    assert K.split(q, q, q, leaves, key, causal).averaged is None
    left = masks["padding+causal"][1][2]                        # rows 0-2 of batch 0: nothing
    with_left = [leaves[0], leaves[1], left, *leaves[3:]]
    assert K.split(q, q, q, with_left, key, causal, scale=0.3).averaged is not None
    # with the causal flag besides, such a row averages the keys up to it: the block kernel's
    assert K.split(q, q, q, with_left, key, True, scale=0.3) is None
    assert K.split(q, q, q, leaves, key, True, scale=0.3) is not None
    assert K.split(q * 1e16, q * 1e16, q, with_left, key, causal, scale=0.3) is None
    fp16_min = [*with_left[:4], torch.full((1, 1, 1, 1), torch.finfo(torch.float16).min)]
    half = q.half()
    assert K.split(half * 4, half * 4, half, fp16_min, key, causal, scale=0.3) is None
    assert K.split(half / 8, half / 8, half, fp16_min, key, causal, scale=0.3) is not None
    assert K.split(q, q, q, [*leaves[:4], torch.full((1, 1, 1, 1), -1e3)], key, causal) is None
    assert K.split(q, q, q, [*leaves[:3], torch.ones(1, 1, 1, 1), leaves[4]], key,
                   causal) is None
    # the planner: by the program; in fp16, where the scores decide the route, the larger
    # scratch of the two, else the fused kernel's
    fused = K.split(q, q, q, leaves, key, causal, values=False)
    assert fused.additive
    for backward in (False, True):
        assert M.workspace_bytes(q, q, q, leaves, key, causal, backward) == \
            KW.workspace_bytes(q, q, q, fused, backward)
        assert M.workspace_bytes(half, half, half, leaves, key, causal, backward) == max(
            KW.workspace_bytes(half, half, half, fused, backward),
            M.block_workspace_bytes(half, half, half, leaves, key, causal, backward))


def test_positions_not_from_zero_stay_on_the_block_kernel():
    b, h, s = 1, 2, 16
    fn, leaves, causal = _masks(b, h, s)["padding+causal"]
    key = M.register_mask_program(_traced(fn, leaves))
    q = torch.randn(b, h, s, 8)
    shifted = [leaves[0] + 3, leaves[1] + 3, leaves[2]]            # the same program
    assert K.split(q, q, q, leaves, key, causal) is not None
    assert K.split(q, q, q, shifted, key, causal) is None
    assert K.split(q, q, q, shifted, key, causal, values=False) is not None   # the planner


@pytest.mark.parametrize("name", [None, "causal", "padding+causal", "hf_eager_left",
                                  "documents"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_capped_scores(name, dtype):
    """Scores capped as ``c * tanh(s / c)`` before the mask (Gemma 2): forward and every
    gradient against the dense computation, on the block kernel (the fused route steps
    aside), alone or with causal, padded, additive and document masks, GQA; and the planned
    scratch counts the kept tanh."""
    torch.manual_seed(0)
    b, h, hk, s, d, cap = 2, 4, 2, 37, 8, 2.0
    causal = name == "causal"
    fn, leaves = None, []
    if name not in (None, "causal"):
        fn, leaves, causal = _masks(b, h, s)[name]
    key = M.register_mask_program(_traced(fn, leaves) if fn is not None else None,
                                  softcap=cap)
    q = (3 * torch.randn(b, h, s, d, dtype=dtype)).requires_grad_()   # past the cap's knee
    k = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, s, d, dtype=dtype, requires_grad=True)
    assert K.split(q, k, v, leaves, key, causal) is None
    out = M.masked_attn(q, k, v, mask_fn=key, leaves=leaves, causal=causal, scale=0.3)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)

    def capped(q, k, v):
        kk, vv = M._grouped(k, h), M._grouped(v, h)
        sc = cap * torch.tanh(torch.matmul(q, kk.transpose(-2, -1)) * 0.3 / cap)
        mask = fn(*leaves) if fn is not None else None
        if mask is not None:
            sc = sc.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else sc + mask
        if causal:
            sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return torch.matmul(torch.softmax(sc, -1).nan_to_num(0.0), vv)
    ref = capped(q, k, v)
    refs = torch.autograd.grad(ref, (q, k, v), g)
    rtol, atol = TOL[dtype]
    for x, y, n in zip((out, *grads), (ref, *refs), ["out", "dq", "dk", "dv"]):
        assert_close(x, y, rtol=rtol, atol=atol, name=f"{name} {n}")
    uncapped = M.register_mask_program(_traced(fn, leaves) if fn is not None else None)
    assert (M.block_workspace_bytes(q, k, v, leaves, key, causal, backward=True) -
            M.block_workspace_bytes(q, k, v, leaves, uncapped, causal, backward=True)) > 0
