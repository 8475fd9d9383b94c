"""Shared fixtures: isolation from the real environment, and a helper to run the guard as a real process."""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"

#: Test files that must run whole on one pytest-xdist worker (the README's ``--dist loadfile``): the torchrun ones
#: pick free TCP ports (``free_port``) and check that no launch-smoke process is left on the machine, which another
#: worker's torchrun job would break; the Slurm ones share the one-node cluster's CPUs (two jobs at once would queue
#: each other past their time limits); the wheel ones build a wheel from the one source tree (``pip wheel`` writes
#: ``build/`` in it: two at once fail with "File exists"). A test class is one unit (its tests share an expensive
#: fixture, set up once). Every other test is a unit of its own, so that a long file's tests spread over the workers
#: (each worker sets a file's module-scoped servers up once; they listen on free ports).
SAME_WORKER = {"test_distributed_e2e.py": "torchrun", "test_multinode_e2e.py": "torchrun",
               "test_preflight_launch.py": "torchrun",
               "test_slurm_e2e.py": "slurm", "test_slurm2_e2e.py": "slurm", "test_install_e2e.py": "wheel"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` with the files of :data:`SAME_WORKER` as one unit each and every other test a unit of its
    own (pytest-xdist's own ``xdist_group`` marks need ``--dist loadgroup``, whose node-id suffix pytest 9.2 no
    longer takes); None: xdist's choice."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TestsAndGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return TestsAndGroups(config, log)


#: Each test's measured wall time and CPU time (setup, call and teardown; seconds; the CPU time is the test process's
#: and its reaped children's: the guard, the job, its workers), for ordering the slow tests: written by ``python -m
#: pytest -n 4 --dist loadfile --record-durations tests/durations.json``. A test not in it counts as
#: ``DEFAULT_DURATION_S`` of wall time and ``WAITER_CPU_SHARE`` of it as CPU.
DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_DURATION_S = 10.0
#: A unit whose CPU time is less than this share of its wall time mostly waits (a deadline, a stall timeout, a
#: hung push) and leaves the cores to the others.
WAITER_CPU_SHARE = 0.4


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", metavar="FILE", default=None,
                     help="write each test's wall and CPU time (seconds) to FILE as JSON (tests/durations.json "
                          "orders the slow tests)")


def _unit(nodeid: str) -> str:
    """The scheduler's unit of a test (see ``pytest_xdist_make_scheduler``)."""
    parts = nodeid.split("::")
    if len(parts) > 2:  # a class's tests share its fixtures (a module-scoped run made once): one unit
        return "::".join(parts[:2])
    return SAME_WORKER.get(parts[0].rsplit("/", 1)[-1], nodeid)


def _measured() -> dict[str, tuple[float, float]]:
    """``DURATIONS`` as {nodeid: (wall_s, cpu_s)}; an older file of wall times alone counts as waiting."""
    try:
        raw = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {nodeid: (float(v[0]), float(v[1])) if isinstance(v, list) else (float(v), WAITER_CPU_SHARE * float(v))
            for nodeid, v in raw.items()}


def interleaved(units: list[tuple[str, float, float]]) -> list[str]:
    """The slow units in the order they start: those that mostly wait and those that mostly compute
    (``WAITER_CPU_SHARE``), each longest first, taken from the two lists in step (by the share of each list's wall
    time already started), so that while some workers wait out deadlines and stall timeouts the others keep the
    cores busy. In a run of the suite in plain longest-first order, four stall and deadline tests ran side by side
    for 40 s with the two cores 20-30 % busy. ``units``: (unit, wall_s, cpu_s)."""
    waiters = sorted((u for u in units if u[2] < WAITER_CPU_SHARE * u[1]), key=lambda u: -u[1])
    burners = sorted((u for u in units if u[2] >= WAITER_CPU_SHARE * u[1]), key=lambda u: -u[1])
    total_w, total_b = sum(u[1] for u in waiters) or 1.0, sum(u[1] for u in burners) or 1.0
    done_w = done_b = 0.0
    order: list[str] = []
    while waiters or burners:
        if burners and (not waiters or done_b / total_b <= done_w / total_w):
            unit = burners.pop(0)
            done_b += unit[1]
        else:
            unit = waiters.pop(0)
            done_w += unit[1]
        order.append(unit[0])
    return order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files of :data:`SAME_WORKER` first (one long unit each, longest first), then the tests marked ``slow``
    (real jobs, seconds to a minute each) by their unit's measured times (``DURATIONS``, :func:`interleaved`), then
    the unit tests, which fill the end. Within a unit, the collection order."""
    measured = _measured()
    wall_s: dict[str, float] = {}
    cpu_s: dict[str, float] = {}
    for item in items:
        unit = _unit(item.nodeid)
        wall, cpu = measured.get(item.nodeid, (DEFAULT_DURATION_S, WAITER_CPU_SHARE * DEFAULT_DURATION_S))
        wall_s[unit] = wall_s.get(unit, 0.0) + wall
        cpu_s[unit] = cpu_s.get(unit, 0.0) + cpu
    slow = {_unit(item.nodeid) for item in items
            if item.get_closest_marker("slow") is not None and item.path.name not in SAME_WORKER}
    rank = {unit: n for n, unit in enumerate(interleaved([(u, wall_s[u], cpu_s[u]) for u in sorted(slow)]))}

    def key(item: pytest.Item) -> tuple[int, float, str]:
        unit = _unit(item.nodeid)
        if item.path.name in SAME_WORKER:
            return 0, -wall_s[unit], unit
        if unit in rank:
            return 1, float(rank[unit]), unit
        return 2, 0.0, ""

    items.sort(key=key)


_recorded: dict[str, list[float]] = {}  # nodeid: [wall_s, cpu_s]
_cpu_at_start: dict[str, float] = {}


def _cpu_now_s() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if item.config.getoption("--record-durations"):
        _cpu_at_start[item.nodeid] = _cpu_now_s()
    yield
    if item.nodeid in _cpu_at_start:
        _recorded.setdefault(item.nodeid, [0.0, 0.0])[1] = _cpu_now_s() - _cpu_at_start.pop(item.nodeid)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _recorded.setdefault(report.nodeid, [0.0, 0.0])[0] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    """``--record-durations FILE``: each xdist worker writes its tests' times beside FILE, and the controller (or a
    run without xdist) merges them into FILE."""
    if not os.environ.get("PYTEST_XDIST_WORKER") and not stat.S_ISCHR(os.stat(os.devnull).st_mode):
        # a rename over /dev/null as root (a test once gave a job /dev/null as the file it renames into place)
        # breaks every later `> /dev/null` on the machine, munged's start included
        print(f"\n{os.devnull} is no longer a character device: a test replaced it", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    target = session.config.getoption("--record-durations")
    if not target:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = Path(target)
    if worker:
        path.with_name(f"{path.name}.{worker}").write_text(json.dumps(_recorded))
        return
    merged: dict[str, list[float]] = dict(_recorded)  # the controller's reports carry no CPU time: the workers' do
    for part_file in path.parent.glob(f"{path.name}.gw*"):
        merged.update(json.loads(part_file.read_text()))
        part_file.unlink()
    lines = (f"{json.dumps(nodeid)}: [{wall:.1f}, {cpu:.1f}]" for nodeid, (wall, cpu) in sorted(merged.items()))
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No real tokens, no real Hub, a private HF cache; GUARD_* from the developer's shell never leak in."""
    home = tmp_path_factory.mktemp("hfhome")
    for name in list(os.environ):
        if name.startswith(("GUARD_", "AWS_")) or name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "SLURM_JOB_ID",
                                                 "JOB_ID", "KUBERNETES_SERVICE_HOST"):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    # No AWS credentials or profiles of the developer's, and no instance metadata lookups (tests/s3server.py)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)  # the client's default: Xet on (tests/xetcas.py)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    # One intra-op thread per torch process: the workers' jobs share the machine's cores. torch's default, a thread
    # per core, bought a single job a faster step for more CPU on an idle 2-core machine (examples/train_loop.py,
    # 200 steps: 29.2 s wall for 53.8 s of CPU, against 38.9 s for 38.9 s), CPU the other workers' jobs need.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The guard, its agent and its workers are Python processes started hundreds of times: with
    # PYTHONDONTWRITEBYTECODE set (as in many container images) each compiled the guard's modules from source again,
    # 0.2 s of CPU a guard run (0.50 s against 0.30 s for `python -m guard --no-preflight -- python -c pass`).
    # An installed wheel has its bytecode compiled at install time; here it is written once, on first use.
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)


@dataclass
class GuardRun:
    returncode: int
    stdout: str
    stderr: str
    #: the guard process's own CPU time (seconds; its children's not included) when measured (``wait_own_cpu_s``)
    own_cpu_s: float | None = None

    @property
    def verdict(self) -> str:
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def fields(self) -> dict[str, str]:
        import shlex

        parts = shlex.split(self.verdict[len("VERDICT: "):])
        return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:])}


def load_factor() -> float:
    """How much busier than one runnable process per core the machine is (``os.getloadavg``'s one-minute figure
    over the cores), at least 1."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


def loaded_s(seconds: float, *, start_s: float | None = None) -> str:
    """A budget of ``seconds`` for a job's start-up and first steps, as a guard duration (``"15s"``), stretched in
    proportion on a machine busier than one runnable process per core (``os.getloadavg``'s one-minute figure): at
    load average 7 on 2 cores a job took 3x its idle time to import torch and make its first step, and a fixed 15 s
    deadline came before its first save; at 3.5 a Trainer had not made its first step 14 s after the start. What a
    test checks stays the same; only the time the job is given grows with the load.

    ``start_s``: the part of ``seconds`` that is start-up (the rest is the test's own timing, e.g. a margin and a
    slow answer, and is not stretched); default all of it."""
    factor = load_factor()
    stretched = seconds if start_s is None else min(start_s, seconds)
    return f"{math.ceil(seconds + stretched * (factor - 1.0))}s"


def wait_own_cpu_s(proc: subprocess.Popen, timeout_s: float) -> float:
    """Wait up to ``timeout_s`` seconds for ``proc`` to exit (``subprocess.TimeoutExpired`` after that) and return
    its own CPU time, user + system seconds without its children's: ``/proc/PID/stat`` fields 14 and 15 (proc(5)),
    read while it has exited but is not reaped yet (``waitid`` with ``WNOWAIT``). ``proc`` is left to be reaped."""
    end = time.monotonic() + timeout_s
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() > end:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        time.sleep(0.05)
    with open(f"/proc/{proc.pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def guard_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def run_guard(args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None,
              timeout_s: float = 120) -> GuardRun:
    """Run ``python -m guard ARGS`` to its end; returns exit code, stdout and stderr. ``timeout_s``, the net
    under a hung run, stretches with the load like the budgets that ``loaded_s`` gives the run."""
    proc = subprocess.run([sys.executable, "-m", "guard", *args], capture_output=True, text=True,
                          env=guard_env(env), cwd=cwd, timeout=timeout_s * load_factor())
    return GuardRun(proc.returncode, proc.stdout, proc.stderr)


def start_guard(args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    """Start ``python -m guard ARGS`` with its output on pipes (for signal tests and streaming checks)."""
    return subprocess.Popen([sys.executable, "-m", "guard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=guard_env(env), cwd=cwd, start_new_session=True)


def signal_when(proc: subprocess.Popen, ready: Path | Callable[[], bool], signum: int, *, settle_s: float = 0.0,
                wait_s: float = 60.0, timeout_s: float = 60.0) -> tuple[str, str]:
    """Send ``signum`` to a guard started with ``start_guard`` once ``ready`` exists, or returns True when it is a
    function (and ``settle_s`` later), or after ``wait_s`` at most; returns its (stdout, stderr). Whatever happens,
    nothing is left running. A test whose point is made once the destination holds what it checks stops the run
    there, instead of waiting out a deadline sized for a loaded machine."""
    is_ready = ready.exists if isinstance(ready, Path) else ready
    try:
        deadline = time.monotonic() + wait_s
        while proc.poll() is None and not _true(is_ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(settle_s)
        proc.send_signal(signum)
        return proc.communicate(timeout=timeout_s)
    finally:
        kill_quietly(proc)


def _true(check: Callable[[], bool]) -> bool:
    """``check()``, False while what it reads is still being written (a half-written JSON file, a file replaced)."""
    try:
        return bool(check())
    except (OSError, ValueError, KeyError, EOFError, RuntimeError):
        return False


def secured_step(dest: Path) -> int | None:
    """The step of the checkpoint a folder destination holds (its ``last-checkpoint/guard_manifest.json``, written
    once the copy is verified), -1 for one without a known step, None while it holds none."""
    try:
        step = json.loads((dest / "last-checkpoint" / "guard_manifest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return None
    return int(step) if step is not None else -1


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not running
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def jobs() -> Path:
    return JOBS


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One S3 server (moto, tests/s3server.py) for a worker's tests, started on first use."""
    from s3server import MotoServer

    with MotoServer(tmp_path_factory.mktemp("moto-e2e")) as server:
        yield server


@pytest.fixture
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh ``destinations.Destination`` of the kind a test is parametrized with, indirectly:
    ``@pytest.mark.parametrize("destination", ["folder", "s3"], indirect=True)``."""
    from destinations import make_destination

    moto = request.getfixturevalue("moto_server") if request.param == "s3" else None
    return make_destination(request.param, tmp_path, moto)


def kill_quietly(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
