"""What the agent's modules share: the agent of this process (``get()``), ``root_cause``, the one-time warning, the
stdout flusher with its fork handlers, and what ``multiprocessing`` started this process as. The hooks (``_torch``,
``_transformers``, ``_dist``) import this module, never the package's ``__init__`` (which defines ``Agent``, binds
it here and installs them): no circle inside the agent. Stdlib only."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

from ..settings import AgentSettings, agent_settings

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["bind", "get", "multiprocessing_role", "root_cause"]

_AGENT: Any = None  # the process's ``guard.inside.agent.Agent``, made by ``get()``
_make: Callable[[AgentSettings], Any] | None = None


def bind(make: Callable[[AgentSettings], Any]) -> None:
    """Set what ``get()`` makes the agent with (``guard.inside.agent.Agent``, bound when the package loads)."""
    global _make
    _make = make


def root_cause(exc: BaseException) -> str:
    """``"Type: message"`` of the error at the root of ``exc``: the innermost of its chain (``__cause__``, else
    ``__context__``), and inside a DataLoader worker's re-raised error (``Caught X in DataLoader worker process N``
    with the worker's ``Original Traceback``, ``torch.utils.data._utils.ExceptionWrapper``) the worker's own last line.
    """
    seen: set[int] = set()
    inner = exc
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = inner.__cause__ or (None if inner.__suppress_context__ else inner.__context__)
        if nxt is None:
            break
        inner = nxt
    text = str(inner)
    if "Original Traceback (most recent call last):" in text:
        lines = [line for line in text.splitlines() if line.strip()]
        if lines and not lines[-1].startswith(" "):
            return lines[-1].strip()[:500]
    return f"{type(inner).__name__}: {text}"[:500]


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        try:
            sys.stderr.write(f"[guard] agent: {text}\n")
        except (OSError, ValueError):
            pass


FLUSH_EVERY_S = 0.1
#: The job's stdout text layer's chunk (``TextIOWrapper._CHUNK_SIZE``): what it writes to the guard's pipe at once.
STDOUT_CHUNK_BYTES = 1 << 16


#: Called every ``FLUSH_EVERY_S`` on the flusher's thread, after the flush and outside its lock; each must return at
#: once and never raise (the agent's step count for the VERDICT's ``step=``).
TICKS: list[Callable[[], None]] = []


def _start_stdout_flusher() -> None:
    """Keep the job's stdout block-buffered (fast) yet timely: flush it every 0.1 s from a daemon thread, which also
    runs ``TICKS``.

    The supervisor does not set ``PYTHONUNBUFFERED``: unbuffered, every ``print`` is a system call of its own
    (1M lines: 0.6 s -> 3 s). stderr is line-buffered by Python already (3.9+). A job that asked for unbuffered
    output itself keeps it (the thread then only runs ``TICKS``).
    """
    stream = sys.stdout
    flushing = stream is not None and not os.environ.get("PYTHONUNBUFFERED")
    if flushing:
        try:  # the text layer hands 64 KiB at a time to the pipe (Python's default 8 KiB: 8x the writes and wake-ups)
            chunk = getattr(stream, "_CHUNK_SIZE", None)
            if isinstance(chunk, int):
                setattr(stream, "_CHUNK_SIZE", max(chunk, STDOUT_CHUNK_BYTES))  # noqa: B010 - a private attribute
        except (AttributeError, TypeError, ValueError):
            pass

    def flush_forever() -> None:
        import time

        while True:
            time.sleep(FLUSH_EVERY_S)
            if flushing:
                with _FLUSHING:  # a fork waits for this flush to end (see _before_fork)
                    try:
                        current = sys.stdout
                        if current is not None:
                            current.flush()
                    except (OSError, ValueError):  # closed, or a broken pipe: nothing to do
                        pass
            for tick in TICKS:
                try:
                    tick()
                except Exception:
                    pass

    _register_fork_handlers()
    threading.Thread(target=flush_forever, name="guard-flush", daemon=True).start()


#: Held by the flusher thread while it flushes stdout, and by a fork in progress (``os.register_at_fork``).
_FLUSHING = threading.Lock()
_fork_state = {"registered": False, "held": False}
#: How long a fork waits for the flusher's write to end (seconds); a stdout nobody reads could hold it forever.
FORK_WAIT_S = 10.0


def _before_fork() -> None:
    """Before ``fork()``: wait for the flusher's flush to end, and keep it from starting another. The flush holds
    stdout's ``BufferedWriter`` lock; a child forked meanwhile would inherit it held by a thread it does not have,
    and its first ``print`` would wait forever (the bpo-6721 class: a DataLoader worker with the fork start
    method)."""
    _fork_state["held"] = _FLUSHING.acquire(timeout=FORK_WAIT_S)


def _after_fork() -> None:
    if _fork_state["held"]:
        _fork_state["held"] = False
        _FLUSHING.release()


def _register_fork_handlers() -> None:
    if _fork_state["registered"] or not hasattr(os, "register_at_fork"):
        return
    _fork_state["registered"] = True
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


def multiprocessing_role(orig_argv: list[str] | None = None) -> str | None:
    """What ``multiprocessing`` started this process as, from its command line (``sys.orig_argv``): ``"spawn"`` (a
    spawn child: a DataLoader worker, or a ``torch.multiprocessing.spawn`` rank), ``"helper"`` (the forkserver, the
    resource tracker: never a training rank), or None (started otherwise: a script, torchrun's ranks).

    Facts (CPython ``Lib/multiprocessing``): a spawn child runs ``python -c 'from multiprocessing.spawn import
    spawn_main; spawn_main(...)' --multiprocessing-fork``; the forkserver ``-c 'from multiprocessing.forkserver
    import main; main(...)'``; the resource tracker ``-c 'from multiprocessing.resource_tracker import main;...'``.
    """
    argv = list(getattr(sys, "orig_argv", []) if orig_argv is None else orig_argv)
    if "-c" not in argv:
        return None
    command = argv[argv.index("-c") + 1] if argv.index("-c") + 1 < len(argv) else ""
    if "multiprocessing.spawn" in command or "--multiprocessing-fork" in argv:
        return "spawn"
    if "from multiprocessing." in command:
        return "helper"
    return None


def _flush_at_exit() -> None:
    """Report the steps checked since the last flush (a NaN in the last steps before a normal exit counts)."""
    agent = _AGENT
    if agent is not None and agent.pid == os.getpid():
        try:
            agent.watch.flush("exit")
        except Exception as exc:  # the job is ending: never raise
            _warn_once(f"last loss check failed: {exc!r}")


def get() -> Any:
    """The agent of this process (a ``guard.inside.agent.Agent``), or None when the job runs without a supervisor
    (every call is a no-op) or in a forked child."""
    global _AGENT
    if _AGENT is not None and _AGENT.pid != os.getpid():
        return None  # a forked child (DataLoader worker): silent
    if _AGENT is None:
        settings = agent_settings()
        if not settings.socket_path or _make is None:
            return None
        _AGENT = _make(settings)
        _AGENT.dormant = multiprocessing_role() == "spawn"
    return _AGENT
