"""Source locations come from the user's code wherever it is checked out, and for plain
functions as for modules."""

from __future__ import annotations

import importlib.util
import sys
import textwrap

import pytest
import torch

import spdsl
from spdsl import ShardingError

_USER_CODE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F


    def attend(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return o.sum()


    class Attend(torch.nn.Module):
        def forward(self, q, k, v):
            return attend(q, k, v)
''')


def _load(tmp_path, folder: str):
    # a checkout whose folder has the library's own name: a clone's default
    d = tmp_path / folder
    d.mkdir()
    f = d / "user_code.py"
    f.write_text(_USER_CODE)
    spec = importlib.util.spec_from_file_location(f"user_code_{folder}", f)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("folder", ["spdsl", "torch", "elsewhere"])
@pytest.mark.parametrize("form", ["function", "module"])
def test_error_names_the_user_line_in_any_checkout(tmp_path, folder, form):
    mod = _load(tmp_path, folder)
    fn = mod.attend if form == "function" else mod.Attend()
    q = torch.randn(1, 16, 4, 8)       # 4 heads over 8 ranks: an error with a source line
    with pytest.raises(ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=8, attention="ulysses")(fn), q, q, q)
    msg = str(e.value)
    assert "[divisible heads]" in msg
    at = next(line for line in msg.splitlines() if line.strip().startswith("at:"))
    # a module's line is the one in its forward (torch keeps forward frames); a plain
    # function's is its own
    assert f"user_code.py:{7 if form == 'function' else 14}" in at, msg


def test_plan_sources_in_a_checkout_named_spdsl(tmp_path):
    mod = _load(tmp_path, "spdsl")
    q = torch.randn(1, 16, 4, 8)
    plan = spdsl.plan(spdsl.sp_shard(seq=2)(mod.attend), q, q, q)
    sources = {c.source for c in plan.collectives if c.purpose == "ulysses"}
    assert sources and all("user_code.py:7" in s for s in sources), sources
