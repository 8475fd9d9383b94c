"""Loads the jobguard agent into every Python process of a supervised job, then the next ``sitecustomize``.

The supervisor puts this folder first on ``PYTHONPATH``. The agent is loaded under a private top-level name
(``_jobguard``, from the package folder two levels up), never as ``guard``: a project with its own ``guard.py``
still gets its own module on ``import guard``, and a script that imports jobguard's ``guard`` gets the public API,
which finds this agent by that private name (the folder holding jobguard's package is appended to ``sys.path``,
after everything else, for scripts that ``import guard`` where jobguard is not installed).

Python imports the first ``sitecustomize`` it finds, so after the agent this module imports the one that would
have been used without it (a container's own ``sitecustomize``, e.g. for CUDA paths); what that file changes in
``sys.path`` is kept.
"""

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_PRIVATE = "_jobguard"  # guard.PRIVATE_NAME


def _load_agent() -> None:
    import importlib
    import importlib.util

    package_dir = os.path.dirname(os.path.dirname(_here))  # .../guard
    spec = importlib.util.spec_from_file_location(_PRIVATE, os.path.join(package_dir, "__init__.py"),
                                                  submodule_search_locations=[package_dir])
    if spec is None or spec.loader is None:
        raise ImportError(f"no package at {package_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_PRIVATE] = module
    try:
        spec.loader.exec_module(module)
        importlib.import_module(_PRIVATE + ".inside.agent").install()
    except BaseException:
        for name in [n for n in sys.modules if n == _PRIVATE or n.startswith(_PRIVATE + ".")]:
            del sys.modules[name]
        raise


try:
    _load_agent()
    # So that a job script's ``import guard`` finds jobguard's public API even where jobguard is not installed:
    # last on sys.path, after the script's own folder (put first later), so a project's ``guard.py`` still wins.
    _root = os.path.dirname(os.path.dirname(os.path.dirname(_here)))
    if _root not in sys.path:
        sys.path.append(_root)
except Exception as _exc:  # noqa: BLE001 - the job must run even when the agent cannot load
    sys.stderr.write(f"[guard] agent: not loaded ({_exc!r}); the job runs unwatched by the agent\n")

# Chain to the sitecustomize this one shadows: look past this folder, then put it back where it was, keeping
# whatever the other file added to (or removed from) sys.path.
_this = sys.modules.pop("sitecustomize", None)
_at = [i for i, p in enumerate(sys.path) if os.path.abspath(p or os.curdir) == _here]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
try:
    import sitecustomize  # noqa: F401  (the next one, if any)
except ImportError:
    pass
finally:
    for _i in _at:
        sys.path.insert(min(_i, len(sys.path)), _here)
    if "sitecustomize" not in sys.modules and _this is not None:
        sys.modules["sitecustomize"] = _this
