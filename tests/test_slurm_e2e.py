"""The guard under a real Slurm: batch jobs on the one-node cluster of tests/slurm/up.sh (Debian 12's slurm-wlm
22.05), the guard as the batch step's command (tests/slurm/guarded.sbatch).

All jobs are submitted at once when the module starts (the node has 2 CPUs and OverSubscribe=YES) and each test
then waits for its own: the module takes about as long as its longest job (the requeue: a stop, the requeue delay
of ``cred_expire=30`` s, the resumed run). Each test checks the VERDICT in the job's output file, ``ExitCode`` from
``scontrol show job``, the secured checkpoint's content (``torch.load``) and that nothing of the job is left
running. Without a cluster the tests skip with the reason; with ``CI=true`` that skip is a failure. Under
pytest-xdist the module must stay whole on one worker (``--dist loadfile``, as the README's command has it), or
each worker would submit the jobs again.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from conftest import JOBS, REPO, guard_env

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = Path(__file__).resolve().parent / "slurm" / "guarded.sbatch"
NANO = str(JOBS / "nanogpt_like.py")
FAST = ["--skip-check", "python=imports are checked by the other tests"]
SAVED = r"\[guard\] the job saved \S+ \(step (\d+),"
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
            "BOOT_FAIL", "DEADLINE")


def _cluster_problem() -> str | None:
    """Why no Slurm cluster can take jobs here, or None."""
    if shutil.which("sbatch") is None or shutil.which("scontrol") is None:
        return "no Slurm here (sbatch, scontrol not on PATH; tests/slurm/up.sh installs one as root)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10, check=False)
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=10,
                               check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"Slurm does not answer ({exc})"
    if "is UP" not in ping.stdout:
        return f"slurmctld is not up: {(ping.stdout + ping.stderr).strip()[:200]} (run tests/slurm/up.sh)"
    if not any(s.rstrip("*~#").split("+")[0] in ("idle", "mixed", "allocated") for s in nodes.stdout.split()):
        return f"no Slurm node takes jobs (sinfo: {nodes.stdout.strip() or nodes.stderr.strip()})"
    return None


@dataclass
class Job:
    name: str
    job_id: str
    folder: Path

    @property
    def log(self) -> Path:
        return self.folder / "job.log"

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def verdicts(self) -> list[str]:
        return [line for line in self.text().splitlines() if line.startswith("VERDICT: ")]

    def fields(self, verdict: str) -> dict[str, str]:
        parts = shlex.split(verdict[len("VERDICT: "):])
        return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:])}

    def show(self) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", "-o", self.job_id], capture_output=True, text=True,
                             timeout=20, check=False).stdout
        return dict(re.findall(r"(?:^|\s)([A-Za-z/:]+)=(\S*)", out))

    def wait_for_text(self, pattern: str, *, count: int = 1, timeout_s: float = 120) -> None:
        end = time.monotonic() + timeout_s
        while len(re.findall(pattern, self.text())) < count:
            if time.monotonic() > end:
                pytest.fail(f"job {self.name} ({self.job_id}): {pattern!r} x{count} not in its output within "
                            f"{timeout_s:g}s:\n{self.text()[-4000:]}")
            time.sleep(0.5)

    def wait_end(self, *, timeout_s: float = 240, restarts: int = 0) -> dict[str, str]:
        """Wait until the job is in a terminal state (after ``restarts`` requeues); returns its fields."""
        end = time.monotonic() + timeout_s
        while True:
            info = self.show()
            if info.get("JobState") in TERMINAL and int(info.get("Restarts", "0") or 0) >= restarts:
                return info
            if time.monotonic() > end:
                subprocess.run(["scancel", self.job_id], check=False, timeout=20)
                pytest.fail(f"job {self.name} ({self.job_id}) did not end within {timeout_s:g}s: {info}\n"
                            f"{self.text()[-4000:]}")
            time.sleep(1)

    def leftovers(self) -> list[str]:
        """Processes of this job still running (their command line names the job's folder), after a short wait."""
        end = time.monotonic() + 10
        while True:
            found = []
            for proc in psutil.process_iter(["pid", "cmdline"]):
                cmdline = " ".join(proc.info["cmdline"] or [])
                if str(self.folder) in cmdline:
                    found.append(f"{proc.info['pid']}: {cmdline[:200]}")
            queued = subprocess.run(["squeue", "-h", "-j", self.job_id, "-t", "PD,R,CG,S"], capture_output=True,
                                    text=True, timeout=20, check=False).stdout.strip()
            if queued:
                found.append(f"squeue: {queued}")
            if not found or time.monotonic() > end:
                return found
            time.sleep(0.5)


def _submit(root: Path, name: str, sbatch_options: list[str], guard_args: list[str]) -> Job:
    folder = root / name
    folder.mkdir()
    env = guard_env({"JOBGUARD_PYTHON": sys.executable, "OMP_NUM_THREADS": "1"})
    proc = subprocess.run(["sbatch", "--parsable", f"--job-name=jg-{name}", f"--output={folder / 'job.log'}",
                           f"--chdir={folder}", *sbatch_options, str(SBATCH), *guard_args],
                          capture_output=True, text=True, env=env, timeout=30, check=False)
    assert proc.returncode == 0, f"sbatch failed: {proc.stderr}"
    return Job(name, proc.stdout.strip().split(";")[0], folder)


class Driver(threading.Thread):
    """Sends each job its signal once its output shows it is ready, all jobs side by side (a daemon thread)."""

    def __init__(self, actions: dict[str, tuple[Job, str, int, list[str]]], timeout_s: float = 180) -> None:
        super().__init__(daemon=True)
        self.actions = dict(actions)  # name: (job, pattern, count, argv)
        self.sent: dict[str, float] = {}  # name: monotonic time the command ran
        self.errors: dict[str, str] = {}
        self.timeout_s = timeout_s

    def run(self) -> None:
        end = time.monotonic() + self.timeout_s
        while self.actions and time.monotonic() < end:
            for name, (job, pattern, count, argv) in list(self.actions.items()):
                if len(re.findall(pattern, job.text())) >= count:
                    proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
                    if proc.returncode:
                        self.errors[name] = f"{argv}: exit {proc.returncode}: {proc.stderr}"
                    self.sent[name] = time.monotonic()
                    del self.actions[name]
            time.sleep(0.3)
        for name, (job, pattern, count, _) in self.actions.items():
            self.errors[name] = f"{pattern!r} x{count} not in the output of {job.job_id} within {self.timeout_s:g}s"

    def check(self, name: str, job: Job) -> None:
        """Fail unless the signal of ``name`` went out (waiting for the driver as long as it runs)."""
        while name not in self.sent and name not in self.errors and self.is_alive():
            time.sleep(0.3)
        if name in self.errors or name not in self.sent:
            pytest.fail(f"{name}: {self.errors.get(name, 'not sent')}\n{job.text()[-4000:]}")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Job], Driver]]:
    problem = _cluster_problem()
    if problem is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true and the Slurm tests cannot run: {problem}")
        pytest.skip(problem)
    root = tmp_path_factory.mktemp("slurm")
    submitted: dict[str, Job] = {}

    def submit(name: str, sbatch_options: list[str], guard_args: list[str]) -> None:
        submitted[name] = _submit(root, name, sbatch_options, guard_args)

    try:
        # Preempted once (SIGTERM to the whole job, as a preemption sends), requeued by the guard, resumed, finished.
        submit("requeue", ["--time=5", "--requeue"],
               [*FAST, "--grace", "10s", "--requeue", "--push-to", str(root / "requeue" / "dest"),
                str(REPO / "examples" / "train_loop.py"), "--steps", "50", "--save-every", "100000",
                "--log-every", "10", "--output-dir", str(root / "requeue" / "out")])
        # --time=2: the limit comes from scontrol (22.05 sets no SLURM_JOB_END_TIME); a loop that saves ckpt.pt
        # when the guard asks (--api=True) and never on its own, so the request's time shows the margin.
        submit("deadline", ["--time=2"],
               [*FAST, "--push-to", str(root / "deadline" / "dest"), NANO,
                f"--out_dir={root / 'deadline' / 'out'}", "--eval_interval=100000", "--step_s=0.05", "--api=True"])
        # scancel: SIGTERM to the job's processes, SIGKILL KillWait (30 s) later.
        submit("scancel", ["--time=5"],
               [*FAST, "--grace", "10s", "--push-to", str(root / "scancel" / "dest"), NANO,
                f"--out_dir={root / 'scancel' / 'out'}", "--eval_interval=40", "--step_s=0.05"])
        # --signal=B:USR1@100 on a 3-minute job: SIGUSR1 to the batch step (the guard) at 80 s, or up to 60 s
        # earlier ("Due to the resolution of event handling by Slurm", sbatch(1)); the guard's own deadline stop
        # comes later (180 s less a margin of at most 90 s).
        submit("usr1", ["--time=3", "--signal=B:USR1@100"],
               [*FAST, "--grace", "10s", "--push-to", str(root / "usr1" / "dest"), NANO,
                f"--out_dir={root / 'usr1' / 'out'}", "--eval_interval=40", "--step_s=0.05"])
        # An srun job step with two tasks under one guard.
        submit("srun", ["--time=3", "--ntasks=2"],
               [*FAST, "--", "srun", "--ntasks=2", sys.executable, str(JOBS / "plain_loop.py"), "--steps", "40",
                "--step-s", "0.05"])
    except BaseException:
        for job in submitted.values():
            subprocess.run(["scancel", job.job_id], check=False, timeout=20)
        raise
    requeue, cancel = submitted["requeue"], submitted["scancel"]
    driver = Driver({
        # a preemption's SIGTERM to every process of the job (not a cancel): the guard secures, then requeues
        "requeue": (requeue, r"step=10 ", 1, ["scancel", "--signal=TERM", "--full", requeue.job_id]),
        "scancel": (cancel, SAVED, 3, ["scancel", cancel.job_id]),
    })
    driver.start()
    yield submitted, driver
    for job in submitted.values():  # whatever a failed test left behind
        if job.show().get("JobState") not in TERMINAL:
            subprocess.run(["scancel", job.job_id], check=False, timeout=20)


def _saved_steps(job: Job) -> list[int]:
    return [int(s) for s in re.findall(SAVED, job.text())]


def test_time_limit_found_through_scontrol_is_the_budget(jobs: tuple[dict[str, Job], Driver]) -> None:
    import torch

    job = jobs[0]["deadline"]
    info = job.wait_end(timeout_s=210)
    text = job.text()
    assert info["ExitCode"] == "75:0", (info, text[-3000:])
    assert re.search(r"budget +pass +timeout 2m \(from scontrol EndTime\)", text), text[:6000]
    assert re.search(r"distributed +n/a +one process", text) and "launcher detected" not in text
    [verdict] = job.verdicts()
    fields = job.fields(verdict)
    assert (fields["status"], fields["reason"], fields["exit"], fields["secured"]) == (
        "TIMEOUT", "deadline", "75", "yes"), verdict
    # The checkpoint is asked for at the end less the margin, at most half the 120 s budget (no 98 s margin
    # before any measurement, no 60 s floor under an exact end time): the job trained for most of it.
    assert float(fields["elapsed"]) >= 45, verdict
    # the one save, the one the guard asked for (the agent reports it: "checkpoint saved by the job: PATH (step N")
    [saved] = [int(n) for n in re.findall(r"checkpoint saved by the job: \S+ \(step (\d+),", text)]
    secured = torch.load(job.folder / "dest" / "last-checkpoint" / "ckpt.pt")
    assert secured["iter_num"] == saved > 100, (secured["iter_num"], saved)
    assert f"resumes from step {saved}" in fields["hint"]
    assert job.leftovers() == []


def test_scancel_secures_the_newest_save(jobs: tuple[dict[str, Job], Driver]) -> None:
    import torch

    job = jobs[0]["scancel"]
    jobs[1].check("scancel", job)
    info = job.wait_end(timeout_s=90)
    text = job.text()
    [verdict] = job.verdicts()
    fields = job.fields(verdict)
    assert (fields["status"], fields["exit"], fields["secured"]) == ("INTERRUPTED", "75", "yes"), verdict
    assert info["JobState"] == "CANCELLED", info
    secured = torch.load(job.folder / "dest" / "last-checkpoint" / "ckpt.pt")
    assert secured["iter_num"] == max(_saved_steps(job)), (secured["iter_num"], _saved_steps(job), text[-3000:])
    assert job.leftovers() == []


def test_signal_usr1_before_the_limit_stops_the_job_with_its_checkpoint(jobs: tuple[dict[str, Job], Driver]) -> None:
    import torch

    job = jobs[0]["usr1"]
    info = job.wait_end(timeout_s=240)
    text = job.text()
    assert info["ExitCode"] == "75:0", (info, text[-3000:])
    [verdict] = job.verdicts()
    fields = job.fields(verdict)
    assert (fields["status"], fields["exit"], fields["secured"]) == ("INTERRUPTED", "75", "yes"), verdict
    assert fields.get("signal") == "SIGUSR1", verdict
    assert float(fields["elapsed"]) < 90, verdict  # the signal, not the limit, ended it
    secured = torch.load(job.folder / "dest" / "last-checkpoint" / "ckpt.pt")
    assert secured["iter_num"] == max(_saved_steps(job)), (secured["iter_num"], _saved_steps(job))
    assert job.leftovers() == []


def test_srun_step_with_two_tasks_under_one_guard(jobs: tuple[dict[str, Job], Driver]) -> None:
    job = jobs[0]["srun"]
    info = job.wait_end(timeout_s=150)
    text = job.text()
    assert info["ExitCode"] == "0:0" and info["JobState"] == "COMPLETED", (info, text[-3000:])
    assert text.count("training finished") == 2, text[-3000:]  # both tasks ran to their end
    assert re.search(r"distributed +pass +world size 2", text), text[:6000]
    [verdict] = job.verdicts()
    assert job.fields(verdict)["status"] == "PASS" and job.fields(verdict)["exit"] == "0", verdict
    assert job.leftovers() == []


def test_requeue_after_a_preemption_resumes_and_finishes(jobs: tuple[dict[str, Job], Driver]) -> None:
    import torch

    job = jobs[0]["requeue"]
    jobs[1].check("requeue", job)
    job.wait_for_text(r"VERDICT: ", timeout_s=90)
    first = job.fields(job.verdicts()[0])
    assert (first["status"], first["exit"], first["secured"]) == ("INTERRUPTED", "75", "yes"), first
    secured_step = int(first["hint"].split("resumes from step ", 1)[1].split(";")[0].split(":")[0])
    marker = job.folder / "dest" / "last-checkpoint" / "guard_checkpoint.json"
    assert json.loads(marker.read_text())["step"] == secured_step
    weights = torch.load(job.folder / "dest" / "last-checkpoint" / "model.pt")
    assert weights and all(torch.isfinite(v).all() for v in weights.values())
    # Requeued (eligible cred_expire=30 s later), the same id runs again with SLURM_RESTART_COUNT=1 and resumes.
    info = job.wait_end(timeout_s=240, restarts=1)
    text = job.text()
    assert info["Restarts"] == "1" and info["ExitCode"] == "0:0", (info, text[-3000:])
    assert len(job.verdicts()) == 2, text[-3000:]
    second = job.fields(job.verdicts()[1])
    assert (second["status"], second["exit"]) == ("PASS", "0"), second
    assert "resumed_from" in second, second
    assert f"at step {secured_step}" in text  # train_loop.py: "resumed from PATH at step N"
    assert job.leftovers() == []
