"""The stages of a run (``guard.run.stages``) with fake collaborators: a supervisor that records what it was given
instead of starting a job, preflight reports made by hand, and a runner instead of ``scontrol``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from guard import protocol
from guard.contract import RunResult
from guard.core.masking import Masker
from guard.errors import PreflightError
from guard.preflight import CheckResult
from guard.run import stages
from guard.run import supervisor as supervisor_module
from guard.run.cli import build_config
from guard.run.config import Config


class RecordingSupervisor:
    """Stands in for ``Supervisor``: keeps its arguments, returns a PASS."""

    made: ClassVar[list[RecordingSupervisor]] = []

    def __init__(self, config: Config, **kwargs: Any) -> None:
        self.config, self.kwargs = config, kwargs
        RecordingSupervisor.made.append(self)

    def run(self) -> RunResult:
        return RunResult("PASS", "ok", 0, 1.0)


class RecordingStart:
    """Stands in for ``JobStart``: keeps the job's command and environment, starts nothing."""

    def __init__(self, command: list[str], environ: Mapping[str, str], **settings: Any) -> None:
        self.command, self.environ, self.settings = command, dict(environ), settings
        self.begun = self.aborted = False

    @classmethod
    def of(cls, command: list[str], environ: Mapping[str, str], watch: Any, **kwargs: Any) -> RecordingStart:
        return cls(command, environ, watch=watch, **kwargs)

    def begin(self) -> None:
        self.begun = True

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> type[RecordingSupervisor]:
    RecordingSupervisor.made = []
    monkeypatch.setattr(supervisor_module, "Supervisor", RecordingSupervisor)
    monkeypatch.setattr(stages, "JobStart", RecordingStart)
    return RecordingSupervisor


def config(tmp_path: Path, *options: str, env: Mapping[str, str] | None = None) -> Config:
    script = tmp_path / "train.py"
    script.write_text("print('loss=1.0')\n")
    return build_config([*options, str(script), "--epochs", "1"], dict(env if env is not None else os.environ))


def test_the_supervisor_gets_securing_the_heartbeat_and_the_settings_check(
        tmp_path: Path, supervisor: type[RecordingSupervisor]) -> None:
    out = tmp_path / "out"
    result = stages.run_job(config(tmp_path, "--no-preflight", "--timeout", "2h", "--output-dir", str(out)),
                            Masker(), time.monotonic())
    assert (result.status, result.reason) == ("PASS", "ok")
    assert result.details["platform"]["name"]
    (made,) = supervisor.made
    securing = made.kwargs["securer"]
    assert securing.output_dir == str(out) and securing.deadline.timeout_s == 7200.0
    assert made.kwargs["heartbeat"] is not None
    rows = made.kwargs["trainer_config_check"]({"output_dir": str(out), "save_strategy": "no", "max_steps": 10})
    assert rows and all(isinstance(row, CheckResult) for row in rows)
    assert made.config.command[-2:] == ("--epochs", "1")


def test_a_failed_preflight_never_starts_the_job(tmp_path: Path, supervisor: type[RecordingSupervisor],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    failed = CheckResult("disk", "fail", "1.0 GB free", hint="free some space")
    report = SimpleNamespace(failed=failed, results=(failed,), gpus=None, to_json=lambda: {"rows": 1})
    monkeypatch.setattr(stages, "_run_preflight", lambda *args, **kwargs: report)
    result = stages.run_job(config(tmp_path), Masker(), time.monotonic())
    assert (result.status, result.reason, result.exit_code) == ("FAIL", "preflight", 3)
    assert result.extra["check"] == "disk" and result.hint == "free some space"
    assert supervisor.made == []


def test_a_signal_during_preflight_interrupts_before_the_job(tmp_path: Path, supervisor: type[RecordingSupervisor],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_preflight(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler only records it
        time.sleep(5)

    monkeypatch.setattr(stages, "_run_preflight", slow_preflight)
    result = stages.run_job(config(tmp_path), Masker(), time.monotonic())
    assert (result.status, result.reason, result.exit_code) == ("INTERRUPTED", "signal", 143)
    assert supervisor.made == [] and stages.abandoned_work
    stages.abandoned_work = False


def test_resume_needs_a_destination(tmp_path: Path, supervisor: type[RecordingSupervisor]) -> None:
    with pytest.raises(PreflightError) as info:
        stages.run_job(config(tmp_path, "--no-preflight", "--resume", "on"), Masker(), time.monotonic())
    assert info.value.check == "resume" and "--push-to" in (info.value.hint or "")


def test_a_resumed_checkpoint_reaches_the_job(tmp_path: Path, supervisor: type[RecordingSupervisor],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from guard.secure import resume
    from guard.secure.checkpoints import describe

    folder = tmp_path / "out" / "checkpoint-30"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"1" * 100)
    fetched = resume.ResumeFrom(path=folder, step=30, revision="abc123", size_bytes=100, source="destination",
                                info=describe(folder, step=30))
    monkeypatch.setattr(resume, "choose", lambda *args, **kwargs: fetched)
    monkeypatch.setattr(stages, "_securer_factory", lambda environ, run_id=None: lambda text: SimpleNamespace(
        destination=text, token=None, tidy=lambda **_: None))
    result = stages.run_job(config(tmp_path, "--no-preflight", "--resume", "on", "--push-to", "alice/run",
                                   "--output-dir", str(tmp_path / "out")), Masker(), time.monotonic())
    (made,) = supervisor.made
    start = made.kwargs["start"]
    assert start.begun and start.environ[protocol.ENV_RESUME_PATH] == str(folder)
    assert start.environ[protocol.ENV_RESUME_STEP] == "30"
    assert made.kwargs["securer"].intake.latest_reported.step == 30
    assert result.extra["resumed_from"] == f"{folder}@abc123"


def test_the_output_folder_and_where_it_came_from(tmp_path: Path) -> None:
    assert stages.output_folder(config(tmp_path, "--output-dir", "/data/out")) == ("/data/out", "--output-dir")
    script = tmp_path / "train.py"
    from_args = build_config([str(script), "--output_dir", "runs/a"], dict(os.environ))
    assert stages.output_folder(from_args) == ("runs/a", "the job's --output_dir argument")
    assert stages.output_folder(config(tmp_path))[0] is None


def test_preflight_only_without_checks_passes(tmp_path: Path) -> None:
    result = stages.preflight_only(config(tmp_path, "--no-preflight"), Masker(), time.monotonic())
    assert (result.status, result.reason, result.exit_code) == ("PASS", "ok", 0)


def test_requeue_runs_scontrol_only_after_a_secured_stop_under_slurm(tmp_path: Path) -> None:
    calls: list[list[str]] = []

    def runner(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    slurm = config(tmp_path, "--requeue", env={**os.environ, "SLURM_JOB_ID": "77"})
    old = signal.getsignal(signal.SIGTERM)
    try:
        stages.requeue(slurm, RunResult("FAIL", "crash", 1, 1.0), runner=runner)
        assert calls == []
        secured = RunResult("TIMEOUT", "deadline", 75, 1.0)
        stages.requeue(slurm, secured, runner=runner)
        assert calls == [["scontrol", "requeue", "77"]] and secured.details["requeue"] == "requeued"
        # many nodes: node 0's guard requeues (once the others said their VERDICT), never another node's too
        node1 = config(tmp_path, "--requeue", env={**os.environ, "SLURM_JOB_ID": "77", "SLURM_NODEID": "1",
                                                   "SLURM_NNODES": "2"})
        stages.requeue(node1, RunResult("TIMEOUT", "deadline", 75, 1.0), runner=runner)
        node0 = config(tmp_path, "--requeue", env={**os.environ, "SLURM_JOB_ID": "77", "SLURM_NODEID": "0",
                                                   "SLURM_NNODES": "2"})
        stages.requeue(node0, RunResult("TIMEOUT", "deadline", 75, 1.0), runner=runner)
        assert calls == [["scontrol", "requeue", "77"]] * 2
    finally:
        signal.signal(signal.SIGTERM, old)


def test_a_guard_failure_after_the_job_started_leaves_no_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job starts before securing is built: a fault in building it (the guard's own) kills and reaps the job,
    and restores the signal handlers."""
    from guard.run import start as start_module
    from guard.secure import securing as securing_module

    def broken(**kwargs: Any) -> None:
        raise RuntimeError("a fault while building securing")

    started: list[Any] = []

    class Spy(start_module.JobStart):
        def begin(self) -> Any:
            job = super().begin()
            started.append(job)
            return job

    monkeypatch.setattr(securing_module, "Securing", broken)
    monkeypatch.setattr(stages, "JobStart", Spy)
    monkeypatch.setattr(start_module, "set_subreaper", lambda: False)  # not for the test process
    before = signal.getsignal(signal.SIGTERM)
    job_config = build_config(["--no-preflight", "--", sys.executable, "-c", "import time; time.sleep(60)"],
                              dict(os.environ))
    with pytest.raises(RuntimeError, match="building securing"):
        stages.run_job(job_config, Masker(), time.monotonic())
    (job,) = started
    assert job.proc.returncode == -signal.SIGKILL  # killed and reaped, not left running
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_job_starts_before_the_policies_are_imported(tmp_path: Path) -> None:
    """What the job's first line waits for: the guard starts the job, then imports securing, the loop and
    telemetry (their imports run while the job's interpreter starts). A fresh interpreter records which modules
    were loaded when the job was started."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, sys\n"
        "from guard.run import cli, start\n"
        "begin = start.JobStart.begin\n"
        "seen = {}\n"
        "def recording(self):\n"
        "    seen.setdefault('loaded', sorted(m for m in sys.modules if m.startswith('guard.')))\n"
        "    return begin(self)\n"
        "start.JobStart.begin = recording\n"
        "code = cli.main(['--no-preflight', '--', sys.executable, '-c', 'print(1)'])\n"
        "print('LOADED ' + json.dumps(seen['loaded']))\n"
        "sys.exit(code)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("LOADED ")]
    loaded = set(json.loads(line.removeprefix("LOADED ")))
    assert "guard.run.start" in loaded and "guard.run.process" in loaded
    policies = {"guard.secure.securing", "guard.secure.plan", "guard.secure.events", "guard.run.supervisor",
                "guard.run.watchdog", "guard.observe.telemetry", "guard.observe.alerts"}
    assert not loaded & policies


def test_the_jobs_first_lines_pass_through_while_the_policies_are_built(tmp_path: Path) -> None:
    """The job's output is passed through from its start (``pipes.EarlyRelay``), not held in the pipe until the
    loop runs: with the policies' build held back until the job's first line reached the guard's stdout (a file
    here), the line does get there, and every line once, in order, after the hand-over too."""
    probe, out = tmp_path / "probe.py", tmp_path / "out.txt"
    probe.write_text(
        "import sys, time\n"
        "from pathlib import Path\n"
        "from guard.run import cli, stages\n"
        "build = stages._supervisor\n"
        "def held(*args, **kwargs):\n"
        "    end = time.monotonic() + 30\n"
        f"    while b'first' not in Path({str(out)!r}).read_bytes() and time.monotonic() < end:\n"
        "        time.sleep(0.05)\n"
        f"    print('SEEN DURING BUILD', b'first' in Path({str(out)!r}).read_bytes(), file=sys.stderr)\n"
        "    return build(*args, **kwargs)\n"
        "stages._supervisor = held\n"
        "job = 'import time; print(\"first\", flush=True); time.sleep(0.5); print(\"second\", flush=True)'\n"
        "sys.exit(cli.main(['--no-preflight', '--', sys.executable, '-c', job]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    with out.open("wb") as stdout:
        done = subprocess.run([sys.executable, str(probe)], stdout=stdout, stderr=subprocess.PIPE, text=True,
                              env=env, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "SEEN DURING BUILD True" in done.stderr
    lines = out.read_text().splitlines()
    assert lines[:2] == ["first", "second"] and lines[2].startswith("VERDICT: PASS"), lines


def test_a_run_ends_without_scanning_proc_when_the_guard_has_no_child_left(tmp_path: Path) -> None:
    """After a clean job's exit the guard has no child: the end of the run (the reaper, the last checks that the
    job's tree is gone) does not list the machine's processes (psutil reads every ``/proc/PID/stat``; it is not
    even imported), and ``python -m guard``'s exit skips the interpreter's finalization but loses nothing: the
    guard's lines, the job's and the VERDICT are all there, with the exit code."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import sys\n"
        "from guard.run import cli\n"
        "code = cli.main(['--no-preflight', '--', sys.executable, '-c', 'print(\"hello\")'])\n"
        "print('PSUTIL', 'psutil' in sys.modules)\n"
        "print('buffered, not flushed', end='')\n"  # what leave() must flush before os._exit
        "cli.leave(code + 3)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    done = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 3, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "hello" and lines[1].startswith("VERDICT: PASS"), lines
    assert "PSUTIL False" in lines and lines[-1] == "buffered, not flushed", lines
    assert "[guard] job exited: 0" in done.stderr


def test_a_profiled_guard_still_ends_through_the_interpreter_so_the_profile_is_written(tmp_path: Path) -> None:
    """``python -m cProfile -o F -m guard ...`` writes F when the interpreter ends; the guard's fast exit
    (``os._exit``) would lose it, so under a profiler ``leave`` exits through ``SystemExit`` (whose code cProfile's
    ``runctx`` itself swallows: its exit status is 0 whatever the script's)."""
    stats = tmp_path / "guard.prof"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    done = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(stats), "-m", "guard", "--no-preflight", "--",
                           sys.executable, "-c", "raise SystemExit(3)"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.splitlines()[-1].startswith("VERDICT: FAIL"), (done.stdout, done.stderr)
    assert stats.stat().st_size > 0


@pytest.mark.parametrize(("script", "args", "told"), [
    # accelerate's complete_nlp_example.py, transformers' run_*_no_trainer.py
    ('parser.add_argument("--resume_from_checkpoint", type=str, default=None)\n', [],
     f"--resume_from_checkpoint {Path('out') / 'step_100'}"),
    ('parser.add_argument("--resume_from_checkpoint", type=str, default=None)\n',
     ["--resume_from_checkpoint", "out/step_50"], None),
    # nanoGPT's train.py: init_from = 'scratch' # 'scratch' or 'resume'; loads out_dir/ckpt.pt when told
    ("init_from = 'scratch'\nif init_from == 'resume':\n    pass\n", ["--out_dir=out"], "--init_from=resume"),
    ("init_from = 'scratch'\nif init_from == 'resume':\n    pass\n", ["--init_from=resume"], None),
    ("import torch\n", [], None),  # a script that loads what guard.resume_path() names, or nothing
])
def test_the_resume_hint_names_what_the_script_needs_to_load_it(
        script: str, args: list[str], told: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tried: complete_nlp_example.py and nanoGPT's train.py stopped at a deadline said 'the next run resumes from
    # step 100: jobguard --resume on --push-to DEST ...'; run so, each started from scratch beside the fetched
    # checkpoint (they load one only with --resume_from_checkpoint PATH, --init_from=resume).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(script)
    config = build_config(["train.py", *args], {})
    assert stages.script_resume_args(config, str(tmp_path / "out" / "step_100")) == told
