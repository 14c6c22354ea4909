"""README.md stays true and short: the demo output it quotes is the committed output, its links
resolve, its test command is the one CI runs, the errors it lists exist. Nothing here runs a
model; rerun the demo and overwrite its examples/results file when the output changes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 250
# the pages that received the README's moved sections: their links are checked too
MOVED = ("docs/benchmarks.md", "docs/models.md", "docs/training.md")
ELIDED = "..."          # a quoted block's line that stands for lines left out


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(text before the block, block)`` for every fenced code block of a Markdown page."""
    out, inside, start, buf, before = [], False, 0, [], []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if inside:
                out.append(("\n".join(before), "\n".join(buf)))
            else:
                before, buf = lines[start:i], []
            inside = not inside
            start = i + 1
        elif inside:
            buf.append(line)
    return out


def quoted_outputs(text: str) -> list[tuple[Path, list[str], str]]:
    """``(results file, quoted lines, prose before)`` for each fenced block whose preceding
    paragraph links an ``examples/results/*.txt`` file: the block quotes that file."""
    out = []
    for before, block in fenced_blocks(text):
        paragraph = before.rstrip().split("\n\n")[-1]
        files = re.findall(r"\]\((examples/results/[\w.-]+\.txt)\)", paragraph)
        if files:
            lines = [ln for ln in block.splitlines() if ln.strip() and ln.strip() != ELIDED]
            out.append((ROOT / files[-1], lines, paragraph))
    return out


def relative_links(text: str) -> list[str]:
    """Link targets that are paths in the repository (not URLs, not in-page anchors)."""
    targets = re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:|#", t)]


def test_readme_quotes_the_committed_demo_output():
    quotes = quoted_outputs(README.read_text())
    files = {f.name for f, _, _ in quotes}
    assert "train_llama_sp.txt" in files, f"the README quotes no demo output ({files})"
    for path, lines, paragraph in quotes:
        assert path.is_file(), f"{path.relative_to(ROOT)} does not exist"
        have = {ln.rstrip() for ln in path.read_text().splitlines()}
        assert lines, f"an empty quote of {path.name}"
        missing = [ln for ln in lines if ln.rstrip() not in have]
        assert not missing, (f"README quotes lines that {path.relative_to(ROOT)} does not hold "
                             f"(rerun the command and commit its output): {missing}")
        header = path.read_text().splitlines()[0]
        for wall in re.findall(r"wall [\d.]+ ?\w+", paragraph):
            assert wall in header, f"README says {wall!r}; {path.name}: {header!r}"


def test_readme_demo_figures_come_from_its_output():
    """Every figure in the quoted demo lines (accuracies, errors, drifts) is in the file."""
    (path, lines, _), = [q for q in quoted_outputs(README.read_text())
                         if q[0].name == "train_llama_sp.txt"]
    text = path.read_text()
    figures = [f for ln in lines for f in re.findall(r"\d[\d,.]*(?:e[+-]\d+)?%?", ln)]
    assert any(f.endswith("%") for f in figures), "no accuracy quoted"
    assert all(f in text for f in figures)


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n < MAX_LINES, f"README.md has {n} lines; move detail to docs/ (under {MAX_LINES})"


@pytest.mark.parametrize("page", ["README.md", *MOVED])
def test_relative_links_resolve(page):
    path = ROOT / page
    links = relative_links(path.read_text())
    assert links or page != "README.md"
    broken = [t for t in links if t and not (path.parent / t).exists()]
    assert not broken, f"{page} links to missing files: {broken}"


def test_readme_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    (ci_cmd,) = [ln.strip() for ln in ci.splitlines()
                 if "python -m pytest -q" in ln and not ln.lstrip().startswith("#")
                 and "tests/" not in ln]
    readme = README.read_text()
    (block,) = [b for _, b in fenced_blocks(readme) if "# 2. the tests" in b]
    lines = block.splitlines()
    readme_cmd = lines[lines.index("# 2. the tests") + 1].strip()
    assert readme_cmd == ci_cmd, f"README: {readme_cmd!r}; .ci/run: {ci_cmd!r}"
    assert readme_cmd.endswith("python -m pytest -q")


def test_troubleshooting_names_real_rules():
    """Each ``[rule]`` the troubleshooting table names is a rule spdsl raises."""
    text = README.read_text()
    section = text.split("## Troubleshooting", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`\[([a-z][a-z -]+)\]`", section)
    assert len(named) >= 5, named
    source = "\n".join(p.read_text() for p in (ROOT / "spdsl").rglob("*.py"))
    unknown = [r for r in named if f'rule="{r}"' not in source]
    assert not unknown, f"README lists errors spdsl does not raise: {unknown}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", *MOVED])
def test_anchors_resolve(page):
    path = ROOT / page
    for target in re.findall(r"\[[^\]]*\]\(([^)\s:]+\.md#[\w-]+)\)", path.read_text()):
        file, anchor = target.split("#")
        heads = re.findall(r"^#+ (.+)$", (path.parent / file).read_text(), flags=re.M)
        assert anchor in {_slug(h) for h in heads}, f"{page}: no heading for {target}"
