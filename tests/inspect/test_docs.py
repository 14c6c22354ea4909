"""The docs stay true: docs/plan.md's register_rule example runs and its error sample is real;
every command output a page of docs/ quotes is the output the command wrote into a results
file under the current code (bench/results/, examples/results/), or says it is a cited
measurement (a revision and a date), an error or message spdsl raises, or a diagram."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import spdsl
from spdsl.models.llama import Llama, LlamaConfig
from spdsl.propagate.rules import RULES

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"


def _blocks(lang: str) -> list[str]:
    """Fenced code blocks whose opening fence names ``lang`` ("" for none)."""
    out: list[str] = []
    inside, keep, buf = False, False, []
    for line in DOC.read_text().splitlines(keepends=True):
        if line.startswith("```"):
            if inside and keep:
                out.append("".join(buf))
            if not inside:
                keep, buf = line.strip() == f"```{lang}", []
            inside = not inside
        elif inside:
            buf.append(line)
    return out


def test_register_rule_example_runs():
    (code,) = [b for b in _blocks("python") if "register_rule(" in b]
    try:
        exec(compile(code, str(DOC), "exec"), {"__name__": "docs_plan"})  # noqa: S102
    finally:
        RULES.pop(torch.ops.mylib.reverse_last, None)


def test_error_sample_is_what_spdsl_prints(monkeypatch):
    monkeypatch.chdir(DOC.parents[1])
    (sample,) = [b for b in _blocks("") if b.startswith("[divisible heads]")]
    ids = torch.zeros(1, 64, dtype=torch.long)
    with pytest.raises(spdsl.ShardingError) as e:
        spdsl.plan(spdsl.sp_shard(seq=8, attention="ulysses")(Llama(LlamaConfig.tiny())), ids,
                   ids.clone())
    assert str(e.value) == sample.strip()


ROOT = DOC.parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
RESULTS = r"\]\(((?:\.\./)?(?:bench|examples)/results/[\w./-]+\.(?:txt|json))\)"
ELIDED = "..."                     # a quoted line that stands for lines left out
COMMANDS = ("python ", "torchrun ", "SPDSL_")
# blocks that draw, not quote: (page, first line)
DIAGRAMS = {("models.md", "user fn + specs"),
            ("pipeline.md", ("sp_shard(model)             annotate/api.py       "
                             "ShardOptions (options.py), a Sharded"))}


def _plain_blocks(page: Path) -> list[tuple[str, list[str], int]]:
    """``(paragraph before, lines, line number)`` of each fenced block without a language."""
    out, lines = [], page.read_text().splitlines()
    inside, lang, start = False, "", 0
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if inside and not lang:
                before = "\n".join(lines[:start]).rstrip().split("\n\n")[-1]
                out.append((before, lines[start + 1:i], start + 1))
            inside, lang, start = not inside, line[3:].strip(), i
    return out


def _quoted(line: str, have: set[str]) -> bool:
    """``line`` is a line of the file; ``...`` inside it stands for any text."""
    line = line.rstrip()
    if ELIDED not in line or line in have:
        return line in have
    pattern = re.compile(".*?".join(re.escape(p) for p in line.split(ELIDED)) + "$")
    return any(pattern.match(h) for h in have)


def _rules() -> set[str]:
    source = "\n".join(p.read_text() for p in (ROOT / "spdsl").rglob("*.py"))
    return set(re.findall(r'rule="([a-z][a-z -]+)"', source))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_quoted_outputs_are_what_their_commands_wrote(page):
    rules = _rules()
    for before, block, at in _plain_blocks(page):
        where = f"{page.name}:{at}"
        files = re.findall(RESULTS, before)
        first = block[0].strip() if block else ""
        if files:
            quoted = [ln for ln in block if ln.strip() not in ("", ELIDED)
                      and not ln.startswith(">>>")]
            assert quoted, f"{where}: an empty quote"
            held = []
            for f in files:
                path = (page.parent / f).resolve()
                assert path.is_file(), f"{where}: {f} does not exist"
                have = {ln.rstrip() for ln in path.read_text().splitlines()}
                held.append([ln for ln in quoted if not _quoted(ln, have)])
            assert min(held, key=len) == [], (
                f"{where} quotes lines that none of {files} holds (rerun the command, commit "
                f"its output, quote it): {min(held, key=len)}")
        elif first.startswith(COMMANDS):
            continue
        elif re.match(r"(spdsl\.errors\.ShardingError: )?\[([a-z -]+)\]", first):
            rule = re.match(r"(?:spdsl\.errors\.ShardingError: )?\[([a-z -]+)\]", first)[1]
            assert rule in rules, f"{where}: spdsl raises no [{rule}]"
        elif "cited" in before:
            assert re.search(r"\b[0-9a-f]{7}\b", before) and re.search(r"20\d\d-\d\d-\d\d",
                                                                        before), (
                f"{where}: a cited output names its revision and date")
        else:
            assert (page.name, first) in DIAGRAMS, (
                f"{where}: a quoted output with no results file linked in the paragraph before "
                f"it (nor marked cited with its revision and date): {first[:80]!r}")


def test_the_repeated_error_sample_is_the_tested_one():
    """docs/models.md repeats docs/plan.md's sample (which a test above runs)."""
    (plan,) = [b for _, b, _ in _plain_blocks(DOC) if b[0].startswith("[divisible heads]")]
    (models,) = [b for _, b, _ in _plain_blocks(ROOT / "docs" / "models.md")
                 if b[0].startswith("[divisible heads]")]
    assert plan == models
