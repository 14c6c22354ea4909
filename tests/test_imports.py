"""Imports go one way: each layer imports only layers below it (at module level and inside
functions alike); private PyTorch names only through ``spdsl._torch``; the example models
(``spdsl/models``) are a bottom layer of their own that imports nothing of spdsl, and nothing in
the library imports them; ``import spdsl`` changes nothing in PyTorch."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "spdsl"

# low -> high; a module may import its own layer's package and any layer below ("models" is
# below everything, and the tests further down keep it apart from the rest both ways)
LAYERS = [
    {"models"},
    {"_version", "env"},      # env: every SPDSL_* switch, read in one place
    {"_torch", "errors", "modelspec"},
    {"checkpoint_reader"},    # reading a checkpoint without running code from it
    {"watchdog"},             # the collectives' numbers, order check and hang bound
    {"kernels", "sharded_state"},
    {"propagate"},
    {"collectives"},
    {"lower", "dtensor_ops", "checkpoint"},   # checkpoint: its barrier and broadcast
    {"remat"},
    {"pipeline"},             # one rank's program: lower, kernels, remat, compile
    {"memory"},
    {"inspect"},              # the plan reads the program the memory planner builds
    {"annotate"},
    {"cli", "hf"},            # the command lines and the planner's search over model shapes;
                              # the Hugging Face Trainer integration (on sp_shard)
    {"__init__", "__main__"},
]
LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _unit(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).parts
    return rel[0].removesuffix(".py")


def _imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


def _files():
    return sorted(ROOT.rglob("*.py"))


def _spdsl_unit(module: str, names: list[str]) -> list[str]:
    """The units an import reaches: ``spdsl.X...`` reaches ``X``; ``import spdsl`` and
    ``from spdsl import X`` read names of the package itself, which the top layer
    (``spdsl/__init__.py``) defines, so they count as the top layer (spell a lower module
    ``import spdsl.collectives as C``)."""
    parts = module.split(".")
    if parts[0] != "spdsl":
        return []
    if len(parts) > 1:
        return [parts[1]]
    return ["__init__"]


def test_every_module_belongs_to_a_layer():
    assert {_unit(f) for f in _files()} <= set(LAYER), {_unit(f) for f in _files()} - set(LAYER)


def test_layers_import_downward_only():
    bad = []
    for f in _files():
        src = _unit(f)
        for line, module, names in _imports(f):
            for dst in _spdsl_unit(module, names):
                if dst in LAYER and dst != src and LAYER[dst] >= LAYER[src]:
                    bad.append(f"{f.relative_to(ROOT.parent)}:{line}: {src} (layer "
                               f"{LAYER[src]}) imports {dst} (layer {LAYER[dst]})")
    assert not bad, "\n".join(bad)


def _all_imports(path: pathlib.Path):
    """Every import, relative ones as ``.``-prefixed module names (``..state``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            yield node.lineno, "." * node.level + (node.module or ""), [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name, []


def _is_models(path: pathlib.Path) -> bool:
    return _unit(path) == "models"


def test_the_library_never_imports_the_example_models():
    bad = []
    for f in _files():
        if _is_models(f):
            continue
        for line, module, names in _all_imports(f):
            parts = module.split(".")
            if (parts[0] == "models" or parts[:2] == ["spdsl", "models"]
                    or (module == "spdsl" and "models" in names)
                    or (module.startswith(".") and "models" in parts + names)):
                bad.append(f"{f.relative_to(ROOT.parent)}:{line}: {module} {names}")
    assert not bad, "\n".join(bad)


def test_the_example_models_import_nothing_of_spdsl():
    # the model files know nothing of distribution: torch (and einops) only
    files = [f for f in _files() if _is_models(f)]
    assert {f.name for f in files} >= {"llama.py", "toys.py"}, files
    bad = [f"{f.relative_to(ROOT.parent)}:{line}: {module}" for f in files
           for line, module, _ in _all_imports(f)
           if module.split(".")[0] == "spdsl" or module.startswith("..")]
    assert not bad, "\n".join(bad)


def test_importing_an_example_model_loads_nothing_heavy():
    # ``import spdsl.models.llama`` runs spdsl/__init__.py; that must not pull in a compiler,
    # Triton or transformers
    probe = (
        "import sys\n"
        "import spdsl.models.llama, spdsl.models.toys\n"
        "heavy = ('triton', 'transformers', 'torch._inductor', 'deepspeed', 'matplotlib')\n"
        "loaded = [m for m in heavy if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr


_PRIVATE_MODULE = re.compile(r"^torch(\.\w+)*\._")
_PRIVATE_ATTR = re.compile(r"\btorch(\.[a-zA-Z]\w*)*\._[a-zA-Z]\w*")


def test_private_torch_apis_only_in_the_adapter():
    bad = []
    for f in _files():
        if f.name == "_torch.py":
            continue
        for line, module, names in _imports(f):
            if module.startswith("torch") and (_PRIVATE_MODULE.match(module) or
                                               any(n.startswith("_") for n in names)):
                bad.append(f"{f.relative_to(ROOT.parent)}:{line}: from {module} import {names}")
        code = ast.parse(f.read_text())
        for node in ast.walk(code):
            if isinstance(node, ast.Attribute):
                text = ast.unparse(node)
                # torch.ops.aten._to_copy and friends are operator names, not private APIs
                if text.startswith("torch.ops."):
                    continue
                if _PRIVATE_ATTR.fullmatch(text):
                    bad.append(f"{f.relative_to(ROOT.parent)}:{node.lineno}: {text}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_import_spdsl_changes_nothing_in_pytorch():
    probe = (
        "from torch.distributed.tensor import DTensor\n"
        "before = dict(DTensor._op_dispatcher._custom_op_handlers)\n"
        "import spdsl\n"
        "after = dict(DTensor._op_dispatcher._custom_op_handlers)\n"
        "assert before == after, sorted(set(map(str, after)) - set(map(str, before)))\n"
        "with spdsl.dtensor_attention():\n"
        "    inside = dict(DTensor._op_dispatcher._custom_op_handlers)\n"
        "assert inside != before\n"
        "assert dict(DTensor._op_dispatcher._custom_op_handlers) == before\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr
