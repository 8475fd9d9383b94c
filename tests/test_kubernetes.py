"""The Kubernetes examples agree with the guard (issue 36): each manifest under ``examples/kubernetes/`` runs the
guard as the container's command, gives ``--grace`` the pod's ``terminationGracePeriodSeconds`` and ``--timeout``
its ``activeDeadlineSeconds``, and keys its ``podFailurePolicy`` on the contract's exit codes; its options parse as
the guard parses them. Then what a pod's end looks like to the guard, end to end: the guard as PID 1 of a new PID
namespace (``unshare --pid --fork``, as a container gives it), SIGTERM from outside the namespace, the grace, the
SIGKILL, the VERDICT; and a SIGTERM that a process of the job sends to PID 1."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO, guard_env, kill_quietly

from guard.contract import ExitCode
from guard.core.durations import parse_duration
from guard.run.cli import build_config

MANIFESTS = sorted((REPO / "examples" / "kubernetes").glob("*.yaml"))


def _jobs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc and doc["kind"] == "Job"]


def _option(command: list[str], flag: str) -> str:
    guard_part = command[:command.index("--")] if "--" in command else command
    return guard_part[guard_part.index(flag) + 1]


def test_there_are_a_job_and_an_indexed_job() -> None:
    names = {path.name for path in MANIFESTS}
    assert {"job.yaml", "indexed-job.yaml"} <= names
    modes = {job["spec"].get("completionMode", "NonIndexed") for path in MANIFESTS for job in _jobs(path)}
    assert modes == {"NonIndexed", "Indexed"}


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_grace_and_timeout_come_from_the_pods_values(path: Path) -> None:
    for job in _jobs(path):
        pod = job["spec"]["template"]["spec"]
        container = pod["containers"][0]
        command = [str(word) for word in container["command"]]
        assert command[0] == "jobguard"
        assert parse_duration(_option(command, "--grace")) == pod["terminationGracePeriodSeconds"]
        assert parse_duration(_option(command, "--timeout")) == pod["activeDeadlineSeconds"]
        assert pod["restartPolicy"] == "Never"  # a podFailurePolicy needs it


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_failure_policy_reads_the_contracts_exit_codes(path: Path) -> None:
    for job in _jobs(path):
        container = job["spec"]["template"]["spec"]["containers"][0]["name"]
        rules = job["spec"]["podFailurePolicy"]["rules"]
        by_code: dict[int, str] = {}
        for rule in rules:
            on = rule.get("onExitCodes")
            if on is not None:
                assert on["containerName"] == container and on["operator"] == "In"
                by_code.update(dict.fromkeys(on["values"], rule["action"]))
        assert by_code == {ExitCode.USAGE: "FailJob", ExitCode.PREFLIGHT: "FailJob", ExitCode.NON_FINITE: "FailJob",
                           ExitCode.SECURED: "Ignore"}
        assert any(rule["action"] == "Ignore" and {"type": "DisruptionTarget"} in rule.get("onPodConditions", [])
                   for rule in rules)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_the_command_parses_as_the_guard_parses_it(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                   ) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    for job in _jobs(path):
        command = [str(word) for word in job["spec"]["template"]["spec"]["containers"][0]["command"]]
        if "--" in command:  # a launcher command: what is after -- need not exist here
            command = [*command[:command.index("--") + 1], sys.executable, "train.py"]
        config = build_config(command[1:], {})
        assert config.settings.watch.grace_s == job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


# -- the guard as PID 1 of its own PID namespace -----------------------------------------------------------------


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


needs_unshare = pytest.mark.skipif(sys.platform != "linux" or not _unshare_works(),
                                   reason="needs unshare --pid --fork --mount-proc (root or user namespaces)")


def _start_as_pid_1(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-m",
                             "guard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=guard_env(), start_new_session=True)


def _guard_pid(unshare: subprocess.Popen[str], timeout_s: float = 60.0) -> int:
    """The guard's pid as seen from here (it is 1 inside): unshare's one child."""
    import psutil

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        children = psutil.Process(unshare.pid).children()
        if children:
            return children[0].pid
        time.sleep(0.05)
    raise AssertionError("unshare started no guard")


@pytest.mark.slow
@needs_unshare
def test_a_pods_end_sigterm_grace_sigkill_to_a_guard_that_is_pid_1(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    # the job ignores SIGTERM (a loop that never checks): the guard's SIGKILL follows --grace
    script = f"trap '' TERM; echo loss=1.0; echo $$ > {shlex.quote(str(ready))}; sleep 120"
    proc = _start_as_pid_1(["--no-preflight", "--grace", "3s", "--", "sh", "-c", script])
    try:
        guard = _guard_pid(proc)
        end = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < end:
            time.sleep(0.05)
        assert ready.exists(), proc.stderr.read() if proc.stderr else ""
        assert int(ready.read_text()) != 1  # the job runs under the guard, which is PID 1 in there
        sent = time.monotonic()
        os.kill(guard, signal.SIGTERM)  # from outside the namespace, as the kubelet's (si_pid 0 in there)
        out, err = proc.communicate(timeout=60)
        took_s = time.monotonic() - sent
    finally:
        kill_quietly(proc)
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("VERDICT: INTERRUPTED reason=signal exit=143 "), out + err
    assert "SIGKILL" in err  # the job outlived its grace
    assert took_s >= 2.4  # the grace was given, less a fifth: the VERDICT comes before the platform's SIGKILL
    assert proc.returncode == 143


@pytest.mark.slow
@needs_unshare
def test_a_sigterm_a_process_of_the_job_sends_to_pid_1_is_the_jobs_failure() -> None:
    proc = _start_as_pid_1(["--no-preflight", "--", "sh", "-c",
                            "echo loss=1.0; sleep 0.5; kill -TERM 1; sleep 1; exit 75"])
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        kill_quietly(proc)
    verdict = out.strip().splitlines()[-1]
    # 75 would read "secured, resume" to a podFailurePolicy: the job's own 75 is exit 1, job_exit=75
    assert verdict.startswith("VERDICT: FAIL reason=crash exit=1 "), out + err
    assert "job_exit=75" in verdict and proc.returncode == 1
    assert "a process of the job itself" in err
