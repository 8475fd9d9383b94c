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

Modules: ``_core`` (the agent of the process, ``get()``, the loss watch, the channel), the hooks ``_torch``,
``_transformers`` and ``_dist`` (which import ``_core`` only), and this ``__init__``, which installs the hooks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..settings import agent_settings
from . import _core
from ._core import Agent, LossWatch, _warn_once, get, root_cause

__all__ = ["Agent", "LossWatch", "get", "install", "root_cause"]

_INSTALLED = False


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
             "accelerate.accelerator": _torch.patch_accelerate}
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
    _core._start_stdout_flusher()
    agent = get()
    if agent is not None and not agent.dormant:  # connect now: the supervisor can ask it for stacks
        with agent._lock:
            agent._connect()
