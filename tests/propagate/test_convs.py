"""Short convolutions along the sequence written as ATen convolution become one ``conv1d``
mixer node (``spdsl.propagate.convs``): in the trace, in the plan (split, a halo exchange of
the tokens each output reads across a piece's edge, no gather), on one rank (the rewritten
node computes what the ops did, forward and backward), and left as traced where the
convolution is not of that shape. The multi-rank runs: ``tests/parity/test_conv_parity.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import spdsl
from spdsl.propagate.trace import trace
from tests._util import assert_close
from tests.parity.conv_cases import LAYERS, ConvNet, batch

aten = torch.ops.aten


def _targets(model, *args):
    return [n.target for n in trace(model, args, {}).graph.graph.nodes]


def test_every_spelling_becomes_one_mixer_node():
    targets = _targets(ConvNet(), *batch())
    assert aten.convolution.default not in targets
    assert aten.constant_pad_nd.default not in targets
    assert aten.slice.Tensor not in targets              # the causal slices went with them
    assert targets.count(torch.ops.spdsl.mixer.default) == len(LAYERS)


def test_plan_names_the_halo_and_its_bytes():
    """Rank 0's buffer of each exchange: the ``d (k - 1)`` tokens each causal output reads
    before it (to the next rank); of the "same" ones, those read before it, and the gradients
    of those read after it in backward (rank 0 has no previous rank)."""
    B, L, C, P = 2, 64, 16, 4
    plan = spdsl.plan(spdsl.sp_shard(seq=P)(ConvNet()), *batch(B, L))
    convs = [v for v in plan.values if v.origin.startswith("mixer.")]
    assert [v.origin for v in convs] == ["mixer.conv1d.state"] * len(LAYERS)
    assert all(v.typed == f"f32[{B},{C},{L}@sp]" for v in convs)
    halos = [c for c in plan.collectives if c.kind == "halo_exchange"]
    read = [(d * (k - 1) // 2, d * (k - 1) - d * (k - 1) // 2) if s.startswith("same")
            else (d * (k - 1), 0) for s, k, d, _g, _b in LAYERS]
    assert [(c.purpose, c.bytes, c.bytes_bwd, c.module) for c in halos] == [
        ("halo", B * C * a * 4, B * C * b * 4, f"convs.{i}") for i, (a, b) in enumerate(read)]
    assert read[-1] == (1, 2)                 # padding="same", kernel 4
    assert not [c for c in plan.collectives if c.kind in ("all_gather", "all_to_all")]


def test_pieces_shorter_than_the_halo_run_whole():
    """2 tokens a rank: the kernel-4 and the dilated convolutions read 3 and 4 tokens before
    each output, more than the previous rank holds; they run whole (their input gathered),
    the others still split."""
    plan = spdsl.plan(spdsl.sp_shard(seq=4)(ConvNet()), *batch(2, 8))
    origins = [v.origin.removeprefix("mixer.conv1d.") for v in plan.values
               if v.origin.startswith("mixer.")]
    assert origins == ["whole", "state", "whole", "state", "state", "state"]


class _Other(nn.Module):
    """Convolutions of other shapes: strided, unpadded (a shorter output), padded with ones,
    and a causal output read before its slice too."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv = nn.Conv1d(8, 8, 3, groups=8, stride=2 if kind == "strided" else 1,
                              padding=2 if kind == "read_whole" else 0)

    def forward(self, x):
        h = x.transpose(1, 2)
        if self.kind == "ones":
            return self.conv(F.pad(h, (2, 0), value=1.0)).sum()
        if self.kind == "read_whole":
            y = self.conv(h)
            return y[..., :h.shape[2]].sum() + y.pow(2).sum()
        return self.conv(h).sum()


@pytest.mark.parametrize("kind", ["strided", "valid", "ones", "read_whole"])
def test_other_convolutions_are_left_as_traced(kind):
    x = torch.randn(2, 32, 8)
    targets = _targets(_Other(kind), x)
    assert aten.convolution.default in targets
    assert torch.ops.spdsl.mixer.default not in targets
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(_Other(kind)), x)
    assert any(c.kind == "all_gather" for c in plan.collectives)      # gathered, as before


def test_one_rank_step_is_the_single_device_step(one_rank):
    torch.manual_seed(0)
    ref = ConvNet()
    model = copy.deepcopy(ref)
    args = batch()
    want = ref(*args)
    want.backward()
    loss = spdsl.sp_shard(seq=1)(model)(*args)
    loss.backward()
    assert_close(loss, want, rtol=1e-6, name="loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, name=name)
