"""The plan's cost model of exposed and hidden communication (``spdsl.inspect.timing``), one
process: transfer times from the links' figures, the compute from FLOPs counted against
PyTorch's own counter on the single-device model, and what each overlap hides."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import spdsl
import spdsl.collectives.grads as GR
import spdsl.lower.grad_buckets as G
import spdsl.lower.ops as O
import spdsl.pipeline.build as PR
from spdsl.inspect.flops import ATTENTION_BWD
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.propagate.attention_choice import Links

P = 4
# one node's links at 1 GB/s, 10 us, 1 TFLOP/s: round numbers to check the formulas by hand
LINKS = Links(1e9, 1e8, 1e12, 1e-5, 8)


def _plan(config: LlamaConfig, seq: int, **options):
    torch.manual_seed(0)
    model = Llama(config)
    ids = torch.randint(0, config.vocab_size, (1, seq))
    return model, ids, spdsl.plan(spdsl.sp_shard(seq=P, **options)(model), ids, ids)


def _h8() -> LlamaConfig:
    return LlamaConfig.tiny().replace(n_heads=8, n_kv_heads=4)


def _consistent(t) -> None:
    assert t.step_s == pytest.approx(t.compute_s + t.exposed_s)
    assert t.comm_s == pytest.approx(t.exposed_s + t.hidden_s)
    for x in t.transfers:
        assert 0.0 <= x.exposed <= x.seconds + 1e-15


def test_transfer_seconds_follow_the_links():
    _, _, plan = _plan(LlamaConfig.tiny(), 256, remat="none")
    t = plan.timing(LINKS)
    _consistent(t)
    wire = {"all_to_all": (P - 1) / P, "all_reduce": 2 * (P - 1) / P, "halo_exchange": 1.0}
    kinds = set()
    for x in t.transfers:
        c = x.collective
        nbytes = c.bytes if x.phase == "forward" else c.bytes_bwd
        assert x.seconds == pytest.approx(1e-5 + nbytes * wire[c.kind] / 1e9), c
        kinds.add(c.kind)
    assert kinds == set(wire)
    # 4 ranks over a 2-rank node: every transfer crosses nodes, at the slower link
    slow = plan.timing(Links(1e9, 1e8, 1e12, 1e-5, 2))
    a2a = [x for x in slow.transfers if x.collective.kind == "all_to_all"]
    c = a2a[0].collective
    assert a2a[0].seconds == pytest.approx(1e-5 + c.bytes * (P - 1) / P / 1e8)
    # every collective the plan lists runs once forward and once backward where it has bytes
    listed = sum((c.bytes > 0) + (c.bytes_bwd > 0) for c in plan.collectives)
    assert len(t.transfers) == listed


def test_compute_is_the_single_device_flops_over_the_ranks():
    # imported here: torch.utils.flop_counter imports triton, which must not load before
    # tests/kernels/conftest.py chooses its CPU interpreter at collection
    from torch.utils.flop_counter import FlopCounterMode
    model, ids, plan = _plan(LlamaConfig.small(), 512, remat="none")
    t = plan.timing(LINKS)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(ids, ids).backward()
    counts = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    # PyTorch's counter on the unsharded step: the projections' mm, and SDPA written out as
    # two bmm forward and four backward over every score (the model: half, causal, and a
    # flash backward 2.5x its forward)
    assert t.flops["matmul"] * P == counts["aten.mm"]
    assert t.flops["attention"] * P == pytest.approx(
        counts["aten.bmm"] * 0.5 * (1 + ATTENTION_BWD) / 3, rel=1e-12)
    assert t.compute_s == pytest.approx(sum(t.flops.values()) / LINKS.flops_per_s)
    # full remat runs each layer's forward again: more matmul work, the same transfers
    full = _plan(LlamaConfig.small(), 512, remat="full")[2].timing(LINKS)
    assert full.flops["matmul"] > t.flops["matmul"]
    assert full.comm_s == pytest.approx(t.comm_s)
    # a tiled MLP runs each chunk's forward again in backward: its three projections once more
    c = LlamaConfig.small()
    tiled = _plan(c, 512, remat=spdsl.Remat("none", tile_mlp=True, mlp_chunks=4))[2]
    extra = 2 * (512 // P) * c.dim * c.ffn_dim * 3 * c.n_layers
    assert tiled.timing(LINKS).flops["matmul"] == t.flops["matmul"] + extra


def test_one_exchange_each_way_hides_nothing(monkeypatch):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 1)
    _, _, plan = _plan(_h8(), 1024, remat="none")
    t = plan.timing(LINKS)
    for x in t.transfers:
        if x.collective.purpose == "ulysses":
            assert x.exposed == pytest.approx(x.seconds) and x.behind == ""


def _ulysses_by_pass(t) -> list[list]:
    """Each attention's four Ulysses transfers of one pass (two head groups), in order."""
    uly = [x for x in t.transfers if x.collective.purpose == "ulysses"]
    return [uly[i:i + 4] for i in range(0, len(uly), 4)]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "projection_fused"])
def test_head_groups_hide_all_but_the_first_and_last_exchange(monkeypatch, fused):
    links = Links(1e9, 1e8, 1e11, 1e-5, 8)
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 1)
    one = _plan(_h8(), 1024, remat="none")[2].timing(links)
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    if not fused:
        monkeypatch.setattr(PR, "fuse_output_projection", lambda *a: 0)
    _, _, plan = _plan(_h8(), 1024, remat="none")
    two = plan.timing(links)
    _consistent(two)
    passes = _ulysses_by_pass(two)
    assert 4 * len(passes) == 2 * len(
        [x for x in one.transfers if x.collective.purpose == "ulysses"])
    # at 100 GFLOP/s a group's attention (one head over 1,024 tokens) outlasts the exchange
    # beside it: of each attention's four transfers per pass only the first (group 1's in)
    # and the last (group 2's out) are waited for. With the output projection fused in, one
    # group's share of it (2 x 256 tokens x 64 x 64 / 2 groups) runs before the wait for the
    # last forward exchange, and two shares' gradients (twice the work each) before the
    # first backward one
    share = 2 * (1024 // P) * 64 * 64 / 2 / links.flops_per_s if fused else 0.0
    for first, second, third, last in passes:
        assert second.exposed == 0.0 and third.exposed == 0.0
        assert second.behind == third.behind == "head-group attention"
        if first.phase == "forward":
            assert first.exposed == pytest.approx(first.seconds)
            assert last.exposed == pytest.approx(last.seconds - share)
        else:
            assert first.exposed == pytest.approx(first.seconds - 2 * share)
            assert last.exposed == pytest.approx(last.seconds)
    assert {p[0].phase for p in passes} == {"forward", "backward"}
    u1, u2 = one.by_purpose()["ulysses"], two.by_purpose()["ulysses"]
    assert u2[1] < 0.6 * u1[1]          # exposed: about half of one exchange each way
    assert two.step_s < one.step_s


def test_the_fused_projection_counts_its_flops_as_matmuls(monkeypatch):
    monkeypatch.setattr(O, "ULYSSES_GROUPS", 2)
    fused = _plan(_h8(), 1024, remat="none")[2].timing(LINKS)
    monkeypatch.setattr(PR, "fuse_output_projection", lambda *a: 0)
    plain = _plan(_h8(), 1024, remat="none")[2].timing(LINKS)
    assert fused.flops == pytest.approx(plain.flops, rel=1e-12)
    assert fused.compute_s == pytest.approx(plain.compute_s)
    assert fused.exposed_s < plain.exposed_s


def test_gradient_buckets_hide_behind_the_rest_of_backward(monkeypatch):
    monkeypatch.setattr(G, "GRAD_BUCKET_BYTES", 64 * 1024)     # a few buckets, not one
    _, _, plan = _plan(LlamaConfig.tiny(), 1024, remat="none")
    grads = [x for x in plan.timing(LINKS).transfers if x.collective.purpose == "gradient"]
    assert len(grads) >= 3
    # the buckets done early (the last layers' weights) reduce under earlier layers' backward
    assert grads[0].exposed == 0.0 and grads[0].behind == "backward compute"
    assert sum(x.exposed for x in grads) < sum(x.seconds for x in grads)
    # waited where each starts: all exposed
    monkeypatch.setattr(GR, "GRAD_OVERLAP", False)
    _, _, plan = _plan(LlamaConfig.tiny(), 1024, remat="none")
    for x in plan.timing(LINKS).transfers:
        if x.collective.purpose == "gradient":
            assert x.exposed == pytest.approx(x.seconds)


def test_ring_steps_hide_behind_the_block_compute():
    _, _, plan = _plan(LlamaConfig.tiny(), 1024, remat="none", attention="ring")
    t = plan.timing(Links(1e9, 1e8, 1e10, 1e-5, 8))     # blocks of ~1 ms, pieces of 66 us
    _consistent(t)
    ring = [x for x in t.transfers if x.collective.purpose == "ring"]
    assert len(ring) == 2 * 2 * (P - 1)                   # 2 layers, forward and backward
    assert all(x.exposed == 0.0 and x.behind == "ring block compute" for x in ring)
    # links 1000x slower: the transfers outlast the blocks and show
    slow = plan.timing(Links(1e6, 1e6, 1e10, 1e-5, 8))
    assert all(x.exposed > 0.5 * x.seconds for x in slow.transfers
               if x.collective.purpose == "ring")


def test_the_printed_plan_gives_the_summary():
    _, _, plan = _plan(LlamaConfig.tiny(), 256, remat="none")
    text = str(plan)
    assert "communication:" in text and "exposed" in text
    assert str(plan.timing(LINKS)).startswith("communication (cost model: 1 GB/s")


def test_default_links_follow_the_device():
    _, _, cpu = _plan(LlamaConfig.tiny(), 256, remat="none")
    assert cpu.timing().links == Links.default("cpu")
    with torch.device("meta"):            # planned for accelerators: a GPU node's links
        model = Llama(LlamaConfig.tiny())
    ids = torch.empty(1, 256, dtype=torch.long, device="meta")
    meta = spdsl.plan(spdsl.sp_shard(seq=P, remat="none")(model), ids, ids)
    t = meta.timing()
    assert t.links == Links.default("cuda")
    assert t.comm_s == pytest.approx(meta.timing(Links.default("cuda")).comm_s)
