"""Destinations for secured checkpoints (a Hub repo or a folder): push, verify, fetch.

A push is secured only once verified: every file's size and sha256 at the destination equal the local file's.

- **Hub**: one ``create_commit`` into ``last-checkpoint/`` that also deletes what was there before (what
  ``upload_folder(delete_patterns=...)`` does, but always one commit: with ``hf_xet`` installed
  ``upload_folder`` switches to a multi-commit pipeline). Verification reads ``get_paths_info`` at that commit:
  LFS files carry their sha256, compared with the sha256 the client computed while uploading (no second read);
  regular files (small, at most 10 MB on the Hub) carry their git blob sha1, compared with ``git_hash`` of the
  local bytes. Nothing is downloaded again.
- **Folder**: a copy into a temporary folder beside the target, fsynced, then swapped in atomically as
  ``last-checkpoint`` (``renameat2(RENAME_EXCHANGE)`` on Linux, else two renames), then re-hashed. The copy holds a
  manifest, ``guard_manifest.json`` (step, size and sha256 of each file), which fetching verifies against.
- **Fetch** downloads ``last-checkpoint/`` at the newest commit and checks every file against the tree listing
  (sha256 of LFS files, git sha1 of regular ones) or the folder's manifest. The step comes from the checkpoint's
  ``trainer_state.json`` (``global_step``), else from the newest commit titled ``... checkpoint step N`` (every
  push writes one), else from the manifest (folders).

Bounded waiting (``guard.secure.hubhttp``): every Hub request has a timeout, and during a push or fetch none
outlives its deadline; network errors and 408/429/5xx answers are retried here, with backoff, while time remains.
Limits: the bound is process-wide (with two pushes at once the earlier deadline applies to both), and transfers made by
``hf_xet`` (when installed and not disabled) bypass the HTTP client, so only their HTTP calls are bounded.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from guard.errors import (
    CheckpointRewrittenError,
    DestinationError,
    HubError,
    PartsMissingError,
    PushFailedError,
    TransientDestinationError,
    UsageError,
)
from guard.secure import formats
from guard.secure.checkpoints import is_marked_suspect, rewritten_after
from guard.secure.dest.base import FetchedCheckpoint  # one type for every destination's fetch
from guard.secure.hubhttp import (
    PROGRESS,
    REQUEST_TIMEOUTS_S,
    Mismatch,
    bounded,
    cause_hint,
    classify,
    failure_cause,
    fatal_hint,
    install_request_bounds,
    retry_after_s,
)
from guard.secure.layout import CHECKPOINT_FOLDER_RE

if TYPE_CHECKING:
    from huggingface_hub import CommitOperationAdd, HfApi

__all__ = ["CHECKPOINT_FOLDER", "MANIFEST_NAME", "REQUEST_TIMEOUTS_S", "Destination", "FetchedCheckpoint",
           "FolderCopy", "PushResult", "SecuredRecord", "Securer", "final_model_files", "install_request_bounds",
           "parse_destination"]

logger = logging.getLogger("guard.hub")
T = TypeVar("T")

CHECKPOINT_FOLDER = "last-checkpoint"
#: The title of every checkpoint commit the guard makes; the newest commit with this title is the secured one.
CHECKPOINT_COMMIT_TITLE = "guard: checkpoint step {step}"
#: The title of the commit that uploads a checkpoint's files; the record (``CHECKPOINT_COMMIT_TITLE``, adding the
#: manifest) follows only once every file verified. Never matches ``_STEP_IN_TITLE``.
UPLOAD_COMMIT_TITLE = "guard: upload of step {step}, not verified yet"
MANIFEST_NAME = "guard_manifest.json"
_MIN_ATTEMPT_S = 1.0  # don't start another attempt with less time than this left
#: Many nodes: how often a node whose part is in looks for the others' (seconds; one listing each).
PARTS_POLL_S = 0.5
_ACCEPTED_FORMS = ("hf://NS/NAME, hf://datasets/NS/NAME, NS/NAME (a Hub model repo), s3://BUCKET/PREFIX, "
                   "or a folder path (absolute, or starting with ./, ../ or file://)")
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")
_STEP_IN_TITLE = re.compile(r"checkpoint step (\d+)")
_GUARD_TITLE = re.compile(r"guard: checkpoint step (\d+)")
_UPLOAD_TITLE = re.compile(r"guard: upload of step (\d+), not verified yet")


# ---------------------------------------------------------------------------------------------------------------
# Destinations and results
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Destination:
    """Where secured checkpoints go.

    Attributes:
        kind: ``"hub"``, ``"folder"`` or ``"s3"``.
        repo_id: ``"NS/NAME"`` (hub), else None.
        repo_type: ``"model"`` or ``"dataset"`` (hub), else None.
        path: the folder, absolute (folder), else None.
        url: ``s3://BUCKET/PREFIX`` in its canonical form (s3), else None.
    """

    kind: str
    repo_id: str | None = None
    repo_type: str | None = None
    path: Path | None = None
    url: str | None = None

    def __str__(self) -> str:
        if self.kind == "folder":
            return str(self.path)
        if self.kind == "s3":
            return str(self.url)
        return f"hf://{'datasets/' if self.repo_type == 'dataset' else ''}{self.repo_id}"


def parse_destination(text: str) -> Destination:
    """Parse ``--push-to``: ``hf://NS/NAME``, ``hf://datasets/NS/NAME``, bare ``NS/NAME`` (a Hub model repo),
    ``s3://BUCKET/PREFIX`` (``guard.secure.dest.s3.parse_s3_url``), or a folder path (absolute, or starting with
    ``./``, ``../`` or ``file://``). Forms from ``shared/CONTRACT.md``.

    A bare ``NS/NAME`` that names an existing folder here (``checkpoints/run1``) is refused: it would mean a Hub
    repo, and with a token the guard would create one by mistake.

    Raises:
        UsageError: (``option="--push-to"``) for anything else, naming the accepted forms; for a bare form that is
            also a local folder, with "did you mean ./NAME".
    """
    raw = text.strip() if isinstance(text, str) else ""
    if raw.startswith("s3://"):
        from guard.secure.dest.s3 import parse_s3_url

        bucket, prefix = parse_s3_url(raw)
        return Destination("s3", url=f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")
    if raw.startswith("file://") and len(raw) > len("file://"):
        return Destination("folder", path=Path(os.path.abspath(raw[len("file://"):])))
    if raw.startswith(("/", "./", "../")):
        return Destination("folder", path=Path(os.path.abspath(raw)))
    repo_type, parts = "model", raw.split("/")
    if raw.startswith("hf://"):
        parts = raw[len("hf://"):].rstrip("/").split("/")
        if len(parts) == 3 and parts[0] in ("datasets", "models"):
            repo_type, parts = ("dataset" if parts[0] == "datasets" else "model"), parts[1:]
    if len(parts) == 2 and all(_NAME.fullmatch(p) and "--" not in p and ".." not in p for p in parts) \
            and not parts[1].endswith(".git"):
        if not raw.startswith("hf://") and os.path.exists(raw):
            raise UsageError(f"--push-to {raw}: a bare NS/NAME is a Hub repo, but ./{raw} is a folder here",
                             option="--push-to",
                             hint=f"did you mean ./{raw}? (write hf://{raw} for the Hub repo)")
        return Destination("hub", repo_id="/".join(parts), repo_type=repo_type)
    raise UsageError(f"--push-to {text!r} is not a destination: use {_ACCEPTED_FORMS}", option="--push-to",
                     hint="e.g. --push-to hf://alice/my-run or --push-to ./secured")


@dataclass(frozen=True)
class PushResult:
    """A verified push.

    Attributes:
        destination: the destination's canonical form (``str(Destination)``).
        revision: the Hub commit id (40 hex), or the folder written (absolute path).
        files: paths of the files secured, relative to the checkpoint (or output) folder, sorted.
        size_bytes: their total size.
        elapsed_s: seconds the push took, upload and verification, all attempts (injected clock).
        attempts: attempts made (1 when the first one succeeded).
        step: the checkpoint's training step; None for the final model.
        attempt_s: seconds of the attempt that succeeded alone (no failed attempt, no backoff or Retry-After wait):
            what a throughput estimate may learn from; None when unknown.
    """

    destination: str
    revision: str
    files: tuple[str, ...]
    size_bytes: int
    elapsed_s: float
    attempts: int
    step: int | None = None
    attempt_s: float | None = None

    @property
    def pushed(self) -> str:
        """``DEST@REVISION``, the VERDICT's ``pushed=`` value."""
        return f"{self.destination}@{self.revision}"

    @property
    def bytes_per_s(self) -> float:
        """Effective throughput of the attempt that succeeded: ``size_bytes / attempt_s`` (``elapsed_s`` when the
        attempt's own time is unknown; files the Hub already had count too); 0.0 when that time is 0."""
        took = self.attempt_s if self.attempt_s is not None else self.elapsed_s
        return self.size_bytes / took if took > 0 else 0.0


@dataclass(frozen=True)
class SecuredRecord:
    """What the destination records as secured: ``revision`` (Hub commit id, or the ``last-checkpoint`` folder),
    ``step`` (None when not recorded), and where the checkpoint came from (the manifest's, None when not
    recorded): ``output_dir`` (the job's output folder, relative to its working folder when inside it) and
    ``place`` (the checkpoint's path relative to it: ``"checkpoint-20"`` for a folder, ``"."`` for files that lay
    at its top, e.g. ``ckpt.pt``)."""

    revision: str
    step: int | None
    output_dir: str | None = None
    place: str | None = None


# ---------------------------------------------------------------------------------------------------------------
# Local files
# ---------------------------------------------------------------------------------------------------------------


def _list_files(folder: Path, keep: Callable[[str], bool] = lambda rel: True) -> list[str]:
    """Files under ``folder`` (posix relative paths, sorted), minus ``.git``/``.cache`` folders and ``keep`` misses.
    Symbolic links are never followed out of ``folder`` (``checkpoints.list_files``)."""
    from guard.secure.checkpoints import list_files

    return [rel for rel in list_files(folder)
            if not rel.startswith((".git/", ".cache/")) and "/.git/" not in rel and "/.cache/" not in rel and keep(rel)]


def _signatures(folder: Path, files: list[str]) -> dict[str, tuple[int, int, int]]:
    """``{rel: (size, mtime_ns, inode)}``: compared before and after a copy to catch a file rewritten meanwhile
    (in place, or replaced by a rename: a new inode)."""
    out = {}
    for rel in files:
        with contextlib.suppress(OSError):
            st = os.stat(folder / rel)
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def _refuse_torn(what: str, folder: Path, files: list[str], where: str, destination: str, *,
                 parts: bool = False) -> None:
    """Raise ``PushFailedError`` when a file of ``files`` under ``folder`` is not structurally whole
    (``formats.check_files``): ``where`` says which copy (``"local"``, ``"uploaded"``); ``parts``: the folder is one
    node's part of a many-node checkpoint (what its format names on other nodes is not looked for here)."""
    from guard.secure.formats import check_files

    problems = check_files(folder, files, parts=parts)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; ... {len(problems) - 3} more" if len(problems) > 3 else "")
        raise PushFailedError(f"cannot secure {what}: the {where} files are not whole ({shown}); the secured copy "
                              "is left as it was", destination=destination,
                              hint="the job was still writing the checkpoint (or cut it short): let its save finish "
                                   "(a longer --grace), or save to a temporary name and rename it into place")


def _default_dir_mode() -> int:
    """The mode a new folder gets from the process umask (``0o777 & ~umask``), read from ``/proc/self/status``
    (Linux 4.7+, ``Umask:``) when possible, else by setting and restoring the umask."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return 0o777 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o777 & ~mask


def _staging_dir(prefix: str, parent: Path) -> Path:
    """A fresh temporary folder in ``parent`` with the destination's default permissions (``tempfile.mkdtemp``
    creates 0700 folders, which would then be swapped in as the secured one)."""
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(staging, _default_dir_mode())
    return staging


def holds_final_model(output_dir: str | os.PathLike[str] | None, only: Collection[str] | None = None) -> bool:
    """``output_dir`` is a folder holding final model files (``final_model_files``); False for None."""
    return output_dir is not None and os.path.isdir(output_dir) and bool(final_model_files(output_dir, only))


def final_model_files(output_dir: str | os.PathLike[str], only: Collection[str] | None = None) -> list[str]:
    """The final model files of an output folder: everything but its checkpoint folders (``checkpoint-*/``,
    accelerate's ``step_N/``, ``checkpoint_N/`` and ``checkpoints/``, ``global_stepN/``), ``last-checkpoint/``,
    ``runs/`` and hidden or underscore-prefixed files and folders. Returns sorted posix relative paths.

    ``only``: the relative paths that may count, for an output folder that is not the job's own (the working
    folder of ``--save model.pt``: its sources, data and logs are no model); None: the whole folder."""
    def keep(rel: str) -> bool:
        if only is not None and rel not in only:
            return False
        parts = rel.split("/")
        if len(parts) > 1 and (parts[0] in (CHECKPOINT_FOLDER, "runs", "checkpoints")
                               or parts[0].startswith("checkpoint-") or CHECKPOINT_FOLDER_RE.fullmatch(parts[0])):
            return False
        return not any(p.startswith((".", "_")) for p in parts)
    return _list_files(Path(output_dir), keep)


def _hash_file(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _copy_and_hash(src: Path, dst: Path) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` (fsynced) in one read pass; returns (size in bytes, sha256 hex) of what was read."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while chunk := fin.read(1 << 20):
            digest.update(chunk)
            fout.write(chunk)
            size += len(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return size, digest.hexdigest()


@dataclass(frozen=True)
class FolderCopy:
    """What the last push to a folder destination wrote: bytes copied, and unchanged files (and their bytes) taken
    from the previous secured copy by a hard link instead."""

    copied_bytes: int
    reused_bytes: int
    reused_files: int


def _read_manifest(secured: Path) -> dict[str, Any]:
    """The manifest (``guard_manifest.json``) of a secured folder; empty when it has none or it cannot be read."""
    try:
        manifest = json.loads((secured / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def _manifest_files(secured: Path) -> dict[str, tuple[int, str]]:
    """``{rel: (size, sha256)}`` from the manifest of a secured ``last-checkpoint`` folder; empty when it has none
    (or it cannot be read)."""
    try:
        recorded = _read_manifest(secured)["files"]
        return {str(rel): (int(entry["size"]), str(entry["sha256"])) for rel, entry in recorded.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


#: Checkpoint folder names of the layouts the guard knows (their parent is the output folder).
_CHECKPOINT_LIKE = re.compile(r"(?:tmp-)?(?:checkpoint-|checkpoint_|step_|global_step)[0-9]+")


def _placement(folder: Path) -> dict[str, str]:
    """Where a pushed checkpoint lies, for resume to put it back: ``{"output_dir": ..., "place": ...}``. A
    checkpoint-like folder (``checkpoint-N``, ``checkpoint_N``, ``step_N``, ``global_stepN``) is placed by its name
    in its parent; any other folder holds files that lay at the top of the output folder (``ckpt.pt``). The output
    folder is written relative to the working folder when inside it, so that the next run (another machine, the
    same checkout) finds it again."""
    where = Path(os.path.abspath(folder))
    output_dir, place = (where.parent, where.name) if _CHECKPOINT_LIKE.fullmatch(where.name) else (where, ".")
    here = Path(os.getcwd())
    text = os.path.relpath(output_dir, here) if output_dir.is_relative_to(here) else str(output_dir)
    return {"output_dir": text, "place": place}


def _placed(manifest: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(output_dir, place)`` from a manifest (see ``_placement``); None for what it does not record."""
    out, place = manifest.get("output_dir"), manifest.get("place")
    place_ok = isinstance(place, str) and (place == "." or _CHECKPOINT_LIKE.fullmatch(place) is not None)
    return (out if isinstance(out, str) and out else None), (place if place_ok else None)


def _against_manifest(fetched: Path, manifest: dict[str, Any], present: list[str]) -> list[str]:
    """Problems of a fetched checkpoint against its manifest (``{"files": {rel: {"size", "sha256"}}}``): a file it
    names that is missing or differs in size or sha256, a file it does not name."""
    recorded = manifest.get("files")
    if not isinstance(recorded, dict):
        return [f"{MANIFEST_NAME} names no files"]
    problems = []
    for rel, want in sorted(recorded.items()):
        local = fetched / rel
        if not local.is_file():
            problems.append(f"{rel} missing (named by {MANIFEST_NAME})")
        elif not isinstance(want, dict) or _hash_file(local) != (want.get("size"), want.get("sha256")):
            problems.append(f"{rel} differs from the size and sha256 recorded in {MANIFEST_NAME}")
    problems += [f"{rel} is not named by {MANIFEST_NAME}" for rel in present
                 if rel != MANIFEST_NAME and rel not in recorded]
    return problems


def _reuse_unchanged(src: Path, previous: Path, dst: Path, recorded: tuple[int, str] | None) -> tuple[int, str] | None:
    """Hard-link ``previous`` (the same file in the previous secured copy) to ``dst`` when ``src`` has the size and
    sha256 its manifest ``recorded``; returns ``(size, sha256)`` then, else None (the caller copies). Reading
    ``src`` once to hash it replaces writing it again; the link is verified with every other file afterwards.
    None too where the file system refuses hard links."""
    if recorded is None:
        return None
    try:
        if src.stat().st_size != recorded[0] or previous.stat().st_size != recorded[0]:
            return None
    except OSError:
        return None
    found = _hash_file(src)
    if found != recorded:
        return None
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.link(previous, dst, follow_symlinks=False)
    except OSError:  # EPERM, EXDEV, EMLINK, ENOTSUP: no hard links here
        return None
    return found


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with Linux ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


#: Where the fallback swap keeps the previous secured copy until the new one is in place (never matched by the
#: staging glob): ``.last-checkpoint.previous-<pid>``.
_PREVIOUS = f".{CHECKPOINT_FOLDER}.previous-"
#: The final push's journal: the renames of files staged and verified beside the root, replayed by the next run.
_FINAL_JOURNAL = ".guard-final-journal.json"


def _swap_in(staging: Path, target: Path) -> Path | None:
    """Put ``staging`` at ``target`` atomically; returns the path now holding the old content (to delete).

    ``renameat2(RENAME_EXCHANGE)`` where the file system has it; else (NFS and others) two renames, the previous
    copy first moved to ``.last-checkpoint.previous-<pid>``: killed between the two, the next run finds no
    ``last-checkpoint`` and that folder, and puts it back (``_recover``), so the secured copy is never lost."""
    if not target.exists():
        os.rename(staging, target)
        return None
    if _rename_exchange(staging, target):
        return staging
    old = target.with_name(f"{_PREVIOUS}{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.rename(target, old)
    _fsync_dir(target.parent)
    os.rename(staging, target)
    return old


def _pid_alive(text: str) -> bool:
    import psutil

    return text.isdigit() and psutil.pid_exists(int(text))


def _recover(root: Path, log: logging.Logger = logger) -> None:
    """Finish what a push killed part way left at a folder destination (its process is gone):

    - no ``last-checkpoint`` but a previous copy (``.last-checkpoint.previous-<pid>``, or ``.last-checkpoint.tmp-
      <pid>-XXXX.old`` of older versions): it is put back; with ``last-checkpoint`` present it is removed;
    - a final push's journal: every staged file it lists is renamed into place (all were verified before the
      journal was written), then the journal is removed.
    """
    target = root / CHECKPOINT_FOLDER
    previous = [e for e in root.glob(f"{_PREVIOUS}*") if not _pid_alive(e.name[len(_PREVIOUS):])]
    previous += [e for e in root.glob(f".{CHECKPOINT_FOLDER}.tmp-*.old")
                 if not _pid_alive(e.name[len(f".{CHECKPOINT_FOLDER}.tmp-"):].split("-", 1)[0])]
    for entry in sorted(previous, key=lambda e: e.stat().st_mtime, reverse=True):
        if not target.exists() and entry.is_dir():
            os.rename(entry, target)
            _fsync_dir(root)
            log.warning("%s was missing after a push killed mid-swap: the previous secured copy is back in place",
                        target)
        else:
            shutil.rmtree(entry, ignore_errors=True)
    journal = root / _FINAL_JOURNAL
    try:
        entries = json.loads(journal.read_text())
    except (OSError, ValueError):
        return
    if _pid_alive(str(entries.get("pid", ""))):
        return
    for rel, staged in entries.get("renames", {}).items():
        if (root / staged).is_file():
            os.replace(root / staged, root / rel)
    _fsync_dir(root)
    journal.unlink()
    log.warning("a final push to %s was killed while its files were put in place: finished it from its journal",
                root)


def _remove_stale_staging(root: Path) -> None:
    """Remove ``.last-checkpoint.tmp-<pid>-XXXX`` staging folders left by a push that was killed (its process is
    gone), after ``_recover`` put back a previous copy that a killed swap left aside."""
    _recover(root)
    for entry in root.glob(f".{CHECKPOINT_FOLDER}.tmp-*"):
        pid = entry.name[len(f".{CHECKPOINT_FOLDER}.tmp-"):].split("-", 1)[0]
        if entry.is_dir() and not entry.name.endswith(".old") and not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _step_from_trainer_state(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------------------------
# The securer
# ---------------------------------------------------------------------------------------------------------------


class Securer:
    """Pushes checkpoints and the final model to one destination, verifies them, fetches them back.

    Args:
        destination: a ``Destination`` or ``--push-to`` text (see ``parse_destination``).
        api: the ``huggingface_hub.HfApi`` to use (Hub destinations); default ``HfApi(token=token)``.
        token: Hub token for the default ``api``; default: ``HF_TOKEN`` or the stored login.
        clock: monotonic seconds; ``deadline`` arguments are values of this clock.
        sleep: waits between attempts (seconds).
        log: the logger (default ``guard.secure.hub``).
        backoff_s: first wait between attempts; doubles up to ``max_backoff_s`` (seconds).
        run_id: this run's id (``SecureSettings.run_id``): an S3 destination keeps each run's checkpoints under
            it until the record names them; default ``"run"``.
        store: the ``guard.secure.dest.base.Store`` of an S3 destination; default ``S3Store.from_url``, built on
            first use.
        node_rank, nodes: this node's index and the job's node count (``SecureSettings``), when every node secures
            its own part of each checkpoint (many nodes, each with its own disk; S3): the record moves only once
            every node's part is there (``guard.secure.nodes.whole``); default 0 and 1 (one node: part and record
            are one push).

    Raises:
        UsageError: ``destination`` text that ``parse_destination`` refuses.
    """

    def __init__(self, destination: Destination | str, *, api: HfApi | None = None, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 log: logging.Logger = logger, backoff_s: float = 1.0, max_backoff_s: float = 8.0,
                 run_id: str | None = None, store: Any = None, node_rank: int = 0, nodes: int = 1) -> None:
        self.destination = destination if isinstance(destination, Destination) else parse_destination(destination)
        self._api, self._token = api, token
        self.token = token  # for worker processes (guard.secure.worker), sent on their stdin
        self._clock, self._sleep, self._log = clock, sleep, log
        self.last_attempt_s: float | None = None  # the last successful attempt's own seconds
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self._repo_ready = False
        self.last_copy: FolderCopy | None = None  # what the last folder-destination push wrote
        self.run_id = run_id or "run"
        self._store = store
        self.node_rank, self.nodes = node_rank, max(1, nodes)  # this node's part of a many-node checkpoint
        #: Called with ``(step, revision)`` the moment a checkpoint push has moved the destination's record (the
        #: folder swapped in, the Hub's record commit made, the S3 record written), before its cleanup: a push
        #: killed after that point has secured its step all the same (``guard.secure.worker`` reports it).
        self.on_recorded: Callable[[int, str], None] | None = None

    # -- public API -------------------------------------------------------------------------------------------

    def push_checkpoint(self, local_dir: str | os.PathLike[str], *, step: int, deadline: float,
                        files: list[str] | None = None, saved_by_s: float | None = None,
                        source: str | None = None) -> PushResult:
        """Secure a complete checkpoint folder as ``DEST/last-checkpoint/`` (replacing the previous one), verified.

        The Hub commit is titled ``guard: checkpoint step N`` (``CHECKPOINT_COMMIT_TITLE``): that title is the
        record ``fetch_last_checkpoint`` looks for, so that an unrelated commit on top never changes what is
        resumed from.

        Args:
            local_dir: the checkpoint folder (e.g. ``output/checkpoint-120``); must not change meanwhile.
            step: its training step (in the commit message / manifest).
            deadline: clock value by which the push, retries included, must be over.
            files: the files to secure, relative to ``local_dir`` (``CheckpointInfo.files``: a set of loose model
                files in an output folder); default: every file of the folder.
            saved_by_s: the newest file mtime (epoch seconds) when the checkpoint was seen complete
                (``CheckpointInfo.newest_mtime_s``); a file modified after it, up to the end of the copy, was
                rewritten in place (a loop that saves ``ckpt.pt`` again) and is no longer that checkpoint: the
                push fails rather than secure it under the old step. None: not checked.
            source: the folder the job saved the files in when ``local_dir`` is a copy of them
                (``guard.secure.snapshots``): the record's ``source`` and placement; default ``local_dir``.

        Returns:
            The verified ``PushResult`` (``revision``: Hub commit id, or the ``last-checkpoint`` folder).

        Raises:
            PushFailedError: no time left, a non-retryable Hub error (auth, permission), a local read error,
                or the retries ran out of time; its message lists every attempt. ``CheckpointRewrittenError``
                (a subclass): a file was written again after ``saved_by_s``.
        """
        folder = Path(local_dir)
        if files is None:
            files = _list_files(folder) if folder.is_dir() else []
        else:
            files = sorted(rel for rel in files if (folder / rel).is_file())
        what = f"checkpoint step {step}"
        if not files:
            raise PushFailedError(f"cannot secure {what}: {folder} has no files", destination=str(self.destination),
                                  hint="the guard only pushes complete checkpoint folders; check --output-dir")
        suspects = [str(p) for p in [folder, *(folder / rel for rel in files)] if is_marked_suspect(p)]
        if suspects:
            raise PushFailedError(f"cannot secure {what}: {suspects[0]} is marked suspect (saved after the first "
                                  "non-finite loss): never pushed", destination=str(self.destination),
                                  hint="resume from the secured checkpoint saved before the non-finite loss")

        def still_that_save() -> None:
            # before the push and in every attempt once the copy's first signatures are taken (compared again after
            # the copy): a rewrite before them is seen here, one after them by that comparison, so a retry after
            # "changed while copied" never secures the next save as this step
            rewritten = rewritten_after(folder, files, saved_by_s) if saved_by_s is not None else None
            if rewritten is not None:
                raise self._rewritten(what, folder / rewritten[0], rewritten[1], step)
            _refuse_torn(what, folder, files, "local", str(self.destination), parts=self.nodes > 1)

        still_that_save()
        placed = Path(source) if source else folder
        message = CHECKPOINT_COMMIT_TITLE.format(step=step)

        def attempt() -> str:
            if self.destination.kind == "s3":
                return self._s3_push_checkpoint(folder, files, step, still_that_save, placed, deadline)
            if self.destination.kind == "folder":
                return self._folder_push_checkpoint(folder, files, step, still_that_save, placed)
            return self._hub_push(folder, files, f"{CHECKPOINT_FOLDER}/", message, replace=True, record_step=step,
                                  check_before=still_that_save, placed=placed)

        return self._push(what, folder, files, step, attempt, deadline)

    def tidy(self) -> None:
        """After the run (its pushes are over): a folder destination loses what a push killed part way left there
        (a staging folder, a previous copy aside: ``_recover``); a push whose process still lives (not reaped yet:
        ``worker.reap_killed`` first) keeps its own.
        Other destinations: nothing (an S3 run's staged objects are its own, under its run id). Never raises."""
        if self.destination.kind != "folder" or self.destination.path is None or not self.destination.path.is_dir():
            return
        try:
            _remove_stale_staging(self.destination.path)
        except OSError as exc:
            self._log.warning("cannot tidy %s after the run: %s", self.destination.path, exc)

    def _recorded(self, step: int, revision: str) -> None:
        if self.on_recorded is not None:
            self.on_recorded(step, revision)

    def _rewritten(self, what: str, path: Path, later_s: float, step: int) -> CheckpointRewrittenError:
        when = "missing now" if math.isinf(later_s) else f"modified {later_s:.1f}s later"
        return CheckpointRewrittenError(
            f"cannot secure {what}: {path} was rewritten after that save ({when}), so it no longer holds step {step}",
            destination=str(self.destination),
            hint="the job saves its checkpoint in place; its newer save is secured under its own step (save each "
                 "checkpoint under a new name, e.g. ckpt-STEP.pt, so an older good one survives a later bad save)")

    def push_final(self, output_dir: str | os.PathLike[str], *, files: Collection[str] | None = None,
                   deadline: float) -> PushResult:
        """Secure the final model files of ``output_dir`` (see ``final_model_files``; ``files``: only those) at the
        destination's root, verified; unchanged files are not uploaded again (the Hub client compares oids at
        preupload; a folder destination compares size and sha256).

        Raises:
            PushFailedError: as ``push_checkpoint``; also when ``output_dir`` has no final model files.
        """
        folder = Path(output_dir)
        names = final_model_files(folder, files) if folder.is_dir() else []
        if not names:
            raise PushFailedError(f"cannot secure the final model: {folder} has no model files",
                                  destination=str(self.destination),
                                  hint="the job wrote no final model to its output folder; check --output-dir")
        _refuse_torn("the final model", folder, names, "local", str(self.destination))
        if self.destination.kind == "s3":
            attempt = lambda: self._s3().put_final(folder, names, deadline=deadline).revision  # noqa: E731
        elif self.destination.kind == "folder":
            attempt = lambda: self._folder_push_final(folder, names)  # noqa: E731
        else:
            attempt = lambda: self._hub_push(folder, names, "", "guard: final model", replace=False)  # noqa: E731
        return self._push("the final model", folder, names, None, attempt, deadline)

    def peek_last_checkpoint(self, *, deadline: float) -> SecuredRecord | None:
        """What the guard secured last, without downloading it, or None when nothing is.

        Hub: the newest commit titled ``guard: checkpoint step N`` (``CHECKPOINT_COMMIT_TITLE``, the record every
        checkpoint push makes), so that a commit on top (a README, the Trainer's own push) never changes what is
        resumed from; a ``last-checkpoint/`` without such a commit (pushed by something else) is HEAD's, step
        unknown, or, when the guard's own upload commits (``UPLOAD_COMMIT_TITLE``: files not verified, no record
        yet) are in the history, the newest commit below the oldest of them: an upload is never a record.
        Folder: the folder itself and its manifest's step.

        Raises:
            HubError: the destination cannot be read before ``deadline``.
        """
        result, _ = self._with_retries(f"reading {CHECKPOINT_FOLDER}'s record", lambda: self._peek(deadline),
                                       deadline, push=False)
        return result

    def _peek(self, deadline: float = math.inf) -> SecuredRecord | None:
        if self.destination.kind == "s3":
            record = self._s3().read_record(deadline=deadline)
            if record is None:
                return None
            return SecuredRecord(str(record.revision).strip('"'), record.step, record.source, record.place)
        if self.destination.kind == "folder":
            assert self.destination.path is not None
            if self.destination.path.is_dir():
                _recover(self.destination.path, self._log)
            source = self.destination.path / CHECKPOINT_FOLDER
            if not source.is_dir():
                return None
            manifest = _read_manifest(source)
            step = manifest.get("step")
            return SecuredRecord(str(source), step if isinstance(step, int) else _step_from_trainer_state(source),
                                 *_placed(manifest))
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        api, repo_id, repo_type = self._hub(), self.destination.repo_id, self.destination.repo_type
        assert repo_id is not None
        try:
            commits = list(api.list_repo_commits(repo_id, repo_type=repo_type))  # newest first
        except (RepositoryNotFoundError, RevisionNotFoundError):
            return None
        for commit in commits:
            if match := _GUARD_TITLE.fullmatch(commit.title.strip()):
                return SecuredRecord(commit.commit_id, int(match[1]), *_placed(self._hub_manifest(commit.commit_id)))
        # no record: a last-checkpoint/ pushed by something else, read at the newest commit below every upload of
        # the guard's own (an upload commit is a record only once its files verified; one that failed verification,
        # or was cut off before its record, is never resumed from, nor is a commit on top of it)
        uploads = [i for i, commit in enumerate(commits) if _UPLOAD_TITLE.fullmatch(commit.title.strip())]
        below = commits[uploads[-1] + 1:] if uploads else commits
        if not below:
            self._log.info("no commit at %s records a secured checkpoint: only the guard's unverified uploads (%s)",
                           self.destination, commits[uploads[-1]].title.strip() if uploads else "none")
            return None
        self._log.info("no commit at %s records a secured checkpoint (titled %r): using %s's %s/ if any%s",
                       self.destination, CHECKPOINT_COMMIT_TITLE.format(step="N"),
                       "HEAD" if not uploads else below[0].commit_id[:12], CHECKPOINT_FOLDER,
                       f" (below {len(uploads)} unverified upload commit(s) of the guard's)" if uploads else "")
        return SecuredRecord(below[0].commit_id, None)

    def _hub_manifest(self, revision: str) -> dict[str, Any]:
        """The record's manifest at ``revision`` (a small file), or ``{}`` (a record of an older guard)."""
        from huggingface_hub.errors import EntryNotFoundError

        api, repo_id = self._hub(), self.destination.repo_id
        assert repo_id is not None
        with tempfile.TemporaryDirectory(prefix=".guard-peek-") as tmp:
            try:
                path = api.hf_hub_download(repo_id, f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}", revision=revision,
                                           repo_type=self.destination.repo_type, local_dir=tmp,
                                           cache_dir=Path(tmp) / ".cache")
                manifest = json.loads(Path(path).read_text())
            except (EntryNotFoundError, OSError, ValueError):
                return {}
        return manifest if isinstance(manifest, dict) else {}

    def fetch_last_checkpoint(self, into_dir: str | os.PathLike[str], *, deadline: float,
                              revision: str | None = None) -> FetchedCheckpoint | None:
        """Download the destination's ``last-checkpoint/`` at the revision the guard recorded (``revision``, else
        ``peek_last_checkpoint``'s; never a later unrelated HEAD), verify every file, and place it as
        ``into_dir/checkpoint-<step>``. A ``checkpoint-<step>`` already there is kept when it holds the same files,
        else moved aside to a hidden ``.checkpoint-<step>.replaced-<time>-<pid>`` folder (never deleted).

        Returns:
            The fetched checkpoint, or None when the destination (or its ``last-checkpoint/``) does not exist.

        Raises:
            HubError: a file differs from what the destination records (corrupt or partial download), the step
                cannot be told, or the deadline passed.
        """
        into = Path(into_dir)
        into.mkdir(parents=True, exist_ok=True)
        if self.destination.kind == "s3":
            result, _ = self._with_retries(f"fetching {CHECKPOINT_FOLDER}", lambda: self._s3_fetch(into, deadline),
                                           deadline, push=False)
            return result
        if self.destination.kind == "folder":
            result, _ = self._with_retries(f"fetching {CHECKPOINT_FOLDER}", lambda: self._folder_fetch(into),
                                           deadline, push=False)
            return result
        if revision is None:
            record = self.peek_last_checkpoint(deadline=deadline)
            if record is None:
                return None
            revision = record.revision
        recorded = revision
        result, _ = self._with_retries(f"fetching {CHECKPOINT_FOLDER}@{recorded[:12]}",
                                       lambda: self._hub_fetch(into, recorded), deadline, push=False)
        return result

    # -- retries ----------------------------------------------------------------------------------------------

    def _push(self, what: str, folder: Path, files: list[str], step: int | None, attempt: Callable[[], str],
              deadline: float) -> PushResult:
        start = self._clock()
        size = sum((folder / rel).stat().st_size for rel in files)  # before: the job may rotate the folder out later
        self._log.info("securing %s (%d files, %.1f MB) at %s", what, len(files), size / 1e6, self.destination)
        from guard.observe.telemetry import Progress

        PROGRESS.append(Progress(f"securing {what}", size, clock=self._clock, logger=self._log))
        try:
            revision, attempts = self._with_retries(f"securing {what}", attempt, deadline, push=True)
        finally:
            PROGRESS.pop()
        result = PushResult(str(self.destination), revision, tuple(files), size, self._clock() - start, attempts, step,
                            attempt_s=self.last_attempt_s)
        self._log.info("secured %s at %s in %.1fs (%.1f MB/s)", what, result.pushed, result.elapsed_s,
                       result.bytes_per_s / 1e6)
        return result

    def _with_retries(self, what: str, attempt: Callable[[], T], deadline: float, *, push: bool) -> tuple[T, int]:
        tried: list[str] = []
        pause, mismatches = self._backoff_s, 0

        def fail(reason: str, hint: str) -> HubError:
            message = f"{what} at {self.destination} failed: {reason}"
            if tried and not (len(tried) == 1 and tried[0].endswith(reason)):
                shown = tried if len(tried) <= 5 else [*tried[:2], f"... {len(tried) - 4} more", *tried[-2:]]
                message += f" (attempts: {'; '.join(shown)})"
            if push:
                return PushFailedError(message, destination=str(self.destination), attempts=len(tried), hint=hint)
            return HubError(message, destination=str(self.destination), hint=hint)

        asked_s: float | None = None  # the last Retry-After the Hub sent

        def kept_failing() -> str:
            causes = {failure_cause(entry) for entry in tried}
            for cause in ("rate_limit", "auth", "unreachable"):
                if cause in causes and (hint := cause_hint(cause, retry_after=asked_s)):
                    return hint
            return "the destination kept failing (see the attempts); check the network and the Hub's status"

        while True:
            left = deadline - self._clock()
            if left <= 0:
                raise fail("no time left before the deadline", kept_failing() if tried else
                           "a larger --margin leaves more time to secure it")
            try:
                began = self._clock()
                with bounded(lambda: deadline - self._clock()):
                    value = attempt()
                self.last_attempt_s = self._clock() - began
                return value, len(tried) + 1
            except TransientDestinationError as err:  # a store's "may succeed if tried again" (guard.secure.dest)
                kind, text, asked_s = "transient", err.message, None
            except DestinationError as err:
                if push and not isinstance(err, PushFailedError):
                    raise fail(err.message, err.hint or fatal_hint(err.message)) from err
                raise
            except HubError:
                raise
            except Exception as err:  # noqa: BLE001 - classified below; unknown errors are fatal
                kind, text = classify(err)
                asked_s = retry_after_s(err) if kind == "transient" else None
            tried.append(f"#{len(tried) + 1} {text}")
            self._log.warning("%s: attempt %d failed: %s", what, len(tried), text)
            if kind == "deadline":
                raise fail("the deadline was reached", "a larger --margin leaves more time to secure it")
            if kind == "fatal" or (kind == "mismatch" and (mismatches or not push)):
                hint = (fatal_hint(text) if kind == "fatal" else
                        "the destination does not hold what was sent; check it (a .gitignore?)" if push else
                        "the copy at the destination is corrupt or incomplete; resume from a local checkpoint")
                raise fail(text, hint)
            mismatches += kind == "mismatch"
            left = deadline - self._clock()
            if asked_s is not None:  # the Hub said when to come back (Retry-After): never sooner
                if asked_s > left - _MIN_ATTEMPT_S:
                    self._log.error("%s: the Hub asks to wait %.0fs before the next attempt (Retry-After), more than "
                                    "the %.0fs left: not retrying", what, asked_s, max(left, 0.0))
                    raise fail(f"the Hub asked to wait {asked_s:.0f}s (Retry-After) and {max(left, 0.0):.0f}s were "
                               "left", kept_failing())
                self._log.warning("%s: the Hub asks to wait %.0fs (Retry-After): next attempt then", what, asked_s)
                self._sleep(max(asked_s, min(pause, left / 2)))
                pause = min(pause * 2, self._max_backoff_s)
                continue
            wait = min(pause, left / 2)
            if left - wait < _MIN_ATTEMPT_S:
                raise fail("no time left for another attempt", kept_failing())
            self._sleep(wait)
            pause = min(pause * 2, self._max_backoff_s)

    # -- S3 (guard.secure.dest.s3) ----------------------------------------------------------------------------

    def _s3(self) -> Any:
        if self._store is None:
            from guard.secure.dest.s3 import S3Store

            self._store = S3Store.from_url(str(self.destination))
        return self._store

    def _s3_push_checkpoint(self, folder: Path, files: list[str], step: int, check: Callable[[], None],
                            placed: Path, deadline: float) -> str:
        """One node's part of ``step`` put and verified, checked again against the save, then the record moved to
        it (one conditional write); returns the record's ETag."""
        store, where = self._s3(), _placement(placed)
        requires = formats.requires(folder) if self.nodes > 1 and folder.is_dir() else None
        part = store.put_part(folder, files, run_id=self.run_id, step=step, node_rank=self.node_rank,
                              nodes=self.nodes, place=where["place"], source=where["output_dir"], deadline=deadline,
                              requires=requires)
        check()  # still the save this step names, now that its bytes are at the destination
        parts = [part] if self.nodes == 1 else self._await_whole(store, step, deadline)
        record = store.write_record(parts, deadline=deadline)
        if (record.run_id, record.step) != (self.run_id, step):
            self._log.info("the record at %s already names step %s of this run: step %d not recorded over it",
                           self.destination, record.step, step)
        else:
            self._recorded(step, str(record.revision).strip('"'))
        return str(record.revision).strip('"')  # the record's ETag, without the quotes HTTP gives it

    def _await_whole(self, store: Any, step: int, deadline: float) -> list[Any]:
        """Many nodes: this node's part of ``step`` is in; wait (polling the destination's listing every
        ``PARTS_POLL_S``) until every node's part is and their union is whole (``nodes.whole``), then return the
        parts for the record. Any node may move the record (a conditional write: the second writer finds it done).

        Raises:
            PartsMissingError: not whole before ``deadline`` (less the time of one more listing).
        """
        from guard.secure import nodes as many

        said = None
        while True:
            found = many.whole(store.parts(run_id=self.run_id, step=step, deadline=deadline), run_id=self.run_id,
                               step=step, nodes=self.nodes)
            if found.complete:
                self._log.info("%s", found.describe())
                return list(found.parts.values())
            if found.describe() != said:
                said = found.describe()
                self._log.info("waiting for the other nodes' parts: %s", said)
            ahead = self._others_ahead(store, step, deadline)
            if ahead is not None:  # the nodes missing here put a later step: they will never put this one
                raise PartsMissingError(
                    f"checkpoint step {step} will not be whole at {self.destination}: {said}; the other nodes put "
                    f"step {ahead}", missing=found.missing_text(), destination=str(self.destination),
                    hint="the nodes secure the same steps when their saves are as fast as their pushes; a later "
                         "step is secured instead")
            if self._clock() + 2 * PARTS_POLL_S >= deadline:
                raise PartsMissingError(
                    f"checkpoint step {step} is not whole at {self.destination}: {said}",
                    missing=found.missing_text(), destination=str(self.destination),
                    hint=f"node {self.node_rank}'s part is there, verified; the record was not moved: look at the "
                         "VERDICT of the missing nodes")
            self._sleep(PARTS_POLL_S)

    def _others_ahead(self, store: Any, step: int, deadline: float) -> int | None:
        """The lowest step after ``step`` that every other node has put a part of (they skipped ``step``: its push
        would wait for parts that never come), or None (also for a store that cannot list the steps)."""
        listing = getattr(store, "part_steps", None)
        if listing is None:
            return None
        others = set(range(self.nodes)) - {self.node_rank}
        later = [s for s, ranks in listing(run_id=self.run_id, deadline=deadline).items()
                 if s > step and others <= ranks]
        return min(later) if later else None

    def _s3_fetch(self, into: Path, deadline: float) -> FetchedCheckpoint | None:
        store = self._s3()
        record = store.read_record(deadline=deadline)
        if record is None:
            return None
        fetched: FetchedCheckpoint = store.fetch(record, into, deadline=deadline)
        return fetched

    # -- Hub --------------------------------------------------------------------------------------------------

    def _hub(self) -> HfApi:
        install_request_bounds()
        if self._api is None:
            from huggingface_hub import HfApi

            self._api = HfApi(token=self._token)
        return self._api

    def _hub_push(self, folder: Path, files: list[str], prefix: str, message: str, *, replace: bool,
                  record_step: int | None = None, check_before: Callable[[], None] | None = None,
                  placed: Path | None = None) -> str:
        """One commit of ``files``, verified; with ``record_step`` (a checkpoint), that commit is titled
        ``UPLOAD_COMMIT_TITLE`` and, once every file verified, a second commit adds the manifest under the record's
        title (``CHECKPOINT_COMMIT_TITLE``, on top of exactly the verified commit): a commit that failed
        verification is never the record. Returns the commit id of the record (or of the one commit)."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, RepoFile
        from huggingface_hub.errors import EntryNotFoundError

        api, repo_id, repo_type = self._hub(), self.destination.repo_id, self.destination.repo_type
        assert repo_id is not None and repo_type is not None
        if not self._repo_ready:
            api.create_repo(repo_id, repo_type=repo_type, private=True, exist_ok=True)
            self._repo_ready = True
        before = _signatures(folder, files)
        if check_before is not None:
            check_before()
        adds = [CommitOperationAdd(path_in_repo=prefix + rel, path_or_fileobj=str(folder / rel)) for rel in files]
        deletes: list[CommitOperationDelete] = []
        if replace:
            try:
                remote = [e.path for e in api.list_repo_tree(repo_id, path_in_repo=prefix.rstrip("/"),
                                                             recursive=True, repo_type=repo_type)
                          if isinstance(e, RepoFile)]
            except EntryNotFoundError:
                remote = []
            keep = {op.path_in_repo for op in adds}
            deletes = [CommitOperationDelete(path_in_repo=p) for p in remote if p not in keep]
        title = message if record_step is None else UPLOAD_COMMIT_TITLE.format(step=record_step)
        info = api.create_commit(repo_id, [*deletes, *adds], commit_message=title, repo_type=repo_type,
                                 commit_description=f"Secured by jobguard: {len(files)} files from {folder.name}.")
        self._verify_hub(api, info.oid, adds)
        after = _signatures(folder, files)
        changed = sorted(rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel))
        if changed:  # rewritten in place while uploading: what was sent may be torn; the retry's commit replaces it
            raise Mismatch([f"{rel} changed while it was uploaded" for rel in changed])
        _refuse_torn(message.removeprefix("guard: "), folder, files, "uploaded", str(self.destination))
        if record_step is None:
            return info.oid
        placed = placed or folder
        manifest = {"step": record_step, "source": str(placed), **_placement(placed), "verified_commit": info.oid,
                    "files": {op.path_in_repo[len(prefix):]: {"size": op.upload_info.size,
                                                               "sha256": op.upload_info.sha256.hex()}
                              for op in adds}}
        body = json.dumps(manifest, indent=1).encode()
        record = CommitOperationAdd(path_in_repo=prefix + MANIFEST_NAME, path_or_fileobj=body)
        # parent_commit: the record goes on top of exactly the verified commit, or not at all
        done = api.create_commit(repo_id, [record], commit_message=message, repo_type=repo_type,
                                 parent_commit=info.oid,
                                 commit_description=f"Verified: {len(files)} files of commit {info.oid}.")
        self._recorded(record_step, done.oid)
        self._verify_hub(api, done.oid, [record], contents={record.path_in_repo: body})
        return done.oid

    def _verify_hub(self, api: HfApi, revision: str, adds: list[CommitOperationAdd],
                    contents: dict[str, bytes] | None = None) -> None:
        from huggingface_hub import RepoFile
        from huggingface_hub.utils.sha import git_hash

        repo_id = self.destination.repo_id
        assert repo_id is not None
        remote: dict[str, RepoFile] = {}
        paths = [op.path_in_repo for op in adds]
        for i in range(0, len(paths), 100):
            # lfs (sha256, size) comes without expand=True, which would only add last-commit data
            for found in api.get_paths_info(repo_id, paths[i:i + 100], revision=revision,
                                            repo_type=self.destination.repo_type):
                if isinstance(found, RepoFile):  # a folder at a file's path counts as missing
                    remote[found.path] = found
        problems = []
        for op in adds:
            entry, size = remote.get(op.path_in_repo), op.upload_info.size
            if entry is None:
                problems.append(f"{op.path_in_repo} missing")
            elif entry.size != size:
                problems.append(f"{op.path_in_repo} has {entry.size} bytes, local {size}")
            elif entry.lfs is not None and entry.lfs.sha256 != op.upload_info.sha256.hex():
                problems.append(f"{op.path_in_repo} sha256 {entry.lfs.sha256[:12]}.. differs")
            elif entry.lfs is None and entry.blob_id != git_hash((contents or {}).get(op.path_in_repo)
                                                                 or Path(str(op.path_or_fileobj)).read_bytes()):
                problems.append(f"{op.path_in_repo} git sha1 {entry.blob_id[:12]}.. differs")
        if problems:
            raise Mismatch(problems)

    def _hub_fetch(self, into: Path, revision: str) -> FetchedCheckpoint | None:
        from huggingface_hub import RepoFile
        from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError
        from huggingface_hub.utils.sha import git_hash

        api, repo_id, repo_type = self._hub(), self.destination.repo_id, self.destination.repo_type
        assert repo_id is not None
        try:
            sha = revision
            entries = [e for e in api.list_repo_tree(repo_id, path_in_repo=CHECKPOINT_FOLDER, recursive=True,
                                                     revision=sha, repo_type=repo_type) if isinstance(e, RepoFile)]
        except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
            return None
        if not entries or sha is None:
            return None
        staging = _staging_dir(".guard-fetch-", into)
        try:
            api.snapshot_download(repo_id, repo_type=repo_type, revision=sha, local_dir=staging,
                                  cache_dir=staging / ".cache" / "hub", allow_patterns=[f"{CHECKPOINT_FOLDER}/*"])
            problems = []
            for entry in entries:
                local = staging / entry.path
                if not local.is_file():
                    problems.append(f"{entry.path} missing")
                elif local.stat().st_size != entry.size:
                    problems.append(f"{entry.path} has {local.stat().st_size} bytes, expected {entry.size}")
                elif entry.lfs is not None and _hash_file(local)[1] != entry.lfs.sha256:
                    problems.append(f"{entry.path} sha256 differs from the recorded {entry.lfs.sha256[:12]}..")
                elif entry.lfs is None and git_hash(local.read_bytes()) != entry.blob_id:
                    problems.append(f"{entry.path} git sha1 differs from the recorded {entry.blob_id[:12]}..")
            fetched = staging / CHECKPOINT_FOLDER
            manifest = _read_manifest(fetched)
            if manifest:  # the record written after verification: every file must match its sha256
                problems += _against_manifest(fetched, manifest, [e.path[len(CHECKPOINT_FOLDER) + 1:]
                                                                 for e in entries])
                with contextlib.suppress(OSError):
                    (fetched / MANIFEST_NAME).unlink()
                entries = [e for e in entries if e.path != f"{CHECKPOINT_FOLDER}/{MANIFEST_NAME}"]
            if problems:
                raise Mismatch(problems)
            step = _step_from_trainer_state(fetched)
            if step is None and isinstance(manifest.get("step"), int):
                step = manifest["step"]
            if step is None:
                for commit in api.list_repo_commits(repo_id, revision=sha, repo_type=repo_type):
                    if match := _STEP_IN_TITLE.search(commit.title):
                        step = int(match[1])
                        break
            files = [e.path[len(CHECKPOINT_FOLDER) + 1:] for e in entries]
            return self._place(fetched, into, step, sha, files, sum(e.size for e in entries),
                               place=_placed(manifest)[1])
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _place(self, fetched: Path, into: Path, step: int | None, revision: str, files: list[str],
               size: int, place: str | None = None) -> FetchedCheckpoint:
        """Put the verified ``fetched`` folder where the checkpoint came from: ``into/<place>`` for a checkpoint
        folder (``checkpoint-<step>`` when not recorded), or its files at the top of ``into`` (``place`` ``"."``:
        ``out/ckpt.pt`` for a loop that reloads its own file). What is there already is kept when identical, else
        moved aside to a hidden ``.NAME.replaced-<time>-<pid>`` (never deleted)."""
        if step is None:
            raise HubError(f"cannot tell the step of {self.destination}/{CHECKPOINT_FOLDER}",
                           destination=str(self.destination),
                           hint="it has no trainer_state.json and was not pushed by the guard")
        stamp = f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        if place == ".":
            for rel in sorted(files):
                target = into / rel
                if target.is_file() and _hash_file(target) == _hash_file(fetched / rel):
                    continue
                if target.exists() or target.is_symlink():
                    aside = target.with_name(f".{target.name}.{stamp}")
                    os.rename(target, aside)
                    self._log.warning("%s differs from the secured checkpoint: moved it to %s", target, aside)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.rename(fetched / rel, target)
            _fsync_dir(into)
            where = into / files[0] if len(files) == 1 else into
            self._log.info("fetched %s/%s (step %d) back into %s", self.destination, CHECKPOINT_FOLDER, step, where)
            return FetchedCheckpoint(where, step, revision, tuple(sorted(files)), size)
        target = into / (place or f"checkpoint-{step}")
        if target.exists():
            mine = {rel: _hash_file(target / rel) for rel in _list_files(target)}
            if mine == {rel: _hash_file(fetched / rel) for rel in _list_files(fetched)}:
                self._log.info("%s already holds the secured checkpoint (step %d): keeping it", target, step)
                return FetchedCheckpoint(target, step, revision, tuple(sorted(files)), size)
            aside = into / f".{target.name}.{stamp}"
            os.rename(target, aside)  # a partial or different local copy: kept aside (hidden), not deleted
            self._log.warning("%s differs from the secured checkpoint: moved it to %s", target, aside)
        os.rename(fetched, target)
        _fsync_dir(into)
        self._log.info("fetched %s/%s (step %d) into %s", self.destination, CHECKPOINT_FOLDER, step, target)
        return FetchedCheckpoint(target, step, revision, tuple(sorted(files)), size)

    # -- folders ----------------------------------------------------------------------------------------------

    def _folder_push_checkpoint(self, folder: Path, files: list[str], step: int,
                                check_before: Callable[[], None], placed: Path | None = None) -> str:
        root = self.destination.path
        assert root is not None
        root.mkdir(parents=True, exist_ok=True)
        target = root / CHECKPOINT_FOLDER
        _remove_stale_staging(root)
        staging = _staging_dir(f".{CHECKPOINT_FOLDER}.tmp-{os.getpid()}-", root)
        try:
            before = _signatures(folder, files)
            check_before()
            previous = _manifest_files(target)
            sums: dict[str, tuple[int, str]] = {}
            linked: list[str] = []
            for rel in files:
                reused = _reuse_unchanged(folder / rel, target / rel, staging / rel, previous.get(rel))
                if reused is not None:
                    sums[rel] = reused
                    linked.append(rel)
                else:
                    sums[rel] = _copy_and_hash(folder / rel, staging / rel)
            reused_bytes = sum(sums[rel][0] for rel in linked)
            self.last_copy = FolderCopy(copied_bytes=sum(size for size, _ in sums.values()) - reused_bytes,
                                        reused_bytes=reused_bytes, reused_files=len(linked))
            if linked:
                self._log.info("%d unchanged files (%.1f MB) linked from the previous %s, %d copied (%.1f MB)",
                               len(linked), reused_bytes / 1e6, CHECKPOINT_FOLDER, len(files) - len(linked),
                               self.last_copy.copied_bytes / 1e6)
            after = _signatures(folder, files)
            changed = sorted(rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel))
            if changed:  # a job that saves in place (torch.save over ckpt.pt) wrote it again meanwhile: torn copy
                raise Mismatch([f"{rel} changed while it was copied" for rel in changed])
            # the copy that would become the secured one, checked by format before anything is swapped
            _refuse_torn(f"checkpoint step {step}", staging, files, "copied", str(self.destination))
            placed = placed or folder
            manifest = {"step": step, "source": str(placed), **_placement(placed),
                        "files": {rel: {"size": size, "sha256": sha} for rel, (size, sha) in sums.items()}}
            with open(staging / MANIFEST_NAME, "w") as out:
                json.dump(manifest, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            for dirpath, _, _ in sorted(os.walk(staging), key=lambda w: -len(w[0])):
                _fsync_dir(Path(dirpath))
            # Verified before the swap: a push killed at any point leaves the previous last-checkpoint in place.
            try:
                self._verify_folder(staging, {rel: sums[rel] for rel in files}, exclude={MANIFEST_NAME})
            except Mismatch:
                if not linked:
                    raise
                # The previous secured copy no longer matched its manifest (changed on the destination's disk):
                # the files taken from it are copied from the checkpoint instead, then everything is verified again.
                self._log.warning("the previous %s does not match its manifest: copying its %d files again",
                                  CHECKPOINT_FOLDER, len(linked))
                for rel in linked:
                    (staging / rel).unlink()
                    if _copy_and_hash(folder / rel, staging / rel) != sums[rel]:
                        raise Mismatch([f"{rel} changed while it was copied"]) from None
                self.last_copy = FolderCopy(copied_bytes=sum(size for size, _ in sums.values()), reused_bytes=0,
                                            reused_files=0)
                self._verify_folder(staging, {rel: sums[rel] for rel in files}, exclude={MANIFEST_NAME})
            old = _swap_in(staging, target)
            _fsync_dir(root)
            self._recorded(step, str(target))
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return str(target)

    def _folder_push_final(self, folder: Path, files: list[str]) -> str:
        """Every changed file is first copied beside its place (``.NAME.guard-tmp``) and verified; then a journal
        of the renames is written and fsynced, the renames done, the journal removed. Killed before the journal,
        nothing changed; after it, the next run finishes the renames (``_recover``): never a mixed model."""
        root = self.destination.path
        assert root is not None
        root.mkdir(parents=True, exist_ok=True)
        _recover(root, self._log)
        sums, staged = {}, {}
        try:
            for rel in files:
                src, dst = folder / rel, root / rel
                sums[rel] = _hash_file(src)
                if dst.is_file() and _hash_file(dst) == sums[rel]:
                    continue  # unchanged
                tmp = dst.with_name(f".{dst.name}.guard-tmp")
                staged[rel] = tmp
                if _copy_and_hash(src, tmp) != sums[rel]:
                    raise Mismatch([f"{rel} changed while it was copied"])
            for tmp in staged.values():  # each copy hashes as its source, which was checked whole by format
                _fsync_dir(tmp.parent)
            if staged:
                journal = root / _FINAL_JOURNAL
                with open(journal, "w") as out:
                    json.dump({"pid": os.getpid(), "renames": {rel: tmp.relative_to(root).as_posix()
                                                                for rel, tmp in staged.items()}}, out)
                    out.flush()
                    os.fsync(out.fileno())
                _fsync_dir(root)
                for rel, tmp in staged.items():
                    os.replace(tmp, root / rel)
                for parent in {(root / rel).parent for rel in staged}:
                    _fsync_dir(parent)
                journal.unlink()
                _fsync_dir(root)
                staged = {}
        finally:
            for tmp in staged.values():
                with contextlib.suppress(OSError):
                    tmp.unlink()
        self._verify_folder(root, sums, exclude=None)
        return str(root)

    def _verify_folder(self, target: Path, expected: dict[str, tuple[int, str]], exclude: set[str] | None) -> None:
        problems = [f"{rel} differs" for rel, want in expected.items()
                    if not (target / rel).is_file() or _hash_file(target / rel) != want]
        if exclude is not None:  # the checkpoint folder must hold exactly these files
            allowed = set(expected) | exclude
            problems += [f"{rel} unexpected" for rel in _list_files(target) if rel not in allowed]
        if problems:
            raise Mismatch(problems)

    def _folder_fetch(self, into: Path) -> FetchedCheckpoint | None:
        assert self.destination.path is not None
        if self.destination.path.is_dir():
            _recover(self.destination.path, self._log)
        source = self.destination.path / CHECKPOINT_FOLDER
        if not source.is_dir():
            return None
        manifest = _read_manifest(source)
        recorded = manifest.get("files") or {}
        files = sorted(set(recorded) | {rel for rel in _list_files(source) if rel != MANIFEST_NAME})
        staging = Path(tempfile.mkdtemp(prefix=".guard-fetch-", dir=into))
        try:
            fetched, problems = staging / CHECKPOINT_FOLDER, []
            for rel in files:
                if not (source / rel).is_file():
                    problems.append(f"{rel} missing")
                    continue
                size, sha = _copy_and_hash(source / rel, fetched / rel)
                want = recorded.get(rel)
                if want is not None and (want.get("size"), want.get("sha256")) != (size, sha):
                    problems.append(f"{rel} differs from the manifest")
                elif want is None and _hash_file(fetched / rel) != (size, sha):
                    problems.append(f"{rel} differs from its copy")
            if problems:
                raise Mismatch(problems)
            step = _step_from_trainer_state(fetched)
            if step is None and isinstance(manifest.get("step"), int):
                step = manifest["step"]
            size_total = sum((fetched / rel).stat().st_size for rel in files)
            return self._place(fetched, into, step, str(source), files, size_total, place=_placed(manifest)[1])
        finally:
            shutil.rmtree(staging, ignore_errors=True)
