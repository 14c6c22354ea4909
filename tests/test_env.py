"""``spdsl.env``: every ``SPDSL_*`` switch the library names is declared there, with its default
and a line of its table; a switch reads its default where unset, and on/off as documented."""

from __future__ import annotations

import pathlib
import re

import pytest

import spdsl.env as env

ROOT = pathlib.Path(__file__).resolve().parent.parent / "spdsl"


def test_every_switch_named_in_the_library_is_declared_and_documented():
    named = {m for f in ROOT.rglob("*.py") for m in re.findall(r"SPDSL_[A-Z_]+[A-Z]",
                                                               f.read_text())}
    assert named == set(env.DEFAULTS), (named ^ set(env.DEFAULTS))
    table = {line.split()[0] for line in env.__doc__.splitlines()
             if line.startswith("SPDSL_")}
    assert table == set(env.DEFAULTS)


@pytest.mark.parametrize("name", sorted(env.DEFAULTS))
def test_unset_reads_the_default(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    assert env.value(name) == env.DEFAULTS[name]
    monkeypatch.setenv(name, "x7")
    assert env.value(name) == "x7"


def test_on_by_default_is_off_only_at_0_and_off_by_default_on_only_at_1(monkeypatch):
    for text, want in ((None, True), ("0", False), ("1", True), ("no", True)):
        if text is None:
            monkeypatch.delenv("SPDSL_GRAD_OVERLAP", raising=False)
        else:
            monkeypatch.setenv("SPDSL_GRAD_OVERLAP", text)
        assert env.on("SPDSL_GRAD_OVERLAP") is want, text
    for text, want in ((None, False), ("0", False), ("1", True), ("yes", False)):
        if text is None:
            monkeypatch.delenv("SPDSL_DEBUG", raising=False)
        else:
            monkeypatch.setenv("SPDSL_DEBUG", text)
        assert env.on("SPDSL_DEBUG") is want, text
