"""``tools/counts.py``: no count of the restructuring rose above ``tools/counts.json``, and each
detector counts its kind of site and not the lookalikes (small trees written here)."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("spdsl_tools_counts", ROOT / "tools/counts.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod                 # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


counts = _load()


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text).lstrip("\n"))
    return root


def _lines(sites, path: str) -> list[int]:
    return [s.line for s in sites if s.path == path]


def test_no_count_rose():
    recorded = json.loads(counts.RECORD.read_text())
    rises, _ = counts.compare(counts.measure(ROOT), recorded)
    assert not rises, "\n".join(rises)


READS = """
'''SPDSL_DOC in a docstring is not a read.'''
import os
from os import environ as env_alias, getenv
from spdsl.names import NAME
LOCAL = "SPDSL_LOCAL"
a = os.environ.get("SPDSL_A")
b = os.environ["SPDSL_B"]
c = getenv("SPDSL_C")
d = "SPDSL_D" in env_alias
e = os.environ.get(LOCAL)
f = os.environ.get(NAME)
g = os.environ.get(f"SPDSL_{a}")
h = os.environ.get("HOME")
os.environ["SPDSL_SET"] = "1"
i = {}.get("SPDSL_DICT")
j = "SPDSL_TEXT"
"""

COMM = """
import torch
import torch.distributed as dist
from torch.distributed import barrier as wait_all
from torch.distributed import _functional_collectives as funcol
from spdsl._shim import gather_one, c10d
from spdsl import collectives as C
dist.all_reduce(t)
torch.distributed.broadcast(t, 0)
wait_all()
funcol.all_to_all_single(t, None, None, g)
gather_one(t, 0, g)
c10d.all_reduce_.default(t, "sum", "g")
def f():
    import torch.distributed as d2
    return d2.new_group([0, 1])
dist.get_rank(), dist.get_world_size(), funcol.wait_tensor(t), C.all_reduce(t), C.reduce_(t)
op = c10d.all_reduce_.default
t.scatter_(0, i, v)
"""

SHIM = """
import torch
import torch.distributed._functional_collectives as functional_collectives
gather_one = getattr(functional_collectives, "all_gather_single", None) \\
    or functional_collectives.all_gather_tensor
c10d = torch.ops._c10d_functional
"""

PATCHED = """
from dataclasses import dataclass
@dataclass(frozen=True)
class Plan:
    x: int
    def __post_init__(self):
        object.__setattr__(self, "y", 1)
        self.__dict__["z"] = 2
    def cache(self):
        object.__setattr__(self, "_c", 1)
        self.__dict__["_d"] = 2
class Box:
    def __init__(self):
        self._x = 1
    def set(self, other):
        self._y = 2
        other._z = 3
def patch(plan, obj):
    plan._memory = 1
    plan.__dict__["_m"] = 2
    setattr(plan, "_n", 3)
    obj.__class__ = Box
    plan._count += 1
    plan.public = 4
    plan.__doc__ = "d"
    setattr(plan, "public", 5)
    setattr(plan, f"__{plan}__", 6)
    plan._list[0] = 1
    return plan._memory
"""

LIB = """
import importlib
from spdsl.cli.search import max_seq
import spdsl.cli.search
from spdsl import cli
from .cli import search
importlib.import_module("spdsl.cli.search")
from spdsl.modelspec.cli import UsageError
from spdsl import client
import spdsl.clip
"""


def _synthetic(tmp_path: Path) -> Path:
    return _tree(tmp_path, {
        "spdsl/__init__.py": "",
        "spdsl/env.py": "import os\nA = os.environ.get('SPDSL_A')\n",
        "spdsl/names.py": "NAME = 'SPDSL_NAMED'\n",
        "spdsl/reads.py": READS,
        "spdsl/collectives.py": "import torch.distributed as dist\nreduce_ = dist.all_reduce\n"
                                "dist.all_reduce(t)\n",
        "spdsl/_shim.py": SHIM,
        "spdsl/comm.py": COMM,
        "spdsl/patched.py": PATCHED,
        "spdsl/lib.py": LIB,
        "spdsl/__main__.py": "from spdsl.cli.tool import main\n",
        "spdsl/cli/__init__.py": "",
        "spdsl/cli/search.py": "def max_seq():\n    return 1\n",
        "spdsl/cli/tool.py": "from spdsl.cli.search import max_seq\n",
        "bench/run.py": "from spdsl.cli.search import max_seq\n",
        "bench/other.py": "from spdsl.memory.search import max_seq\n",
        "spdsl/big.py": "x = 1\n" * 501,
        "spdsl/edge.py": "x = 1\n" * 500,
        "spdsl/pipeline.py": "",
        "spdsl/kernels/flash.py": "",
        "spdsl/propagate/__init__.py": "",
        "spdsl/propagate/engine.py": "",
        "spdsl/propagate/rules/views.py": "",
        "spdsl/propagate/rules/loss.py": "",
        "spdsl/lower/graph.py": "",
        "tests/test_pipeline.py": "",
        "tests/test_loss.py": "",
        "tests/propagate/test_engine_golden.py": "",
        "tests/propagate/rules/test_rules_views.py": "",
        "tests/lower/test_graphs.py": "",
    })


def test_detectors(tmp_path):
    sites = counts.measure(_synthetic(tmp_path))
    assert _lines(sites["env_reads"], "spdsl/reads.py") == [6, 7, 8, 9, 10, 11, 12]
    assert len(sites["env_reads"]) == 7                           # spdsl/env.py's read is not
    assert _lines(sites["group_calls"], "spdsl/comm.py") == [7, 8, 9, 10, 11, 12, 15]
    assert len(sites["group_calls"]) == 7                         # nor collectives.py's call
    assert _lines(sites["patched_after"], "spdsl/patched.py") == [9, 10, 16, 18, 19, 20, 21, 22]
    assert [(s.path, s.line) for s in sites["cli_imports"]] == \
        [("bench/run.py", 1), *(("spdsl/lib.py", n) for n in range(2, 7))]
    assert [(s.path, s.line) for s in sites["search_in_cli"]] == [("spdsl/cli/search.py", 1)]
    assert [s.path for s in sites["long_files"]] == ["spdsl/big.py"]
    assert [s.path for s in sites["untested_core"]] == \
        ["spdsl/lower/graph.py", "spdsl/propagate/rules/loss.py"]


SWAPPER = """
import contextlib
@contextlib.contextmanager
def swapped(obj, name, value):
    own = vars(obj)[name]
    setattr(obj, name, value)
    yield
    setattr(obj, name, own)
def quiet(mod):
    with swapped(mod, "_flag", False):
        pass
"""

SWAPS = """
import spdsl._torch
from spdsl import _torch as T
from spdsl._torch import swapped
def f(mod, m, cls):
    with swapped(mod, "_x", 1):
        pass
    with T.swapped(m, "forward", m), spdsl._torch.swapped(cls, "y", 2):
        pass
    mod._x = 1
"""

ATTACH = """
def _attach(trainer, mixin, runner):
    trainer.__class__ = type("S", (mixin, type(trainer)), {"_loss": runner})
    trainer.model.forward = runner.forward
    trainer.args.flag = False
    setattr(trainer.accelerator, "gather", runner.gather)
    runner._seen = True
    model = trainer.model
    model._x = 1
def other(trainer):
    trainer._y = 1
    trainer.__class__ = object
"""


def test_foreign_patches(tmp_path):
    """Swaps through the one helper, whatever the import, and the trainer attachment's writes
    to the trainer it is given; everything else the attachment file patches (through another
    name, in another function) stays in ``patched_after``."""
    sites = counts.measure(_tree(tmp_path, {
        "spdsl/__init__.py": "", "spdsl/hf/__init__.py": "",
        "spdsl/_torch.py": SWAPPER, "spdsl/swaps.py": SWAPS, "spdsl/hf/trainer.py": ATTACH,
        "spdsl/lookalike.py": "def swapped(a, b, c):\n    return a\nswapped(1, '_x', 3)\n"}))
    assert [(s.path, s.line) for s in sites["foreign_patches"]] == [
        ("spdsl/_torch.py", 9), *(("spdsl/hf/trainer.py", n) for n in (2, 3, 4, 5)),
        ("spdsl/swaps.py", 5), ("spdsl/swaps.py", 7), ("spdsl/swaps.py", 7)]
    assert [(s.path, s.line) for s in sites["patched_after"]] == [
        *(("spdsl/hf/trainer.py", n) for n in (6, 8, 10, 11)), ("spdsl/swaps.py", 9)]


def test_search_moved_out_of_cli(tmp_path):
    root = _synthetic(tmp_path)
    _tree(root, {"spdsl/cli/search.py": "from spdsl.memory.search import max_seq\n",
                 "spdsl/memory/search.py": "def max_seq():\n    return 1\n"})
    assert counts.counts(counts.measure(root))["search_in_cli"] == 0


def test_ratchet(tmp_path, monkeypatch, capsys):
    root = _synthetic(tmp_path / "tree")
    monkeypatch.setattr(counts, "RECORD", tmp_path / "counts.json")
    assert counts.main(["--root", str(root), "--write"]) == 0
    assert counts.main(["--root", str(root), "--check"]) == 0
    with open(root / "spdsl/comm.py", "a") as f:
        f.write("dist.all_gather(out, t)\ndist.all_reduce(t)\n")
    capsys.readouterr()
    assert counts.main(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "group_calls rose from 7 to 9" in err
    assert "spdsl/comm.py:19  dist.all_gather(out, t)" in err
    assert "spdsl/comm.py:20  dist.all_reduce(t)" in err         # the same code once more
    assert "spdsl/comm.py:7 " not in err                         # only the new sites
    assert counts.main(["--root", str(root), "--write"]) == 1     # a rise is not recorded
    (root / "spdsl/big.py").write_text("x = 1\n")
    assert counts.main(["--root", str(root), "--write", "--accept-rise"]) == 0
    capsys.readouterr()
    assert counts.main(["--root", str(root), "--check"]) == 0
    (root / "spdsl/comm.py").write_text("")
    assert counts.main(["--root", str(root), "--check"]) == 0
    err = capsys.readouterr().err
    assert "group_calls went down from 9 to 0" in err and "--write" in err
    assert json.loads(counts.RECORD.read_text())["counts"]["long_files"] == 0
