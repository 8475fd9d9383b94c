"""Secret masking for everything the guard writes: its own lines, the job's output, the report.

What is secret (the contract, "Secrets"): the value of every environment variable whose name contains
``TOKEN``, ``KEY``, ``SECRET`` or ``PASSWORD`` (any case) and that is at least 8 characters long, and any
Hugging Face token (``hf_`` followed by 30 or more letters; real ones have 34, per gitleaks' rule
``huggingface-access-token``). Each value is also masked in its URL-quoted and JSON-escaped forms, as the
GitHub Actions runner does for its secrets (``actions/runner`` ``HostContext.cs``, value encoders).

The job's output arrives in arbitrary chunks, so a secret may be split across two reads. ``Masker.safe_len``
tells how much of an unfinished line can be written now: everything except a tail that could be the start of
a secret. The output pump holds that tail until the rest of the line arrives.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Mapping

__all__ = ["MASK", "Masker", "command_line_secrets", "secret_values"]

MASK = b"***"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
MIN_SECRET_LEN = 8
HF_TOKEN = re.compile(rb"hf_[A-Za-z]{30,}")
_HF_TAIL = re.compile(rb"h(?:f(?:_[A-Za-z]*)?)?$")


def secret_values(environ: Mapping[str, str]) -> list[str]:
    """The secret values in an environment (names matching TOKEN/KEY/SECRET/PASSWORD, values >= 8 chars)."""
    found = {
        value
        for name, value in environ.items()
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET_LEN and not value.isspace()
    }
    return sorted(found)


# An option name whose last word names a secret: `--wandb-key`, `--hf_token`, `--api-key`, `--apikey`,
# `--db-password`, `--client_secret`. Words only *containing* one do not count (`--tokenizer_name`, `--max_tokens`,
# `--keyword`), nor a tokenizer's special tokens (`--pad_token`, `--eos_token`: text, not credentials).
_SECRET_OPTION = re.compile(r"^--?(?:[\w.]*[-_.])?\w*(?:key|token|secret|password|passwd|pwd)$", re.IGNORECASE)
_SPECIAL_TOKEN = re.compile(r"(?:^|[-_.])(?:pad|eos|bos|unk|sep|cls|mask|special|chat)[-_.]?token$", re.IGNORECASE)


def command_line_secrets(argv: Iterable[str]) -> list[str]:
    """The values that follow secret-named options on a command line (contract, "Secrets").

    ``--wandb-key VALUE`` and ``--hf_token=VALUE`` give ``VALUE``; a following token that is itself an option
    (starts with ``-``) is not taken. Values under 8 characters are left to ``Masker`` (it ignores them).

    Example:
        >>> command_line_secrets(["train.py", "--wandb-key", "abcd1234efgh", "--hf_token=hf_x", "--lr", "3"])
        ['abcd1234efgh', 'hf_x']
    """
    args = list(argv)
    found: list[str] = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if not _SECRET_OPTION.match(name) or _SPECIAL_TOKEN.search(name):
            continue
        if eq:
            found.append(value)
        elif i + 1 < len(args) and not args[i + 1].startswith("-"):
            found.append(args[i + 1])
    return [value for value in found if value and not value.isspace()]


def _encoded_forms(value: str) -> set[bytes]:
    forms = {value, urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value), json.dumps(value)[1:-1]}
    return {form.encode() for form in forms if len(form) >= MIN_SECRET_LEN}


class Masker:
    """Replaces secrets with ``***`` in bytes.

    Args:
        values: secret strings (each also masked URL-quoted and JSON-escaped). Values under 8 characters are
            ignored (masking them would mangle ordinary output).

    Example:
        >>> m = Masker(["s3cr3t-value"])
        >>> m.mask(b"token=s3cr3t-value")
        b'token=***'
    """

    def __init__(self, values: Iterable[str] = ()) -> None:
        forms: set[bytes] = set()
        for value in values:
            if len(value) >= MIN_SECRET_LEN:
                forms |= _encoded_forms(value)
        # Longest first, so that a value containing another is masked whole.
        self._secrets = sorted(forms, key=len, reverse=True)
        self._prefixes: dict[int, set[bytes]] = {}
        for secret in self._secrets:
            for n in range(1, len(secret)):
                self._prefixes.setdefault(n, set()).add(secret[:n])
        self._max_prefix = max(self._prefixes, default=0)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Masker:
        """A masker for the secrets of ``environ`` (default: ``os.environ``)."""
        return cls(secret_values(os.environ if environ is None else environ))

    def mask(self, data: bytes) -> bytes:
        """Return ``data`` with every secret and Hugging Face token replaced by ``***``."""
        for secret in self._secrets:
            if secret in data:
                data = data.replace(secret, MASK)
        if b"hf_" in data:
            data = HF_TOKEN.sub(MASK, data)
        return data

    def mask_text(self, text: str) -> str:
        """``mask`` for ``str`` (UTF-8)."""
        return self.mask(text.encode("utf-8", "surrogateescape")).decode("utf-8", "surrogateescape")

    def safe_len(self, data: bytes) -> int:
        """How many leading bytes of an unfinished line can be written now.

        The rest is a tail that could be the beginning of a secret (or of an ``hf_`` token) whose end has not
        arrived yet; the caller keeps it until more data comes.
        """
        keep = 0
        for n in range(min(self._max_prefix, len(data)), 0, -1):
            if data[-n:] in self._prefixes[n]:
                keep = n
                break
        tail = _HF_TAIL.search(data[-64:]) if data else None
        if tail is not None:
            keep = max(keep, len(data[-64:]) - tail.start())
        return len(data) - keep
