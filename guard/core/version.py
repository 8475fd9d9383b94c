"""The version of jobguard (pyproject.toml's ``version``; the same text)."""

__version__ = "0.1.0"
