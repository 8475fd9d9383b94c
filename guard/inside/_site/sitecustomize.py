"""Loads the jobguard agent into every Python process of a supervised job, then the next ``sitecustomize``.

The supervisor puts this folder first on ``PYTHONPATH``. Python imports the first ``sitecustomize`` it finds,
so after installing the agent this module imports the one that would have been used without it (a
container's own ``sitecustomize``, e.g. for CUDA paths), so that nothing is clobbered.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))

try:
    try:
        import guard.inside.agent as _guard_agent
    except ImportError:
        _root = os.environ.get("GUARD_AGENT_PKG_ROOT")
        if _root and _root not in sys.path:
            sys.path.append(_root)
        import guard.inside.agent as _guard_agent
    _guard_agent.install()
except Exception as _exc:  # the job must run even when the agent cannot load
    sys.stderr.write(f"[guard] agent: not loaded ({_exc!r}); the job runs unwatched by the agent\n")

# Chain to the sitecustomize this one shadows.
_saved = sys.path[:]
_this = sys.modules.pop("sitecustomize", None)
try:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    import sitecustomize  # noqa: F401  (the next one, if any)
except ImportError:
    pass
finally:
    sys.path[:] = _saved
    if "sitecustomize" not in sys.modules and _this is not None:
        sys.modules["sitecustomize"] = _this
