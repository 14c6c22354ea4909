"""State passing of the sequence mixers (``spdsl.lower.mixers``), in one process: the sequence
cut into P pieces, each piece run as its rank runs it, the ranks as threads whose exchanges
are the same stacking and slicing the collectives do (an all-gather's backward sums every
rank's gradient of a piece into its owner's: here autograd through ``torch.stack`` does). The
outputs and the gradient of every input against the function on the whole sequence, fp32.
Hugging Face's torch implementations are the functions (the ones its models call on CPU); the
process-group runs are ``tests/hf/test_hybrid_parity.py``."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from spdsl.lower.mixers import _PASSING
from spdsl.propagate.mixer_form import MIXERS, bind, make_site

RTOL = 1e-5


class _Threads:
    """``spdsl.lower.mixers.Ranks`` for P threads of one process."""

    def __init__(self, parts: int) -> None:
        self.parts, self.slots = parts, {}
        self.barrier = threading.Barrier(parts)

    def rank(self, r: int):
        sim = self

        class _Rank:
            parts, rank = sim.parts, r

            def gather(self, x):
                return sim._swap("gather", r, x, lambda xs: torch.stack(xs))

            def neighbours(self, to_prev, to_next):
                got = sim._swap("near", r, (to_prev, to_next), lambda xs: xs)
                return (got[r - 1][1] if r > 0 else to_next[:0],
                        got[r + 1][0] if r < sim.parts - 1 else to_prev[:0])
        return _Rank()

    def _swap(self, what: str, r: int, x, combine):
        self.slots[(what, r)] = x
        self.barrier.wait()
        got = combine([self.slots[(what, q)] for q in range(self.parts)])
        self.barrier.wait()
        return got


def _split(bound: dict, seq: dict[str, int], parts: int, r: int) -> dict:
    out = dict(bound)
    for name, dim in seq.items():
        x = bound[name]
        n = x.shape[dim] // parts
        out[name] = x.narrow(dim, r * n, n)
    return out


def _passing(form_name: str, fn, bound: dict, seq: dict[str, int], out_dim: int,
             parts: int) -> torch.Tensor:
    """The whole output, each piece computed as rank r does."""
    form = MIXERS[form_name]
    sim, outs, errors = _Threads(parts), [None] * parts, []

    def one(r: int) -> None:
        try:
            site, tensors = make_site(form, fn, _split(bound, seq, parts, r))
            outs[r] = _PASSING[form_name](site, tensors, sim.rank(r))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)
            sim.barrier.abort()
    threads = [threading.Thread(target=one, args=(r,)) for r in range(parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return torch.cat(outs, out_dim)


def _check(fn, kwargs: dict, form: str, seq: dict[str, int], out_dim: int, parts: int,
           first=lambda o: o[0] if isinstance(o, tuple) else o, constants=()) -> None:
    """``constants``: tensors no gradient is asked of (a module's buffers)."""
    leaves = {k: v.clone().requires_grad_(v.is_floating_point() and k not in constants)
              if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    bound = bind(fn, (), leaves)
    ref = first(fn(**leaves))
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9))
    grads_ref = torch.autograd.grad((ref * w).sum(), [v for v in leaves.values()
                                                       if isinstance(v, torch.Tensor)
                                                       and v.requires_grad])
    got = _passing(form, fn, bound, seq, out_dim, parts)
    grads = torch.autograd.grad((got * w).sum(), [v for v in leaves.values()
                                                  if isinstance(v, torch.Tensor)
                                                  and v.requires_grad])
    scale = ref.detach().abs().max()
    assert float((got - ref).detach().abs().max() / scale) <= RTOL
    for g, gr in zip(grads, grads_ref):
        assert float((g - gr).abs().max() / gr.abs().max().clamp_min(1e-12)) <= 10 * RTOL
    # the pieces from zero states alone are far off: the test sees a missing correction
    with torch.no_grad():
        alone = torch.cat([first(fn(**_split(leaves, seq, parts, r)))
                           for r in range(parts)], out_dim)
    assert float((alone - ref.detach()).abs().max() / scale) > 1e-3


def _gdn_inputs(S=48, H=4, dk=8, dv=6, B=2):
    g = torch.Generator().manual_seed(0)
    return {"query": torch.randn(B, S, H, dk, generator=g),
            "key": torch.randn(B, S, H, dk, generator=g),
            "value": torch.randn(B, S, H, dv, generator=g),
            "g": -F.softplus(torch.randn(B, S, H, generator=g)) * 0.3,
            "beta": torch.sigmoid(torch.randn(B, S, H, generator=g))}


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("fn_name", ["torch_chunk_gated_delta_rule",
                                     "torch_recurrent_gated_delta_rule"])
def test_gated_delta_rule(fn_name, parts):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    kw = {**_gdn_inputs(), "use_qk_l2norm_in_kernel": True}
    if fn_name == "torch_chunk_gated_delta_rule":
        kw["chunk_size"] = 8           # pieces of 12-24 tokens: several chunks, a ragged one
    seq = {n: 1 for n in ("query", "key", "value", "g", "beta")}
    _check(getattr(m, fn_name), kw, "gated_delta_rule", seq, 1, parts)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("fn_name", ["chunk_kimi_delta_attention",
                                     "recurrent_kimi_delta_attention"])
def test_kimi_delta_attention(fn_name, parts):
    """The gated delta rule with a decay per key channel (``g``: [B, S, H, dk])."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m
    kw = _gdn_inputs()
    gen = torch.Generator().manual_seed(3)
    kw["g"] = -F.softplus(torch.randn(kw["key"].shape, generator=gen)) * 0.3
    kw.update(initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
    if fn_name == "chunk_kimi_delta_attention":
        kw["chunk_size"] = 8
    seq = {n: 1 for n in ("query", "key", "value", "g", "beta")}
    _check(getattr(m, fn_name), kw, "kimi_delta_attention", seq, 1, parts)


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("groups", [1, 2])
def test_ssd(parts, groups):
    from transformers.models.bamba import modeling_bamba as m
    g = torch.Generator().manual_seed(1)
    B, S, H, p, n = 2, 48, 4, 6, 5
    kw = {"hidden_states": torch.randn(B, S, H, p, generator=g),
          "dt": torch.randn(B, S, H, generator=g),
          "A": -torch.rand(H, generator=g) - 0.1,
          "B": torch.randn(B, S, groups, n, generator=g),
          "C": torch.randn(B, S, groups, n, generator=g),
          "chunk_size": 8, "D": torch.randn(H, generator=g),
          "dt_bias": torch.randn(H, generator=g), "dt_softplus": True,
          "dt_limit": (0.0, float("inf"))}
    seq = {n: 1 for n in ("hidden_states", "dt", "B", "C")}
    _check(m.mamba2_chunk_scan, kw, "ssd", seq, 1, parts)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("gated", [True, False])
def test_selective_scan(parts, gated):
    """Mamba-1: a decay per channel and state element; the output gated by ``silu(z)``."""
    from transformers.models.mamba import modeling_mamba as m
    g = torch.Generator().manual_seed(4)
    B, D, L, n = 2, 6, 36, 4
    kw = {"hidden_states": torch.randn(B, D, L, generator=g),
          "dt": torch.randn(B, D, L, generator=g) - 1,
          "A": -torch.rand(D, n, generator=g) - 0.1,
          "B": torch.randn(B, n, L, generator=g), "C": torch.randn(B, n, L, generator=g),
          "D": torch.randn(D, generator=g), "delta_bias": torch.randn(D, generator=g),
          "delta_softplus": True, "use_associative_scan": False}
    if gated:
        kw["z"] = torch.randn(B, D, L, generator=g)
    seq = {n: 2 for n in ("hidden_states", "dt", "z", "B", "C") if n in kw}
    _check(m.mamba_selective_scan, kw, "selective_scan", seq, 2, parts)


@pytest.mark.parametrize("parts", [2, 3])
def test_lightning_attention(parts):
    """MiniMax: a fixed decay per head, in blocks of 8 (pieces of 12-18 tokens: ragged
    blocks), with the buffers its module computes."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    from spdsl.propagate.lightning import lightning_attention
    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=4, head_dim=8, block_size=8,
                        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    mod = MiniMaxLightningAttention(cfg, layer_idx=0)
    g = torch.Generator().manual_seed(5)
    kw = {n: torch.randn(2, 36, 4, 8, generator=g) * 0.5 for n in ("query", "key", "value")}
    kw.update(slope_rate=mod.slope_rate, query_decay=mod.query_decay, key_decay=mod.key_decay,
              diagonal_decay=mod.diagonal_decay, block_size=8)
    seq = {n: 1 for n in ("query", "key", "value")}
    _check(lightning_attention, kw, "lightning_attention", seq, 1, parts,
           constants=("slope_rate", "query_decay", "key_decay", "diagonal_decay"))


def test_lightning_forward_is_minimax_own():
    """The forward traced in place of MiniMax's: the same outputs as its own (fp32)."""
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    from spdsl.propagate.lightning import traced_forward
    cfg = MiniMaxConfig(hidden_size=32, num_attention_heads=4, head_dim=8, block_size=8,
                        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    torch.manual_seed(0)
    mod = MiniMaxLightningAttention(cfg, layer_idx=1)
    x = torch.randn(2, 37, 32)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, 30:] = 0
    ref = MiniMaxLightningAttention.forward(mod, x, None, mask)[0]
    got = traced_forward(MiniMaxLightningAttention.forward)(mod, x, None, mask)[0]
    assert float((got - ref).detach().abs().max() / ref.detach().abs().max()) <= 1e-6


@pytest.mark.parametrize("parts", [2, 4])
def test_causal_conv1d(parts):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    g = torch.Generator().manual_seed(2)
    kw = {"hidden_states": torch.randn(2, 6, 32, generator=g),
          "weight": torch.randn(6, 4, generator=g), "bias": torch.randn(6, generator=g),
          "activation": "silu"}
    _check(m.causal_conv1d_fn, kw, "causal_conv1d", {"hidden_states": 2}, 2, parts)


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("before,after,dilation,groups", [
    (3, 0, 1, 6),          # causal, depthwise, kernel 4
    (4, 0, 2, 6),          # causal, dilated (kernel 3, dilation 2)
    (2, 0, 1, 1),          # causal, dense
    (1, 1, 1, 3),          # symmetric ("same"), grouped
    (0, 2, 1, 6)])         # anti-causal: the next rank's tokens only
def test_conv1d(parts, before, after, dilation, groups):
    """A convolution written as ATen ops (``spdsl.propagate.convs``): each rank's halo from
    both neighbours, zeros past the ends."""
    from spdsl.propagate.convs import conv1d
    g = torch.Generator().manual_seed(4)
    k = (before + after) // dilation + 1
    kw = {"input": torch.randn(2, 6, 36, generator=g),
          "weight": torch.randn(6, 6 // groups, k, generator=g),
          "bias": torch.randn(6, generator=g),
          "before": before, "after": after, "dilation": dilation, "groups": groups}
    _check(conv1d, kw, "conv1d", {"input": 2}, 2, parts)


def test_fused_kernels_decline_while_traced():
    """mamba_ssm's fused training kernel (in-projection output to out-projection) returns None
    while spdsl traces, as Hugging Face's torch stand-in for it does, so the model takes its
    unfused path of captured mixers; outside a trace the function is the model's again."""
    from transformers.models.bamba import modeling_bamba as m

    from spdsl.propagate.mixers import captured_mixers

    def kernel(*args, **kwargs):
        raise AssertionError("the fused kernel ran while traced")
    orig = m.mamba2_split_conv1d_scan_combined
    m.mamba2_split_conv1d_scan_combined = kernel
    try:
        with captured_mixers():
            assert m.mamba2_split_conv1d_scan_combined(torch.zeros(1, 4, 8), None) is None
        assert m.mamba2_split_conv1d_scan_combined is kernel
    finally:
        m.mamba2_split_conv1d_scan_combined = orig
