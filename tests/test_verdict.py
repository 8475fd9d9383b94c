"""Tests for ``guard.contract``: the VERDICT line's grammar, and the atomic JSON report."""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
from pathlib import Path

import pytest

from guard.contract import RunResult, render_line, report_dict, signal_name, write_report
from guard.core.masking import Masker


def fields(line: str) -> tuple[str, dict[str, str], list[str]]:
    """Split a VERDICT line as a log monitor does: status, KEY=VALUE dict, key order."""
    assert line.startswith("VERDICT: ")
    parts = shlex.split(line[len("VERDICT: "):])
    pairs = [p.split("=", 1) for p in parts[1:]]
    return parts[0], dict(pairs), [k for k, _ in pairs]


def test_minimal_line() -> None:
    line = render_line(RunResult("PASS", "ok", 0, 12.345))
    assert line == "VERDICT: PASS reason=ok exit=0 elapsed=12.3"


def test_docstring_example() -> None:
    line = render_line(RunResult("FAIL", "non_finite_loss", 4, 12.34, step=3, loss=float("nan")))
    assert line == "VERDICT: FAIL reason=non_finite_loss exit=4 elapsed=12.3 step=3 loss=nan"


@pytest.mark.parametrize("value", [
    "plain",
    "two words",
    "it's quoted",
    'say "hi"',
    "a;b|c&d $(rm -rf /) `x`",
    "back\\slash",
    "",
    "=",
    "tab\there",
])
def test_values_round_trip_through_shlex(value: str) -> None:
    result = RunResult("TIMEOUT", "deadline", 75, 1.0, extra={"checkpoint": value, "pushed": f"hf://a/b@{value}"},
                       hint=value)
    status, parsed, _ = fields(render_line(result))
    assert status == "TIMEOUT"
    assert parsed["checkpoint"] == value
    assert parsed["pushed"] == f"hf://a/b@{value}"
    if value:
        assert parsed["hint"] == value


def test_keys_come_in_the_fixed_order() -> None:
    result = RunResult(
        "TIMEOUT", "deadline", 75, 3600.04, step=120, loss=1.23456789,
        extra={"zzz_custom": 1, "signal": "SIGTERM", "secured": True, "pushed": "hf://a/b@abc123",
               "checkpoint": "out/checkpoint-120", "rank": 0},
        hint="resume from the checkpoint",
    )
    _status, parsed, order = fields(render_line(result))
    assert order == ["reason", "exit", "elapsed", "step", "loss", "rank", "checkpoint", "pushed", "secured",
                     "signal", "hint", "zzz_custom"]
    assert parsed["elapsed"] == "3600.0"
    assert parsed["loss"] == "1.23457"
    assert parsed["secured"] == "yes"
    assert parsed["rank"] == "0"  # a zero is known, not missing


def test_unknown_values_are_left_out() -> None:
    _, parsed, _ = fields(render_line(RunResult("FAIL", "crash", 1, 0.0, extra={"checkpoint": None})))
    assert set(parsed) == {"reason", "exit", "elapsed"}


def test_one_line_whatever_the_hint_holds() -> None:
    hint = "first line\nsecond line\r\nthird\x0bfourth\u2028fifth"
    line = render_line(RunResult("FAIL", "crash", 1, 0.0, hint=hint))
    assert len(line.splitlines()) == 1
    assert "\n" not in line and "\r" not in line
    _, parsed, _ = fields(line)
    assert parsed["hint"].startswith("first line second line")
    assert parsed["exit"] == "1"


def test_secrets_are_masked_in_the_line() -> None:
    masker = Masker(["s3cr3t-Value-1234567"])
    hint = "push to https://user:s3cr3t-Value-1234567@host failed; hf_" + "a" * 34
    line = render_line(RunResult("FAIL", "push_failed", 6, 0.0, hint=hint), masker)
    assert "s3cr3t" not in line and "hf_aaa" not in line
    _, parsed, _ = fields(line)
    assert parsed["hint"] == "push to https://user:***@host failed; ***"


def test_a_secret_with_a_single_quote_is_masked() -> None:
    secret = "pa'ss-word-123"
    line = render_line(RunResult("FAIL", "crash", 1, 0.0, hint=f"url https://u:{secret}@h failed"), Masker([secret]))
    _, parsed, _ = fields(line)
    assert secret not in parsed["hint"]


def test_unknown_status_is_refused() -> None:
    with pytest.raises(ValueError, match="OK"):
        RunResult("OK", "ok", 0)


def test_signal_name() -> None:
    assert signal_name(signal.SIGTERM) == "SIGTERM"
    assert signal_name(signal.SIGKILL) == "SIGKILL"
    assert signal_name(200) == "SIG200"


# ---------------------------------------------------------------------------------------------------------------
# JSON report
# ---------------------------------------------------------------------------------------------------------------


def _strict_load(path: Path) -> dict:
    def refuse(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_report_is_strict_json_with_nan_as_a_string(tmp_path: Path) -> None:
    result = RunResult("FAIL", "non_finite_loss", 4, 1.23456, step=3, loss=math.nan, sanity=[2.5, 2.4, math.inf],
                       details={"nested": {"x": -math.inf, "ok": 1.5}, "rows": [(1, math.nan)]})
    target = tmp_path / "sub" / "report.json"
    write_report(target, result)
    data = _strict_load(target)
    assert data["status"] == "FAIL" and data["exit_code"] == 4 and data["step"] == 3
    assert data["loss"] == "nan"
    assert data["sanity"] == [2.5, 2.4, "inf"]
    assert data["details"] == {"nested": {"x": "-inf", "ok": 1.5}, "rows": [[1, "nan"]]}
    assert data["elapsed_s"] == 1.235


def test_report_dict_keeps_finite_values() -> None:
    data = report_dict(RunResult("PASS", "ok", 0, 2.0, step=10, loss=0.5))
    assert (data["step"], data["loss"], data["reason"]) == (10, 0.5, "ok")


def test_report_is_atomic_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = tmp_path / "report.json"
    target.write_text("old content")
    write_report(target, RunResult("PASS", "ok", 0, 1.0))
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    assert _strict_load(target)["status"] == "PASS"


def test_a_failed_write_leaves_the_old_report_and_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "report.json"
    target.write_text('{"old": true}')

    def broken_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        write_report(target, RunResult("PASS", "ok", 0, 1.0))
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    assert target.read_text() == '{"old": true}'


def test_report_masks_secrets_in_every_form(tmp_path: Path) -> None:
    secret = 'pa"ss\\word-123'
    masker = Masker([secret])
    result = RunResult("FAIL", "crash", 1, 0.0, hint=f"bad {secret}", details={"env": {"X": secret}})
    target = tmp_path / "r.json"
    write_report(target, result, masker)
    text = target.read_text()
    assert "word-123" not in text
    data = _strict_load(target)
    assert data["hint"] == "bad ***"
    assert data["details"]["env"]["X"] == "***"


# ---------------------------------------------------------------------------------------------------------------
# Enums: the same text and numbers as the plain values; rendering and parsing round-trip
# ---------------------------------------------------------------------------------------------------------------


def test_enums_render_as_the_contract_values() -> None:
    from guard.contract import EXIT_STALLED, STATUSES, ExitCode, Reason, Status

    assert EXIT_STALLED is ExitCode.STALLED and EXIT_STALLED == 5
    assert [str(code) for code in (ExitCode.OK, ExitCode.SECURED)] == ["0", "75"]
    assert f"{ExitCode.TIMEOUT_UNSECURED}" == "124" and f"{Reason.NON_FINITE_LOSS}" == "non_finite_loss"
    assert Status.FAIL == "FAIL" and str(Status.TIMEOUT) == "TIMEOUT" and STATUSES[0] == "PASS"
    plain = RunResult("FAIL", "stalled", 5, 3.21, extra={"rank": 1})
    typed = RunResult(Status.FAIL, Reason.STALLED, ExitCode.STALLED, 3.21, extra={"rank": 1})
    assert render_line(typed) == render_line(plain) == "VERDICT: FAIL reason=stalled exit=5 elapsed=3.2 rank=1"
    assert json.loads(json.dumps(report_dict(typed))) == json.loads(json.dumps(report_dict(plain)))


def test_render_then_parse_round_trips() -> None:
    from guard.contract import parse_verdict

    result = RunResult("TIMEOUT", "deadline", 75, 12.34, step=7, loss=2.5,
                       extra={"checkpoint": "/out/checkpoint 7", "pushed": "hf://me/run@abc", "secured": True},
                       hint="resume with --resume")
    parsed = parse_verdict(render_line(result) + "\n")
    assert parsed is not None
    assert (parsed.status, parsed.reason, parsed.exit_code, parsed.elapsed_s) == ("TIMEOUT", "deadline", 75, 12.3)
    assert parsed.fields["checkpoint"] == "/out/checkpoint 7" and parsed.fields["secured"] == "yes"
    assert parsed.fields["hint"] == "resume with --resume"
    assert parse_verdict("[job] VERDICT: PASS reason=ok exit=0 elapsed=1.0") is None
