"""End to end: a command line that never leaks or misleads (issue 21): secrets after a space, bare flags,
misplaced values, folder destinations, on/off, the exit codes in --help, a VERDICT after \\r, the options dump."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import JOBS, guard_env, run_guard

pytestmark = pytest.mark.slow

SECRET = "wb-0123456789abcdefSECRET"


def test_a_secret_after_an_option_with_a_space_is_masked_in_the_guards_lines_and_the_jobs_output() -> None:
    run = run_guard(["--no-preflight", str(JOBS / "fake_verdict.py"), "--code", "0", "--wandb-api-key", SECRET])
    both = run.stdout + run.stderr
    assert SECRET not in both, both
    assert SECRET.encode().hex() not in both  # its hex form
    assert "job (script form):" in run.stderr and "--wandb-api-key ***" in run.stderr
    assert "Authorization: Basic " in run.stdout and "hex ***" in run.stdout


def test_a_verdict_after_a_carriage_return_is_escaped_like_one_at_a_line_start() -> None:
    proc = subprocess.run([sys.executable, "-m", "guard", "--no-preflight", str(JOBS / "fake_verdict.py"),
                           "--code", "9"], capture_output=True, env=guard_env(), timeout=120)
    stdout = proc.stdout.decode()  # bytes as written: text mode would turn the \r into \n
    assert "\r[job] VERDICT: PASS" in stdout, repr(stdout)
    for piece in stdout.splitlines():  # splits at \r as terminals do: no job line reads as the guard's
        assert not piece.startswith("VERDICT: PASS"), repr(piece)
    assert proc.returncode == 9 and stdout.splitlines()[-1].startswith("VERDICT: FAIL reason=crash")


def test_bare_launch_smoke_means_on_and_a_misplaced_value_gets_its_options_usage_error(tmp_path: Path) -> None:
    bare = run_guard(["--launch-smoke", "--no-preflight", str(JOBS / "echo_args.py")])
    assert bare.returncode == 0, bare.stdout + bare.stderr
    assert "--launch-smoke on (flag)" in bare.stderr
    wrong = run_guard(["--resume", "maybe", str(JOBS / "echo_args.py")], cwd=tmp_path)
    assert wrong.returncode == 2
    assert "--resume" in wrong.stderr and "maybe" in wrong.stderr and "script not found" not in wrong.stderr
    assert "if-valid" in wrong.stderr  # the accepted values
    switch = run_guard(["--dry-run", "yes", str(JOBS / "echo_args.py")], cwd=tmp_path)
    assert switch.returncode == 2 and "--dry-run takes no value" in switch.stderr, switch.stderr


def test_on_off_options_print_on_off_and_the_dump_shows_only_options_set_at_info(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    run = run_guard(["--no-preflight", "--background-push", "off", "--report", str(report),
                     str(JOBS / "echo_args.py")])
    assert run.returncode == 0, run.stderr
    assert "--background-push off (flag)" in run.stderr and "True" not in run.stderr and "False" not in run.stderr
    assert "--sanity-steps" not in run.stderr  # at its default
    options = json.loads(report.read_text())["details"]["options"]
    assert options["--sanity-steps"] == {"value": "5", "source": "default"}
    assert options["--background-push"] == {"value": "off", "source": "flag"}
    debug = run_guard(["--no-preflight", str(JOBS / "echo_args.py")], env={"GUARD_LOG_LEVEL": "DEBUG"})
    assert "--sanity-steps" in debug.stderr


def test_help_lists_the_exit_codes() -> None:
    run = run_guard(["--help"])
    assert run.returncode == 0
    tail = run.stdout[run.stdout.index("Exit codes"):]
    for code in ("0 ", "2 ", "3 ", "4 ", "5 ", "6 ", "7 ", "70 ", "75 ", "124 ", "128+N"):
        assert f"  {code}" in tail or f"    {code}" in tail, tail
    assert "README." not in tail


# A folder destination in the VERDICT's pushed= field (the folder, no "@revision"): checked on the run of
# tests/test_reported_failures_e2e.py's test_an_abort_after_training_completed_and_saved_is_a_pass_with_a_warning_...
