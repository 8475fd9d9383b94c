"""Static analysis of the job's script: read with ``ast`` and the PEP 723 regex, never run.

What it finds (``ScriptFacts``): the Hub ids the script names as string literals, the ``TrainingArguments``
keyword literals in the same dict shape the in-job agent sends (so ``check_trainer_config`` serves both), the
trackers it reports to, its top-level imports and its PEP 723 ``script`` block.

A string counts as a literal when it is written in the call, or when the argument is a name assigned exactly
one literal value in the script (``model_id = "org/name"`` ... ``from_pretrained(model_id)``).

Paths not taken: a Hub push, a tracker start, ``torch.compile`` or an import written inside an ``if`` whose test
is a flag or config value (``if training_args.push_to_hub:``, ``if wandb_log:``) happens only when that value is
true. The test is evaluated with what is known: the job's command line (``overrides``, from
``guard.preflight.cmdline``), else the script's single literal for a plain name (``wandb_log = False``).
True: the code counts as run. False or unknown: it is a ``Mention``, which the checks turn into a warning at
most, never a failure. ``if __name__ == "__main__":`` is taken; ``if TYPE_CHECKING:`` is not.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = ["PEP723_REGEX", "Mention", "Pep723Block", "ScriptFacts", "analyze_script", "analyze_source",
           "read_pep723"]

#: The canonical regular expression of the inline script metadata specification
#: (packaging.python.org, "Inline script metadata", from PEP 723).
PEP723_REGEX = re.compile(r"(?m)^# /// (?P<type>[a-zA-Z0-9-]+)$\s(?P<content>(^#(| .*)$\s)+)^# ///$")

#: A Hub repo id with its namespace: ``org/name`` (the Hub's allowed characters).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

#: ``TrainingArguments`` subclasses named ``*Config`` (TRL) whose keywords are TrainingArguments keywords.
_TRL_CONFIGS = frozenset(
    {"SFTConfig", "DPOConfig", "GRPOConfig", "ORPOConfig", "KTOConfig", "CPOConfig", "RewardConfig", "PPOConfig",
     "RLOOConfig", "OnlineDPOConfig", "GKDConfig", "PRMConfig", "BCOConfig", "XPOConfig", "NashMDConfig"}
)

#: TrainingArguments keywords copied into ``ScriptFacts.trainer_config`` (``evaluation_strategy`` is the old
#: name of ``eval_strategy``). ``hub_private_repo`` and ``trackio_space_id`` feed the tracking check.
_CONFIG_KEYS = frozenset(
    {"output_dir", "push_to_hub", "hub_model_id", "hub_strategy", "save_strategy", "eval_strategy", "report_to",
     "bf16", "fp16", "torch_compile", "gradient_checkpointing", "max_steps", "hub_private_repo", "trackio_space_id"}
)

#: Calls whose string argument is a place the script writes to, so the same string is not a Hub id to check.
_SAVE_CALLS = frozenset({"save_pretrained", "save_model", "save_to_disk", "save", "to_json", "to_csv"})

_UNKNOWN = object()


@dataclass(frozen=True)
class Pep723Block:
    """The script's PEP 723 ``script`` block.

    Attributes:
        dependencies: the ``dependencies`` PEP 508 strings, as written.
        requires_python: the ``requires-python`` specifier, or None.
        error: why the block cannot be used (two blocks, bad TOML, wrong types), or None.
    """

    dependencies: tuple[str, ...] = ()
    requires_python: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Mention:
    """Something the script does only on a path that may not be taken.

    Attributes:
        kind: ``push`` (a ``push_to_hub`` call), ``tracker`` (``wandb.init`` ...), ``compile`` (``torch.compile``)
            or ``import``.
        what: the repo id pushed to (``""`` when none is named), the tracker, ``torch.compile``, or the module.
        condition: the ``if`` test it depends on, as source text (``training_args.push_to_hub``); ``not (...)``
            for an ``else`` branch.
        line: the line of the call or import (1-based).
        taken: False when the test is known false (a flag off on the command line or by its literal), None when
            unknown.
    """

    kind: str
    what: str
    condition: str
    line: int
    taken: bool | None = None

    def describe(self, script: str) -> str:
        """``"push_to_hub() in run_clm.py line 640 runs only if training_args.push_to_hub (off)"``."""
        label = {"push": f"push_to_hub({self.what!r})" if self.what else "push_to_hub()",
                 "tracker": f"{self.what}.init()", "compile": "torch.compile()",
                 "import": f"import {self.what}"}.get(self.kind, self.what)
        if self.condition.startswith("it raises nothing (try/except"):  # caught: the job goes on without it
            return f"{label} in {script} line {self.line} is inside try/except: a failure there is caught"
        state = "off" if self.taken is False else "not set on the command line"
        return f"{label} in {script} line {self.line} runs only if {self.condition} ({state})"


@dataclass(frozen=True)
class ScriptFacts:
    """What the script says about the job, read statically.

    Attributes:
        path: the script.
        models: Hub model ids named as literals (``from_pretrained``, ``pipeline(model=)``, ``SentenceTransformer``,
            a Trainer's ``model="..."``, ``snapshot_download``/``hf_hub_download``).
        datasets: Hub dataset ids named as literals (``load_dataset``, downloads with ``repo_type="dataset"``).
        hub_model_ids: ``hub_model_id=`` literals: where the Trainer pushes (checked by hub-auth, not hub-repos).
        push_calls: one entry per ``x.push_to_hub(...)`` call: its repo id literal, or ``""`` when it names none
            (``trainer.push_to_hub()`` pushes to ``hub_model_id``).
        trainer_config: ``TrainingArguments`` keyword literals in the agent's dict shape (keys only when known:
            ``output_dir, push_to_hub, hub_model_id, hub_strategy, save_strategy, eval_strategy, report_to (list),
            bf16, fp16, torch_compile, gradient_checkpointing, has_eval_dataset, max_steps, loss_class``, plus
            ``hub_private_repo`` and ``trackio_space_id``).
        trackers: trackers the script starts itself (``wandb.init``, ``trackio.init``, ``mlflow.start_run`` ...);
            a bare import does not count (it is often optional, inside ``try``).
        trackio_space_id: ``trackio.init(space_id=...)`` literal, if any.
        trackio_private: ``trackio.init(private=...)`` literal (None: not given or not a literal).
        imports: top-level modules imported unconditionally at module level (not inside ``try`` or functions, nor
            under an ``if`` that is not known to be taken).
        mentions: pushes, tracker starts, ``torch.compile`` calls and module-level imports on a path that may not
            be taken (see the module docstring); they are in none of the fields above.
        pep723: the PEP 723 block, or None when there is none.
        syntax_error: the parse error, or None.
        saves: what writes checkpoints or a model, as the messages name it (``a Trainer``, ``torch.save()``,
            ``save_model()``, ``save_pretrained()``), in source order; a Trainer with ``save_strategy="no"`` and no
            save call is not one.
    """

    path: Path
    models: tuple[str, ...] = ()
    datasets: tuple[str, ...] = ()
    hub_model_ids: tuple[str, ...] = ()
    push_calls: tuple[str, ...] = ()
    trainer_config: Mapping[str, Any] = field(default_factory=dict)
    trackers: frozenset[str] = frozenset()
    trackio_space_id: str | None = None
    trackio_private: bool | None = None
    imports: tuple[str, ...] = ()
    mentions: tuple[Mention, ...] = ()
    pep723: Pep723Block | None = None
    syntax_error: str | None = None
    saves: tuple[str, ...] = ()


def read_pep723(source: str) -> Pep723Block | None:
    """Read the ``script`` block with the specification's reference algorithm.

    Args:
        source: the script's text.

    Returns:
        The block, None when the script has none, or a block whose ``error`` says why it cannot be used
        (two ``script`` blocks are an error, per the specification).
    """
    blocks = [m for m in PEP723_REGEX.finditer(source) if m.group("type") == "script"]
    if not blocks:
        return None
    if len(blocks) > 1:
        return Pep723Block(error=f"{len(blocks)} `# /// script` blocks (PEP 723 allows one)")
    content = "".join(
        line[2:] if line.startswith("# ") else line[1:]
        for line in blocks[0].group("content").splitlines(keepends=True)
    )
    try:
        data = tomllib.loads(content)
    except tomllib.TOMLDecodeError as exc:
        return Pep723Block(error=f"the `# /// script` block is not valid TOML: {exc}")
    deps = data.get("dependencies", [])
    requires = data.get("requires-python")
    if not isinstance(deps, list) or not all(isinstance(d, str) for d in deps):
        return Pep723Block(error="`dependencies` in the `# /// script` block is not a list of strings")
    if requires is not None and not isinstance(requires, str):
        return Pep723Block(error="`requires-python` in the `# /// script` block is not a string")
    return Pep723Block(dependencies=tuple(deps), requires_python=requires)


def analyze_script(path: Path, *, overrides: Mapping[str, Any] | None = None) -> ScriptFacts:
    """Read ``path`` (UTF-8) and analyse it; see ``analyze_source``.

    Raises:
        OSError: the script cannot be read.
    """
    source = Path(path).read_text(encoding="utf-8", errors="replace")
    return analyze_source(source, path=Path(path), overrides=overrides)


def syntax_error_text(exc: SyntaxError) -> str:
    """``"line 3: invalid syntax"`` plus the offending line and a caret under the column, as Python shows it."""
    text = f"line {exc.lineno}: {exc.msg}"
    if exc.text:
        line = exc.text.rstrip("\n")
        stripped = line.lstrip()
        caret = max(0, (exc.offset or 1) - 1 - (len(line) - len(stripped)))
        text += f"\n    {stripped}\n    {' ' * min(caret, len(stripped))}^"
    return text


def analyze_source(source: str, *, path: Path, overrides: Mapping[str, Any] | None = None) -> ScriptFacts:
    """Analyse a script's text without running it.

    Args:
        source: the script's text.
        path: where it lives; ids that name an existing path next to it (or in the current folder) are local.
        overrides: the job's command-line settings (``JobArgs.values``: name -> value), used to decide whether
            an ``if`` on a flag is taken; None: none known.

    Returns:
        The facts; on a syntax error only ``pep723`` and ``syntax_error`` (``syntax_error_text``) are set.
    """
    pep723 = read_pep723(source)
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        return ScriptFacts(path=path, pep723=pep723, syntax_error=syntax_error_text(exc))
    names = _single_literals(tree)
    conditions = _Conditions(names, overrides or {})
    visitor = _Visitor(names, conditions)
    visitor.visit(tree)
    local_roots = (path.parent, Path.cwd())
    config = visitor.trainer_config()
    written = set(visitor.written)

    def hub_ids(candidates: list[str]) -> tuple[str, ...]:
        out: list[str] = []
        for text in candidates:
            if text in out or text in written or not _HUB_ID.match(text):
                continue
            if any((root / text).exists() for root in local_roots):
                continue
            out.append(text)
        return tuple(out)

    return ScriptFacts(
        path=path,
        models=hub_ids(visitor.models),
        datasets=hub_ids(visitor.datasets),
        hub_model_ids=tuple(dict.fromkeys(visitor.hub_model_ids)),
        push_calls=tuple(visitor.push_calls),
        trainer_config=config,
        trackers=frozenset(visitor.trackers),
        trackio_space_id=visitor.trackio_space_id,
        trackio_private=visitor.trackio_private,
        imports=tuple(dict.fromkeys(_unconditional_imports(tree, conditions, visitor.mentions))),
        mentions=tuple(visitor.mentions),
        pep723=pep723,
        saves=tuple(dict.fromkeys(([] if not visitor.trainer_eval or config.get("save_strategy") == "no"
                                   else ["a Trainer"]) + visitor.saves)),
    )


# ---------------------------------------------------------------------------------------------------------------
# AST helpers
# ---------------------------------------------------------------------------------------------------------------


def _single_literals(tree: ast.AST) -> dict[str, Any]:
    """Names assigned exactly one literal value anywhere in the script (others: ambiguous, left out)."""
    seen: dict[str, Any] = {}
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, (ast.AugAssign, ast.For, ast.AsyncFor, ast.NamedExpr, ast.With, ast.AsyncWith)):
            if isinstance(node, (ast.With, ast.AsyncWith)):
                stores = [item.optional_vars for item in node.items if item.optional_vars is not None]
            else:
                stores = [node.target]
            for store in stores:
                for sub in ast.walk(store):
                    if isinstance(sub, ast.Name):
                        seen[sub.id] = _UNKNOWN
            continue
        for target in targets:
            if isinstance(target, ast.Name):
                try:
                    literal = ast.literal_eval(value) if value is not None else _UNKNOWN
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    literal = _UNKNOWN
                if target.id in seen and seen[target.id] != literal:
                    literal = _UNKNOWN
                seen[target.id] = literal
            else:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Name):
                        seen[sub.id] = _UNKNOWN
    return {name: value for name, value in seen.items() if value is not _UNKNOWN}


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _call_owner(node: ast.Call) -> str:
    """``trackio`` for ``trackio.init(...)``; empty for a bare call."""
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.value.id
    return ""


_NOT_KNOWN = object()


class _Conditions:
    """Evaluates ``if`` tests with three values: True, False, or None (unknown).

    A name or attribute reads its last part from ``overrides`` (the command line: ``training_args.push_to_hub``
    -> ``push_to_hub``); a plain name falls back to its single literal in the script. ``and``/``or``/``not`` and
    one comparison of two known values are evaluated; anything else is unknown.
    """

    def __init__(self, names: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
        self.names = names
        self.overrides = overrides

    def value(self, node: ast.AST) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "__name__":
                return "__main__"
            if node.id == "TYPE_CHECKING":
                return False
            if node.id in self.overrides:
                return self.overrides[node.id]
            return self.names.get(node.id, _NOT_KNOWN)
        if isinstance(node, ast.Attribute):
            if node.attr == "TYPE_CHECKING":
                return False
            return self.overrides.get(node.attr, _NOT_KNOWN)
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.value(item) for item in node.elts]
            return _NOT_KNOWN if any(item is _NOT_KNOWN for item in items) else items
        return _NOT_KNOWN

    def truth(self, node: ast.AST) -> bool | None:
        """Whether the test is true: True, False, or None when it depends on what only the run knows."""
        if isinstance(node, ast.BoolOp):
            parts = [self.truth(v) for v in node.values]
            stop = isinstance(node.op, ast.Or)  # or: any True decides; and: any False decides
            if stop in parts:
                return stop
            return None if None in parts else not stop
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            inner = self.truth(node.operand)
            return None if inner is None else not inner
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self.value(node.left), self.value(node.comparators[0])
            if left is _NOT_KNOWN or right is _NOT_KNOWN:
                return None
            op = node.ops[0]
            try:
                if isinstance(op, (ast.Eq, ast.Is)):
                    return bool(left == right)
                if isinstance(op, (ast.NotEq, ast.IsNot)):
                    return bool(left != right)
                if isinstance(op, ast.In):
                    return bool(left in right)
                if isinstance(op, ast.NotIn):
                    return bool(left not in right)
            except TypeError:
                return None
            return None
        value = self.value(node)
        if value is _NOT_KNOWN:
            return None
        if isinstance(value, str):
            return value.strip().lower() not in ("false", "no", "0", "none", "f", "n", "")
        return bool(value)

    def asked(self, node: ast.AST) -> bool:
        """Whether the test names a flag that the command line turns on (``--wandb_log=True``): the user asked
        for that path, even when the rest of the test (``and master_process``) is known only at run time."""
        for sub in ast.walk(node):
            key = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else None
            if key is not None and key in self.overrides:
                value = self.overrides[key]
                if value is True or (isinstance(value, str) and value.strip().lower() in ("true", "yes", "1")):
                    return True
        return False


class _Visitor(ast.NodeVisitor):
    def __init__(self, names: dict[str, Any], conditions: _Conditions | None = None) -> None:
        self.names = names
        self.conditions = conditions or _Conditions(names, {})
        self.guards: list[tuple[str, bool | None]] = []  # enclosing tests not known true: (text, taken)
        self.mentions: list[Mention] = []
        self.models: list[str] = []
        self.datasets: list[str] = []
        self.hub_model_ids: list[str] = []
        self.push_calls: list[str] = []
        self.written: set[str] = set()
        self.trackers: set[str] = set()
        self.trackio_space_id: str | None = None
        self.trackio_private: bool | None = None
        self.args_calls: list[dict[str, Any]] = []
        self.trainer_eval: list[bool | None] = []
        self.trainer_losses: list[str] = []
        self.losses: list[str] = []
        self.checkpointing_call = False
        self.compile_call = False
        self.saves: list[str] = []  # "torch.save()", "save_model()", "save_pretrained()"

    # -- literals ------------------------------------------------------------------------------------------
    def literal(self, node: ast.AST | None) -> Any:
        if node is None:
            return _UNKNOWN
        if isinstance(node, ast.Name) and node.id in self.names:
            return self.names[node.id]
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.literal(item) for item in node.elts]
            return _UNKNOWN if any(item is _UNKNOWN for item in items) else list(items)
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return _UNKNOWN

    def text(self, node: ast.AST | None) -> str | None:
        value = self.literal(node)
        return value if isinstance(value, str) else None

    @staticmethod
    def arg(node: ast.Call, index: int, keyword: str | None = None) -> ast.AST | None:
        if keyword:
            for kw in node.keywords:
                if kw.arg == keyword:
                    return kw.value
        if len(node.args) > index and not any(isinstance(a, ast.Starred) for a in node.args[: index + 1]):
            return node.args[index]
        return None

    # -- paths not taken -----------------------------------------------------------------------------------
    def _branch(self, test: ast.expr, body: list[ast.AST], orelse: list[ast.AST]) -> None:
        self.visit(test)
        truth = self.conditions.truth(test)
        if truth is None and self.conditions.asked(test):
            truth = True
        text = ast.unparse(test)
        for branch, value, label in ((body, truth, text), (orelse, None if truth is None else not truth,
                                                           f"not ({text})")):
            pushed = value is not True
            if pushed:
                self.guards.append((label, value))
            for stmt in branch:
                self.visit(stmt)
            if pushed:
                self.guards.pop()

    def visit_If(self, node: ast.If) -> None:
        self._branch(node.test, list(node.body), list(node.orelse))

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._branch(node.test, [node.body], [node.orelse])

    def visit_Try(self, node: ast.Try) -> None:
        """A ``try`` body whose errors a handler catches may fail without failing the job (a ``push_to_hub()`` in
        ``try/except``: the script goes on offline): what it does there is a path that may not complete, like one
        under an ``if`` not known to be true. Handlers, ``else`` and ``finally`` are visited as they are."""
        if not node.handlers:
            self.generic_visit(node)
            return
        caught = ", ".join(ast.unparse(h.type) if h.type is not None else "anything" for h in node.handlers)
        self.guards.append((f"it raises nothing (try/except {caught})", None))
        for stmt in node.body:
            self.visit(stmt)
        self.guards.pop()
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            self.visit(part)

    visit_TryStar = visit_Try

    def guarded(self, kind: str, what: str, node: ast.AST) -> bool:
        """Record a ``Mention`` when ``node`` is on a path that may not be taken; True when it was recorded."""
        if not self.guards:
            return False
        off = next(((text, value) for text, value in self.guards if value is False), None)
        text, value = off or self.guards[0]
        self.mentions.append(Mention(kind, what, text, getattr(node, "lineno", 0), value))
        return True

    # -- calls ---------------------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node)
        owner = _call_owner(node)
        if name == "from_pretrained":
            first = self.arg(node, 0, "pretrained_model_name_or_path")
            text = self.text(first)
            if text is None:  # PeftModel.from_pretrained(model, "adapter-id")
                text = next((t for t in map(self.text, node.args) if t), None)
                text = text or self.text(self.arg(node, 1, "model_id"))
            if text:
                self.models.append(text)
        elif name == "load_dataset":
            if text := self.text(self.arg(node, 0, "path")):
                self.datasets.append(text)
        elif name == "pipeline":
            if text := self.text(self.arg(node, 1, "model")):
                self.models.append(text)
        elif name in ("SentenceTransformer", "CrossEncoder", "SparseEncoder"):
            if text := self.text(self.arg(node, 0, "model_name_or_path")):
                self.models.append(text)
        elif name in ("snapshot_download", "hf_hub_download"):
            text = self.text(self.arg(node, 0, "repo_id"))
            repo_type = self.text(self.arg(node, 99, "repo_type")) or "model"
            if text and repo_type == "dataset":
                self.datasets.append(text)
            elif text and repo_type == "model":
                self.models.append(text)
        elif name == "push_to_hub" and isinstance(node.func, ast.Attribute):
            repo = self.text(self.arg(node, 0, "repo_id")) or ""
            if not self.guarded("push", repo, node):
                self.push_calls.append(repo)
        elif name in _SAVE_CALLS:
            if text := self.text(self.arg(node, 0)):
                self.written.add(text)
            if (name == "save" and owner == "torch") or name in ("save_model", "save_pretrained"):
                self.saves.append(f"{'torch.' if name == 'save' else ''}{name}()")
        elif name.endswith("TrainingArguments") or name in _TRL_CONFIGS:
            self._training_arguments(node)
        elif name.endswith("Trainer") and name[:1].isupper():
            self._trainer(node)
        elif name == "gradient_checkpointing_enable":
            self.checkpointing_call = True
        elif name == "compile" and owner == "torch":
            if not self.guarded("compile", "torch.compile", node):
                self.compile_call = True
        elif name == "init" and owner in ("wandb", "trackio"):
            if self.guarded("tracker", owner, node):
                self.generic_visit(node)
                return
            self.trackers.add(owner)
            if owner == "trackio":
                self.trackio_space_id = self.text(self.arg(node, 99, "space_id")) or self.trackio_space_id
                private = self.literal(self.arg(node, 99, "private"))
                if isinstance(private, bool):
                    self.trackio_private = private
        elif owner == "mlflow" and name in ("start_run", "set_tracking_uri", "log_metric", "autolog") and \
                not self.guarded("tracker", "mlflow", node):
            self.trackers.add("mlflow")
        if name.endswith("Loss") and name[:1].isupper():
            self.losses.append(name)
        self.generic_visit(node)

    def _training_arguments(self, node: ast.Call) -> None:
        found: dict[str, Any] = {}
        for kw in node.keywords:
            key = "eval_strategy" if kw.arg == "evaluation_strategy" else kw.arg
            if key not in _CONFIG_KEYS:
                continue
            value = self.literal(kw.value)
            if value is _UNKNOWN:
                found[key] = _UNKNOWN
                continue
            if key == "report_to":
                value = [value] if isinstance(value, str) else list(value) if isinstance(value, list) else _UNKNOWN
            if key == "hub_model_id" and isinstance(value, str):
                self.hub_model_ids.append(value)
            if key == "output_dir" and isinstance(value, str):
                self.written.add(value)
            found[key] = value
        first = self.arg(node, 0)
        if first is not None and "output_dir" not in found:  # TrainingArguments("out", ...)
            found["output_dir"] = self.literal(first)
        self.args_calls.append(found)

    def _trainer(self, node: ast.Call) -> None:
        if text := self.text(self.arg(node, 99, "model")):
            self.models.append(text)
        if any(kw.arg is None for kw in node.keywords):  # Trainer(**kwargs): eval dataset unknown
            self.trainer_eval.append(None)
        else:
            # sentence-transformers evaluates with an ``evaluator=`` alone, no eval dataset needed
            values = [self.arg(node, 99, "eval_dataset"), self.arg(node, 99, "evaluator")]
            self.trainer_eval.append(any(v is not None and self.literal(v) is not None for v in values))
        loss = self.arg(node, 99, "loss")
        if isinstance(loss, ast.Call) and (loss_name := _call_name(loss)):
            self.trainer_losses.append(loss_name)

    # -- result --------------------------------------------------------------------------------------------
    def trainer_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {}
        conflicting: set[str] = set()
        for call in self.args_calls:
            for key, value in call.items():
                if key in config and config[key] != value:
                    conflicting.add(key)
                config.setdefault(key, value)
        config = {k: v for k, v in config.items() if k not in conflicting and v is not _UNKNOWN}
        if len(set(self.trainer_eval)) == 1 and self.trainer_eval[0] is not None:
            config["has_eval_dataset"] = self.trainer_eval[0]
        if self.checkpointing_call and "gradient_checkpointing" not in config:
            config["gradient_checkpointing"] = True
        if self.compile_call and "torch_compile" not in config:
            config["torch_compile"] = True
        cached = [name for name in self.losses if name.startswith("Cached")]
        if cached or self.trainer_losses:
            config["loss_class"] = (cached or self.trainer_losses)[0]
        return config


def _unconditional_imports(tree: ast.Module, conditions: _Conditions, mentions: list[Mention]) -> list[str]:
    """Top-level module names imported at module level outside ``try`` (optional imports) and functions.

    An ``if`` known true is followed, a known false one's ``else``; imports under a test that is not known to be
    true are added to ``mentions`` (kind ``import``) instead.
    """
    names: list[str] = []

    def imported(stmt: ast.stmt) -> list[str]:
        if isinstance(stmt, ast.Import):
            return [alias.name.split(".")[0] for alias in stmt.names]
        if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            return [stmt.module.split(".")[0]]
        return []

    def walk(body: list[ast.stmt], guard: tuple[str, bool | None] | None) -> None:
        for stmt in body:
            for module in imported(stmt):
                if guard is None:
                    names.append(module)
                else:
                    mentions.append(Mention("import", module, guard[0], stmt.lineno, guard[1]))
            if isinstance(stmt, ast.If):
                test = ast.unparse(stmt.test)
                truth = conditions.truth(stmt.test)
                if truth is None and conditions.asked(stmt.test):
                    truth = True
                if truth is False and "TYPE_CHECKING" in test:
                    continue
                walk(stmt.body, guard if truth is True else guard or (test, truth))
                negated = None if truth is None else not truth
                walk(stmt.orelse, guard if negated is True else guard or (f"not ({test})", negated))
            elif isinstance(stmt, ast.With):
                walk(stmt.body, guard)

    walk(tree.body, None)
    return names
