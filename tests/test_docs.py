"""The documentation site cannot drift from the code.

- ``docs/options.md`` is what ``scripts/gen_options.py`` writes from the guard's argument parsers today;
- every ``GUARD_*`` variable the code reads is documented on some page of ``docs/``;
- the table of statuses, reasons and exit codes in ``docs/verdict.md`` agrees with ``guard/contract.py``;
- every page of ``docs/`` is in the site's nav (``mkdocs.yml``) and every nav entry exists; every relative link
  between pages points to a page of the site (``mkdocs build --strict`` checks the same and the anchors; it needs
  the docs extra, these tests do not).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from guard.contract import ExitCode, Reason, Status
from guard.run.config import OPTIONS, env_name

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_options", ROOT / "scripts" / "gen_options.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages() -> dict[str, str]:
    return {path.name: path.read_text(encoding="utf-8") for path in sorted(DOCS.glob("*.md"))}


# ---------------------------------------------------------------------------------------------------------------
# The options reference
# ---------------------------------------------------------------------------------------------------------------


def test_options_page_is_what_the_parser_gives() -> None:
    generator = _generator()
    expected = generator.render()
    current = (DOCS / "options.md").read_text(encoding="utf-8")
    assert current == expected, f"docs/options.md differs from the guard's parsers: run `{generator.COMMAND}`"


def test_options_page_lists_every_option_with_its_variable() -> None:
    text = (DOCS / "options.md").read_text(encoding="utf-8")
    for option in OPTIONS:
        assert re.search(rf"^\| (`|<code>){re.escape(option.flag)}\b.*\| `{env_name(option.name)}` \|", text,
                         re.MULTILINE), f"{option.flag} ({env_name(option.name)}) has no row in docs/options.md"


def test_option_links_name_options() -> None:
    names = {option.name for option in OPTIONS}
    unknown = sorted(set(_generator().MORE) - names)
    assert not unknown, f"scripts/gen_options.py MORE names no option: {unknown}"


def _variables_read(package: Path) -> set[str]:
    """Every ``GUARD_*`` name the code can read: ``GUARD_<OPTION>`` of every option, and every string constant
    that is exactly a ``GUARD_*`` name (``"GUARD_DEBUG"``, ``protocol.ENV_SOCKET``), except the names listed in a
    module's ``__all__`` (Python names such as ``GUARD_MARKER_NAME``, not variables)."""
    found = {env_name(option.name) for option in OPTIONS}
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        exported: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                exported.update(id(item) for item in ast.walk(node.value))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in exported
                    and re.fullmatch(r"GUARD_[A-Z0-9_]*[A-Z0-9]", node.value)):
                found.add(node.value)
    return found


def test_every_guard_variable_is_documented() -> None:
    read = _variables_read(ROOT / "guard")
    assert {"GUARD_DEBUG", "GUARD_LOG_LEVEL", "GUARD_TIMEOUT", "GUARD_AGENT_SOCKET"} <= read  # the scan sees them
    documented = set(re.findall(r"\bGUARD_[A-Z0-9_]*[A-Z0-9]\b", "\n".join(_pages().values())))
    missing = sorted(read - documented)
    assert not missing, (f"GUARD_* variables the code reads but no page of docs/ names: {missing} (an option's "
                         "variable or a GUARD_AGENT_* one: run `python scripts/gen_options.py`; any other: document "
                         "it on a page and in the generator's 'Other variables')")


# ---------------------------------------------------------------------------------------------------------------
# The exit codes
# ---------------------------------------------------------------------------------------------------------------

#: The reasons whose exit code is one of the guard's own (``ExitCode``); the others exit with the job's own code
#: or 128 + a signal, written in words in the table.
FIXED: dict[Reason, set[int]] = {
    Reason.OK: {ExitCode.OK},
    Reason.DRY_RUN: {ExitCode.OK},
    Reason.USAGE: {ExitCode.USAGE},
    Reason.PREFLIGHT: {ExitCode.PREFLIGHT},
    Reason.NON_FINITE_LOSS: {ExitCode.NON_FINITE},
    Reason.STALLED: {ExitCode.STALLED},
    Reason.PUSH_FAILED: {ExitCode.PUSH_FAILED},
    Reason.INCOMPLETE: {ExitCode.INCOMPLETE},
    Reason.GUARD_ERROR: {ExitCode.GUARD_ERROR},
    Reason.DEADLINE: {ExitCode.SECURED, ExitCode.TIMEOUT_UNSECURED},
    Reason.SIGNAL: {ExitCode.SECURED, 128},
}
#: The reasons that exit with the job's own code (or 128 + signal).
JOBS_OWN = {Reason.CRASH, Reason.OOM, Reason.KILLED}


def _exit_table() -> list[tuple[str, list[str], str]]:
    """``(status, reasons, exit code text)`` for each row of the verdict page's table."""
    lines = (DOCS / "verdict.md").read_text(encoding="utf-8").splitlines()
    start = lines.index("| STATUS | reason | exit code |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        status, reason, code = (cell.strip() for cell in line.strip("|").split(" | "))
        # The reasons are the cell's code spans outside its parentheses (those explain, and may quote code).
        depth, outside = 0, []
        for char in reason:
            depth += char == "("
            if depth == 0:
                outside.append(char)
            depth -= char == ")"
        rows.append((status, re.findall(r"`([a-z_]+)`", "".join(outside)), code))
    return rows


def _numbers(text: str) -> set[int]:
    """The exit codes a cell names: ``75``, ``124``, ``128 + signal`` (as 128), ranges ``2-7`` expanded."""
    found: set[int] = set()
    for low, high in re.findall(r"\b(\d+)-(\d+)\b", text):
        found.update(range(int(low), int(high) + 1))
    found.update(int(n) for n in re.findall(r"\b\d+\b", re.sub(r"\b\d+-\d+\b", "", text)))
    return found


def test_exit_code_table_covers_the_contract() -> None:
    rows = _exit_table()
    assert {status for status, _, _ in rows} == {status.value for status in Status}
    listed = [reason for _, reasons, _ in rows for reason in reasons]
    assert sorted(listed) == sorted(reason.value for reason in Reason), \
        "docs/verdict.md's table must name every reason of guard.contract.Reason once"
    named = set().union(*(_numbers(code) for _, _, code in rows))
    missing = sorted(int(code) for code in ExitCode if int(code) not in named)
    assert not missing, f"exit codes of guard.contract.ExitCode not in docs/verdict.md's table: {missing}"


@pytest.mark.parametrize("reason", sorted(Reason, key=lambda r: r.value), ids=lambda r: r.value)
def test_exit_code_of_each_reason(reason: Reason) -> None:
    row = next((status, code) for status, reasons, code in _exit_table() if reason.value in reasons)
    numbers = _numbers(row[1])
    if reason in FIXED:
        assert numbers == {int(code) for code in FIXED[reason]}, f"{reason.value}: the page says {row[1]!r}"
    else:
        assert reason in JOBS_OWN, f"{reason.value}: a new reason; say in this test which codes it exits with"
        assert "own exit code" in row[1] or "128 + signal" in row[1], f"{reason.value}: {row[1]!r}"


def test_crash_codes_that_collide_are_the_guards_table() -> None:
    """The crash row lists the codes a job's own exit code must not keep (they would read as the guard's):
    every fixed code of ``ExitCode`` but 0 and the crash code itself."""
    code = next(code for _, reasons, code in _exit_table() if "crash" in reasons)
    listed = _numbers(code.split("(", 1)[1]) if "(" in code else set()
    fixed = {int(c) for c in ExitCode} - {0, 1}
    assert listed == fixed, f"the crash row's list {sorted(listed)} is not the guard's table {sorted(fixed)}"


# ---------------------------------------------------------------------------------------------------------------
# The site
# ---------------------------------------------------------------------------------------------------------------


def _nav_pages(entries: Any) -> list[str]:
    pages: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            pages.extend(_nav_pages(value))
        elif isinstance(value, str) and not value.startswith(("http://", "https://")):
            pages.append(value)
    return pages


def test_every_page_is_in_the_nav() -> None:
    site = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(site["nav"])
    pages = set(_pages())
    assert not sorted(set(nav) - pages), f"mkdocs.yml names pages that do not exist: {sorted(set(nav) - pages)}"
    left_out = sorted(pages - set(nav))
    assert not left_out, f"pages of docs/ not in mkdocs.yml's nav: {left_out} (add each under nav:)"
    assert len(nav) == len(set(nav)), "a page is in the nav twice"


def test_links_between_pages_resolve() -> None:
    pages = _pages()
    broken = []
    for name, text in pages.items():
        text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL, or an anchor on the same page (mkdocs checks anchors)
            path = target.split("#", 1)[0]
            if path not in pages and not (DOCS / path).is_file():
                broken.append(f"{name}: {target}")
    assert not broken, ("links to files that are not part of the site (docs/): name a repository file as code, or "
                        f"link it by its full URL: {broken}")


# ---------------------------------------------------------------------------------------------------------------
# The README: read in minutes, its links and its commands true
# ---------------------------------------------------------------------------------------------------------------


README_MAX_BYTES = 16_000  # issue 36: the README was 62 KB; the rest of what it said lives in docs/


def test_the_readme_is_short() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (at most {README_MAX_BYTES}): move detail to docs/"


def test_the_readme_links_point_at_files_of_the_repository() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    relative = [t for t in targets if "://" not in t]
    assert relative, "the README links no page"
    missing = sorted(t for t in relative if not (ROOT / t).exists())
    assert not missing, f"README.md links to missing files: {missing}"


def test_the_readme_exit_codes_and_test_command_agree_with_the_code() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (PASS|FAIL|TIMEOUT|INTERRUPTED) \| `(\w+)`", text, re.MULTILINE)
    assert {reason for _, reason in rows} == {reason.value for reason in Reason} - {"dry_run"}
    for code in (c for c in ExitCode if c not in (ExitCode.OK, ExitCode.TIMEOUT_UNSECURED, ExitCode.SECURED)):
        assert re.search(rf"^\| FAIL \| `\w+`[^|]*\| {int(code)} \|$", text, re.MULTILINE), f"no row for exit {code}"
    assert "75 when a checkpoint is secured, else 124" in text
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    command = "python -m pytest -q -n 4 --dist loadfile"
    assert command in ci and command in text  # the README's test command is the one CI runs
    assert "git+https://<where you host the repo>" in text and "OWNER" not in text
