"""Small helpers shared by the preflight checks: bounded calls, formatting, Hugging Face environment facts.

Standard library only: nothing here imports ``huggingface_hub``, ``torch`` or ``pynvml``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("guard.preflight")

T = TypeVar("T")

#: Values ``huggingface_hub`` reads as true (``huggingface_hub.constants.ENV_VARS_TRUE_VALUES``, upper-cased).
TRUE_VALUES = frozenset({"1", "ON", "YES", "TRUE"})


class NoAnswer(TimeoutError):
    """A bounded call did not return within its time limit (the call keeps running in a daemon thread).

    Args:
        timeout_s: the limit that ran out, in seconds.
    """

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"no answer in {timeout_s:g} s")
        self.timeout_s = timeout_s


def call_bounded(fn: Callable[..., T], timeout_s: float, *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` in a daemon thread and wait at most ``timeout_s`` seconds for it.

    ``huggingface_hub`` 2.4.0 shares one HTTP client created with ``timeout=None`` (``utils/_http.py``
    ``default_client_factory``), and ``whoami``/``auth_check`` take no timeout, so a server that accepts the
    connection and never answers would hang the caller forever. Changing the global client factory would also
    change the timeouts of the guard's later checkpoint uploads, so each call runs in its own daemon thread
    instead: the caller stops waiting at the limit, and a call that never returns cannot keep the process alive.

    Args:
        fn: the callable.
        timeout_s: how long to wait, in seconds (> 0).
        *args: positional arguments for ``fn``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        What ``fn`` returned.

    Raises:
        NoAnswer: ``fn`` did not return within ``timeout_s``.
        BaseException: whatever ``fn`` raised, re-raised in the caller's thread.
    """
    value: list[T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def target() -> None:
        try:
            value.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            error.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=target, name="guard-preflight-call", daemon=True)
    thread.start()
    if not done.wait(max(timeout_s, 0.001)):
        log.debug("call %s gave no answer in %.1f s", getattr(fn, "__name__", fn), timeout_s)
        raise NoAnswer(timeout_s)
    if error:
        raise error[0]
    return value[0]


def is_true(value: str | None) -> bool:
    """Whether an environment value reads as true the way ``huggingface_hub`` reads it (1/ON/YES/TRUE)."""
    return value is not None and value.strip().upper() in TRUE_VALUES


def hf_offline(environ: Mapping[str, str]) -> str | None:
    """The variable that puts the Hub client offline, as ``NAME=VALUE`` text, or None when online.

    Source: ``huggingface_hub.constants.HF_HUB_OFFLINE`` reads ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``.
    """
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if is_true(environ.get(name)):
            return f"{name}={environ[name].strip()}"
    return None


def hf_home(environ: Mapping[str, str]) -> Path:
    """``HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else ``~/.cache/huggingface``.

    Source: ``huggingface_hub.constants.HF_HOME``.
    """
    home = environ.get("HF_HOME")
    if home:
        return Path(os.path.expandvars(home)).expanduser()
    xdg = environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg).expanduser() / "huggingface"


def hf_hub_cache(environ: Mapping[str, str]) -> Path:
    """The Hub download cache: ``HF_HUB_CACHE``, else ``HUGGINGFACE_HUB_CACHE``, else ``HF_HOME/hub``."""
    cache = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(os.path.expandvars(cache)).expanduser()
    return hf_home(environ) / "hub"


def hf_token(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """Find the Hugging Face token the way ``huggingface_hub.utils.get_token`` does, without importing it.

    Order (``huggingface_hub/utils/_auth.py``): ``HF_TOKEN``, ``HUGGING_FACE_HUB_TOKEN``, then the token file
    (``HF_TOKEN_PATH``, default ``HF_HOME/token``).

    Returns:
        ``(token, where)``: the token or None, and where it came from (a variable name or the file path), for
        messages. The token itself must never be printed.
    """
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = (environ.get(name) or "").strip()
        if value:
            return value, name
    path_text = environ.get("HF_TOKEN_PATH")
    path = Path(os.path.expandvars(path_text)).expanduser() if path_text else hf_home(environ) / "token"
    try:
        value = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None, "HF_TOKEN"
    return (value or None), str(path)


def fmt_bytes(size_bytes: float) -> str:
    """``12_300_000_000`` -> ``"12.3 GB"`` (powers of 1000, as ``guard.core.durations.parse_size`` reads ``GB``)."""
    value = float(size_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} PB"  # pragma: no cover - the loop always returns


def one_line(text: object, limit: int = 300) -> str:
    """A message squeezed onto one line and cut to ``limit`` characters."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
