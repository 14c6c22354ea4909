"""``plan.to_html``: a self-contained page, checked in a real browser when one is installed."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from spdsl.inspect.html import typed_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or \
    shutil.which("google-chrome")


def test_page_is_self_contained_and_has_the_plan(tiny_plan, tmp_path):
    path = tmp_path / "plan.html"
    page = tiny_plan.to_html(str(path))
    assert path.read_text(encoding="utf-8") == page
    assert "<script" not in page and not re.search(r"(src|href)=['\"]?(https?:|//)", page)
    assert "spdsl sharding plan · tiny Llama" in page
    assert "layers.0-1" in page and "×2 identical" in page
    assert page.count("<i></i>") == 2                     # one square per folded layer
    assert "spdsl/models/llama.py:" in page                     # source locations
    assert 'class="badge ulysses"' in page and "all_to_all · ulysses · 24.0 KiB" in page
    assert "1.00x" in page


def test_typed_shapes_are_coloured_by_placement():
    assert 'class="chip S"' in typed_html("f32[2,64@sp,64]", "Shard(1)")
    assert '<span class="split">64@sp</span>' in typed_html("f32[2,64@sp,64]", "Shard(1)")
    assert 'class="chip R"' in typed_html("f32[64,64]", "Replicate()")
    assert 'class="chip P"' in typed_html("f32[]{sum@sp}", "Partial(sum)")
    assert "&lt;" in typed_html("<odd>")                  # escaped


def screenshot(html_path: Path, png_path: Path, size: str = "1400,1000") -> None:
    """Render ``html_path`` with headless Chromium into ``png_path``."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--no-first-run", f"--user-data-dir={profile}", f"--screenshot={png_path}",
             f"--window-size={size}", html_path.resolve().as_uri()],
            check=True, capture_output=True, timeout=120)


@pytest.mark.skipif(CHROMIUM is None,
                    reason="needs chromium (apt-get install -y chromium) and Pillow "
                           "(in the test extra)")
def test_page_renders_in_a_browser(tiny_plan, tmp_path):
    image = pytest.importorskip("PIL.Image", reason="needs Pillow (pip install -e '.[test]')")
    html_path, png = tmp_path / "plan.html", tmp_path / "plan.png"
    tiny_plan.to_html(str(html_path))
    screenshot(html_path, png)
    img = image.open(png).convert("RGB")
    assert img.size == (1400, 1000)
    colours = {rgb for _, rgb in img.getcolors(maxcolors=1 << 24)}
    assert len(colours) > 200                             # text, chips and tiles, not blank

    def near(rgb, tol=12):
        return any(all(abs(a - b) <= tol for a, b in zip(c, rgb)) for c in colours)

    assert near((124, 58, 237))                           # a purple Ulysses badge
    assert near((219, 234, 254))                          # a blue Shard chip
    assert near((4, 120, 87))                             # the green 1.00x ratio tile
