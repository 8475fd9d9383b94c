"""Write docs/options.md, the options reference, from the guard's own argument parsers.

The page is what ``jobguard --help`` says, as a table: every option of the parser that ``guard/run/cli.py`` builds
(its flag, value form, environment variable ``GUARD_<OPTION>``, default and meaning, all read from the parser), the
options of ``jobguard watch`` (``guard/watch.py``), the help's closing text (value forms and exit codes), and the
other ``GUARD_*`` variables: ``GUARD_DEBUG`` and ``GUARD_LOG_LEVEL`` (their readers' docstrings in
``guard/run/config.py``) and the ``GUARD_AGENT_*`` variables the guard sets for its agent (the ``#:`` comments in
``guard/protocol.py``). Nothing on the page is typed by hand but the links to the pages that explain each option, so
the page cannot drift from the code: ``tests/test_docs.py`` fails when the committed page differs from what this
script writes.

Usage::

    python scripts/gen_options.py           # (re)write docs/options.md
    python scripts/gen_options.py --check   # exit 1 when docs/options.md is not what the parsers give
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from anywhere: the checkout's guard package
    sys.path.insert(0, str(ROOT))

from guard import protocol  # noqa: E402
from guard.run import cli, config  # noqa: E402
from guard.watch import _build_parser as watch_parser  # noqa: E402

PAGE = ROOT / "docs" / "options.md"
COMMAND = "python scripts/gen_options.py"

#: Where each option is explained at length (a page of the site, with an anchor). An option missing here simply
#: has no link; a name here that is no option fails the test.
MORE: dict[str, str] = {
    "timeout": "securing.md#the-deadline",
    "started_at": "securing.md#the-deadline",
    "margin": "securing.md#the-margin",
    "grace": "securing.md#one-deadline-a-push-that-can-be-killed",
    "push_to": "securing.md#destinations",
    "output_dir": "inside-the-job.md#what-counts-as-a-checkpoint",
    "background_push": "securing.md#background-securing",
    "final_push_window": "securing.md#a-finished-job-is-a-pass",
    "push_interval": "checkpoints.md#the-background-interval-fits-the-destination",
    "push_stall": "checkpoints.md#a-push-that-makes-no-progress-is-replaced",
    "sanity_steps": "inside-the-job.md#what-the-agent-sees",
    "dry_run": "quickstart.md#a-rehearsal-before-a-paid-job",
    "stall_timeout": "troubleshooting.md#stalled-exit-5",
    "require_env": "preflight.md#what-preflight-checks",
    "report": "verdict.md#the-json-report",
    "require_model": "preflight.md#what-preflight-checks",
    "require_dataset": "preflight.md#what-preflight-checks",
    "require_gpus": "preflight.md#what-preflight-checks",
    "gpu_type": "preflight.md#what-preflight-checks",
    "min_free_disk": "preflight.md#what-preflight-checks",
    "expected_duration": "preflight.md#what-preflight-checks",
    "skip_check": "preflight.md#skipping-a-check",
    "require_shards": "preflight.md#data-shards",
    "launch_smoke": "preflight.md#the-launch-smoke",
    "launch_smoke_timeout": "preflight.md#the-launch-smoke",
    "no_preflight": "preflight.md",
    "resume": "securing.md#resume",
    "uv": "huggingface-jobs.md#the-scripts-own-environment-uv",
    "requeue": "slurm.md",
    "check_every": "inside-the-job.md#what-the-agent-sees",
    "max_skipped_steps": "inside-the-job.md#what-the-agent-sees",
    "loss_rise_factor": "inside-the-job.md#what-the-agent-sees",
    "loss_rise_steps": "inside-the-job.md#what-the-agent-sees",
    "heartbeat": "alerts.md#the-heartbeat",
    "trackio": "alerts.md#trackio",
    "alert_webhook": "alerts.md#alerts-slack-discord-any-webhook",
    "alert_level": "alerts.md#alerts-slack-discord-any-webhook",
    "alert_throughput_drop": "alerts.md#alerts-slack-discord-any-webhook",
    "alert_throughput_window": "alerts.md#alerts-slack-discord-any-webhook",
}

_HELP = re.compile(r"^(?P<meaning>.*) \(env (?P<env>GUARD_[A-Z0-9_]+); default: (?P<default>.*)\)$", re.DOTALL)
_AGENT_VAR = re.compile(r"((?:^#:.*\n)+)^(ENV_[A-Z_]+) = \"(GUARD_[A-Z0-9_]+)\"", re.MULTILINE)


def _cell(text: str) -> str:
    """``text`` for one Markdown table cell: one line, its pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    """``text`` as inline code, also inside a table cell: a pipe in a code span splits GitHub's table cells even
    when escaped, and an escaped one shows its backslash on the site, so such a span is written as HTML."""
    if "|" in text:
        return "<code>" + html.escape(text, quote=False).replace("|", "&#124;") + "</code>"
    return f"`{text}`"


def _form(action: argparse.Action) -> str:
    """The option as ``--help`` shows it: ``--timeout DURATION``, ``--resume [MODE]``, ``--dry-run``."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return flag
    metavar = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
    return f"{flag} [{metavar}]" if action.nargs == "?" else f"{flag} {metavar}"


def _option_rows() -> list[str]:
    """One table row per option of the guard's parser (``guard.run.cli``), in ``--help`` order."""
    rows = []
    for action in cli._parser(prog="jobguard")._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        found = _HELP.match(action.help or "")
        if found is None:
            raise SystemExit(f"gen_options: the help of {action.option_strings[0]} does not end with "
                             f"'(env GUARD_...; default: ...)': {action.help!r}")
        meaning = found["meaning"]
        if action.nargs == "?" and "alone" not in meaning:
            meaning += f"; given alone: `{action.const}`"
        if isinstance(action, argparse._AppendAction):
            if "repeatable" not in meaning:
                meaning += " (repeatable)"
            meaning += f"; `{found['env']}` takes a comma list"
        more = MORE.get(action.dest)
        link = f"[more]({more})" if more else ""
        rows.append(f"| {_code(_form(action))} | {_code(found['env'])} | {_cell(found['default'])} | "
                    f"{_cell(meaning)} | {link} |")
    return rows


def _watch_rows() -> list[str]:
    rows = []
    for action in watch_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        form = _form(action) if action.option_strings else f"{action.metavar} (optional)"
        rows.append(f"| {_code(form)} | {_cell(action.help or '')} |")
    return rows


def _agent_variables() -> list[str]:
    """``GUARD_AGENT_*`` rows from ``guard/protocol.py``: each constant with its ``#:`` comment."""
    source = Path(protocol.__file__).read_text(encoding="utf-8")
    rows = []
    for comment, _constant, name in _AGENT_VAR.findall(source):
        text = " ".join(line.removeprefix("#:").strip() for line in comment.splitlines()).replace("``", "`")
        rows.append(f"| {_code(name)} | {_cell(text)} |")
    return rows


def _doc(function: object) -> str:
    """The first paragraph of ``function``'s docstring, on one line, in Markdown's single backticks."""
    text = (getattr(function, "__doc__", None) or "").strip().split("\n\n")[0]
    return " ".join(text.split()).replace("``", "`")


def render() -> str:
    """The whole page, as ``docs/options.md`` must hold it."""
    parser = cli._parser(prog="jobguard")
    lines = [
        f"<!-- Generated by {COMMAND} from the guard's argument parsers: do not edit; run it again. -->",
        "",
        "# Options",
        "",
        "Every option of `jobguard` (and `jobguard preflight`), as `jobguard --help` gives it:",
        "",
        "```",
        parser.usage or "",
        "```",
        "",
        "Options come before the script: everything after `SCRIPT.py` (or after `--`) belongs to the job. Each option",
        "falls back to its environment variable, then to its default: the flag wins over the variable, the variable",
        "over the default. The config log at the start says where each value came from (`flag`, `env` or",
        "`default`); the `--report` JSON holds every option with its value and source (`details.options`).",
        "",
        "| option | environment variable | default | meaning | |",
        "|---|---|---|---|---|",
        *_option_rows(),
        "",
        "## `jobguard watch`",
        "",
        "`jobguard watch [FILE]` reads a job log and exits with the `exit=` of its last guard VERDICT line",
        "([VERDICT and exit codes](verdict.md#watching-a-jobs-log-jobguard-watch)). Its options have no",
        "environment variables:",
        "",
        "| argument | meaning |",
        "|---|---|",
        *_watch_rows(),
        "",
        "## Value forms and exit codes",
        "",
        "`jobguard --help` ends with these lines:",
        "",
        "```",
        parser.epilog or "",
        "```",
        "",
        "A malformed value is a usage error before anything runs: one `[guard]` line naming the option and the",
        "accepted forms, a hint line, `VERDICT: FAIL reason=usage exit=2`, and the job is not started.",
        "",
        "## Other variables",
        "",
        "| variable | meaning |",
        "|---|---|",
        f"| `GUARD_DEBUG` | {_cell(_doc(config.debug_enabled))} |",
        f"| `GUARD_LOG_LEVEL` | {_cell(_doc(config.log_level))} |",
        "",
        "The guard sets these for its agent inside the job's processes; they are not for you to set:",
        "",
        "| variable | meaning |",
        "|---|---|",
        *_agent_variables(),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="exit 1 when docs/options.md is out of date")
    check = args.parse_args(argv).check
    text = render()
    current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
    if check:
        if current != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run {COMMAND}", file=sys.stderr)
            return 1
        return 0
    if current != text:
        PAGE.write_text(text, encoding="utf-8")
        print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
