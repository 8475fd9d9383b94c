"""Secret masking for everything the guard writes: its own lines, the job's output, the report.

What is secret (the contract, "Secrets"): the value of every environment variable whose name contains
``TOKEN``, ``KEY``, ``SECRET`` or ``PASSWORD`` (any case) and that is at least 8 characters long, and any
Hugging Face token (``hf_`` followed by 30 or more letters; real ones have 34, per gitleaks' rule
``huggingface-access-token``). Each value is also masked in its URL-quoted and JSON-escaped forms, its hex and its
base64 (at the three byte offsets it can sit at inside a longer encoded text, standard and URL-safe), as the
GitHub Actions runner does for its secrets (``actions/runner`` ``HostContext.cs``, value encoders). Overlapping
matches are masked as their union.

The job's output arrives in arbitrary chunks, so a secret may be split across two reads. ``Masker.safe_len``
tells how much of an unfinished line can be written now: everything except a tail that could be the start of
a secret, in any of its forms, hex and base64 included (an HTTP debug log's ``Authorization`` header written in two
reads). The output pump holds that tail until the rest of the line arrives; what it holds is only ever a proper
beginning of one of the forms, so a line that ends in, say, a digit that begins a secret's hex waits for its next
read or a newline.

Cost: no table of prefixes is built (it grew with the square of a secret's length: an 8 KB PEM value took
~30 MB). ``mask`` is one substring search per secret form (C speed), skipped when the output lacks the form's
rarest byte (one ``memchr`` pass), and ``safe_len`` looks only at the last ``len(secret) - 1`` bytes, searching
them for each secret's first 8 bytes, then searches the ``2 * len(secret)`` bytes around the cut for a whole
form it would split; memory is the secrets themselves.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping

__all__ = ["MASK", "Masker", "MaskingFilter", "command_line_secrets", "secret_values"]

MASK = b"***"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD", re.IGNORECASE)
MIN_SECRET_LEN = 8
HF_TOKEN = re.compile(rb"hf_[A-Za-z]{30,}")
#: The value of a ``write_token`` query parameter: trackio's dashboard URL carries one (``trackio.show()`` prints
#: ``...?write_token=...``, a key that lets anyone log to the project).
WRITE_TOKEN = re.compile(rb"(?<=write_token=)[^&\s\"'<>#]{8,}")
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
_SECRET_OPTION = re.compile(r"^--?(?:[\w.-]*[-_.])?\w*(?:key|token|secret|password|passwd|pwd)$", re.IGNORECASE)
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


def _base64_forms(raw: bytes) -> set[str]:
    """The value's base64 as it appears inside a longer encoded text, at each of the 3 byte offsets (as in
    ``Authorization: Basic base64(user:secret)``): the characters that depend on the value's bytes alone, in the
    standard and the URL-safe alphabets (the GitHub Actions runner masks these forms of its secrets too)."""
    whole = base64.b64encode(raw).decode()  # the value encoded alone, padding included
    forms: set[str] = {whole, whole.replace("+", "-").replace("/", "_")}
    for shift, first in ((0, 0), (1, 2), (2, 3)):  # the first character that no prefix byte reaches
        text = base64.b64encode(b"\0" * shift + raw).decode().rstrip("=")
        if (shift + len(raw)) % 3:
            text = text[:-1]  # the last character also depends on the byte after the value
        text = text[first:]
        forms |= {text, text.replace("+", "-").replace("/", "_")}
    return forms


def _encoded_forms(value: str) -> set[bytes]:
    """The value as written, URL-quoted and JSON-escaped (also held back at the end of an unfinished line)."""
    import urllib.parse  # here: its imports (ipaddress) are start-up time for a run with no secret

    forms = {value, urllib.parse.quote(value, safe=""), urllib.parse.quote_plus(value), json.dumps(value)[1:-1]}
    return {form.encode() for form in forms if len(form) >= MIN_SECRET_LEN}


def _binary_forms(value: str) -> set[bytes]:
    """The value's hex (both cases) and base64 forms (an HTTP debug log's header), masked and held back at the end
    of an unfinished line like the others."""
    raw = value.encode("utf-8", "surrogateescape")
    forms = {raw.hex(), raw.hex().upper(), *_base64_forms(raw)}
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
        binary: set[bytes] = set()
        for value in values:
            if len(value) >= MIN_SECRET_LEN:
                forms |= _encoded_forms(value)
                binary |= _binary_forms(value)
        self._secrets = sorted(forms | binary, key=len, reverse=True)
        self._held = self._secrets  # every form is held back by safe_len (a split hex or base64 too)
        # Each form behind its rarest byte in log text: output without that byte cannot hold the form, and one
        # ``memchr`` pass costs a twentieth of a substring search (1 MB of log lines: 3 us a form instead of 70).
        self._gated = [(_rare_byte(secret), secret) for secret in self._secrets]
        self._max_len = len(self._held[0]) if self._held else 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Masker:
        """A masker for the secrets of ``environ`` (default: ``os.environ``)."""
        return cls(secret_values(os.environ if environ is None else environ))

    def mask(self, data: bytes) -> bytes:
        """Return ``data`` with every secret and Hugging Face token replaced by ``***``.

        Overlapping secrets (two values sharing characters, a value and its encoded form) are masked as the union
        of their matches: one ``***`` per run of bytes any of them covers, so no part of either stays visible.
        """
        spans: list[tuple[int, int]] = []
        for rare, secret in self._gated:
            if rare not in data:
                continue
            at = data.find(secret)
            while at != -1:
                spans.append((at, at + len(secret)))
                at = data.find(secret, at + 1)
        if b"_" in data and b"hf_" in data:
            spans += [match.span() for match in HF_TOKEN.finditer(data)]
        if b"write_token=" in data:
            spans += [match.span() for match in WRITE_TOKEN.finditer(data)]
        if not spans:
            return data
        spans.sort()
        out, done = [], 0
        start, end = spans[0]
        for begin, stop in spans[1:]:
            if begin <= end:
                end = max(end, stop)
                continue
            out += [data[done:start], MASK]
            done, start, end = end, begin, stop
        out += [data[done:start], MASK, data[end:]]
        return b"".join(out)

    def mask_text(self, text: str) -> str:
        """``mask`` for ``str`` (UTF-8)."""
        return self.mask(text.encode("utf-8", "surrogateescape")).decode("utf-8", "surrogateescape")

    def safe_len(self, data: bytes) -> int:
        """How many leading bytes of an unfinished line can be written now.

        The rest is a tail that could be the beginning of a secret (or of an ``hf_`` token) whose end has not
        arrived yet; the caller keeps it until more data comes.
        """
        keep = 0
        if self._max_len > 1 and data:
            end = data[-(self._max_len - 1):]
            keep = max((_prefix_tail(end, secret) for secret in self._held), default=0)
        tail = _HF_TAIL.search(data[-64:]) if data else None
        if tail is not None:
            keep = max(keep, len(data[-64:]) - tail.start())
        return self._not_inside(data, len(data) - keep)

    def _not_inside(self, data: bytes, cut: int) -> int:
        """``cut`` moved back to the start of any whole form that it would split (a held tail that begins one
        form, say the hex of a value ending in ``7``, may start inside another that is complete before it)."""
        moved = True
        while moved and 0 < cut < len(data):
            moved = False
            for secret in self._secrets:
                window = data[max(0, cut - len(secret) + 1):cut + len(secret) - 1]
                offset = max(0, cut - len(secret) + 1)
                at = window.find(secret)
                while at != -1:
                    if offset + at < cut < offset + at + len(secret):
                        cut, moved = offset + at, True
                        break
                    at = window.find(secret, at + 1)
                if moved:
                    break
        return cut


#: Bytes from the most to the least common in training logs (letters by English frequency, digits, punctuation
#: of numbers and key=value pairs); a byte not listed (an uppercase letter, ``%``, ``+``) is rarer than all of them.
_COMMON = b" etaoinsrhldcumfpgwybvkxjqz0123456789.:=,-_/'\"()[]{}\n"


def _rare_byte(secret: bytes) -> bytes:
    """The byte of ``secret`` least likely to occur in log text (one byte, for a ``memchr`` gate)."""
    rank = {byte: i for i, byte in enumerate(_COMMON)}
    return bytes([max(secret, key=lambda byte: rank.get(byte, len(_COMMON)))])


def _prefix_tail(tail: bytes, secret: bytes) -> int:
    """The length of the longest end of ``tail`` that is a proper beginning of ``secret`` (0 if none).

    Cost: one ``bytes.find`` of the secret's first ``MIN_SECRET_LEN`` bytes over the last ``len(secret) - 1`` bytes,
    plus one comparison per place where those bytes occur, then at most ``MIN_SECRET_LEN - 1`` short comparisons.
    """
    tail = tail[-(len(secret) - 1):]
    head = secret[:MIN_SECRET_LEN]
    at = tail.find(head)
    while at != -1:
        if secret.startswith(tail[at:]):
            return len(tail) - at
        at = tail.find(head, at + 1)
    for at in range(max(0, len(tail) - len(head) + 1), len(tail)):  # ends shorter than the head
        if secret.startswith(tail[at:]):
            return len(tail) - at
    return 0


class MaskingFilter(logging.Filter):
    """A ``logging`` filter for a handler: masks each record's message (arguments merged in first), its exception
    text and its stack text, so that every logger that reaches that handler is masked, not only ``guard``'s.

    Args:
        masker: the secret masker.
    """

    def __init__(self, masker: Masker) -> None:
        super().__init__()
        self.masker = masker
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = self.masker.mask_text(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.masker.mask_text(record.exc_text)
        if record.stack_info:
            record.stack_info = self.masker.mask_text(record.stack_info)
        return True
