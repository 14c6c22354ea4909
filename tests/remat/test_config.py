"""``spdsl.remat.config``: reading ``remat=`` values, the refused combinations, ``describe``,
and ``RematChoice``'s record."""

from __future__ import annotations

import pytest

from spdsl.errors import ShardingError
from spdsl.remat.config import Remat, RematChoice, device_memory, parse_bytes


@pytest.mark.parametrize("text,n", [("80GiB", 80 * 2 ** 30), ("1.5 MiB", 1572864),
                                    ("2kb", 2000), ("1e9", 10 ** 9), (4096, 4096),
                                    (" 3 B ", 3)])
def test_parse_bytes(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["80 GB/s", "lots", "5 parsecs", ""])
def test_parse_bytes_refuses_what_is_not_a_size(text):
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes(text)


def test_every_accepted_remat_value():
    assert Remat.of(None) == Remat("fit") and Remat.of(None).fit
    assert Remat.of("full") == Remat("full") and not Remat.of("full").fit
    assert Remat.of("40GiB") == Remat("auto", budget=40 * 2 ** 30)
    assert Remat.of(1024) == Remat("auto", budget=1024)
    r = Remat("full", tile_mlp=True)
    assert Remat.of(r) is r
    half = Remat.of(0.5)
    assert half.mode == "auto" and half.budget == int(device_memory() * 0.5)


@pytest.mark.parametrize("value,error", [(True, TypeError), ("fast", ShardingError),
                                         (-5, ShardingError), ("-1GiB", ShardingError)])
def test_values_that_are_not_a_remat(value, error):
    with pytest.raises(error):
        Remat.of(value)


@pytest.mark.parametrize("kw,text", [
    ({"mode": "partial"}, "use one of"),
    ({"mode": "fit", "offload": True}, "chooses the mode and its offload"),
    ({"mode": "fit", "recompute_collectives": True}, "chooses the mode"),
    ({"mode": "none", "offload": True}, "checkpoints nothing"),
])
def test_refused_combinations(kw, text):
    with pytest.raises(ValueError, match=text):
        Remat(**kw)


def test_describe_lists_what_differs_from_the_defaults():
    assert Remat("auto").describe() == "auto"
    assert Remat("full", offload=True, recompute_collectives=True).describe() == \
        "full(recompute_collectives, offload)"
    assert Remat("auto", budget=10, tile_mlp=True, mlp_chunks=4).describe() == \
        "auto(budget=10, tile_mlp=True, mlp_chunks=4)"
    assert Remat("auto").with_(tile_loss=False).describe() == "auto(tile_loss=False)"


def test_a_choice_round_trips_and_reads():
    c = RematChoice("auto", 2 ** 30, "memory_budget=", (("none", 3 * 2 ** 30),
                                                        ("auto", 2 ** 29)))
    assert RematChoice.from_dict(c.to_dict()) == c
    assert str(c) == ("fit -> auto (fits): planned peak per rank none 3.00 GiB, auto 512.00 "
                      "MiB; budget 1.00 GiB (memory_budget=)")
    bad = RematChoice("full", 100, "device", (("full", 200),), fits=False)
    assert "nothing fits; the leanest tried" in str(bad) and "100 B" in str(bad)
    assert str(RematChoice("none", 0, "", (), unplanned="no layers")) == \
        "fit -> none (unplanned: no layers)"
