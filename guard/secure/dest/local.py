"""Local files for the stores: listing, hashing, copying, the manifest, placing a fetched checkpoint.

Every function here works on this machine's files only (no destination): the stores (``guard.secure.dest.folder``,
``guard.secure.dest.hub``, ``guard.secure.dest.s3``: its fetch places through ``place_fetched`` too) and the
securer call them. Hashes are SHA-256 (lowercase hex), sizes bytes, paths posix
and relative to the folder they are listed from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from guard.errors import HubError, PushFailedError, WeightsNotFiniteError
from guard.secure.dest.base import CHECKPOINT_FOLDER, MANIFEST_NAME, FetchedCheckpoint
from guard.secure.layout import CHECKPOINT_FOLDER_RE

__all__ = ["copy_and_hash", "final_model_files", "fsync_dir", "hash_file", "holds_final_model", "list_files",
           "place_fetched", "placed", "placement", "read_manifest", "refuse_not_finite", "refuse_torn", "same_bytes",
           "signatures", "staging_dir", "step_from_trainer_state"]

def list_files(folder: Path, keep: Callable[[str], bool] = lambda rel: True) -> list[str]:
    """Files under ``folder`` (posix relative paths, sorted), minus ``.git``/``.cache`` folders and ``keep`` misses.
    Symbolic links are never followed out of ``folder`` (``checkpoints.list_files``)."""
    from guard.secure.checkpoints import list_files as listed

    return [rel for rel in listed(folder)
            if not rel.startswith((".git/", ".cache/")) and "/.git/" not in rel and "/.cache/" not in rel and keep(rel)]


def signatures(folder: Path, files: list[str]) -> dict[str, tuple[int, int, int]]:
    """``{rel: (size, mtime_ns, inode)}``: compared before and after a copy to catch a file rewritten meanwhile
    (in place, or replaced by a rename: a new inode). A file that cannot be read is left out."""
    out = {}
    for rel in files:
        with contextlib.suppress(OSError):
            st = os.stat(folder / rel)
            out[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def changed_since(folder: Path, files: list[str], before: dict[str, tuple[int, int, int]]) -> list[str]:
    """The files whose ``signatures`` differ from ``before`` (sorted)."""
    after = signatures(folder, files)
    return sorted(rel for rel in set(before) | set(after) if before.get(rel) != after.get(rel))


def refuse_torn(what: str, folder: Path, files: list[str], where: str, destination: str, *,
                parts: bool = False) -> None:
    """Raise ``PushFailedError`` when a file of ``files`` under ``folder`` is not structurally whole
    (``formats.check_files``): ``where`` says which copy (``"local"``, ``"copied"``, ``"uploaded"``); ``parts``: the
    folder is one node's part of a many-node checkpoint (what its format names on other nodes is not looked for
    here)."""
    from guard.secure.formats import check_files

    problems = check_files(folder, files, parts=parts)
    if problems:
        shown = "; ".join(problems[:3]) + (f"; ... {len(problems) - 3} more" if len(problems) > 3 else "")
        raise PushFailedError(f"cannot secure {what}: the {where} files are not whole ({shown}); the secured copy "
                              "is left as it was", destination=destination,
                              hint="the job was still writing the checkpoint (or cut it short): let its save finish "
                                   "(a longer --grace), or save to a temporary name and rename it into place")


def refuse_not_finite(what: str, folder: Path, files: list[str], destination: str, *, fetched: bool = False,
                      deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
                      log: logging.Logger | None = None) -> float:
    """Read the weights of ``files`` under ``folder`` (``guard.secure.weights.check_files``: safetensors files,
    ``torch.save`` zips) and raise ``WeightsNotFiniteError`` naming the file and tensor when one holds a NaN or an
    infinity; ``fetched``: the files were fetched for a resume (the message says "not resumed"), else they are about
    to be pushed. Returns the seconds the check took.

    Raises:
        WeightsNotFiniteError: a tensor is not finite.
        PushFailedError: the check did not end by ``deadline`` (``clock`` seconds), or a file cannot be read.
    """
    from guard.secure.weights import CheckTimedOut, check_files

    try:
        checked = check_files(folder, files, deadline=deadline, clock=clock)
    except CheckTimedOut as exc:
        raise PushFailedError(f"cannot secure {what}: {exc} (the push's deadline)", destination=destination,
                              hint="a larger --margin leaves time to read the weights before they are secured") \
            from exc
    except OSError as exc:
        raise PushFailedError(f"cannot read the weights of {what}: {exc}", destination=destination,
                              hint="check the files' permissions and the disk") from exc
    if checked.files and log is not None:
        log.debug("weights of %s finite: %d weight file(s), %.1f MB read in %.2fs", what, checked.files,
                  checked.size_bytes / 1e6, checked.elapsed_s)
    bad = checked.bad
    if bad is None:
        return checked.elapsed_s
    if fetched:
        raise WeightsNotFiniteError(
            f"{what} at {destination} holds weights that are not finite ({bad.describe()} has a NaN or an "
            "infinity): not resumed", file=bad.file, tensor=bad.tensor, destination=destination,
            hint="it was secured before the guard read saved weights; the next good save replaces it (or remove "
                 "it from the destination)")
    raise WeightsNotFiniteError(
        f"cannot secure {what}: its weights are not finite ({folder / bad.file}: tensor {bad.tensor} ({bad.dtype}) "
        "has a NaN or an infinity): never pushed", file=bad.file, tensor=bad.tensor, destination=destination,
        hint="the weights went non-finite while the loss was finite (a NaN-safe loss, a gradient that overflowed): "
             "the newest good checkpoint saved before it is secured instead. A -inf is allowed only in a tensor "
             "whose name ends in 'mask' (an attention mask kept as a buffer)")


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


def staging_dir(prefix: str, parent: Path) -> Path:
    """A fresh temporary folder in ``parent`` with the destination's default permissions (``tempfile.mkdtemp``
    creates 0700 folders, which would then be swapped in as the secured one). Raises ``OSError``."""
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
    return list_files(Path(output_dir), keep)


def hash_file(path: Path) -> tuple[int, str]:
    """``(size in bytes, sha256 hex)`` of ``path``, read once. Raises ``OSError``."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def copy_and_hash(src: Path, dst: Path) -> tuple[int, str]:
    """Copy ``src`` to ``dst`` (fsynced) in one read pass; returns (size in bytes, sha256 hex) of what was read.
    Raises ``OSError``."""
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


def fsync_dir(path: Path) -> None:
    """fsync a folder (its entries: a rename or a new file in it is durable after this). Raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(secured: Path) -> dict[str, Any]:
    """The manifest (``guard_manifest.json``) of a secured folder; empty when it has none or it cannot be read."""
    try:
        manifest = json.loads((secured / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def placement(folder: Path) -> dict[str, str]:
    """Where a pushed checkpoint lies, for resume to put it back: ``{"output_dir": ..., "place": ...}``. A
    checkpoint-like folder (``checkpoint-N``, ``checkpoint_N``, ``step_N``, ``global_stepN``, ``iter_N``, ``step-N``:
    ``layout.CHECKPOINT_FOLDER_RE``) is placed by its name
    in its parent; any other folder holds files that lay at the top of the output folder (``ckpt.pt``). The output
    folder is written relative to the working folder when inside it, so that the next run (another machine, the
    same checkout) finds it again."""
    where = Path(os.path.abspath(folder))
    output_dir, place = (where.parent, where.name) if CHECKPOINT_FOLDER_RE.fullmatch(where.name) else (where, ".")
    here = Path(os.getcwd())
    text = os.path.relpath(output_dir, here) if output_dir.is_relative_to(here) else str(output_dir)
    return {"output_dir": text, "place": place}


def placed_source(output_dir: str | None, place: str | None) -> dict[str, str]:
    """The manifest's placement fields from a part's ``source`` (output folder) and ``place`` (``placement``'s
    inverse): ``{"source": absolute checkpoint path, "output_dir": ..., "place": ...}``; empty when not known."""
    if output_dir is None or place is None:
        return {}
    return {"source": os.path.abspath(os.path.join(output_dir, place)), "output_dir": output_dir, "place": place}


def placed(manifest: dict[str, Any]) -> tuple[str | None, str | None]:
    """``(output_dir, place)`` from a manifest (see ``placement``); None for what it does not record."""
    out, place = manifest.get("output_dir"), manifest.get("place")
    place_ok = isinstance(place, str) and (place == "." or CHECKPOINT_FOLDER_RE.fullmatch(place) is not None)
    return (out if isinstance(out, str) and out else None), (place if place_ok else None)


def step_from_trainer_state(folder: Path) -> int | None:
    """``global_step`` of the folder's ``trainer_state.json`` (a Trainer checkpoint), or None."""
    try:
        return int(json.loads((folder / "trainer_state.json").read_text())["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def same_bytes(a: Path, b: Path) -> bool:
    """``a`` and ``b`` are regular files (links followed) with the same bytes, compared block by block: the sizes
    first, then up to the first block that differs. Raises ``OSError`` (a file that cannot be read)."""
    if not (a.is_file() and b.is_file()) or a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            block = fa.read(1 << 20)
            if block != fb.read(1 << 20):
                return False
            if not block:
                return True


def place_fetched(fetched: Path, into: Path, step: int | None, revision: str, files: list[str], size: int,
                  place: str | None, destination: str, log: logging.Logger) -> FetchedCheckpoint:
    """Put the verified ``fetched`` folder (holding ``files``, ``size`` bytes in all) where the checkpoint came
    from, for every store: ``into/<place>`` for a checkpoint folder (``checkpoint-<step>`` when not recorded), or
    its files at the top of ``into`` (``place`` ``"."``: ``out/ckpt.pt`` for a loop that reloads its own file; a
    ``place`` that ``placement`` never writes counts as not recorded).
    What is there already is kept when it holds the same files with the same bytes (``same_bytes``), else moved
    aside to a hidden ``.NAME.replaced-<time>-<pid>`` (never deleted). Every folder a file or the checkpoint was
    renamed into is fsynced, so that the placed checkpoint outlives a crash of the machine right after.

    Raises:
        HubError: ``step`` is None (the checkpoint does not say its step).
        WeightsNotFiniteError: a fetched weight file holds a NaN or an infinity (nothing is placed).
        OSError: a rename or a read failed.
    """
    if step is None:
        raise HubError(f"cannot tell the step of {destination}/{CHECKPOINT_FOLDER}", destination=destination,
                       hint="it has no trainer_state.json and was not pushed by the guard")
    if place is not None and place != "." and not CHECKPOINT_FOLDER_RE.fullmatch(place):
        place = None  # a place the guard never records (``placement``): never a path out of ``into``
    refuse_not_finite(f"{CHECKPOINT_FOLDER} (step {step})", fetched, files, destination, fetched=True, log=log)
    stamp = f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    names = tuple(sorted(files))
    if place == ".":
        renamed_into = {into}
        for rel in names:
            target = into / rel
            if same_bytes(target, fetched / rel):
                continue
            if target.exists() or target.is_symlink():
                aside = target.with_name(f".{target.name}.{stamp}")
                os.rename(target, aside)
                log.warning("%s differs from the secured checkpoint: moved it to %s", target, aside)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(fetched / rel, target)
            renamed_into.add(target.parent)
        for folder in sorted(renamed_into):
            fsync_dir(folder)
        where = into / names[0] if len(names) == 1 else into
        log.info("fetched %s/%s (step %d) back into %s", destination, CHECKPOINT_FOLDER, step, where)
        return FetchedCheckpoint(where, step, revision, names, size)
    target = into / (place or f"checkpoint-{step}")
    if target.exists():
        if list_files(target) == list_files(fetched) and all(same_bytes(target / rel, fetched / rel)
                                                              for rel in names):
            log.info("%s already holds the secured checkpoint (step %d): keeping it", target, step)
            _name_in_tracker(target, log)
            return FetchedCheckpoint(target, step, revision, names, size)
        aside = target.with_name(f".{target.name}.{stamp}")
        os.rename(target, aside)  # a partial or different local copy: kept aside (hidden), not deleted
        log.warning("%s differs from the secured checkpoint: moved it to %s", target, aside)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(fetched, target)
    _name_in_tracker(target, log)
    fsync_dir(target.parent)
    log.info("fetched %s/%s (step %d) into %s", destination, CHECKPOINT_FOLDER, step, target)
    return FetchedCheckpoint(target, step, revision, names, size)


@dataclasses.dataclass(frozen=True)
class _Tracker:
    """A file beside a checkpoint folder that names the one to load (it lies outside the folder, so the record does
    not hold it): ``folder`` matches the folder's name (group 1: its step), ``name`` is the file's, ``text`` what
    it holds for a folder (its name, its step), ``loader`` who reads it."""

    folder: re.Pattern[str]
    name: str
    text: Callable[[str, int], str]
    loader: str

    def step_named(self, held: str) -> int | None:
        """The step the tracker's text ``held`` names, or None (another text: Megatron's ``release``)."""
        found = self.folder.fullmatch(held)
        if found is not None:
            return int(found[1])
        return int(held) if held.isdigit() else None


#: DeepSpeed's ``latest`` names its tag folder ``global_step<N>`` (``DeepSpeedEngine.load_checkpoint`` with no tag
#: reads it; ``deepspeed/runtime/engine.py``); Megatron-LM's ``latest_checkpointed_iteration.txt`` holds the
#: iteration of ``iter_<7 digits>`` (rank 0 writes it after every rank saved; ``load_checkpoint`` reads it first and
#: starts from scratch without it: ``megatron/training/checkpointing.py``, ``read_metadata``).
_TRACKERS = (_Tracker(re.compile(r"global_step([0-9]+)"), "latest", lambda name, step: name,
                      "DeepSpeed's load_checkpoint"),
             _Tracker(re.compile(r"iter_([0-9]+)"), "latest_checkpointed_iteration.txt",
                      lambda name, step: str(step), "Megatron-LM's load_checkpoint"))


def _name_in_tracker(target: Path, log: logging.Logger) -> None:
    """A checkpoint folder placed back whose layout has a tracker file beside it (``_TRACKERS``: DeepSpeed's
    ``latest``, Megatron-LM's ``latest_checkpointed_iteration.txt``): the tracker names it, as the job wrote it
    after the save, unless one names a later step. Written atomically (a temporary file renamed); never raises (the
    job then loads what it is told to)."""
    for tracker in _TRACKERS:
        mine = tracker.folder.fullmatch(target.name)
        if mine is None:
            continue
        beside = target.parent / tracker.name
        try:
            named = tracker.step_named(beside.read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError):
            named = None
        if named is not None and named >= int(mine[1]):
            return
        scratch = beside.with_name(f".{tracker.name}.tmp-{os.getpid()}")
        try:
            scratch.write_text(tracker.text(target.name, int(mine[1])), encoding="utf-8")
            os.replace(scratch, beside)
        except OSError as exc:
            log.warning("cannot write %s naming %s (%s reads it): %s", beside, target.name, tracker.loader, exc)
            return
        log.info("%s names %s (%s reads it)", beside, target.name, tracker.loader)
        return
