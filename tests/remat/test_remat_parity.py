"""Every remat mode, with and without tiling, gives the no-remat loss and gradients (fp32), on
SP 1, 2 and 4: one launch per degree, shared with tests/memory (``cases.launch``)."""

from __future__ import annotations

import pytest

from tests.memory.cases import MODES, launch

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

LOSS_RTOL = 1e-6
GRAD_RTOL = 1e-5      # tiling sums weight gradients chunk by chunk: fp32 rounding order only


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"sp{w}")
def test_every_mode_matches_no_remat(world):
    for rank, res in enumerate(launch(world)):
        for name, modes in res.items():
            for mode, out in modes.items():
                where = f"sp{world} rank {rank} {name} {mode}"
                assert out["loss_err"] <= LOSS_RTOL, f"{where}: loss rel err {out['loss_err']:.2e}"
                assert out["grad_err"] <= GRAD_RTOL, f"{where}: grad rel err {out['grad_err']:.2e}"


@pytest.mark.parametrize("world", [1, 4], ids=lambda w: f"sp{w}")
def test_tiling_applied_when_asked(world):
    res = launch(world)[0]
    for name in ("tiny_256", "small_512") if world == 1 else ("tiny_256",):
        assert res[name]["auto_tiled"]["tiled_loss"] and res[name]["auto_tiled"]["tiled_mlp"]
        assert res[name]["full_tiled"]["tiled_mlp"] == res[name]["auto_tiled"]["tiled_mlp"]
        assert not res[name]["none"]["tiled_loss"] and not res[name]["none"]["tiled_mlp"]


def test_auto_saves_attention_and_matmuls_only():
    res = launch(1)[0]["small_512"]["auto"]
    kinds = {s.split("(")[0] for s in res["saved_ops"]}
    assert any("scaled_dot_product" in k for k in kinds), res["saved_ops"]
    assert kinds <= {"aten.mm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"}


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"sp{w}")
def test_offload_is_exact_and_holds_the_kept_tensors_on_the_host(world):
    """Offload copies, never computes: loss and gradients bitwise those of the same mode without
    it; the device keeps less, the host holds what moved (measured and planned alike)."""
    for rank, res in enumerate(launch(world)):
        for name in ("tiny_256", "tiny_1024"):
            modes = res[name]
            for off, base in (("full_offload", "full"), ("auto_offload", "auto")):
                where = f"sp{world} rank {rank} {name} {off}"
                assert modes[off]["loss"] == modes[base]["loss"], where
                assert modes[off]["grad_err"] == modes[base]["grad_err"], where
                assert modes[off]["saved"] < modes[base]["saved"], where
                assert modes[off]["real"]["host"] > 0 and modes[off]["plan_host"] > 0, where
                assert modes[base]["real"]["host"] == 0 == modes[base]["plan_host"], where


def test_modes_order_memory():
    """full < auto < none in saved activations, on every degree; full with the all-to-alls
    recomputed below full."""
    for world in (1, 2, 4):
        for res in launch(world):
            for name in ("tiny_1024", "small_512") if world == 1 else ("tiny_1024",):
                saved = {m: res[name][m]["saved"] for m in MODES if m in res[name]}
                assert saved["full"] < saved["auto"] < saved["none"], (world, name, saved)
                assert saved["auto_tiled"] < saved["auto"], (world, name, saved)
                # re-running the all-to-alls in backward keeps only each layer's input
                if world > 1:
                    assert saved["full_recompute"] < saved["full"], (world, name, saved)
