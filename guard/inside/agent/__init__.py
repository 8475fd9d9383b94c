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

Modules: this ``__init__`` (the agent of one process: the channel, the loss watch; the hooks' installation),
``_core`` (what the hooks share: ``get()``, ``root_cause``, the stdout flusher), and the hooks ``_torch``,
``_transformers`` and ``_dist``, which import ``_core``, never this package's ``__init__``: no circle; ``_losses``
(the loss watch: losses in, ``step`` messages out; one step per optimizer step under gradient accumulation).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable

from ... import protocol
from ..settings import AgentSettings, agent_settings
from . import _core
from ._core import _warn_once, get, root_cause
from ._losses import LossWatch

TYPE_CHECKING = False  # typing's own flag, without importing typing in every job process (see protocol.py)
if TYPE_CHECKING:
    from typing import Any

__all__ = ["Agent", "LossWatch", "get", "install", "root_cause"]

_INSTALLED = False
#: A checkpoint folder's step in its name, as the guard reads it (``checkpoint-N``, ``step_N``, ``global_stepN``).
_STEP_NAME_RE = re.compile(r"^(?:checkpoint-|checkpoint_|step_|step-|global_step)([0-9]+)$")
#: What a dormant agent (a ``multiprocessing`` spawn child) keeps to itself until it is seen to be a training rank.
HELD_WHILE_DORMANT = frozenset({"watching", "dist"})


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
        "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE"),  # torchrun's per-rank error file (@record)
    }


class Agent:
    """The agent of one process. Use ``guard.inside.agent.get()``; None means no supervisor."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.pid = os.getpid()
        self.dropped = 0
        self.dead = False
        self.backward_hook = True  # off once a Trainer or guard.report() provides the losses
        self._loss_state = threading.local()  # scaled, user_loss: each thread's own (two threads may call backward)
        #: A process started by ``multiprocessing`` spawn (a DataLoader worker, or a rank of
        #: ``torch.multiprocessing.spawn``): it connects only once it says something a training rank says (a loss,
        #: a save), so a DataLoader worker never connects with its parent's RANK; what it would say before waits.
        self.dormant = False
        self._held: list[dict[str, Any]] = []
        self.begun = 0  # steps (or micro-batches) this process has begun: a cheap counter, never sent per step
        self.checkpoint_request: dict[str, Any] | None = None
        self.stop_requested = False
        self.trainer = False  # a Trainer is instrumented: its saves come through its callback, not torch.save
        self.api_used: set[str] = set()  # guard.should_checkpoint / checkpoint_saved / should_stop calls seen
        self.served_stop = False  # should_checkpoint() answered True to a request with stop (deadline, signal)
        self.watch = LossWatch(self, settings.sanity_steps, settings.check_every)
        self._count_sent = 0  # the step count last sent by send_count
        self.resumed = False  # the job loaded the checkpoint the guard resumed it from (resume_seen)
        self.saved_paths: set[str] = set()  # real paths of the files the job saved (torch.save returned)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._acked = threading.Event()
        self._closed = threading.Event()
        from ._dist import DistRelay

        self.relay = DistRelay(self)

    @property
    def scaled(self) -> tuple[Any, Any] | None:
        """(``GradScaler.scale``'s result, the loss it scaled) of this thread, until its backward ran."""
        value: tuple[Any, Any] | None = getattr(self._loss_state, "scaled", None)
        return value

    @scaled.setter
    def scaled(self, value: tuple[Any, Any] | None) -> None:
        self._loss_state.scaled = value

    @property
    def user_loss(self) -> Any:
        """The loss this thread gave to accelerate's ``Accelerator.backward`` or DeepSpeed's
        ``DeepSpeedEngine.backward``, while that runs; else None."""
        return getattr(self._loss_state, "user_loss", None)

    @user_loss.setter
    def user_loss(self, value: Any) -> None:
        self._loss_state.user_loss = value

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
            if self.dormant:
                if message.get("t") in HELD_WHILE_DORMANT:
                    self._held.append(message)
                    return True
                self.dormant = False  # a training rank after all (torch.multiprocessing.spawn)
            sock = self._connect()
            if sock is None:
                return False
            held, self._held = self._held, []
            for earlier in held:
                self._send_raw(sock, earlier)
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
                # the last step counted (the steps since the last report were not sent): the VERDICT's step=
                self.send({"t": "progress", "begun": self.begun, "step": self.watch.step})
            elif kind == "dump":
                _dump_threads()
                # How far this rank got: a rank blocked outside a collective has begun fewer steps than the
                # ranks waiting for it inside one.
                self.send({"t": "progress", "begun": self.begun, "step": self.watch.step, "where": _main_where()})

    def send_count(self) -> None:
        """The step count, when it moved since the last time (``count``, no loss: nothing read from the
        device): run every 0.1 s by the flusher's thread (``_core.TICKS``), so that the VERDICT's ``step=`` is
        the last step counted even when a signal kills this process before the next window's report."""
        step = self.watch.step
        if step > self._count_sent and not self.dormant and self._sock is not None:
            self._count_sent = step
            self.send({"t": "count", "step": step})

    def warn(self, text: str) -> None:
        """One ``[guard] agent:`` line on stderr, once per text."""
        _warn_once(text)

    def wait_stop(self, timeout_s: float = 10.0) -> None:
        """After a non-finite loss: wait (bounded) for the supervisor's SIGTERM, so that the job does not train on.

        Returns early when the supervisor is gone (the channel closed), and at once when a stop was already asked
        for (a deadline's or a signal's checkpoint request, a ``stop``): the guard already decided, and waiting
        would only eat the time left for the save.
        """
        if self.dead or self.stop_requested or self.served_stop or self.checkpoint_request is not None:
            return  # a stop (or a checkpoint request with its stop) is already under way: never block on it
        self._closed.wait(timeout_s)

    def wait_ack(self) -> None:
        """Wait (bounded) for the supervisor's go-ahead after ``trainer_config``."""
        if not self.dead:
            self._acked.wait(self.settings.ack_timeout_s)

    def ask(self, message: dict[str, Any]) -> None:
        """Send ``message`` and wait (bounded) for its ``ack``: each question waits for its own answer."""
        if not self.dead:
            self._acked.clear()
        if self.send(message):
            self.wait_ack()

    # -- what the hooks and the public API call -------------------------------------------------------------

    def on_loss(self, loss: Any, step: int | None, source: str, *, mean: bool = False) -> None:
        """A loss from a hook or ``guard.report`` (``LossWatch.observe``: ``mean``, a loss a library divides by the
        accumulation steps itself)."""
        self.watch.observe(loss, step, source, mean=mean)
        # a loop that never asks ``should_checkpoint`` (a plain DCP loop) still reads the job's store: node 0's run
        # id and its requests reach this node's guard (before, such a loop on two nodes with no --run-id never
        # met: TIMEOUT exit=124 secured=no on both). ``poll`` itself reads only every --check-every steps
        self.relay.poll(self.watch.count, self.settings.check_every)
        if self.watch.count % 16 == 1:
            self._probe_sigterm_handler()

    def _probe_sigterm_handler(self) -> None:
        """Tell the supervisor (once) that the script installed its own SIGTERM handler: a loop that saves when
        told, so at a deadline the guard sends it SIGTERM early enough for that save. Probed every 16 steps."""
        if "sigterm_handler" not in self.api_used and callable(signal.getsignal(signal.SIGTERM)):
            self.note_api("sigterm_handler")

    def checkpoint_due(self) -> bool:
        if self.served_stop and not self.trainer:
            # Asked again after answering a stop request: this rank's part of the save is done (a rank other than
            # the one that calls checkpoint_saved, e.g. in DDP): end it like the saving rank.
            self.stop_requested = True
            self.end_process()
        self.relay.poll(self.watch.count, self.settings.check_every)
        request = self.checkpoint_request
        if request is None:
            return False
        at_step = request.get("at_step")
        due = at_step is None or self.watch.step >= int(at_step)
        if due and request.get("stop") and not self.trainer:
            self.served_stop = True
            self.note_api("stop_served")  # the loop got the stop: its end is no finished training
        return due

    def note_api(self, name: str) -> None:
        """Tell the supervisor (once per name) that the script uses the guard's API: a script that calls
        ``should_checkpoint`` can answer a checkpoint request; one that calls ``should_stop`` ends itself."""
        if name not in self.api_used:
            self.api_used.add(name)
            self.send({"t": "api", "name": name})

    def resume_seen(self, path: str) -> None:
        """The job loaded ``path`` (``torch.load``, which accelerate's ``load_state`` and the Trainer's
        ``resume_from_checkpoint`` use too): when it is the checkpoint the guard resumed from, or a file in it, the
        step count goes on from that checkpoint's step (once) and the supervisor is told (``resume_loaded``). A
        job that never loads it counts from 0, and its VERDICT says it did not load the resumed checkpoint.

        A file the job saved itself before loading it is not the resumed checkpoint any more, even at its path:
        pytorch/examples' word_language_model saves ``--save model.pt`` each epoch and loads it back only after
        training, so the ``model.pt`` the guard fetched was overwritten long before (no resume: counts from 0)."""
        resume = self.settings.resume_path
        if self.resumed or not resume:
            return
        where, top = os.path.realpath(path), os.path.realpath(resume)
        if where != top and not where.startswith(top.rstrip(os.sep) + os.sep):
            return
        if where in self.saved_paths:
            return
        self.resumed = True
        self.watch.resumed(self.settings.resume_step)
        self.note_api("resume_loaded")

    def reports_saves(self) -> bool:
        """Whether ``file_saved`` reports a ``torch.save`` (not under a Trainer nor a script that reports its own
        checkpoints with ``should_checkpoint``/``checkpoint_saved``)."""
        return not (self.trainer or self.api_used & {"should_checkpoint", "checkpoint_saved"})

    def dcp_saved(self, path: str, save_s: float) -> None:
        """``torch.distributed.checkpoint.save`` returned on this rank (``path``: its ``checkpoint_id``): this rank's
        shard is written, and so is the coordinator's ``.metadata`` (every rank waits for the coordinator's finish
        before it returns). Reported as ``checkpoint_saved`` from each rank (``zero``: the world's rank 0), so that
        the guard needs no settle time, and each node's guard of a many-node job finds its part at once; not under
        a Trainer nor a script that reports its own saves. The step is the N of a ``step_N``-like name (the job's
        own count), else the agent's."""
        if not self.reports_saves():
            return
        self.watch.flush("save")
        self.relay.learn_run_id()
        named = _STEP_NAME_RE.search(os.path.basename(os.path.normpath(path)))
        self.send({"t": "checkpoint_saved", "path": os.path.abspath(path), "save_s": round(save_s, 3),
                   "step": int(named[1]) if named else self.watch.step, "requested": False,
                   "zero": _rank_info()["rank"] in (None, 0), "hook": "dcp"})

    def file_saved(self, path: str, save_s: float, bad_tensor: str | None = None) -> None:
        """``torch.save`` wrote ``path`` (complete: the call returned); not reported under a Trainer (its callback
        reports its saves) nor once the script uses ``should_checkpoint``/``checkpoint_saved`` (it reports them).
        The losses pending in the check window are read and sent first (one device sync per save).

        ``bad_tensor``: the first saved tensor that is not finite (``_torch.first_non_finite``), or None. The weights
        are a witness of their own: a loss kept finite (a masked mean of nothing, ``torch.where`` around a 0/0) can
        train NaN weights. Such a save counts as the run's first non-finite step (its loss sent as NaN, source
        ``weights``): the save is never secured, and the run ends ``non_finite_loss`` as for a NaN loss."""
        self.saved_paths.add(os.path.realpath(path))
        if not self.reports_saves():
            return  # the script reports its own checkpoints: a file of one is not a checkpoint yet
        # A save is a read point: the losses still pending in the --check-every window go first, so a non-finite
        # loss reaches the guard before the save it covers (and the job stops here, not at its end).
        self.watch.flush("save")
        self.relay.learn_run_id()
        if bad_tensor is not None:
            _warn_once(f"the job saved {path} with weights that are not finite ({bad_tensor}) while its loss was "
                       "finite: the save is not secured")
            self.watch.non_finite_weights(bad_tensor)
        message: dict[str, Any] = {"t": "file_saved", "path": os.path.abspath(path), "step": self.watch.step,
                                   "save_s": round(save_s, 3)}
        try:  # the save's signature: the guard holds its copy of the file to exactly this save
            st = os.stat(path)
            message.update(size=st.st_size, mtime_ns=st.st_mtime_ns, inode=st.st_ino)
        except OSError:
            pass
        if bad_tensor is not None:
            message.update(finite=False, bad_tensor=bad_tensor)
        self.send(message)
        self._probe_sigterm_handler()

    def end_process(self) -> None:
        """After a stop the guard asked for (deadline, signal) and the checkpoint saved: end the process, so that
        the script's code after training does not run as if training had finished. A script that reads
        ``guard.should_stop()`` handles the stop itself and is left alone. Raises ``SystemExit(0)``
        (``finally`` blocks and ``atexit`` handlers still run)."""
        if "should_stop" in self.api_used or not self.stop_requested:
            return
        _warn_once("the guard stopped training (deadline or signal) and the checkpoint is saved: ending the "
                   "process here (a script that reads guard.should_stop() handles this itself)")
        self.watch.flush("report")
        raise SystemExit(0)

    def checkpoint_done(self, path: str, step: int | None, *, save_s: float | None = None, zero: bool = True) -> None:
        request, self.checkpoint_request = self.checkpoint_request, None
        if request is not None and request.get("stop"):
            self.stop_requested = True
        self.watch.flush("report")
        self.relay.learn_run_id()
        self.send({"t": "checkpoint_saved", "path": os.path.abspath(path), "step": step, "save_s": save_s,
                   "requested": request is not None, "zero": zero})


def _short(filename: str) -> str:
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return os.path.basename(filename)


def _main_where() -> str | None:
    """Where the main thread waits, in one line: its innermost frame, the innermost frame of a library (not the
    standard library) and the script's frame, inner to outer: ``wait (threading.py:331) <- upload
    (mylib/push.py:12) <- train.py:40``. None when the main thread is not found."""
    import sysconfig
    import traceback

    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    stack = traceback.extract_stack(frame)
    if not stack:
        return None
    stdlib = sysconfig.get_paths().get("stdlib", "\0")
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "\0"
    picked = [stack[-1]]
    library = next((f for f in reversed(stack) if not f.filename.startswith(stdlib)
                    and os.path.abspath(f.filename) != script and "guard/inside" not in f.filename), None)
    if library is not None and library is not stack[-1]:
        picked.append(library)
    own = next((f for f in reversed(stack) if os.path.abspath(f.filename) == script), None)
    parts = [f"{f.name} ({_short(f.filename)}:{f.lineno})" for f in picked if f is not own]
    if own is not None:
        parts.append(f"{own.name} ({_short(own.filename)}:{own.lineno})")
    where = " <- ".join(parts)
    if any("torch/_dynamo/" in f.filename or "torch/_inductor/" in f.filename for f in stack):
        where += " (inside torch.compile: torch/_dynamo/)"  # compiling, whatever library frame is innermost
    return where


def _dump_threads() -> None:
    """Write the stacks of every thread of this process to stderr (asked for when the job looks hung)."""
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    rank = os.environ.get("RANK")
    lines = [f"[guard] agent: stacks of pid {os.getpid()}{f' (rank {rank})' if rank else ''}:\n"]
    for ident, frame in sys._current_frames().items():
        if names.get(ident) == "guard-agent":
            continue
        lines.append(f"  thread {names.get(ident, ident)}:\n")
        lines.extend("    " + entry for entry in "".join(traceback.format_stack(frame)).splitlines(True))
    try:
        os.write(2, "".join(lines).encode("utf-8", "replace"))
    except OSError:
        pass


_core.bind(Agent)  # get() makes this process's agent of this class


# -- post-import hooks ----------------------------------------------------------------------------------------


if TYPE_CHECKING:
    from importlib.abc import Loader as _LoaderBase
else:
    _LoaderBase = object  # duck-typed at run time: importlib.abc stays out of every job's start-up


class _HookedLoader(_LoaderBase):
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


def _send_count() -> None:
    agent = get()
    if agent is not None:
        agent.send_count()


def install() -> None:
    """Install the post-import hooks (called by the agent's ``sitecustomize``; idempotent, never raises)."""
    global _INSTALLED
    if _INSTALLED or not agent_settings().socket_path:
        return
    _INSTALLED = True
    role = _core.multiprocessing_role()
    if role == "helper":  # the forkserver, the resource tracker: never a rank; its forks would carry an agent too
        return
    from . import _torch, _transformers

    hooks = {"torch": _torch.patch, "transformers.trainer": _transformers.patch,
             "transformers.training_args": _transformers.patch_arguments,
             "accelerate.accelerator": _torch.patch_accelerate, "deepspeed.runtime.engine": _torch.patch_deepspeed,
             "torch.distributed.checkpoint": _torch.patch_dcp,
             "torch.optim.optimizer": _torch.patch_optimizer, "torch.utils.data.dataloader": _torch.patch_dataloader}
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
            agent.send({"t": "exception", "exc_type": exc_type.__name__, "message": str(exc)[:500],
                        "root": root_cause(exc)})
        previous(exc_type, exc, tb)

    sys.excepthook = excepthook
    import atexit

    atexit.register(_core._flush_at_exit)
    _core.TICKS.append(_send_count)
    _core._start_stdout_flusher()
    agent = get()
    if agent is not None and not agent.dormant:  # connect now: the supervisor can ask it for stacks
        with agent._lock:
            agent._connect()
