"""``apply_remat`` on one rank's local program of a tiny Llama (one process): what each mode
does to the graph, what its checkpoint regions recompute in backward (ops counted as they
run, not read off the policy), and that every mode computes the untransformed program's loss
and gradients. The multi-rank parity of every mode against single-device PyTorch is in
``tests/remat/test_remat_parity.py``; the policy's own answers in ``tests/remat/test_policy.py``."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch

import spdsl
import spdsl.pipeline as PR
from spdsl._torch import TorchDispatchMode
from spdsl.lower.layers import layer_of
from spdsl.memory.fit import SIZING
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.remat import Remat, SavePolicy, apply_remat
from spdsl.remat.segments import Checkpointed

SEQ = 64
A2A = "_c10d_functional.all_to_all_single.default"
_A2A_OP = torch.ops._c10d_functional.all_to_all_single.default
SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"
MM = "aten.mm.default"


class _Ops(TorchDispatchMode):
    """Every op that runs, by name and by signature (``name(4x8,8x2)``), counted."""

    def __init__(self) -> None:
        super().__init__()
        self.names, self.signatures = Counter(), Counter()
        self.in_layers, self.layer = Counter(), False     # those run inside a region

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func)] += 1
        self.in_layers[str(func)] += self.layer
        shapes = ",".join("x".join(map(str, a.shape)) for a in args
                          if isinstance(a, torch.Tensor))
        self.signatures[f"{func}({shapes})"] += 1
        out = func(*args, **(kwargs or {}))
        if func == _A2A_OP:      # a fake group leaves what it receives unset: keep labels in range
            out.zero_()
        return out


@contextlib.contextmanager
def _local(parts: int):
    """(model, local program, state specs, input specs, state, inputs) of rank 0 of
    ``parts``, before remat, in a fake process group of ``parts`` ranks kept up inside the
    ``with``."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(1))
    f = spdsl.sp_shard(seq=parts, remat="none")(model)
    entry = f.build((ids, ids), {})
    with PR.planned_step(f.job, entry, (ids, ids), {}, SIZING) as s:
        local = ids[:, : SEQ // parts]
        yield model, s.lowered, s.state, s.inputs, list(entry.traced.state), (local, local)


@pytest.fixture(scope="module")
def sp1():
    with _local(1) as got:
        pass                 # one rank's program runs no collective: no group needed
    return got


@pytest.fixture(scope="module")
def sp2():
    with _local(2) as got:
        yield got


def _step(gm, state, inputs, watch=()) -> tuple[torch.Tensor, list[torch.Tensor], _Ops, _Ops]:
    """Loss, gradients of the floating state, and the ops forward and backward ran (those
    forward ran inside the modules ``watch`` apart)."""
    leaves = [torch.nn.Parameter(t.detach().clone()) if t.is_floating_point() else t
              for t in state]
    fwd = _Ops()
    hooks = [h for m in watch for h in (
        m.register_forward_pre_hook(lambda *_: setattr(fwd, "layer", True)),
        m.register_forward_hook(lambda *_: setattr(fwd, "layer", False)))]
    with fwd:
        loss = gm(*leaves, *inputs)[0]
    for h in hooks:
        h.remove()
    with _Ops() as bwd:
        loss.backward()
    return loss.detach(), [p.grad for p in leaves if p.is_floating_point()], fwd, bwd


def _recomputed(gm, base, state, inputs) -> Counter:
    """Ops backward runs under ``gm`` beyond those it runs under the untransformed ``base``:
    the forward ops its checkpoint regions run again."""
    return _step(gm, state, inputs)[3].signatures - _step(base, state, inputs)[3].signatures


def _regions(gm) -> list[Checkpointed]:
    return [m for m in gm.children() if isinstance(m, Checkpointed)]


def test_none_leaves_the_graph_as_it_is(sp1):
    _, gm, st, ins, *_ = sp1
    code = gm.code
    out = apply_remat(gm, "none", st, ins)
    assert out is gm and out.code == code and not _regions(out)
    assert not out.spdsl_remat.tiled_loss and out.spdsl_remat.tiled_mlp == 0
    assert out.spdsl_remat.saved == []


def test_other_modes_rewrite_a_copy(sp1):
    _, gm, st, ins, *_ = sp1
    code = gm.code
    tiled = apply_remat(gm, Remat("none", tile_loss=True), st, ins)
    assert tiled is not gm and tiled.spdsl_remat.tiled_loss and not _regions(tiled)
    full = apply_remat(gm, "full", st, ins)
    assert full is not gm and gm.code == code, "the input program was rewritten in place"


def test_full_checkpoints_each_layer_in_one_region(sp1):
    model, gm, st, ins, *_ = sp1
    out = apply_remat(gm, "full", st, ins)
    regions = _regions(out)
    assert len(regions) == len(model.layers)
    layers = []
    for reg in regions:
        mods = {layer_of(n.meta.get("spdsl_module", "")) for n in reg.inner.graph.nodes
                if n.op == "call_function"}
        mods.discard(None)       # ops between layers join the layer before them
        assert len(mods) == 1, mods
        layers += mods
        # "full" keeps the collectives only
        assert isinstance(reg.policy, SavePolicy) and reg.policy.save == frozenset()
        assert reg.policy.save_collectives
    assert layers == [f"layers.{i}" for i in range(len(model.layers))]


def test_full_recomputes_every_layer_op_and_auto_none_it_saves(sp1):
    model, gm, st, ins, state, inputs = sp1
    layers = len(model.layers)
    fwd = _step(gm, state, inputs)[2]
    # every layer matmul but each layer's last (the output head runs outside the layers):
    # recomputation stops once the layer's saved tensors are rebuilt, and the down
    # projection's output is saved by no backward
    layer_mms = fwd.names[MM] - 1 - layers
    full = _recomputed(apply_remat(gm, "full", st, ins), gm, state, inputs)
    assert sum(v for k, v in full.items() if k.startswith(MM + "(")) == layer_mms
    assert sum(v for k, v in full.items() if k.startswith(SDPA + "(")) == layers

    auto = apply_remat(gm, "auto", st, ins)
    saved = auto.spdsl_remat.saved
    assert any(s.startswith(SDPA) for s in saved) and any(s.startswith(MM) for s in saved)
    again = _recomputed(auto, gm, state, inputs)
    assert not set(saved) & set(again), f"saved yet recomputed: {set(saved) & set(again)}"
    # the attention and matmuls "full" runs again, "auto" keeps
    both = {s.split("(")[0] for s in set(saved) & set(full)}
    assert both == {SDPA, MM}, both
    # what it does not save runs again: each layer's two norms and its activation
    assert sum(v for k, v in again.items() if k.startswith("aten.rsqrt.default(")) == 2 * layers
    assert sum(v for k, v in again.items() if k.startswith("aten.silu.default(")) == layers


def test_a_budget_keeps_attention_and_drops_the_matmuls(sp1):
    _, gm, st, ins, state, inputs = sp1
    full = _recomputed(apply_remat(gm, "full", st, ins), gm, state, inputs)

    def kept(candidate, *_):           # a peak model that charges each saved signature
        return len(_regions(candidate)[0].policy.save)

    out = apply_remat(gm, Remat("auto", budget=1), st, ins, peak=kept)
    assert [s.split("(")[0] for s in out.spdsl_remat.saved] == [SDPA]
    assert out.spdsl_remat.predicted_peak == 1
    again = _recomputed(out, gm, state, inputs)
    assert not any(k.startswith(SDPA + "(") for k in again)
    mms = {k: v for k, v in again.items() if k.startswith(MM + "(")}
    assert mms and mms == {k: v for k, v in full.items() if k.startswith(MM + "(")}
    with pytest.raises(TypeError, match="peak="):
        apply_remat(gm, Remat("auto", budget=1), st, ins)


@pytest.mark.parametrize("mode", ["full", "auto"])
def test_recompute_collectives_changes_only_the_collectives(sp2, mode):
    _, gm, st, ins, state, inputs = sp2
    kept_gm = apply_remat(gm, mode, st, ins)
    a2a_fwd = _step(kept_gm, state, inputs, watch=_regions(kept_gm))[2].in_layers[A2A]
    assert a2a_fwd > 0
    kept = _recomputed(kept_gm, gm, state, inputs)
    again = _recomputed(apply_remat(gm, Remat(mode, recompute_collectives=True), st, ins),
                        gm, state, inputs)
    assert not any(k.startswith(A2A) for k in kept), kept
    assert sum(v for k, v in again.items() if k.startswith(A2A)) == a2a_fwd
    collective = ("_c10d_functional.", "spdsl.")
    assert {k: v for k, v in again.items() if not k.startswith(collective)} == \
        {k: v for k, v in kept.items() if not k.startswith(collective)}


MODES = {"none": Remat("none"), "full": Remat("full"), "auto": Remat("auto"),
         "full_recompute": Remat("full", recompute_collectives=True),
         "tiled": Remat("auto", tile_loss=True, tile_mlp=True, mlp_chunks=4)}


def test_every_mode_computes_the_same_loss_and_gradients(sp1):
    _, gm, st, ins, state, inputs = sp1
    loss, grads, *_ = _step(gm, state, inputs)
    for name, remat in MODES.items():
        out = apply_remat(gm, remat, st, ins)
        got, got_grads, *_ = _step(out, state, inputs)
        assert (got - loss).abs() <= 1e-6 * loss.abs(), (name, got.item(), loss.item())
        for i, (g, w) in enumerate(zip(got_grads, grads, strict=True)):
            err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
            assert err <= 1e-6, f"{name}: state {i} gradient rel err {err:.2e}"
    assert apply_remat(gm, MODES["tiled"], st, ins).spdsl_remat.tiled_mlp == 2
