"""The sequence-mixer rule (``spdsl.propagate.rules.mixers``) asked directly: on a
``spdsl.mixer`` node of a registered form, the strategies by factor (batch rows, heads, state
passing, whole), which arguments each splits, and state passing priced as the states it
exchanges (gathered from every rank, or a halo from a neighbour)."""

from __future__ import annotations

import pytest
import torch

from spdsl.propagate.mixer_form import MIXERS, SITES, add_site, bind, make_site
from spdsl.propagate.placement import REPLICATE, Shard
from tests.propagate._rule_ctx import ctx_of, strategies, table

MIXER = torch.ops.spdsl.mixer
R = repr(REPLICATE)


def delta_rule(query, key, value, g, beta):
    """The signature of a gated delta rule: [B, S, H, d] x 3, [B, S, H] x 2."""


def ssd(hidden_states, dt, A, B, C):
    """Mamba-2's scan: x [B, S, H, p], dt [B, S, H], A [H], B/C [B, S, groups, n]."""


def conv(hidden_states, weight):
    """A short causal conv: x [B, D, S], weight [D, kernel]."""


@pytest.fixture
def mixer_ctx():
    keys = []

    def make(form: str, fn, tensors, placements, parts: int = 4):
        site, ts = make_site(MIXERS[form], fn, bind(fn, tuple(tensors), {}))
        key = add_site(site)
        keys.append(key)
        return ctx_of(lambda *a: MIXER(list(a), key), ts, MIXER, placements, parts)
    yield make
    for k in keys:
        SITES.pop(k, None)


def _gdn(heads: int = 4):
    q = torch.randn(1, 16, heads, 8)
    return [q, q, q, torch.randn(1, 16, heads), torch.randn(1, 16, heads)]


SEQ = Shard(1, 1, 16)              # [B, S@sp, ...]


def test_delta_rule_offers_heads_then_state_passing_then_whole(mixer_ctx):
    ctx = mixer_ctx("gated_delta_rule", delta_rule, _gdn(), [SEQ] * 5)
    ss = strategies(ctx)
    assert [s.rule for s in ss] == ["mixer.gated_delta_rule.heads",
                                    "mixer.gated_delta_rule.state",
                                    "mixer.gated_delta_rule.whole"]
    assert ss[0].inputs == (Shard(2, 1, 4),) * 5 and ss[0].output == Shard(2, 1, 4)
    assert ss[1].inputs == (SEQ,) * 5 and ss[1].lowering == "mixer_state"
    # the [B, Hv, dk, dk + dv] fp32 state of every other rank: 1*4*8*16*4 B, three times
    assert ss[1].extra_cost == 2048 * 3
    assert ss[2].inputs == (REPLICATE,) * 5 and ss[2].output == REPLICATE


def test_heads_that_do_not_divide_the_degree_leave_state_passing(mixer_ctx):
    ctx = mixer_ctx("gated_delta_rule", delta_rule, _gdn(heads=3), [SEQ] * 5)
    assert [s.rule for s in strategies(ctx)] == ["mixer.gated_delta_rule.state",
                                                 "mixer.gated_delta_rule.whole"]


def test_split_batch_rows_keep_their_split(mixer_ctx):
    rows = Shard(0, 1, 2)
    q = torch.randn(2, 16, 4, 8)
    ctx = mixer_ctx("gated_delta_rule", delta_rule,
                    [q, q, q, torch.randn(2, 16, 4), torch.randn(2, 16, 4)], [rows] + [R] * 4)
    ss = strategies(ctx)
    assert ss[0].rule == "mixer.gated_delta_rule.batch"
    assert ss[0].inputs == (Shard(0, 1, 2),) * 5 and ss[0].output == Shard(0, 1, 2)


def test_one_rank_plans_state_passing_at_no_cost(mixer_ctx):
    ctx = mixer_ctx("gated_delta_rule", delta_rule, _gdn(), [SEQ] * 5, parts=1)
    ss = strategies(ctx)
    assert [(s.rule, s.extra_cost) for s in ss] == [
        ("mixer.gated_delta_rule.state", 0.0), ("mixer.gated_delta_rule.whole", 0.0)]


def test_grouped_b_and_c_stay_whole_when_their_groups_do_not_divide(mixer_ctx):
    x, dt, A = torch.randn(1, 16, 4, 8), torch.randn(1, 16, 4), torch.randn(4)
    bc = torch.randn(1, 16, 1, 2)                       # one group shared by the 4 heads
    ctx = mixer_ctx("ssd", ssd, [x, dt, A, bc, bc], [SEQ, SEQ, R, SEQ, SEQ])
    heads = next(s for s in strategies(ctx) if s.rule == "mixer.ssd.heads")
    assert table([heads])[0][1] == ("Shard(2)", "Shard(2)", "Shard(0)", R, R)
    state = next(s for s in strategies(ctx) if s.rule == "mixer.ssd.state")
    assert table([state])[0][1] == ("Shard(1)", "Shard(1)", R, "Shard(1)", "Shard(1)")


def test_a_conv_exchanges_a_halo_and_needs_its_kernel_of_tokens_per_rank(mixer_ctx):
    x = torch.randn(2, 8, 16)                           # [B, D, S@sp]
    seq = Shard(2, 1, 16)
    ctx = mixer_ctx("causal_conv1d", conv, [x, torch.randn(8, 4)], [seq, R])
    state = next(s for s in strategies(ctx) if s.rule == "mixer.causal_conv1d.state")
    # kernel - 1 = 3 tokens of [2, 8] fp32 from the previous rank, not from every rank
    assert state.extra_cost == 2 * 8 * 3 * 4
    assert state.inputs == (seq, REPLICATE)
    # a kernel of 6 needs 5 earlier tokens; 4 per rank is too few: no state passing
    ctx = mixer_ctx("causal_conv1d", conv, [x, torch.randn(8, 6)], [seq, R])
    assert "mixer.causal_conv1d.state" not in [s.rule for s in strategies(ctx)]
