"""Counts of what spdsl's restructuring removes (and of the foreign objects it still changes),
read from the source with ``ast`` (no import of spdsl), and a ratchet that keeps each from going
back up.

    python tools/counts.py              # one line per count
    python tools/counts.py -v           # and under each, every counted site: file:line  code
    python tools/counts.py --json       # the counts as JSON
    python tools/counts.py --check      # exit 1 when a count is above tools/counts.json
    python tools/counts.py --write      # record the counts in tools/counts.json

count            what it counts, in ``spdsl/``
---------------  -------------------------------------------------------------------------------
env_reads        ``SPDSL_*`` switches read (``os.environ.get``/``[]``/``in``, ``os.getenv``; the
                 name a literal, an f-string or a constant) outside ``spdsl/env.py``, their one
                 reader
group_calls      calls of ``torch.distributed`` process-group functions (collectives, point to
                 point, barriers, ``new_group``, ``_functional_collectives``, ``_c10d_functional``
                 ops) outside ``spdsl/collectives/``, through any alias a file imports, spdsl's
                 re-exports (``spdsl._torch``) included; not ``get_rank``, ``wait_tensor`` (no
                 data moves) nor methods of a ``ProcessGroup`` object (``pg.allreduce``)
patched_after    objects patched after construction, spdsl's own or not (the source does not
                 say whose): ``x.__dict__[k] = v``; ``object.__setattr__`` outside a class's own
                 ``__init__``/``__post_init__``/``__new__``; ``x._attr = v``, ``setattr(x,
                 "_attr", v)`` and ``x.__class__ = C`` where ``x`` is not ``self``/``cls``; all
                 but the trainer attachment's writes to its trainer (``foreign_patches``'). Held
                 at 0. Neither count sees a public name set outside the attachment (``x.attr =
                 v``) nor a name known only when it runs (``setattr(x, name, v)``, as in
                 ``swapped`` itself)
foreign_patches  objects spdsl does not own (PyTorch's modules and classes, Hugging Face's, the
                 user's) changed: each call of ``spdsl._torch.swapped`` (set for the length of a
                 ``with``, put back on any exit), and in ``spdsl/hf/trainer.py``'s ``_attach``
                 (``sequence_parallel``'s one attachment to a trainer the user built) every
                 assignment or ``setattr``, public names included, to its first parameter (the
                 trainer) and what hangs off it (its class, model, arguments, accelerator);
                 a write there through another name is ``patched_after``'s to count. Held, not
                 meant to reach 0
cli_imports      imports of ``spdsl.cli`` outside ``spdsl/cli/`` and ``spdsl/__main__.py`` (and
                 in ``bench/``)
search_in_cli    1 while the planner's search (``max_seq``, ``propose``, ``seq_bound``,
                 ``model_plan``, ``Estimator``) is defined under ``spdsl/cli/`` (a re-export: 0)
long_files       files over 500 lines
untested_core    modules of ``annotate/``, ``propagate/``, ``lower/``, ``remat/``, ``pipeline``
                 with no test file named for them in their package's folder of ``tests/`` (for
                 ``propagate/rules/views.py``: ``tests/propagate/**/test_{,rules_}views{,_*}.py``)

``tools/counts.json`` holds the counts and their sites as last recorded. ``--check`` fails when a
count rose and says to run ``--write`` when one went down; ``--write`` refuses to record a rise
unless ``--accept-rise`` is given, so the file follows progress down only.
"""

from __future__ import annotations

import argparse
import ast
import collections
import functools
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).resolve().with_name("counts.json")
MAX_LINES = 500
CORE = ("annotate", "propagate", "lower", "remat", "pipeline")
SEARCH_ENTRIES = {"max_seq", "propose", "seq_bound", "model_plan", "Estimator"}
BUILDERS = {"__init__", "__post_init__", "__new__"}
SWAP = "spdsl._torch.swapped"                   # the one helper that puts back what it changes
ATTACH = ("spdsl/hf/trainer.py", "_attach")     # the one attachment to a user's trainer

# where torch's process-group functions live, and which of their names move data or make groups
GROUP_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d",
                 "torch.distributed._functional_collectives", "torch.distributed.nn",
                 "torch.distributed.nn.functional"}
OP_NAMESPACES = {"torch.ops._c10d_functional", "torch.ops.c10d_functional", "torch.ops.c10d",
                 "torch.ops._c10d_functional_autograd"}
GROUP_PREFIXES = ("all_reduce", "all_gather", "all_to_all", "reduce_scatter", "broadcast",
                  "gather", "scatter")
GROUP_EXACT = {"send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier",
               "monitored_barrier", "new_group", "new_subgroups", "reduce", "permute_tensor"}


@dataclass(frozen=True)
class Site:
    """One counted place: ``key`` is what the record compares (no line numbers, which move)."""
    path: str
    line: int
    code: str
    key: str = ""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}  {self.code}" if self.line else f"{self.path}  {self.code}"

    @property
    def ident(self) -> str:
        return self.key or f"{self.path}: {self.code}"


@dataclass
class Source:
    """A parsed file: its dotted module name and the names it binds to other modules' names."""
    path: str                                          # relative to the root, with "/"
    text: str
    tree: ast.Module
    module: str
    aliases: dict[str, str] = field(default_factory=dict)     # local name -> dotted name
    strings: dict[str, str] = field(default_factory=dict)     # local name -> str constant
    exports: dict[str, str] = field(default_factory=dict)     # top-level names only
    constants: dict[str, str] = field(default_factory=dict)   # top-level str constants
    nodes: list[ast.AST] = field(default_factory=list)        # every node, walked once

    def code(self, node: ast.AST) -> str:
        line = self.text.splitlines()[node.lineno - 1].strip()   # only for the few counted
        return line if len(line) <= 100 else line[:97] + "..."

    def site(self, node: ast.AST) -> Site:
        return Site(self.path, node.lineno, self.code(node))

    @functools.cached_property
    def building(self) -> set[int]:
        """Ids of the nodes run by a class's own ``__init__``/``__post_init__``/``__new__``
        (not by a function defined inside one)."""
        return {id(n) for c in self.nodes if isinstance(c, ast.ClassDef) for fn in c.body
                if isinstance(fn, _FUNCTIONS[:2]) and fn.name in BUILDERS
                for n in _walk(fn.body, skip=_FUNCTIONS)}


class Project:
    """Every ``.py`` file under ``spdsl/`` and ``bench/`` of ``root``, parsed once."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.files: dict[str, Source] = {}
        for top in ("spdsl", "bench"):
            for p in sorted((self.root / top).rglob("*.py")):
                rel = p.relative_to(self.root).as_posix()
                text = p.read_text(encoding="utf-8")
                if top == "bench" and "cli" not in text:
                    continue                       # read only for imports of spdsl.cli
                mod = rel[:-3].replace("/", ".").removesuffix(".__init__")
                self.files[rel] = Source(rel, text, ast.parse(text, rel), mod)
        self.modules = {s.module: s for s in self.files.values()}
        for s in self.files.values():
            s.nodes = _walk([s.tree])
            _bind(s)

    def spdsl(self) -> list[Source]:
        return [s for p, s in self.files.items() if p.startswith("spdsl/")]

    def qualname(self, src: Source, node: ast.AST) -> str | None:
        """The dotted name ``node`` stands for (``dist.all_reduce`` -> ``torch.distributed.
        all_reduce``), through imports, simple assignments and spdsl's own re-exports (not
        ``spdsl.collectives``': a name it gives a torch function is its own)."""
        q = _local_qualname(node, src.aliases)
        for _ in range(8):                         # a re-export of a re-export, and so on
            if q is None:
                return None
            parts = q.split(".")
            for i in range(len(parts) - 1, 0, -1):
                mod = self.modules.get(".".join(parts[:i]))
                if mod is not None and parts[i] in mod.exports and \
                        _outside(mod.path, "collectives"):
                    q = ".".join([mod.exports[parts[i]], *parts[i + 1:]])
                    break
            else:
                return q
        return q

    def string(self, src: Source, node: ast.AST, whole: bool = False) -> str | None:
        """The leading text of a string expression: a literal, an f-string's head, a constant
        (of this file, or imported from another); with ``whole``, only text known entirely."""
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr) and node.values and not whole:
            return self.string(src, node.values[0]) or ""
        if isinstance(node, ast.Name) and node.id in src.strings:
            return src.strings[node.id]
        q = self.qualname(src, node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if q and "." in q:
            mod, name = q.rsplit(".", 1)
            if mod in self.modules:
                return self.modules[mod].constants.get(name)
        return None


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _walk(roots: list, skip: tuple = ()) -> list[ast.AST]:
    """Every node under ``roots`` (``ast.walk``'s, a third faster), not entering ``skip``."""
    out, stack = [], list(roots)
    while stack:
        node = stack.pop()
        if isinstance(node, skip):
            continue
        out.append(node)
        for name in node._fields:
            v = getattr(node, name, None)
            if isinstance(v, list):
                stack.extend(c for c in v if isinstance(c, ast.AST))
            elif isinstance(v, ast.AST):
                stack.append(v)
    return out


def _absolute(src: Source, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = src.module.split(".")
    if not src.path.endswith("__init__.py"):
        base = base[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _top_level(body: list[ast.stmt]):
    """Statements run at import: the module's body, into ``if``/``try``/``with``, not defs."""
    for st in body:
        yield st
        for name in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(st, name, None)
            if isinstance(inner, list) and not isinstance(st, (*_FUNCTIONS, ast.ClassDef)):
                yield from _top_level([x for x in inner if isinstance(x, ast.AST)])


def _bindings(src: Source, stmt: ast.AST, aliases: dict, strings: dict) -> None:
    if isinstance(stmt, ast.Import):
        for a in stmt.names:
            if a.asname:
                aliases.setdefault(a.asname, a.name)
            else:
                top = a.name.split(".")[0]
                aliases.setdefault(top, top)
    elif isinstance(stmt, ast.ImportFrom):
        base = _absolute(src, stmt)
        for a in stmt.names:
            if a.name != "*":
                aliases.setdefault(a.asname or a.name, f"{base}.{a.name}" if base else a.name)
    elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            v = stmt.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                strings.setdefault(t.id, v.value)
            else:
                q = _local_qualname(v, aliases)
                if q is not None:
                    aliases.setdefault(t.id, q)


def _bind(src: Source) -> None:
    top = list(_top_level(src.tree.body))
    for st in top:
        _bindings(src, st, src.exports, src.constants)
    src.aliases, src.strings = dict(src.exports), dict(src.constants)
    for node in src.nodes:                         # imports and aliases inside functions too
        _bindings(src, node, src.aliases, src.strings)


def _local_qualname(node: ast.AST, aliases: dict) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _local_qualname(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id == "getattr" and len(node.args) >= 2 and \
            isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        base = _local_qualname(node.args[0], aliases)
        return f"{base}.{node.args[1].value}" if base else None
    if isinstance(node, ast.BoolOp):
        return next(filter(None, (_local_qualname(v, aliases) for v in node.values)), None)
    if isinstance(node, ast.IfExp):
        return _local_qualname(node.body, aliases) or \
            _local_qualname(node.orelse, aliases)
    return None


def _outside(path: str, name: str) -> bool:
    """Whether ``path`` is outside module ``spdsl/<name>.py`` (or package ``spdsl/<name>/``)."""
    return path != f"spdsl/{name}.py" and not path.startswith(f"spdsl/{name}/")


# --- the counts ---------------------------------------------------------------------------


def env_reads(project: Project) -> list[Site]:
    sites = []
    for src in project.spdsl():
        if not _outside(src.path, "env"):
            continue
        for node in src.nodes:
            key = None
            if isinstance(node, ast.Call) and node.args:
                q = project.qualname(src, node.func)
                if q in ("os.environ.get", "os.getenv", "os.environ.setdefault"):
                    key = node.args[0]
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                if project.qualname(src, node.value) == "os.environ":
                    key = node.slice
            elif isinstance(node, ast.Compare) and len(node.ops) == 1 and \
                    isinstance(node.ops[0], (ast.In, ast.NotIn)) and \
                    project.qualname(src, node.comparators[0]) == "os.environ":
                key = node.left
            if key is not None and (project.string(src, key) or "").startswith("SPDSL_"):
                sites.append(src.site(node))
    return sites


def is_group_function(q: str | None) -> bool:
    """Whether the dotted name is a torch process-group function (``torch.distributed.
    all_reduce``, ``torch.ops._c10d_functional.all_to_all_single.default``)."""
    if not q:
        return False
    parts = q.split(".")
    if ".".join(parts[:3]) in OP_NAMESPACES and len(parts) >= 4:
        name = parts[3]
    elif ".".join(parts[:-1]) in GROUP_MODULES:
        name = parts[-1]
    else:
        return False
    name = name.strip("_")
    return name in GROUP_EXACT or name.startswith(GROUP_PREFIXES)


def group_calls(project: Project) -> list[Site]:
    return [src.site(node) for src in project.spdsl() if _outside(src.path, "collectives")
            for node in src.nodes
            if isinstance(node, ast.Call) and is_group_function(project.qualname(src, node.func))]


def _self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _targets(node: ast.AST):
    ts = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
    while ts:
        t = ts.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            ts.extend(t.elts)
        else:
            yield t.value if isinstance(t, ast.Starred) else t


def _patch(project: Project, src: Source, node: ast.AST) -> bool:
    """Whether ``node`` is one of ``patched_after``'s patterns."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and \
            getattr(node, "value", None) is not None:
        for t in _targets(node):
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Attribute) and \
                    t.value.attr == "__dict__":
                if not (_self(t.value.value) and id(node) in src.building):
                    return True
            elif isinstance(t, ast.Attribute) and not _self(t.value) and \
                    (_private(t.attr) or t.attr == "__class__"):
                return True
    elif isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "__setattr__" and \
                isinstance(f.value, ast.Name) and f.value.id == "object":
            return id(node) not in src.building
        if isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) == 3 and \
                not _self(node.args[0]):
            return _private(project.string(src, node.args[1], whole=True) or "")
    return False


def _root(node: ast.AST) -> str | None:
    """The name an attribute chain or item starts from (``trainer`` of ``trainer.args.x``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _attachment(src: Source) -> list[ast.AST]:
    """``ATTACH``'s writes to its first parameter and what hangs off it: assignments, and
    ``setattr``/``object.__setattr__`` calls."""
    path, name = ATTACH
    fns = [n for n in src.nodes if isinstance(n, _FUNCTIONS[:2]) and n.name == name and
           n.args.args] if src.path == path else []
    out = []
    for fn in fns:
        given = fn.args.args[0].arg
        for node in _walk(fn.body, skip=_FUNCTIONS):
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                hit = any(isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) == given
                          for t in _targets(node))
            elif isinstance(node, ast.Call) and node.args and (
                    isinstance(node.func, ast.Name) and node.func.id == "setattr" or
                    isinstance(node.func, ast.Attribute) and node.func.attr == "__setattr__"):
                hit = _root(node.args[0]) == given
            else:
                hit = False
            if hit:
                out.append(node)
    return out


def patched_after(project: Project) -> list[Site]:
    sites = []
    for src in project.spdsl():
        attached = {id(n) for n in _attachment(src)}
        sites += [src.site(n) for n in src.nodes
                  if id(n) not in attached and _patch(project, src, n)]
    return sites


def foreign_patches(project: Project) -> list[Site]:
    sites = []
    for src in project.spdsl():
        for node in src.nodes:
            if isinstance(node, ast.Call):
                f = node.func
                q = project.qualname(src, f) or \
                    (f"{src.module}.{f.id}" if isinstance(f, ast.Name) else None)
                if q == SWAP:
                    sites.append(src.site(node))
        sites += [src.site(n) for n in _attachment(src)]
    return sites


def _is_cli(name: str) -> bool:
    return name == "spdsl.cli" or name.startswith("spdsl.cli.")


def cli_imports(project: Project) -> list[Site]:
    sites = []
    for src in project.files.values():
        if src.path == "spdsl/__main__.py" or src.path.startswith("spdsl/cli/"):
            continue
        for node in src.nodes:
            if isinstance(node, ast.Import):
                hit = any(_is_cli(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(src, node)
                hit = _is_cli(base) or any(_is_cli(f"{base}.{a.name}") for a in node.names)
            elif isinstance(node, ast.Call) and node.args and \
                    (project.qualname(src, node.func) or "").endswith("import_module"):
                hit = _is_cli(project.string(src, node.args[0]) or "")
            else:
                hit = False
            if hit:
                sites.append(src.site(node))
    return sites


def search_in_cli(project: Project) -> list[Site]:
    return [src.site(st) for src in project.spdsl() if src.path.startswith("spdsl/cli/")
            for st in _top_level(src.tree.body)
            if isinstance(st, (ast.FunctionDef, ast.ClassDef)) and st.name in SEARCH_ENTRIES]


def long_files(project: Project) -> list[Site]:
    return [Site(src.path, 0, f"{n} lines", key=src.path) for src in project.spdsl()
            if (n := len(src.text.splitlines())) > MAX_LINES]


def untested_core(project: Project) -> list[Site]:
    tests = project.root / "tests"
    sites = []
    for src in project.spdsl():
        parts = src.path[len("spdsl/"):-3].split("/")
        if parts[0] not in CORE or parts[-1] == "__init__":
            continue
        if len(parts) == 1:                        # spdsl/pipeline.py: tests anywhere
            folder, names = tests, [parts[0]]
        else:                                      # spdsl/propagate/rules/views.py
            folder = tests / parts[0]
            names = [parts[-1], "_".join(parts[1:])]
        found = folder.is_dir() and any(
            f.name[:-3] in (f"test_{n}" for n in names) or
            any(f.name.startswith(f"test_{n}_") for n in names)
            for f in folder.rglob("test_*.py"))
        if not found:
            want = " or ".join(f"test_{n}*.py" for n in names)
            where = folder.relative_to(project.root).as_posix()
            sites.append(Site(src.path, 0, f"no {where}/**/{want}", key=src.path))
    return sites


COUNTERS = {f.__name__: f for f in (env_reads, group_calls, patched_after, foreign_patches,
                                     cli_imports, search_in_cli, long_files, untested_core)}
NAMES = tuple(COUNTERS)


def measure(root: Path = ROOT) -> dict[str, list[Site]]:
    """Every count's sites over the tree at ``root``: ``print(*measure()["group_calls"])``."""
    project = Project(root)
    return {name: sorted(COUNTERS[name](project), key=lambda s: (s.path, s.line))
            for name in NAMES}


def counts(sites: dict[str, list[Site]]) -> dict[str, int]:
    """Each count from its sites (``search_in_cli`` is 1 or 0, whatever the number of defs)."""
    return {k: min(len(v), 1) if k == "search_in_cli" else len(v) for k, v in sites.items()}


def record(sites: dict[str, list[Site]]) -> dict:
    return {"counts": counts(sites), "sites": {k: sorted(s.ident for s in v)
                                               for k, v in sites.items()}}


def compare(sites: dict[str, list[Site]], recorded: dict, *, unrecorded: bool = True,
            ) -> tuple[list[str], list[str]]:
    """(rises, falls): a line naming each count above its recorded figure (or, with
    ``unrecorded``, not recorded at all), with the sites the record does not hold, and a line
    naming each count below it."""
    rises, falls = [], []
    now = counts(sites)
    for name in NAMES:
        was = recorded.get("counts", {}).get(name)
        if was is None:
            if unrecorded:
                rises.append(f"{name}: {now[name]}, not recorded in {RECORD.name}")
        elif now[name] > was:
            known = collections.Counter(recorded.get("sites", {}).get(name, []))
            # each site the record holds fewer times than the tree (a line copied: one new)
            new = [s for s in sites[name] if known.subtract([s.ident]) or known[s.ident] < 0]
            rises.append(f"{name} rose from {was} to {now[name]}; new:"
                         + "".join(f"\n    {s}" for s in new))
        elif now[name] < was:
            falls.append(f"{name} went down from {was} to {now[name]}")
    return rises, falls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-v", "--verbose", action="store_true", help="print every counted site")
    ap.add_argument("--json", action="store_true", help="print the counts as JSON")
    ap.add_argument("--check", action="store_true", help=f"fail when a count is above {RECORD}")
    ap.add_argument("--write", action="store_true", help=f"record the counts in {RECORD}")
    ap.add_argument("--accept-rise", action="store_true", help="let --write record a rise")
    ap.add_argument("--root", type=Path, default=ROOT, help="the tree to count (default: this)")
    a = ap.parse_args(argv)
    sites = measure(a.root)
    recorded = json.loads(RECORD.read_text()) if RECORD.exists() else None
    if a.json:
        print(json.dumps(counts(sites), indent=2))
    elif not a.check or a.verbose:
        for name, n in counts(sites).items():
            print(f"{name:<16} {n}")
            if a.verbose:
                print("".join(f"    {s}\n" for s in sites[name]), end="")
    if a.check or a.write:
        rises, falls = compare(sites, recorded or {}, unrecorded=not a.write)
        if a.write and (not rises or a.accept_rise):
            RECORD.write_text(json.dumps(record(sites), indent=1) + "\n")
            print(f"recorded in {RECORD}", file=sys.stderr)
            return 0
        if rises:
            print(*rises, "a count rose: remove the new sites (or, for a rise meant to stay, "
                  "python tools/counts.py --write --accept-rise)", sep="\n", file=sys.stderr)
            return 1
        for line in falls:
            print(f"{line}: run python tools/counts.py --write to record it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
