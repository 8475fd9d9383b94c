"""The guard's cgroup memory facts, read from the kernel's files.

Memory facts (for telling an out-of-memory kill from another SIGKILL): cgroup v2 ``memory.max`` /
``memory.current`` / ``memory.events`` (``oom_kill`` counter), or cgroup v1 ``memory.limit_in_bytes`` /
``memory.usage_in_bytes`` / ``memory.oom_control`` (kernel docs ``admin-guide/cgroup-v2.rst``,
``cgroup-v1/memory.rst``); ``psutil.virtual_memory()`` would give the host's, not the container's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupMemory", "cgroup_memory"]


@dataclass(frozen=True)
class CgroupMemory:
    """The job's cgroup memory: ``limit_bytes`` (None: unlimited/unknown), ``current_bytes``, ``oom_kills``."""

    limit_bytes: int | None
    current_bytes: int | None
    oom_kills: int


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _oom_kills(path: Path) -> int:
    """The ``oom_kill`` counter of a cgroup's ``memory.events`` (v2) or ``memory.oom_control`` (v1); 0 if absent."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> CgroupMemory | None:
    """Read this process's cgroup memory (v2, then v1); None when neither can be read."""
    rel = v1_rel = ""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[0] == "0":
                rel = parts[2].lstrip("/")
            elif len(parts) == 3 and "memory" in parts[1].split(","):
                v1_rel = parts[2].lstrip("/")
    except OSError:
        pass
    for base in (root / rel, root):
        if (base / "memory.max").exists() or (base / "memory.current").exists():
            return CgroupMemory(_read_int(base / "memory.max"), _read_int(base / "memory.current"),
                                _oom_kills(base / "memory.events"))
    v1 = root / "memory"
    if v1_rel and (v1 / v1_rel / "memory.limit_in_bytes").exists():
        v1 = v1 / v1_rel  # this process's own group (without a cgroup namespace, ROOT/memory is the host's)
    if (v1 / "memory.limit_in_bytes").exists():
        limit = _read_int(v1 / "memory.limit_in_bytes")
        if limit is not None and limit >= 2**60:
            limit = None
        return CgroupMemory(limit, _read_int(v1 / "memory.usage_in_bytes"), _oom_kills(v1 / "memory.oom_control"))
    return None
