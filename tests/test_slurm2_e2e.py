"""The guard on a real two-node Slurm: the cluster of tests/slurm/up2.sh (two slurmd on this machine, each node's
job steps seeing their own disk at one path), one guard per node (tests/slurm/guarded2.sbatch: ``srun
--ntasks-per-node=1 jobguard ... -- torchrun ...``), each node's output in a file of its own.

Checked: the time limit and scancel reach both nodes and both tell the same story (the same VERDICT status, reason
and exit code; the same deadline, from scontrol); each node's run id is the job's; each node saves on its own disk.
With a folder per node and a destination both reach, each node secures its own part of a DCP checkpoint at the time
limit, the destination holds the whole of it, and a requeue resumes it on both nodes.
Without the cluster the tests skip with the reason; with ``CI=true`` that skip is a failure.
"""

from __future__ import annotations

import contextlib
import json
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
from typing import Any

import pytest
import torch
from conftest import JOBS, guard_env
from multinode import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

DIR = Path(os.environ.get("JOBGUARD_SLURM2_DIR", "/run/jobguard-slurm2"))
CONF = DIR / "slurm.conf"
SBATCH = Path(__file__).resolve().parent / "slurm" / "guarded2.sbatch"
PARTS_SBATCH = SBATCH.with_name("parts2.sbatch")  # torchrun --nnodes=$SLURM_NNODES --node-rank=$SLURM_NODEID
SCRATCH = DIR / "scratch"  # each node's own folder there (DIR/local/n1, DIR/local/n2)
DRIVERS: list[Driver] = []  # the module's one driver (the fixture's), for the tests' checks
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "DEADLINE")


def slurm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # the interpreter's own bin folder first: torchrun is found there also when its environment is not activated
    path = os.pathsep.join(p for p in (str(Path(sys.executable).parent), os.environ.get("PATH", "")) if p)
    return guard_env({"SLURM_CONF": str(CONF), "JOBGUARD_PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                      "PATH": path, **(extra or {})})


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


def submit(folder: Path, sbatch_options: list[str], guard_args: list[str], *, script: Path = SBATCH,
           env: dict[str, str] | None = None) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["sbatch", "--parsable", "-N2", f"--output={folder / 'batch.log'}", f"--chdir={folder}",
                           *sbatch_options, str(script), *guard_args], capture_output=True, text=True, timeout=30,
                          check=False, env=slurm_env({"JOBGUARD_NODE_LOGS": str(folder), **(env or {})}))
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


def cancel(job_id: str, timeout_s: float = 90) -> None:
    """Cancel a job to its end: a guard with ``--requeue`` secures at scancel's SIGTERM and requeues the job, which
    is then cancelled again while it waits to start."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = show(job_id).get("JobState")
        if state in TERMINAL:
            return
        if state != "COMPLETING":
            _run(["scancel", job_id])
        time.sleep(2)


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


def test_node_parts_at_the_time_limit_then_a_requeue_resumes_both_nodes(cluster: None, tmp_path: Path) -> None:
    """A DCP job on two nodes, each saving on its own disk (``.metadata`` and rank 0's shard on n1, rank 1's on n2),
    securing to a folder both nodes reach: at the time limit (``--time=1``) both nodes say TIMEOUT exit=75 with one
    secured_step, and the destination holds every node's shard of that step (``dcp_to_torch_save`` loads it); node
    0's guard then requeues the job (``--requeue``), and its next run resumes on both nodes from the destination
    (each node's job loads the whole checkpoint from its own disk) and secures a later step together."""
    token = f"jg-{uuid.uuid4().hex[:8]}"
    out, dest, folder = SCRATCH / token, DIR / "shared" / token / "dest", tmp_path / "parts"
    job_id = submit(folder, ["--time=1", "--requeue"], [
        "--no-preflight", "--grace", "8s", "--margin", "20s", "--requeue", "--output-dir", str(out), "--push-to",
        str(dest), "--", str(JOBS / "dcp_loop.py"), str(out), "--every", "20", "--step-s", "0.05"],
        script=PARTS_SBATCH, env={"MASTER_PORT": str(free_port())})
    try:
        end = time.monotonic() + 240
        while not all("VERDICT: " in text for text in node_logs(folder)):  # the first run's, on both nodes
            if time.monotonic() > end or show(job_id).get("JobState") in TERMINAL:
                pytest.fail(f"job {job_id}: no VERDICT on both nodes: {show(job_id)}\n{node_logs(folder)}")
            time.sleep(0.5)
        secured = tmp_path / "secured"  # before the next run moves the record on
        shutil.copytree(dest / "last-checkpoint", secured)
        logs = node_logs(folder)
        both = "\n".join(f"--- node {n}\n{text[-3000:]}" for n, text in enumerate(logs))
        first = [verdict(text.split("VERDICT: ", 2)[0] + "VERDICT: " + text.split("VERDICT: ", 2)[1].split("\n")[0])
                 for text in logs]
        assert [(f["status"], f["exit"], f.get("secured"), f["node"]) for f in first] == [
            ("TIMEOUT", "75", "yes", "0"), ("TIMEOUT", "75", "yes", "1")], both
        step = first[0]["secured_step"]
        # the same missing= too (the job cannot be asked for a checkpoint: it saves on until the guard stops it, so
        # the newest save may have only one node's part at the destination)
        assert first[1]["secured_step"] == step and first[0].get("missing") == first[1].get("missing"), both
        held = json.loads((secured / "guard_manifest.json").read_text())
        assert (held["step"], held["nodes"], held["run_id"]) == (int(step), 2, f"slurm-{job_id}"), held
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(held["files"]), held
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(secured), str(tmp_path / "whole.pt"))
        state = torch.load(tmp_path / "whole.pt", weights_only=True)
        assert int(state["step"]) == int(step)
        for rank in (0, 1):  # each node's own shard, of that step
            assert float(state[f"rank{rank}"][0]) == rank * 1000 + int(step), rank
        # the requeued run: each node fetches the whole checkpoint onto its own disk and goes on from it
        record = dest / "last-checkpoint" / "guard_manifest.json"

        def moved_on() -> dict[str, Any] | None:
            with contextlib.suppress(OSError, ValueError):
                now = json.loads(record.read_text())
                if now.get("run_id") == f"slurm-{job_id}-r1" and now.get("step", 0) > int(step):
                    return dict(now)
            return None
        end = time.monotonic() + 180
        while (later := moved_on()) is None:
            if time.monotonic() > end or show(job_id).get("JobState") in TERMINAL:
                pytest.fail(f"job {job_id}: the requeued run secured no later step: {show(job_id)}\n"
                            f"{node_logs(folder)}")
            time.sleep(0.5)
        assert later["nodes"] == 2 and {"__0_0.distcp", "__1_0.distcp"} <= set(later["files"]), later
        logs = node_logs(folder)
        both = "\n".join(f"--- node {n}\n{text[-4000:]}" for n, text in enumerate(logs))
        for rank, text in enumerate(logs):
            second = text.split("VERDICT: ", 2)[1]
            assert f"run slurm-{job_id}-r1 (SLURM_JOB_ID and SLURM_RESTART_COUNT)" in second, both
            assert f"rank {rank}: resumed from step {step}" in second, both  # the whole checkpoint, this disk
        for node in ("n1", "n2"):  # fetched onto each node's own disk: every shard there
            assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {
                p.name for p in (DIR / "local" / node / token / f"step_{step}").iterdir()}, node
    finally:
        cancel(job_id)
        for leftover in [*(DIR / "local").glob(f"*/{token}"), dest.parent]:
            shutil.rmtree(leftover, ignore_errors=True)
