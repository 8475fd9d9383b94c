"""The in-job agent: sees the job's losses, reports them, and obeys the supervisor.

Design notes (why it looks like this):

- It is loaded into every Python process of the job by ``guard/inside/_site/sitecustomize.py`` before the script runs,
  so it must be cheap and must never break the job: stdlib only at import, every hook wrapped so that a fault
  of the agent is logged to stderr once and ignored.
- It never imports torch or transformers. A post-import hook (``_PostImportFinder``) patches them the moment the
  job imports them: ``Tensor.backward`` for plain loops (``_torch.py``) and ``Trainer.__init__`` for every
  trainer built on ``transformers.Trainer`` (``_transformers.py``).
- It connects to the supervisor only when it has something to say; a forked child (a DataLoader worker)
  stays silent; sends never block (``MSG_DONTWAIT``; a full socket drops the message and counts it).
- It only reports and obeys: it never talks to the Hub and never decides a verdict.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from ... import protocol
from ..settings import AgentSettings, agent_settings

__all__ = ["Agent", "get", "install"]

_AGENT: Agent | None = None
_INSTALLED = False


def _rank_info() -> dict[str, Any]:
    def _int(name: str) -> int | None:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            return None

    return {
        "rank": _int("RANK"),
        "local_rank": _int("LOCAL_RANK"),
        "world_size": _int("WORLD_SIZE"),
        "node_rank": _int("GROUP_RANK") if _int("GROUP_RANK") is not None else _int("NODE_RANK"),
    }


class LossWatch:
    """Turns losses into ``step`` messages: one by one in the sanity pass, then every ``check_every`` steps.

    After the sanity pass a tensor loss is only added to a device-side accumulator (an asynchronous kernel,
    no host-device sync); the accumulator and the last loss are read every ``check_every`` steps. A NaN or an
    infinity in any of the steps in between makes the accumulated sum non-finite, so none is missed.
    """

    def __init__(self, agent: Agent, sanity_steps: int, check_every: int) -> None:
        self.agent = agent
        self.sanity_steps = sanity_steps
        self.check_every = max(1, check_every)
        self.count = 0
        self.step = 0
        self._acc: Any = None
        self._last: Any = None
        self._since = 0
        self._bad_float = False

    def observe(self, loss: Any, step: int | None, source: str) -> None:
        self.count += 1
        self.step = step if step is not None else self.step + 1
        is_float = isinstance(loss, (int, float))
        if self.count <= self.sanity_steps:
            value = float(loss) if is_float else float(loss.detach().float().item())
            self._send(value, math.isfinite(value), 1, source)
            return
        self._since += 1
        if is_float:
            value = float(loss)
            self._last = value
            if not math.isfinite(value):
                self._bad_float = True
        else:
            detached = loss.detach()
            self._last = detached
            self._acc = detached.float() if self._acc is None else self._acc + detached.float()
        if self._since >= self.check_every or self._bad_float:
            self.flush(source)

    def flush(self, source: str) -> None:
        if not self._since:
            return
        if isinstance(self._last, float):
            value, finite = self._last, not self._bad_float
        else:
            value = float(self._last.float().item())
            total = float(self._acc.item()) if self._acc is not None else 0.0
            finite = math.isfinite(value) and math.isfinite(total)
        self._send(value, finite, self._since, source)
        self._acc, self._since, self._bad_float = None, 0, False

    def _send(self, value: float, finite: bool, n: int, source: str) -> None:
        sent = self.agent.send({"t": "step", "step": self.step, "loss": value, "finite": finite, "n": n,
                                "source": source})
        if sent and not finite:
            # The supervisor stops the job on a non-finite loss; wait for it here (bounded) so that the job does
            # not train on past the bad step while the message travels.
            self.agent.wait_stop()


class Agent:
    """The agent of one process. Use ``guard.inside.agent.get()``; None means no supervisor."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.dropped = 0
        self.dead = False
        self.backward_hook = True  # off once a Trainer or guard.report() provides the losses
        self.begun = 0  # steps (or micro-batches) this process has begun: a cheap counter, never sent per step
        self.checkpoint_request: dict[str, Any] | None = None
        self.stop_requested = False
        self.watch = LossWatch(self, settings.sanity_steps, settings.check_every)
        self.watch.step = settings.resume_step  # a resumed plain loop counts on from the checkpoint's step
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._acked = threading.Event()
        self._closed = threading.Event()
        from ._dist import DistRelay

        self.relay = DistRelay(self)

    # -- channel ------------------------------------------------------------------------------------------------

    def _connect(self) -> socket.socket | None:
        if self._sock is not None or self.dead or not self.settings.socket_path:
            return self._sock
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(2.0)
            sock.connect(self.settings.socket_path)
            sock.settimeout(None)
        except OSError as exc:
            self.dead = True
            _warn_once(f"cannot reach the supervisor ({exc}); the job runs unwatched by the agent")
            return None
        self._sock = sock
        threading.Thread(target=self._read_commands, name="guard-agent", daemon=True).start()
        hello = {"t": "hello", "pid": self.pid, "argv": sys.argv[:8], **_rank_info()}
        self._send_raw(sock, hello)
        return sock

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message without blocking; False when it was not sent (no supervisor, full, forked child)."""
        if self.dead or os.getpid() != self.pid:
            return False
        with self._lock:
            sock = self._connect()
            if sock is None:
                return False
            return self._send_raw(sock, message)

    def _send_raw(self, sock: socket.socket, message: dict[str, Any]) -> bool:
        try:
            sock.send(protocol.encode(message), socket.MSG_DONTWAIT)
            return True
        except BlockingIOError:
            self.dropped += 1
        except OSError:
            self.dead = True
        return False

    def _read_commands(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                data = sock.recv(protocol.MAX_MESSAGE_BYTES)
            except OSError:
                data = b""
            if not data:
                self.dead = True
                self._acked.set()
                self._closed.set()
                return
            message = protocol.decode(data)
            if message is None:
                continue
            kind = message["t"]
            if kind == "ack":
                self._acked.set()
            elif kind == "checkpoint":
                self.checkpoint_request = message
                self.relay.handled.add((message.get("at_step"), message.get("stop")))
                self.relay.publish(message)
            elif kind == "stop":
                self.stop_requested = True
            elif kind == "dump":
                _dump_threads()
                # How far this rank got: a rank blocked outside a collective has begun fewer steps than the
                # ranks waiting for it inside one.
                self.send({"t": "progress", "begun": self.begun, "step": self.watch.step})

    def warn(self, text: str) -> None:
        """One ``[guard] agent:`` line on stderr, once per text."""
        _warn_once(text)

    def wait_stop(self, timeout_s: float = 10.0) -> None:
        """After a non-finite loss: wait (bounded) for the supervisor's SIGTERM, so that the job does not train on.

        Returns early only when the supervisor is gone (the channel closed).
        """
        if not self.dead:
            self._closed.wait(timeout_s)

    def wait_ack(self) -> None:
        """Wait (bounded) for the supervisor's go-ahead after ``trainer_config``."""
        if not self.dead:
            self._acked.wait(self.settings.ack_timeout_s)

    # -- what the hooks and the public API call -------------------------------------------------------------

    def on_loss(self, loss: Any, step: int | None, source: str) -> None:
        self.watch.observe(loss, step, source)

    def checkpoint_due(self) -> bool:
        self.relay.poll(self.watch.count, self.settings.check_every)
        request = self.checkpoint_request
        if request is None:
            return False
        at_step = request.get("at_step")
        return at_step is None or self.watch.step >= int(at_step)

    def checkpoint_done(self, path: str, step: int | None, *, save_s: float | None = None, zero: bool = True) -> None:
        request, self.checkpoint_request = self.checkpoint_request, None
        if request is not None and request.get("stop"):
            self.stop_requested = True
        self.watch.flush("report")
        self.send({"t": "checkpoint_saved", "path": os.path.abspath(path), "step": step, "save_s": save_s,
                   "requested": request is not None, "zero": zero})


def _dump_threads() -> None:
    """Write the stacks of every thread of this process to stderr (asked for when the job looks hung)."""
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    lines = [f"[guard] agent: stacks of pid {os.getpid()} (rank {os.environ.get('RANK', '-')}):\n"]
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "guard-agent":
            continue
        lines.append(f"  thread {names.get(ident, ident)}:\n")
        lines.extend("    " + entry for entry in "".join(traceback.format_stack(frame)).splitlines(True))
    try:
        os.write(2, "".join(lines).encode("utf-8", "replace"))
    except OSError:
        pass


_warned: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _warned:
        _warned.add(text)
        try:
            sys.stderr.write(f"[guard] agent: {text}\n")
        except (OSError, ValueError):
            pass


FLUSH_EVERY_S = 0.1


def _start_stdout_flusher() -> None:
    """Keep the job's stdout block-buffered (fast) yet timely: flush it every 0.1 s from a daemon thread.

    The supervisor does not set ``PYTHONUNBUFFERED``: unbuffered, every ``print`` is a system call of its own
    (1M lines: 0.6 s -> 3 s). stderr is line-buffered by Python already (3.9+). A job that asked for unbuffered
    output itself keeps it.
    """
    stream = sys.stdout
    if stream is None or os.environ.get("PYTHONUNBUFFERED"):
        return

    def flush_forever() -> None:
        import time

        while True:
            time.sleep(FLUSH_EVERY_S)
            try:
                current = sys.stdout
                if current is not None:
                    current.flush()
            except (OSError, ValueError):  # closed, or a broken pipe: nothing to do
                pass

    threading.Thread(target=flush_forever, name="guard-flush", daemon=True).start()


def _flush_at_exit() -> None:
    """Report the steps checked since the last flush (a NaN in the last steps before a normal exit counts)."""
    agent = _AGENT
    if agent is not None and agent.pid == os.getpid():
        try:
            agent.watch.flush("exit")
        except Exception as exc:  # the job is ending: never raise
            _warn_once(f"last loss check failed: {exc!r}")


def get() -> Agent | None:
    """The agent of this process, or None when the job runs without a supervisor (every call is a no-op)."""
    global _AGENT
    if _AGENT is not None and _AGENT.pid != os.getpid():
        return None  # a forked child (DataLoader worker): silent
    if _AGENT is None:
        settings = agent_settings()
        if not settings.socket_path:
            return None
        _AGENT = Agent(settings)
    return _AGENT


# -- post-import hooks ----------------------------------------------------------------------------------------


class _HookedLoader:
    """Wraps a module's loader: runs ``hook(module)`` right after the module executed."""

    def __init__(self, loader: Any, hook: Callable[[Any], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        try:
            self._hook(module)
        except Exception as exc:  # a fault of the agent must never break the job
            _warn_once(f"hook for {module.__name__} failed: {exc!r}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportFinder:
    """A meta path finder (duck-typed, to keep ``importlib.abc`` out of every job's start-up) that wraps the
    loaders of the hooked modules."""

    def __init__(self, hooks: dict[str, Callable[[Any], None]]) -> None:
        self.hooks = hooks
        self._busy: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        hook = self.hooks.get(fullname)
        if hook is None or fullname in self._busy:
            return None
        import importlib.util

        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, hook)
        return spec


def install() -> None:
    """Install the post-import hooks (called by the agent's ``sitecustomize``; idempotent, never raises)."""
    global _INSTALLED
    if _INSTALLED or not agent_settings().socket_path:
        return
    _INSTALLED = True
    from . import _torch, _transformers

    hooks = {"torch": _torch.patch, "transformers.trainer": _transformers.patch}
    for name, hook in list(hooks.items()):
        if name in sys.modules:  # already imported (rare: the agent was installed late)
            try:
                hook(sys.modules[name])
            except Exception as exc:
                _warn_once(f"hook for {name} failed: {exc!r}")
            del hooks[name]
    sys.meta_path.insert(0, _PostImportFinder(hooks))
    previous = sys.excepthook

    def excepthook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        agent = get()
        if agent is not None and not issubclass(exc_type, (SystemExit,)):
            agent.watch.flush("report")
            agent.send({"t": "exception", "exc_type": exc_type.__name__, "message": str(exc)[:500]})
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    import atexit

    atexit.register(_flush_at_exit)
    _start_stdout_flusher()
    agent = get()
    if agent is not None:  # connect now: the supervisor learns the agent is alive and can ask it for stacks
        with agent._lock:
            agent._connect()
