"""The version of spdsl, pyproject.toml's (``tests/test_version.py`` checks)."""

__version__ = "0.1.0"
