"""``spdsl.__version__`` is pyproject's version, ``--version`` prints it, and the licence is
Apache-2.0's full text."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import spdsl
from spdsl.cli.plan import main

ROOT = Path(__file__).resolve().parents[1]
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"      # apache.org/licenses/LICENSE-2.0.txt


def test_version_is_pyprojects(capsys):
    pyproject = (ROOT / "pyproject.toml").read_text()
    want = re.search(r'^version = "([^"]+)"', pyproject, re.MULTILINE).group(1)
    assert spdsl.__version__ == want and "__version__" in spdsl.__all__
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"spdsl {want}"


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_MD5
    assert b"Apache License\n                           Version 2.0, January 2004" in text
