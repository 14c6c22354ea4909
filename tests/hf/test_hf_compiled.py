"""Hugging Face models under ``compile=True`` (tied embeddings: GPT-2, Gemma and a plain
PyTorch model) at SP 2, and under ``remat="full"``/``"auto"`` at SP 4: exact, with the
all-to-alls run by the process group."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.dist import spawn
from tests.hf.cases import COMPILED_CASES, REMAT_CASES, run_all
from tests.hf.test_hf_parity import check, save


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.compile
@pytest.mark.parametrize("name", [c.name for c in COMPILED_CASES])
def test_compiled(compiled, name):
    check(2, compiled, name)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("name", [c.name for c in REMAT_CASES])
def test_remat(remat, name):
    check(4, remat, name)


@pytest.fixture(scope="module")
def compiled():
    per_rank = spawn(run_all, 2, COMPILED_CASES, False, timeout=3000)
    save(2, per_rank)
    return per_rank


@pytest.fixture(scope="module")
def remat():
    per_rank = spawn(run_all, 4, REMAT_CASES, False, timeout=3000)
    save(4, per_rank)
    return per_rank
