"""Dataset shards: enough files match, none empty, each readable in its format, one schema; the datasets cache.

``--require-shards GLOB[:MIN]`` makes a shard set a requirement (a problem is a ``fail``); local data the script
or its arguments name (``data_files=``, ``data_dir=``, ``--train_file``) is checked the same way but a problem is
only a ``warn``. Formats, by file suffix:

- parquet: the footer and its schema through ``pyarrow`` (``pyarrow.parquet.read_metadata``; the same schema
  across shards); without pyarrow, only the ``PAR1`` magic at both ends (a ``warn`` says so);
- JSON lines (``.jsonl``, ``.ndjson``, ``.json``, also ``.gz``): the first record parses;
- CSV/TSV (also ``.gz``): a header row;
- Arrow (``.arrow``): the IPC file or stream schema through pyarrow (the magic bytes without it);
- WebDataset (``.tar``): a valid first tar header (``tarfile``, checksum included).

An HTML page saved under a shard's name (a failed download) is named as such. A Hub dataset the script loads with
a config or split literal is checked against the repo's file listing (``check_hub_splits``; nothing downloaded).
Only footers and first records are read, side by side, and within ``TIME_LIMIT_S``: past it the remaining files
are checked by size only and the row says how many were opened.

Source: parquet files begin and end with ``PAR1`` (Apache Parquet format spec); Arrow IPC files begin with
``ARROW1`` and streams with the ``0xFFFFFFFF`` continuation marker (Arrow columnar format spec); the datasets
cache is ``HF_DATASETS_CACHE``, default ``HF_HOME/datasets`` (``datasets.config``).
"""

from __future__ import annotations

import ast
import csv
import glob
import gzip
import io
import json
import logging
import os
import re
import tarfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.preflight._common import fmt_bytes, hf_home, one_line
from guard.preflight._models import CheckResult

__all__ = ["TIME_LIMIT_S", "ShardSet", "check_data", "check_datasets_cache", "find_local_data", "inspect_shard",
           "shard_bytes"]

NAME = "data"

log = logging.getLogger("guard.preflight.data")

#: The time the shard check may take in all, in seconds; past it files are checked by size only.
TIME_LIMIT_S = 20.0
#: Files opened side by side (footers are small reads; a network filesystem answers them in parallel).
WORKERS = 8
#: A datasets cache on an ephemeral filesystem warns when the job's data is at least this large (bytes).
LARGE_DATA_BYTES = 10 * 1000**3

_FORMAT = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
           ".tsv": "csv", ".arrow": "arrow", ".tar": "tar"}
_DATA_SUFFIXES = tuple(_FORMAT)
_ARG_FLAGS = re.compile(r"^--(train|validation|valid|eval|test)[_-]file$|^--(data|dataset)[_-]dir$|^--data[_-]files?$")
_EPHEMERAL_FS = frozenset({"overlay", "aufs", "tmpfs"})


@dataclass(frozen=True)
class ShardSet:
    """One set of shard files the job reads.

    Attributes:
        pattern: a glob (``data/train-*.parquet``, ``**`` allowed), a file or a folder (every data file in it).
        min_count: how many files at least (None: at least one).
        origin: what named it, for messages (``--require-shards``, ``data_files= in train.py``).
        required: True for ``--require-shards`` (a problem fails), False when found in the script (a warning).
    """

    pattern: str
    min_count: int | None = None
    origin: str = "--require-shards"
    required: bool = True


def _fmt(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] == ".gz":
        suffixes = suffixes[:-1]
        return {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".tsv": "csv"}.get(
            suffixes[-1] if suffixes else "")
    return _FORMAT.get(suffixes[-1]) if suffixes else None


def _looks_html(head: bytes) -> bool:
    text = head.lstrip().lower()
    return text.startswith((b"<!doctype html", b"<html", b"<?xml", b"<head", b"<body"))


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        return None
    return pyarrow


def inspect_shard(path: Path, fmt: str | None, pa: Any = None) -> tuple[str | None, Any]:
    """Open one shard the cheap way and say what is wrong with it.

    Args:
        path: the file.
        fmt: ``parquet``, ``jsonl``, ``csv``, ``arrow``, ``tar`` or None (size only).
        pa: the ``pyarrow`` module, or None (magic bytes only for parquet and Arrow).

    Returns:
        ``(problem, schema)``: the problem as one line (None when readable), and the Arrow schema for parquet and
        Arrow files when pyarrow read it (else None).
    """
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}", None
    if not head:
        return "is empty (0 bytes)", None
    if fmt is None:
        return None, None
    if _looks_html(head):
        return f"is an HTML page, not a {fmt} file (a failed download saved under the shard's name?)", None
    try:
        if fmt == "parquet":
            return _parquet(path, head, pa)
        if fmt == "arrow":
            return _arrow(path, head, pa)
        if fmt == "tar":
            with tarfile.open(path, mode="r:") as tf:
                if getattr(tf, "firstmember", None) is None and path.stat().st_size > 1024:
                    return "is not a tar archive (no member header)", None
            return None, None
        return _text_record(path, fmt), None
    except (OSError, ValueError, tarfile.TarError, UnicodeDecodeError, EOFError) as exc:
        return f"is not a readable {fmt} file: {one_line(exc, 160)}", None
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid/ArrowException (ValueError)
        return f"is not a readable {fmt} file: {type(exc).__name__}: {one_line(exc, 160)}", None


def _parquet(path: Path, head: bytes, pa: Any) -> tuple[str | None, Any]:
    if pa is None:
        with open(path, "rb") as f:
            f.seek(-4, os.SEEK_END)
            tail = f.read(4)
        if head[:4] != b"PAR1" or tail != b"PAR1":
            return "is not a parquet file (no PAR1 magic at its start and end)", None
        return None, None
    meta = pa.parquet.read_metadata(path)
    return None, meta.schema.to_arrow_schema()


def _arrow(path: Path, head: bytes, pa: Any) -> tuple[str | None, Any]:
    if pa is None:
        if head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff":
            return None, None
        return "is not an Arrow IPC file or stream (no ARROW1 magic, no continuation marker)", None
    with pa.OSFile(str(path), "rb") as f:
        if head[:6] == b"ARROW1":
            return None, pa.ipc.open_file(f).schema
        return None, pa.ipc.open_stream(f).schema


def _text_record(path: Path, fmt: str) -> str | None:
    opener: Callable[..., Any] = gzip.open if path.suffix.lower() == ".gz" else open
    with opener(path, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
        if fmt == "csv":
            delimiter = "\t" if ".tsv" in [s.lower() for s in path.suffixes] else ","
            header = next(csv.reader(text, delimiter=delimiter), None)
            if not header or not any(cell.strip() for cell in header):
                return "has no CSV header row"
            return None
        line = ""
        for line in text:
            if line.strip():
                break
            if text.tell() > 1 << 20:  # pragma: no cover - a megabyte of blank lines
                break
        stripped = line.strip()
        if not stripped:
            return "holds no JSON record"
        try:
            json.loads(stripped)
        except ValueError as exc:
            if path.suffix.lower() == ".json" and stripped[:1] in "[{":
                return None  # a pretty-printed JSON document: its first line alone is not a record
            return f"first record is not JSON: {one_line(exc, 120)}"
        return None


def _schema_diff(a: Any, b: Any) -> str:
    names_a, names_b = list(a.names), list(b.names)
    for name in names_a:
        if name not in names_b:
            return f"column {name!r} missing"
    for name in names_b:
        if name not in names_a:
            return f"extra column {name!r}"
    for name in names_a:
        ta, tb = a.field(name).type, b.field(name).type
        if ta != tb:
            return f"column {name!r} is {tb}, not {ta}"
    return "column order differs"


def _expand(shard_set: ShardSet, cwd: Path) -> list[Path]:
    pattern = os.path.expanduser(shard_set.pattern)
    if not os.path.isabs(pattern):
        pattern = str(cwd / pattern)
    if glob.has_magic(pattern):
        return sorted(Path(p) for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
    path = Path(pattern)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and _fmt(p) is not None)
    return [path] if path.is_file() else []


def _shown(path: Path, cwd: Path) -> str:
    try:
        return str(path.relative_to(cwd))
    except ValueError:
        return str(path)


def check_shard_set(shard_set: ShardSet, *, cwd: Path, deadline: float, pa: Any,
                    clock: Callable[[], float] = time.monotonic) -> CheckResult:
    """One row for one shard set (see the module's docstring for what is checked).

    Args:
        shard_set: the set.
        cwd: the folder relative patterns start from (the job's working folder).
        deadline: the ``clock`` time after which no more files are opened.
        pa: the ``pyarrow`` module or None.
        clock: monotonic seconds.
    """
    bad: Any = "fail" if shard_set.required else "warn"
    hint_more = "" if shard_set.required else "; --require-shards GLOB:MIN makes it a requirement"
    files = _expand(shard_set, cwd)
    label = shard_set.pattern if shard_set.required else f"{shard_set.pattern} ({shard_set.origin})"
    want = shard_set.min_count or 1
    if len(files) < want:
        found = "no file" if not files else f"{len(files)} file{'s' if len(files) != 1 else ''}"
        return CheckResult(NAME, bad, f"{label}: {found} matched, the job expects at least {want}",
                           "check the path and that the copy or download finished" + hint_more)
    sizes: dict[Path, int] = {}
    for path in files:
        try:
            sizes[path] = path.stat().st_size
        except OSError:
            sizes[path] = -1
    empty = [p for p in files if sizes[p] == 0]
    if empty:
        others = f" (and {len(empty) - 1} more)" if len(empty) > 1 else ""
        return CheckResult(NAME, bad, f"{label}: {_shown(empty[0], cwd)} is empty (0 bytes){others}",
                           "re-create or re-download the shard" + hint_more)

    def one(path: Path) -> tuple[str | None, Any] | None:
        if clock() > deadline:
            return None
        return inspect_shard(path, _fmt(path), pa)

    with ThreadPoolExecutor(max_workers=min(WORKERS, len(files)), thread_name_prefix="guard-shards") as pool:
        results = list(pool.map(one, files))
    opened = [(p, r) for p, r in zip(files, results, strict=True) if r is not None]
    problems = [(p, r[0]) for p, r in opened if r[0]]
    if problems:
        path, problem = problems[0]
        others = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        return CheckResult(NAME, bad, f"{label}: {_shown(path, cwd)} {problem}{others}",
                           "replace the bad shard (re-download it) or remove it from the set" + hint_more)
    schemas = [(p, r[1]) for p, r in opened if r[1] is not None]
    if schemas:
        ref_path, ref = schemas[0]
        for path, schema in schemas[1:]:
            if not schema.equals(ref, check_metadata=False):
                return CheckResult(NAME, bad, f"{label}: {_shown(path, cwd)} has another schema than "
                                   f"{_shown(ref_path, cwd)}: {_schema_diff(ref, schema)}",
                                   "all shards of a split need one schema; re-export the odd one" + hint_more)
    formats = sorted({_fmt(p) or "other" for p in files})
    total = sum(s for s in sizes.values() if s > 0)
    seen = f"{label}: {len(files)} file{'s' if len(files) != 1 else ''} ({'/'.join(formats)}, {fmt_bytes(total)})"
    if shard_set.min_count:
        seen += f", at least {shard_set.min_count} expected"
    if schemas:
        cols = ", ".join(f"{f.name}:{f.type}" for f in list(schemas[0][1])[:4])
        more = ", ..." if len(schemas[0][1]) > 4 else ""
        seen += f", one schema ({cols}{more})"
    seen += f"; opened {len(opened)} of {len(files)}"
    if len(opened) < len(files):
        seen += f" (time limit {TIME_LIMIT_S:g}s; the rest by size only)"
    if pa is None and any(_fmt(p) in ("parquet", "arrow") for p in files):
        return CheckResult(NAME, "warn", seen + "; pyarrow not installed: magic bytes only, no schema",
                           "pip install pyarrow (or jobguard[data]) to read footers and schemas")
    return CheckResult(NAME, "pass", seen)


# ---------------------------------------------------------------------------------------------------------------
# Local data the script or its arguments name
# ---------------------------------------------------------------------------------------------------------------


def _strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [s for elt in node.elts for s in _strings(elt)]
    if isinstance(node, ast.Dict):
        return [s for value in node.values for s in _strings(value)]
    return []


def _is_local(text: str) -> bool:
    return bool(text.strip()) and "://" not in text and not text.startswith(("hf:", "gs:", "s3:"))


def find_local_data(script: Path | None, script_args: Sequence[str] = ()) -> list[ShardSet]:
    """Local data the job names: ``data_files=``/``data_dir=`` literals in any call of the script, and
    ``--train_file``/``--validation_file``/``--test_file``/``--data_dir`` (also ``-`` spellings) in its arguments.

    Returns:
        One ``ShardSet`` (``required=False``) per distinct path or glob; a ``data_files`` relative to the same
        call's ``data_dir`` is joined to it.
    """
    found: list[ShardSet] = []
    if script is not None:
        try:
            tree = ast.parse(script.read_bytes(), filename=str(script))
        except (OSError, SyntaxError, ValueError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            base = _strings(kw.get("data_dir"))
            files = _strings(kw.get("data_files"))
            if files:
                root = base[0] if base and _is_local(base[0]) else ""
                found += [ShardSet(os.path.join(root, f) if root else f, None, f"data_files= in {script.name}",
                                   False) for f in files if _is_local(f)]
            elif base:
                found += [ShardSet(d, None, f"data_dir= in {script.name}", False) for d in base if _is_local(d)]
    args = list(script_args)
    for i, token in enumerate(args):
        flag, eq, value = token.partition("=")
        if not _ARG_FLAGS.match(flag):
            continue
        value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
        if value and _is_local(value) and not value.startswith("-"):
            found.append(ShardSet(value, None, f"{flag} argument", False))
    unique: dict[str, ShardSet] = {}
    for item in found:
        unique.setdefault(item.pattern, item)
    return list(unique.values())


def check_data(
    shard_sets: Iterable[ShardSet],
    *,
    cwd: Path | None = None,
    time_limit_s: float = TIME_LIMIT_S,
    pyarrow_module: Any = "import",
    clock: Callable[[], float] = time.monotonic,
) -> list[CheckResult]:
    """One ``data`` row per shard set; ``n/a`` when the job names none.

    Args:
        shard_sets: ``--require-shards`` sets first, then the ones ``find_local_data`` found.
        cwd: where relative patterns start (default: the current folder).
        time_limit_s: the time all sets may take together, in seconds.
        pyarrow_module: the ``pyarrow`` module, None to act as if it were missing, or ``"import"``.
        clock: monotonic seconds.
    """
    sets = list(shard_sets)
    if not sets:
        return [CheckResult(NAME, "n/a", "no shards named (--require-shards GLOB[:MIN]; no data_files=, data_dir= "
                            "or --train_file in the job)")]
    pa = _pyarrow() if pyarrow_module == "import" else pyarrow_module
    deadline = clock() + time_limit_s
    root = cwd or Path.cwd()
    return [check_shard_set(s, cwd=root, deadline=deadline, pa=pa, clock=clock) for s in sets]


def _mount_of(path: Path, partitions: Sequence[Any]) -> Any:
    target = str(path)
    best = None
    for part in partitions:
        mount = part.mountpoint.rstrip("/") or "/"
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and \
                (best is None or len(mount) > len(best.mountpoint.rstrip("/") or "/")):
            best = part
    return best


def check_datasets_cache(environ: Mapping[str, str], *, data_bytes: int | None, uses_datasets: bool,
                         partitions: Callable[[], Sequence[Any]] | None = None) -> CheckResult | None:
    """Warn when the datasets cache lies on an ephemeral container filesystem and the job's data is large.

    ``load_dataset`` converts data files into Arrow files under the cache, so a large dataset fills the
    container's writable layer and is converted again on every start.

    Args:
        environ: the job's environment (``HF_DATASETS_CACHE``, ``HF_HOME``).
        data_bytes: the job's data size in bytes when known (its shards), else None.
        uses_datasets: whether the job uses ``datasets`` (the script imports it or names a Hub dataset).
        partitions: ``psutil.disk_partitions(all=True)`` or a stand-in.

    Returns:
        A ``warn`` row, or None when there is nothing to say.
    """
    if not uses_datasets or not data_bytes or data_bytes < LARGE_DATA_BYTES:
        return None
    cache_text = environ.get("HF_DATASETS_CACHE")
    cache = Path(os.path.expandvars(cache_text)).expanduser() if cache_text else hf_home(environ) / "datasets"
    if partitions is None:
        import psutil

        def partitions() -> Sequence[Any]:
            return psutil.disk_partitions(all=True)

    part = _mount_of(cache.absolute(), partitions())
    if part is None or part.fstype not in _EPHEMERAL_FS:
        return None
    return CheckResult(NAME, "warn", f"datasets cache {cache} is on {part.fstype} ({part.mountpoint}), lost with "
                       f"the container, and the data is {fmt_bytes(data_bytes)}: converted again at every start",
                       "set HF_DATASETS_CACHE to a persistent volume")


def shard_bytes(shard_sets: Iterable[ShardSet], cwd: Path | None = None) -> int:
    """The total size in bytes of every file the sets match (0 when none)."""
    total = 0
    for shard_set in shard_sets:
        for path in _expand(shard_set, cwd or Path.cwd()):
            try:
                total += path.stat().st_size
            except OSError:
                continue
    return total


# ---------------------------------------------------------------------------------------------------------------
# Hub datasets: the config and split the script asks for exist (file listing, no download)
# ---------------------------------------------------------------------------------------------------------------

#: Split keywords in file and folder names, as ``datasets.data_files`` infers splits without YAML configs
#: (``KEYWORDS_IN_FILENAME_BASE_PATTERNS``: train/training, validation/valid/dev/val, test/testing/eval/evaluation;
#: ``DEFAULT_PATTERNS_SPLIT_IN_FILENAME``: ``data/{split}-00000-of-00001.*`` takes any split name).
_SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
                "dev": "validation", "val": "validation", "test": "test", "testing": "test", "eval": "test",
                "evaluation": "test"}
_SPLIT_FILE = re.compile(r"(?:^|/)data/([\w]+?)-\d{5}-of-\d{5}")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


@dataclass(frozen=True)
class HubSplit:
    """A ``load_dataset("org/name", config, split=...)`` call of the script (literals only)."""

    repo_id: str
    config: str | None
    splits: tuple[str, ...]


def find_hub_splits(script: Path | None) -> list[HubSplit]:
    """``load_dataset`` calls whose first argument is a Hub id literal, with their config and split literals."""
    if script is None:
        return []
    try:
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[HubSplit] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name != "load_dataset" or not node.args:
            continue
        repo = _strings(node.args[0])
        kw = {k.arg: k.value for k in node.keywords if k.arg}
        if not repo or not _HUB_ID.match(repo[0]):
            continue
        config = _strings(node.args[1] if len(node.args) > 1 else kw.get("name"))
        split_text = _strings(kw.get("split"))
        splits = tuple(dict.fromkeys(re.sub(r"\[.*?\]", "", part).strip() for text in split_text
                                     for part in text.split("+") if part.strip()))
        if config or splits:
            found.append(HubSplit(repo[0], config[0] if config else None, splits))
    return found


def _hub_layout(info: Any) -> tuple[dict[str, set[str]] | None, set[str]]:
    """``(configs -> splits from the YAML configs or None, splits inferred from the file names)``."""
    card = getattr(info, "card_data", None) or getattr(info, "cardData", None) or {}
    configs_yaml = card.get("configs") if hasattr(card, "get") else None
    configs: dict[str, set[str]] | None = None
    if isinstance(configs_yaml, list) and configs_yaml:
        configs = {}
        for entry in configs_yaml:
            if not isinstance(entry, dict):
                continue
            files = entry.get("data_files")
            names = {str(f.get("split")) for f in files if isinstance(f, dict) and f.get("split")} \
                if isinstance(files, list) else set()
            configs[str(entry.get("config_name", "default"))] = names or {"train"}
    inferred: set[str] = set()
    for sibling in getattr(info, "siblings", None) or []:
        path = str(getattr(sibling, "rfilename", "")).lower()
        if _fmt(Path(path)) is None:
            continue
        m = _SPLIT_FILE.search(path)
        if m:
            inferred.add(m.group(1))
            continue
        for word in re.split(r"[/_.\-\s0-9]+", path):
            if word in _SPLIT_WORDS:
                inferred.add(_SPLIT_WORDS[word])
    return configs, inferred or {"train"}


def check_hub_splits(wants: Sequence[HubSplit], *, info_of: Callable[[str], Any],
                     required: Iterable[str] = ()) -> list[CheckResult]:
    """One row per Hub dataset whose config or split the script names: they exist in the repo's file listing.

    Args:
        wants: from ``find_hub_splits``.
        info_of: ``repo_id -> DatasetInfo`` (``HfApi.dataset_info``, siblings listed, nothing downloaded); it
            may raise (missing repo, no answer): that dataset is then left to the ``hub-repos`` row.
        required: ``--require-dataset`` ids: a missing config or split of theirs fails, of others it warns.
    """
    must = set(required)
    rows: list[CheckResult] = []
    for want in wants:
        try:
            info = info_of(want.repo_id)
        except Exception as exc:  # noqa: BLE001 - access problems are the hub-repos row's to report
            log.debug("no file listing of %s: %r", want.repo_id, exc)
            continue
        configs, inferred = _hub_layout(info)
        bad: Any = "fail" if want.repo_id in must else "warn"
        asked = f"{want.repo_id}" + (f" config {want.config!r}" if want.config else "")
        if configs is not None:
            if want.config and want.config not in configs:
                rows.append(CheckResult(NAME, bad, f"{asked}: no such config (configs: {', '.join(sorted(configs))})",
                                        "pass one of the repo's config names to load_dataset"))
                continue
            splits = configs.get(want.config or "default") or next(iter(configs.values()))
        else:
            if want.config and want.config != "default" and not any(
                    str(getattr(s, "rfilename", "")).startswith(want.config + "/") for s in info.siblings or []):
                rows.append(CheckResult(NAME, bad, f"{asked}: no such config (no YAML configs in its card, no "
                                        f"folder {want.config}/)", "check the config name on the dataset's page"))
                continue
            splits = inferred
        missing = [s for s in want.splits if s not in splits]
        if missing:
            rows.append(CheckResult(NAME, bad, f"{asked}: no split {', '.join(map(repr, missing))} (splits: "
                                    f"{', '.join(sorted(splits))})", "use one of the listed splits"))
        else:
            rows.append(CheckResult(NAME, "pass", f"{asked}: split {', '.join(want.splits) or '(all)'} exists "
                                    "(file listing)"))
    return rows
