"""Tests for ``guard.run.config`` (durations, sizes, flag > env > default) and ``guard.run.cli.build_config``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from guard import protocol
from guard.core.durations import format_duration_s
from guard.errors import PreflightError, UsageError
from guard.run.cli import build_config
from guard.run.config import (
    OPTIONS,
    Config,
    RunSettings,
    WatchSettings,
    agent_settings,
    debug_enabled,
    env_name,
    log_level,
    parse_duration,
    parse_size,
    resolve,
)

NO_FLAGS: dict[str, object] = {}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


# ---------------------------------------------------------------------------------------------------------------
# DURATION and SIZE
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("7200", 7200.0),
        ("0", 0.0),
        ("45s", 45.0),
        ("90m", 5400.0),
        ("1.5h", 5400.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("45S", 45.0),
        (" 2h ", 7200.0),
        ("01:30:00", 5400.0),
        ("1:30:05", 5405.0),
        ("100:00:00", 360000.0),
        ("1-02:03:04", 86400.0 + 2 * 3600 + 3 * 60 + 4),
        ("0-00:00:30", 30.0),
    ],
)
def test_every_duration_form_of_the_contract(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("seconds", [100.0, 5400.0, 3700.0, 90061.0, 86400.0 + 1800, 45.0, 0.5])
def test_the_guard_reads_back_the_durations_it_writes(seconds: float) -> None:
    # The guard writes 100 s as "1m40s" and says "raise the timeout to at least 1h30m"; `--timeout 1m40s` (tried
    # on accelerate's complete_nlp_example.py) was a usage error.
    assert parse_duration(format_duration_s(seconds), option="--timeout") == seconds


@pytest.mark.parametrize("text", ["banana", "-5", "-5s", "1:99:00", "1:00:60", "5x", "", "h", "1e3", "inf", "nan",
                                  "1-2", "1::00", "30m1h", "1m1m", "1.5h30m", "1h 30m", "hms"])
def test_bad_durations_are_usage_errors_naming_the_option(text: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_duration(text, option="--stall-timeout")
    assert info.value.option == "--stall-timeout"
    assert "--stall-timeout" in str(info.value)
    assert "HH:MM:SS" in str(info.value)  # the accepted forms are listed


@pytest.mark.parametrize(
    ("text", "size_bytes"),
    [
        ("1000000", 1_000_000),
        ("500MB", 500_000_000),
        ("10GB", 10_000_000_000),
        ("10gb", 10_000_000_000),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("1KiB", 1024),
        ("2T", 2_000_000_000_000),
        ("3 MB", 3_000_000),
    ],
)
def test_sizes(text: str, size_bytes: int) -> None:
    assert parse_size(text) == size_bytes


@pytest.mark.parametrize("text", ["banana", "-1", "5XB", "GB", "1.5.2GB"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(UsageError, match="--min-free-disk"):
        parse_size(text, option="--min-free-disk")


# ---------------------------------------------------------------------------------------------------------------
# Resolution: flag > env > default
# ---------------------------------------------------------------------------------------------------------------


def test_defaults_when_nothing_is_given() -> None:
    values, sources = resolve(NO_FLAGS, {})
    assert set(values) == {o.name for o in OPTIONS} == set(sources)
    assert set(sources.values()) == {"default"}
    assert values["grace"] == 30.0
    assert values["stall_timeout"] == 1800.0
    assert values["sanity_steps"] == 5
    assert values["check_every"] == 10
    assert values["timeout"] is None
    assert values["margin"] is None  # auto
    assert values["dry_run"] is False
    assert values["require_env"] == ()


def test_flag_wins_over_env_which_wins_over_default() -> None:
    environ = {"GUARD_TIMEOUT": "2h", "GUARD_GRACE": "10s"}
    values, sources = resolve({"timeout": "90m"}, environ)
    assert (values["timeout"], sources["timeout"]) == (5400.0, "flag")
    assert (values["grace"], sources["grace"]) == (10.0, "env")
    assert (values["stall_timeout"], sources["stall_timeout"]) == (1800.0, "default")


def test_env_name_rule() -> None:
    assert env_name("stall_timeout") == "GUARD_STALL_TIMEOUT"
    assert env_name("push_to") == "GUARD_PUSH_TO"


def test_blank_env_value_falls_back_to_the_default() -> None:
    values, sources = resolve(NO_FLAGS, {"GUARD_GRACE": "  "})
    assert (values["grace"], sources["grace"]) == (30.0, "default")


def test_switch_from_flag_and_from_env() -> None:
    values, sources = resolve({"dry_run": True}, {})
    assert (values["dry_run"], sources["dry_run"]) == (True, "flag")
    values, sources = resolve(NO_FLAGS, {"GUARD_DRY_RUN": "yes"})
    assert (values["dry_run"], sources["dry_run"]) == (True, "env")
    values, _ = resolve(NO_FLAGS, {"GUARD_DRY_RUN": "off"})
    assert values["dry_run"] is False
    with pytest.raises(UsageError, match="GUARD_DRY_RUN"):
        resolve(NO_FLAGS, {"GUARD_DRY_RUN": "perhaps"})


def test_repeatable_option_from_a_comma_list_in_the_env() -> None:
    values, sources = resolve(NO_FLAGS, {"GUARD_REQUIRE_ENV": "HF_TOKEN, WANDB_API_KEY,,DATA_DIR"})
    assert values["require_env"] == ("HF_TOKEN", "WANDB_API_KEY", "DATA_DIR")
    assert sources["require_env"] == "env"


def test_repeatable_flags_win_over_the_env_list() -> None:
    values, sources = resolve({"require_env": ["A", "B"]}, {"GUARD_REQUIRE_ENV": "C,D"})
    assert values["require_env"] == ("A", "B")
    assert sources["require_env"] == "flag"


def test_skip_check_name_reason() -> None:
    values, _ = resolve({"skip_check": ["gpu=no GPU on this runner", " disk = scratch is fine "]}, {})
    assert values["skip_check"] == (("gpu", "no GPU on this runner"), ("disk", "scratch is fine"))
    values, _ = resolve(NO_FLAGS, {"GUARD_SKIP_CHECK": "gpu=cpu run,hub=offline"})
    assert values["skip_check"] == (("gpu", "cpu run"), ("hub", "offline"))


@pytest.mark.parametrize("text", ["gpu", "gpu=", "=reason", " = "])
def test_skip_check_without_a_reason_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve({"skip_check": [text]}, {})
    assert info.value.option == "--skip-check"
    assert "NAME=REASON" in str(info.value)


@pytest.mark.parametrize(
    ("flags", "environ", "needle"),
    [
        ({"timeout": "banana"}, {}, "--timeout"),
        ({"sanity_steps": "-1"}, {}, "--sanity-steps"),
        ({"sanity_steps": "two"}, {}, "--sanity-steps"),
        ({}, {"GUARD_GRACE": "soon"}, "GUARD_GRACE"),
        ({}, {"GUARD_CHECK_EVERY": "1.5"}, "GUARD_CHECK_EVERY"),
        ({}, {"GUARD_MIN_FREE_DISK": "lots"}, "GUARD_MIN_FREE_DISK"),
        ({}, {"GUARD_RESUME": "sometimes"}, "GUARD_RESUME"),
        ({"output_dir": "  "}, {}, "--output-dir"),
    ],
)
def test_malformed_values_name_the_flag_or_the_variable(flags: dict, environ: dict, needle: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve(flags, environ)
    assert info.value.option == needle
    assert needle in info.value.message


def test_margin_auto_or_duration() -> None:
    assert resolve({"margin": "auto"}, {})[0]["margin"] is None
    assert resolve({"margin": "5m"}, {})[0]["margin"] == 300.0


def test_resume_modes() -> None:
    assert resolve({"resume": "1"}, {})[0]["resume"] == "on"
    assert resolve({"resume": "no"}, {})[0]["resume"] == "off"
    assert resolve({"resume": "if-valid"}, {})[0]["resume"] == "if-valid"


def test_other_guard_variables() -> None:
    assert debug_enabled({"GUARD_DEBUG": "1"}) is True
    assert debug_enabled({"GUARD_DEBUG": "0"}) is False
    assert debug_enabled({}) is False
    assert log_level({"GUARD_LOG_LEVEL": "debug"}) == "DEBUG"
    assert log_level({}) == "INFO"


def test_agent_settings_from_the_supervisor_variables() -> None:
    settings = agent_settings({protocol.ENV_SOCKET: "/tmp/x.sock", protocol.ENV_SANITY_STEPS: "3",
                               protocol.ENV_CHECK_EVERY: "0", protocol.ENV_RESUME_PATH: "/ckpt"})
    assert settings.socket_path == "/tmp/x.sock"
    assert settings.sanity_steps == 3
    assert settings.check_every == 1  # never 0: it divides the steps
    assert settings.resume_path == "/ckpt"
    broken = agent_settings({protocol.ENV_SANITY_STEPS: "many"})
    assert (broken.socket_path, broken.sanity_steps, broken.check_every) == (None, 5, 10)


# ---------------------------------------------------------------------------------------------------------------
# cli.build_config: where the guard's options end and the job begins
# ---------------------------------------------------------------------------------------------------------------


def test_script_form_options_after_the_script_belong_to_the_job(script: Path) -> None:
    config = build_config(["--sanity-steps", "3", str(script), "--timeout", "5", "--lr", "1e-4"], {})
    assert config.values["sanity_steps"] == 3
    assert config.sources["sanity_steps"] == "flag"
    assert config.values["timeout"] is None  # the job's --timeout, not the guard's
    assert config.script == script
    assert config.script_args == ("--timeout", "5", "--lr", "1e-4")
    assert config.command == (sys.executable, str(script), "--timeout", "5", "--lr", "1e-4")


def test_switches_and_equals_forms_before_the_script(script: Path) -> None:
    config = build_config(["--dry-run", "--timeout=2h", str(script), "--dry-run"], {})
    assert config.values["dry_run"] is True
    assert config.values["timeout"] == 7200.0
    assert config.script_args == ("--dry-run",)


def test_a_value_that_looks_like_the_script_is_the_option_value(script: Path) -> None:
    config = build_config(["--output-dir", "out", str(script)], {})
    assert config.values["output_dir"] == "out"
    assert config.script == script


def test_command_form_splits_at_double_dash() -> None:
    config = build_config(["--grace", "5s", "--", sys.executable, "-c", "pass", "--grace", "9"], {})
    assert config.values["grace"] == 5.0
    assert config.script is None
    assert config.command == (sys.executable, "-c", "pass", "--grace", "9")


def test_double_dash_after_the_script_belongs_to_the_job(script: Path) -> None:
    config = build_config([str(script), "--", "x"], {})
    assert config.script_args == ("--", "x")


def test_env_and_sources_reach_the_config(script: Path) -> None:
    config = build_config(["--stall-timeout", "10m", str(script)], {"GUARD_STALL_TIMEOUT": "1h",
                                                                      "GUARD_GRACE": "1m"})
    assert (config.settings.watch.stall_timeout_s, config.sources["stall_timeout"]) == (600.0, "flag")
    assert (config.settings.watch.grace_s, config.sources["grace"]) == (60.0, "env")
    assert config.sources["timeout"] == "default"
    rows = {flag: (value, source) for flag, value, source in config.describe()}
    assert rows["--stall-timeout"] == ("10m", "flag")
    assert rows["--grace"] == ("1m", "env")
    assert rows["--margin"] == ("auto", "default")


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--timeout", "banana", "SCRIPT"], "--timeout"),
        (["--timeout", "-5", "SCRIPT"], "--timeout"),
        (["--timeout", "0", "SCRIPT"], "--timeout"),
        (["--grace", "0s", "SCRIPT"], "--grace"),
        (["--sanity-steps", "-1", "SCRIPT"], "--sanity-steps"),
        (["--stall-timeout", "1:99:00", "SCRIPT"], "--stall-timeout"),
        (["--skip-check", "gpu", "SCRIPT"], "--skip-check"),
        (["does_not_exist.py"], "SCRIPT"),
        ([], "SCRIPT"),
        (["--"], "--"),
        (["--", "no-such-command-xyz-123"], "COMMAND"),
    ],
)
def test_usage_errors_name_the_option(script: Path, argv: list[str], option: str) -> None:
    argv = [str(script) if a == "SCRIPT" else a for a in argv]
    with pytest.raises(UsageError) as info:
        build_config(argv, {})
    assert info.value.option == option
    assert info.value.hint


def test_unknown_option_is_a_usage_error(script: Path) -> None:
    with pytest.raises(UsageError, match="--bogus"):
        build_config(["--bogus", str(script)], {})


def test_a_folder_is_a_usage_error_and_a_broken_script_a_preflight_failure(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="is a folder"):
        build_config([str(tmp_path)], {})
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\ndef f(:\n")
    with pytest.raises(PreflightError) as caught:
        build_config([str(broken)], {})
    assert caught.value.check == "script" and caught.value.exit_code == 3
    assert "line 2" in caught.value.message and "def f(:" in caught.value.message
    assert caught.value.message.splitlines()[-1].endswith("      ^")  # the caret under the column
    assert "broken.py line 2" in (caught.value.hint or "")


def test_bare_resume_means_on_and_leaves_the_script_alone(script: Path) -> None:
    assert build_config(["--resume", str(script)], {}).settings.secure.resume == "on"
    assert build_config(["--resume", "--push-to", "./x", str(script)], {}).settings.secure.resume == "on"
    config = build_config(["--resume", "if-valid", str(script), "--resume"], {})
    assert (config.settings.secure.resume, config.script, config.script_args) == ("if-valid", script, ("--resume",))
    assert build_config(["--resume=off", str(script)], {}).settings.secure.resume == "off"


def test_stall_timeout_zero_is_off(script: Path) -> None:
    from guard.run.timers import StallWatch

    config = build_config(["--stall-timeout", "0", str(script)], {})
    watch = StallWatch(config.settings.watch.stall_timeout_s, 0.0)
    assert watch.due_at() == float("inf") and not watch.expired(1e9)


def test_help_shows_defaults_as_the_readme_writes_them() -> None:
    from guard.run.cli import _parser

    text = " ".join(_parser().format_help().split())
    for option, default in (("stall_timeout", "30m"), ("heartbeat", "5m"), ("grace", "30s"), ("margin", "auto"),
                            ("resume", "auto"), ("dry_run", "off"), ("timeout", "none")):
        assert f"env {env_name(option)}; default: {default})" in text
    assert "1800.0" not in text and "default: -)" not in text


def test_preflight_subcommand_needs_no_script() -> None:
    config = build_config(["--sanity-steps", "2"], {}, subcommand="preflight")
    assert config.subcommand == "preflight"
    assert config.command == ()


def test_skip_check_reasons_may_hold_commas_in_the_environment() -> None:
    values, _ = resolve({}, {"GUARD_SKIP_CHECK": "gpu=not needed, really,hub-auth=offline"})
    assert values["skip_check"] == (("gpu", "not needed, really"), ("hub-auth", "offline"))


def test_push_to_an_existing_folder_without_dot_slash_is_a_usage_error(script: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints" / "run1").mkdir(parents=True)
    with pytest.raises(UsageError, match="is a folder here") as caught:
        build_config(["--push-to", "checkpoints/run1", str(script)], {})
    assert "did you mean ./checkpoints/run1" in (caught.value.hint or "")
    for given in ("./checkpoints/run1", "hf://checkpoints/run1", "acme/run2"):  # acme/run2: no such folder
        assert build_config(["--push-to", given, str(script)], {}).settings.secure.push_to == given


def test_guard_options_in_the_jobs_arguments() -> None:
    from guard.run.config import guard_options_in

    assert guard_options_in(["--steps", "3", "--timeout", "1h", "--push-to=./x", "--timeout", "2h"]) == [
        "--timeout", "--push-to"]
    assert guard_options_in(["--steps", "3", "--", "--timeout"]) == []


# ---------------------------------------------------------------------------------------------------------------
# Typed settings
# ---------------------------------------------------------------------------------------------------------------


def test_settings_are_typed_frozen_and_grouped_by_component(script: Path) -> None:
    import dataclasses

    from guard.run.config import PreflightSettings, RunSettings, SecureSettings, WatchSettings

    config = build_config(["--sanity-steps", "3", "--grace", "45s", "--timeout", "2h", "--dry-run", "--require-env",
                           "WANDB_API_KEY", "--min-free-disk", "2GB", str(script), "--lr", "1"],
                          {"GUARD_STARTED_AT": "1800000000", "GUARD_OUTPUT_DIR": "out", "GUARD_HEARTBEAT": "1m"})
    settings = config.settings
    assert isinstance(settings, RunSettings)
    assert settings.watch == WatchSettings(sanity_steps=3, check_every=10, stall_timeout_s=1800.0, dry_run=True,
                                           max_skipped_steps=50, grace_s=45.0, loss_rise_factor=10.0,
                                           loss_rise_steps=20)
    assert isinstance(settings.secure, SecureSettings) and isinstance(settings.preflight, PreflightSettings)
    assert settings.secure.timeout_s == 7200.0 and settings.secure.timeout_option == "--timeout"
    assert settings.secure.started_at == "1800000000" and settings.secure.started_at_option == "GUARD_STARTED_AT"
    assert settings.secure.output_dir == "out" and not settings.secure.output_dir_from_flag
    assert settings.secure.grace_s == settings.watch.grace_s == 45.0
    assert settings.preflight.require_env == ("WANDB_API_KEY",) and settings.preflight.min_free_disk_bytes == 2 * 10**9
    assert settings.observe.heartbeat_s == 60.0 and settings.observe.trackio is None
    assert settings.job.script == script and settings.job.script_args == ("--lr", "1")
    assert config.settings is settings  # built once
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.watch.sanity_steps = 9  # type: ignore[misc]


def test_replacing_the_command_rebuilds_the_settings(script: Path) -> None:
    import dataclasses

    config = build_config([str(script)], {})
    changed = dataclasses.replace(config, command=("/env/bin/python", str(script)))
    assert changed.settings.job.command == ("/env/bin/python", str(script))
    assert config.settings.job.command != changed.settings.job.command


def test_no_code_reads_the_option_values_by_name() -> None:
    # Components read their typed part (config.settings.<part>), never the string-keyed table.
    import ast

    root = Path(__file__).resolve().parent.parent / "guard"
    found = []
    for path in root.rglob("*.py"):
        if path.name == "config.py" and path.parent.name == "run":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "values" and isinstance(node.value, (ast.Name,
                                                                                                    ast.Attribute)):
                name = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
                if name == "config":
                    found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_the_config_forwards_no_option_as_an_attribute(script: Path) -> None:
    # No __getattr__ and no property over ``values``: an option is read through its typed part only.
    import dataclasses

    assert "__getattr__" not in vars(Config) and not hasattr(Config, "__getattr__")
    config = build_config(["--grace", "5s", str(script)], {})
    for name in ("grace", "grace_s", "push_to", "resume", "timeout_s", "stall_timeout_s"):
        with pytest.raises(AttributeError):
            getattr(config, name)
    public = {name for name in vars(Config) if not name.startswith("_")}
    assert public - {f.name for f in dataclasses.fields(Config)} == {"describe"}
    assert config.settings.watch.grace_s == 5.0


def test_only_the_top_of_the_run_sees_the_whole_config() -> None:
    # The CLI, the stages and the loop hold the Config; every component below gets its typed part.
    import ast

    root = Path(__file__).resolve().parent.parent / "guard"
    takers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "guard.run.config" \
                    and any(alias.name == "Config" for alias in node.names):
                takers.add(str(path.relative_to(root)))
    assert takers == {"run/cli.py", "run/stages.py", "run/supervisor.py"}


def test_the_loop_hands_each_component_its_settings_part() -> None:
    import inspect
    import os
    import typing

    from guard.core.masking import Masker
    from guard.run import diagnose, joblink, supervisor, watchdog

    def annotation(function: typing.Callable[..., object], name: str) -> object:
        return inspect.signature(function).parameters[name].annotation  # a string (postponed annotations)

    assert annotation(joblink.LoopLink.__init__, "settings") == WatchSettings.__name__
    assert annotation(watchdog.Watchdog.from_settings, "settings") == WatchSettings.__name__
    assert annotation(diagnose.job_result, "settings") == RunSettings.__name__
    assert "config" not in inspect.signature(diagnose.job_result).parameters
    config = build_config(["--no-preflight", "--check-every", "3", "--", "true"], dict(os.environ))
    sup = supervisor.Supervisor(config, masker=Masker())
    try:
        assert sup.settings is sup.link.settings is config.settings.watch
        assert sup.link.check_every == 3 and sup.watchdog.sanity_steps == config.settings.watch.sanity_steps
    finally:
        sup._sel.close()


@pytest.mark.parametrize(("argv", "fix"), [(["--timeout", "10", "minutes", "train.py"], "--timeout 10m"),
                                           (["--stall-timeout", "2", "h", "train.py"], "--stall-timeout 2h")])
def test_a_duration_with_a_space_before_its_unit_names_the_option_and_the_forms(
        argv: list[str], fix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 36: `--timeout 10 minutes` said "script not found: minutes"."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("pass\n")
    with pytest.raises(UsageError) as info:
        build_config(argv, {})
    assert info.value.option == argv[0] and "accepted: whole seconds" in info.value.message
    assert info.value.hint == f"write {fix}"


def test_a_script_named_like_a_unit_still_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").write_text("pass\n")
    assert build_config(["--timeout", "10", "m"], {}).script == Path("m")
