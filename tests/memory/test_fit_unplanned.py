"""A step whose memory planner fails (``remat="fit"``, the default) runs unplanned
(``remat="none"``) and exactly, and says why once, in one line. One process, one gloo rank;
the same at SP 2 with one rank failing: ``tests/parity/test_fit_parity.py``. (Apart from
``test_fit.py``, whose fake process group stays up for its module.)"""

from __future__ import annotations

import copy
import warnings

import torch

import spdsl
from spdsl.memory import fit
from spdsl.models.llama import Llama, LlamaConfig
from tests._util import assert_close


def _broken(*a, **kw):
    raise RuntimeError("no fake kernel for this op\nsecond line of the error")


def test_a_step_whose_planner_fails_is_exact_and_warns_once(one_rank, monkeypatch):
    torch.manual_seed(0)
    ref = Llama(LlamaConfig.tiny())
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    want = ref(ids, ids)
    want.backward()
    monkeypatch.setattr(fit, "simulate", _broken)
    step = spdsl.sp_shard(seq=1)(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for _ in range(2):                      # built once: said once
            model.zero_grad(set_to_none=True)
            loss = step(ids, ids)
            loss.backward()
    said = [str(x.message) for x in w if "could not plan" in str(x.message)]
    assert len(said) == 1 and "\n" not in said[0], said
    assert_close(loss, want, rtol=1e-5, name="loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, name=name)
