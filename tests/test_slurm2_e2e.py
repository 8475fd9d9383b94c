"""The guard on a real two-node Slurm: the cluster of tests/slurm/up2.sh (two slurmd on this machine, each node's
job steps seeing their own disk at one path), one guard per node (tests/slurm/guarded2.sbatch: ``srun
--ntasks-per-node=1 jobguard ... -- torchrun ...``), each node's output in a file of its own.

Checked: the time limit and scancel reach both nodes and both tell the same story (the same VERDICT status, reason
and exit code; the same deadline, from scontrol); each node's run id is the job's; each node saves on its own disk.
Without the cluster the tests skip with the reason; with ``CI=true`` that skip is a failure.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import JOBS, guard_env
from multinode import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

DIR = Path(os.environ.get("JOBGUARD_SLURM2_DIR", "/run/jobguard-slurm2"))
CONF = DIR / "slurm.conf"
SBATCH = Path(__file__).resolve().parent / "slurm" / "guarded2.sbatch"
SCRATCH = DIR / "scratch"  # each node's own folder there (DIR/local/n1, DIR/local/n2)
DRIVERS: list[Driver] = []  # the module's one driver (the fixture's), for the tests' checks
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE")


def slurm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return guard_env({"SLURM_CONF": str(CONF), "JOBGUARD_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                      **(extra or {})})


def _run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False, env=slurm_env(),
                          **kwargs)  # type: ignore[call-overload]


def _cluster_problem() -> str | None:
    if not CONF.exists():
        return f"no two-node Slurm cluster ({CONF} missing: run tests/slurm/up2.sh as root)"
    try:
        ping, nodes = _run(["scontrol", "ping"]), _run(["sinfo", "-h", "-N", "-o", "%N %T"])
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the two-node Slurm does not answer ({exc})"
    if "is UP" not in ping.stdout:
        return f"its slurmctld is not up: {(ping.stdout + ping.stderr).strip()[:200]} (run tests/slurm/up2.sh)"
    up = [line for line in nodes.stdout.splitlines() if re.search(r" (idle|mixed|allocated)", line)]
    return None if len(set(up)) >= 2 else f"fewer than two nodes take jobs (sinfo: {nodes.stdout.strip()})"


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = _cluster_problem()
    if problem is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and the two-node Slurm tests cannot run: {problem}")
        pytest.skip(problem)


def submit(folder: Path, sbatch_options: list[str], guard_args: list[str]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["sbatch", "--parsable", "-N2", f"--output={folder / 'batch.log'}", f"--chdir={folder}",
                           *sbatch_options, str(SBATCH), *guard_args], capture_output=True, text=True, timeout=30,
                          check=False, env=slurm_env({"JOBGUARD_NODE_LOGS": str(folder)}))
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return proc.stdout.strip().split(";")[0]


def show(job_id: str) -> dict[str, str]:
    return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", _run(["scontrol", "show", "job", "-o", job_id]).stdout))


def wait_end(job_id: str, timeout_s: float) -> dict[str, str]:
    end = time.monotonic() + timeout_s
    while True:
        info = show(job_id)
        if info.get("JobState") in TERMINAL:
            return info
        if time.monotonic() > end:
            _run(["scancel", job_id])
            pytest.fail(f"job {job_id} did not end within {timeout_s:g}s: {info}")
        time.sleep(1)


def node_logs(folder: Path) -> list[str]:
    return [(folder / f"node-{n}.log").read_text(errors="replace") if (folder / f"node-{n}.log").exists() else ""
            for n in (0, 1)]


def verdict(text: str) -> dict[str, str]:
    lines = [line for line in text.splitlines() if line.startswith("VERDICT: ")]
    assert lines, text[-3000:]
    parts = shlex.split(lines[-1][len("VERDICT: "):])
    return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:] if "=" in p)}


def dcp_job(out: Path, *options: str) -> list[str]:
    """The guard's arguments for a two-node DCP loop saving into ``out`` (each node's own disk)."""
    return ["--no-preflight", "--grace", "8s", *options, "--output-dir", str(out), "--", "torchrun",
            "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            str(JOBS / "dcp_loop.py"), str(out), "--every", "20", "--step-s", "0.05"]


class Driver(threading.Thread):
    """Runs each action's command once its condition holds (a daemon thread, 300 s at most); ``sent`` says which
    ran, ``errors`` what failed."""

    def __init__(self, actions: dict[str, tuple[Callable[[], bool], list[str]]]) -> None:
        super().__init__(daemon=True)
        self.actions = dict(actions)
        self.sent: set[str] = set()
        self.errors: dict[str, str] = {}

    def run(self) -> None:
        end = time.monotonic() + 300
        while self.actions and time.monotonic() < end:
            for name, (ready, argv) in list(self.actions.items()):
                try:
                    if not ready():
                        continue
                except OSError:
                    continue
                proc = _run(argv)
                if proc.returncode:
                    self.errors[name] = f"{argv}: exit {proc.returncode}: {proc.stderr}"
                self.sent.add(name)
                del self.actions[name]
            time.sleep(0.5)

    def check(self, name: str, folder: Path) -> None:
        while name not in self.sent and self.is_alive():
            time.sleep(0.5)
        if name not in self.sent or name in self.errors:
            pytest.fail(f"{name}: {self.errors.get(name, 'never ready')}\n{node_logs(folder)}")


@pytest.fixture(scope="module")
def jobs(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, Path, Path]]]:
    """Every job submitted at once (OverSubscribe: they share the nodes), each test then waits for its own. Their
    folders on the nodes' own disks and the shared one are named by a fresh token (a folder of an earlier run there
    would be resumed from) and removed at the end."""
    root = tmp_path_factory.mktemp("slurm2")
    token = f"jg-{uuid.uuid4().hex[:8]}"
    submitted = {}
    for name, options, guard_options in (("limit", ["--time=2"], ["--margin", "40s"]),
                                         ("scancel", ["--time=5"], [])):
        folder, data = root / name, SCRATCH / f"{token}-{name}"
        submitted[name] = (submit(folder, options, dcp_job(data, *guard_options)), folder, data)
    # a Trainer on both nodes saving into one folder both see (DIR/shared), secured by node 0, requeued after a stop
    shared = DIR / "shared" / token
    submitted["requeue"] = (submit(root / "requeue", ["--time=5", "--requeue"], [
        "--no-preflight", "--grace", "20s", "--requeue", "--push-to", str(shared / "dest"), "--", "torchrun",
        "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(JOBS / "ddp_trainer.py"), "--output-dir", str(shared / "out"), "--step-s", "0.05", "--save-steps", "10",
        "--max-steps", "400"]), root / "requeue", shared)
    # each job's stop, sent from a thread as soon as its job is ready, whichever test runs first
    scancel_id, scancel_logs, _ = submitted["scancel"]
    requeue_id = submitted["requeue"][0]
    driver = Driver({
        "scancel": (lambda: all("sanity pass" in text for text in node_logs(scancel_logs)), ["scancel", scancel_id]),
        # a preemption's SIGTERM to the job step's processes on both nodes (not to the batch shell's srun, which
        # would cancel the step): node 0 secures, then requeues the job
        "requeue": ((shared / "dest" / "last-checkpoint" / "trainer_state.json").exists,
                    ["scancel", "--signal=TERM", requeue_id])})
    driver.start()
    DRIVERS.append(driver)
    try:
        yield submitted
    finally:
        for job_id, _, _ in submitted.values():
            _run(["scancel", job_id])
        for leftover in [*(DIR / "local").glob(f"*/{token}-*"), shared]:
            shutil.rmtree(leftover, ignore_errors=True)


def test_the_time_limit_reaches_both_nodes_and_both_tell_it_alike(jobs: dict[str, tuple[str, Path, Path]]) -> None:
    job_id, folder, data = jobs["limit"]
    info = wait_end(job_id, timeout_s=300)
    logs = node_logs(folder)
    both = "\n".join(f"--- node {n}\n{text[-3000:]}" for n, text in enumerate(logs))
    fields = [verdict(text) for text in logs]
    assert [(f["status"], f["reason"], f["exit"]) for f in fields] == [("TIMEOUT", "deadline", "124")] * 2, both
    assert [f["node"] for f in fields] == ["0", "1"]
    assert info.get("ExitCode") == "124:0", info  # srun's status: the highest of the nodes' (the same here)
    for n, text in enumerate(logs):
        assert f"node: node {n} of 2 (PET_NODE_RANK, PET_NNODES), run slurm-{job_id} (SLURM_JOB_ID)" in text, both
    deadlines = [re.findall(r"\[guard\] deadline: (.+?) \(", text) for text in logs]
    assert deadlines[0] and deadlines[0][:1] == deadlines[1][:1], deadlines  # one deadline, from scontrol, on both
    saved = [sorted((DIR / "local" / node / data.name).glob("step_*")) for node in ("n1", "n2")]
    assert saved[0] and saved[1], saved  # each node saved into its own disk: the folder is local to each


def test_scancel_reaches_both_nodes_and_both_tell_it_alike(jobs: dict[str, tuple[str, Path, Path]]) -> None:
    job_id, folder, _ = jobs["scancel"]
    DRIVERS[-1].check("scancel", folder)
    info = wait_end(job_id, timeout_s=120)
    logs = node_logs(folder)
    both = "\n".join(f"--- node {n}\n{text[-3000:]}" for n, text in enumerate(logs))
    fields = [verdict(text) for text in logs]
    assert [(f["status"], f["reason"], f["exit"], f["signal"]) for f in fields] == [
        ("INTERRUPTED", "signal", "143", "SIGTERM")] * 2, both
    assert info.get("JobState") == "CANCELLED", info


def test_a_requeue_after_a_stop_resumes_on_both_nodes(jobs: dict[str, tuple[str, Path, Path]]) -> None:
    job_id, folder, _ = jobs["requeue"]
    DRIVERS[-1].check("requeue", folder)
    end = time.monotonic() + 240
    while True:
        info = show(job_id)
        if info.get("JobState") in TERMINAL and int(info.get("Restarts", "0") or 0) >= 1:
            break
        if time.monotonic() > end:
            _run(["scancel", job_id])
            pytest.fail(f"job {job_id} did not end after a requeue: {info}\n{node_logs(folder)}")
        time.sleep(1)
    logs = node_logs(folder)
    both = "\n".join(f"--- node {n}\n{text[-4000:]}" for n, text in enumerate(logs))
    first = [verdict(text.split("VERDICT: ", 2)[0] + "VERDICT: " + text.split("VERDICT: ", 2)[1]) for text in logs]
    assert [(f["status"], f["exit"], f.get("secured")) for f in first] == [("INTERRUPTED", "75", "yes")] * 2, both
    assert "requeue" in logs[0], both
    last = [verdict(text) for text in logs]
    assert [(f["status"], f["exit"]) for f in last] == [("PASS", "0")] * 2, both
    for text in logs:
        assert f"run slurm-{job_id}-r1 (SLURM_JOB_ID and SLURM_RESTART_COUNT)" in text, both
        assert "resum" in text.split("VERDICT: ", 2)[-1], both  # the second run resumed on this node too
