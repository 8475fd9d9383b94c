"""The securer: pushes checkpoints and the final model to one destination, verified, and fetches them back.

A push is secured only once verified: every file's size and sha256 at the destination equal the local file's. What
a destination does for that (a folder's swap, the Hub's two commits, S3's conditional record) lives in its store
(``guard.secure.dest``: ``open_store``); this module holds what every destination shares:

- the checks on the local files: not marked suspect, not rewritten since the save (``saved_by_s``), whole by format
  (a torn file is refused before anything moves), finite weights (``guard.secure.weights``: a weight file
  holding a NaN or an infinity is refused before anything moves, its file and tensor named);
- retries of one attempt (put, then record) with backoff, bounded by the deadline: a store's
  ``TransientDestinationError``, network errors and 408/429/5xx (``guard.secure.hubhttp.classify``), one retry of a
  verification mismatch, the Hub's ``Retry-After`` never cut short;
- ``on_recorded``, called the moment the record moves (``guard.secure.worker`` reports it: a push killed after that
  point has secured its step), and ``tidy`` after the run.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from guard.core.durations import format_size
from guard.errors import (
    CheckpointRewrittenError,
    DestinationError,
    GuardError,
    HubError,
    PushFailedError,
    TransientDestinationError,
)
from guard.secure import formats
from guard.secure.checkpoints import is_marked_suspect, rewritten_after
from guard.secure.dest import Destination, open_store, parse_destination, store_class
from guard.secure.dest.base import (
    CHECKPOINT_FOLDER,
    FetchedCheckpoint,
    FinalPushed,
    PartManifest,
    Record,
    Store,
    pushed_text,
)
from guard.secure.dest.local import final_model_files, list_files, placement, refuse_not_finite, refuse_torn
from guard.secure.hubhttp import PROGRESS, bounded, cause_hint, classify, failure_cause, fatal_hint, retry_after_s
from guard.secure.meeting import await_whole, newest_part, parts_store

if TYPE_CHECKING:
    from huggingface_hub import HfApi

    from guard.secure.dest.folder import FolderCopy

__all__ = ["PushResult", "SecuredRecord", "Securer"]

logger = logging.getLogger("guard.secure.securer")
T = TypeVar("T")

_MIN_ATTEMPT_S = 1.0  # don't start another attempt with less time than this left


@dataclass(frozen=True)
class PushResult:
    """A verified push.

    Attributes:
        destination: the destination's canonical form (``str(Destination)``).
        revision: the Hub commit id (40 hex), the folder written (absolute path), or the S3 record's ETag.
        files: paths of the files secured, relative to the checkpoint (or output) folder, sorted.
        size_bytes: their total size.
        elapsed_s: seconds the push took, the weights check, upload and verification, all attempts (injected
            clock).
        attempts: attempts made (1 when the first one succeeded).
        step: the checkpoint's training step; None for the final model.
        attempt_s: seconds of the attempt that succeeded alone (no failed attempt, no backoff or Retry-After wait)
            plus the weights check's (``guard.secure.weights``: it reads the same bytes once more): what a
            throughput estimate may learn from; None when unknown.
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
        """The VERDICT's ``pushed=`` value (``dest.base.pushed_text``)."""
        return pushed_text(self.destination, self.revision)

    @property
    def bytes_per_s(self) -> float:
        """Effective throughput of the attempt that succeeded: ``size_bytes / attempt_s`` (``elapsed_s`` when the
        attempt's own time is unknown; files the Hub already had count too); 0.0 when that time is 0."""
        took = self.attempt_s if self.attempt_s is not None else self.elapsed_s
        return self.size_bytes / took if took > 0 else 0.0


@dataclass(frozen=True)
class SecuredRecord:
    """What the destination records as secured: ``revision`` (Hub commit id, the ``last-checkpoint`` folder, the S3
    record's ETag), ``step`` (None when not recorded), and where the checkpoint came from (the manifest's, None when
    not recorded): ``output_dir`` (the job's output folder, relative to its working folder when inside it) and
    ``place`` (the checkpoint's path relative to it: ``"checkpoint-20"`` for a folder, ``"."`` for files that lay
    at its top, e.g. ``ckpt.pt``)."""

    revision: str
    step: int | None
    output_dir: str | None = None
    place: str | None = None


def _revision(record: Record | FinalPushed) -> str:
    """A record's revision as the VERDICT shows it (an S3 ETag without the quotes HTTP gives it)."""
    return str(record.revision).strip('"')


class Securer:
    """Pushes checkpoints and the final model to one destination, verifies them, fetches them back.

    Args:
        destination: a ``Destination`` or ``--push-to`` text (see ``parse_destination``).
        api: the ``huggingface_hub.HfApi`` to use (Hub destinations); default ``HfApi(token=token)``.
        token: Hub token for the default ``api``; default: ``HF_TOKEN`` or the stored login.
        clock: monotonic seconds; ``deadline`` arguments are values of this clock.
        sleep: waits between attempts (seconds).
        log: the logger (default ``guard.secure.securer``).
        backoff_s: first wait between attempts; doubles up to ``max_backoff_s`` (seconds).
        run_id: this run's id (``SecureSettings.run_id``): an S3 destination keeps each run's checkpoints under
            it until the record names them; default ``"run"``.
        store: the destination's ``guard.secure.dest.base.Store``; default ``open_store(destination)``, made on
            first use.
        node_rank, nodes: this node's index and the job's node count (``SecureSettings``), when every node secures
            its own part of each checkpoint (many nodes, each with its own disk; a ``PartsStore``: folder, S3, Hub):
            the record moves only once every node's part is there (``guard.secure.nodes.whole``); default 0 and 1
            (one node: part and record are one push).

    Raises:
        UsageError: ``destination`` text that ``parse_destination`` refuses.
    """

    def __init__(self, destination: Destination | str, *, api: HfApi | None = None, token: str | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 log: logging.Logger = logger, backoff_s: float = 1.0, max_backoff_s: float = 8.0,
                 run_id: str | None = None, store: Store | None = None, node_rank: int = 0, nodes: int = 1) -> None:
        self.destination = destination if isinstance(destination, Destination) else parse_destination(destination)
        self._api = api
        self.token = token  # for worker processes (guard.secure.worker), sent on their stdin
        self._clock, self._sleep, self._log = clock, sleep, log
        self.last_attempt_s: float | None = None  # the last successful attempt's own seconds
        self._backoff_s, self._max_backoff_s = backoff_s, max_backoff_s
        self.run_id = run_id or "run"
        self._store = store
        self.node_rank, self.nodes = node_rank, max(1, nodes)  # this node's part of a many-node checkpoint
        #: Called with ``(step, revision)`` the moment a checkpoint push has moved the destination's record (the
        #: folder swapped in, the Hub's record commit made, the S3 record written), before its cleanup: a push
        #: killed after that point has secured its step all the same (``guard.secure.worker`` reports it).
        self.on_recorded: Callable[[int, str], None] | None = None

    @property
    def store(self) -> Store:
        """The destination's store (``guard.secure.dest.open_store``), made on first use. Raises
        ``DestinationError`` when it cannot be made here."""
        if self._store is None:
            self._store = open_store(self.destination, api=self._api, token=self.token, log=self._log)
        return self._store

    @property
    def last_copy(self) -> FolderCopy | None:
        """What the last push to a folder destination wrote (``guard.secure.dest.folder.FolderCopy``), else
        None."""
        copy: FolderCopy | None = getattr(self._store, "last_copy", None)
        return copy

    # -- pushes -----------------------------------------------------------------------------------------------

    def push_checkpoint(self, local_dir: str | os.PathLike[str], *, step: int, deadline: float,
                        files: list[str] | None = None, saved_by_s: float | None = None,
                        source: str | None = None, part: bool = False) -> PushResult:
        """Secure a complete checkpoint folder as ``DEST/last-checkpoint/`` (replacing the previous one), verified:
        the store's put, then its record (on a Hub, the commit titled ``guard: checkpoint step N`` that
        ``fetch_last_checkpoint`` looks for, so that an unrelated commit on top never changes what is resumed from).

        Args:
            local_dir: the checkpoint folder (e.g. ``output/checkpoint-120``); must not change meanwhile.
            step: its training step (in the record).
            deadline: clock value by which the push, retries included, must be over.
            files: the files to secure, relative to ``local_dir`` (``CheckpointInfo.files``: a set of loose model
                files in an output folder); default: every file of the folder.
            saved_by_s: the newest file mtime (epoch seconds) when the checkpoint was seen complete
                (``CheckpointInfo.newest_mtime_s``); a file modified after it, up to the end of the copy, was
                rewritten in place (a loop that saves ``ckpt.pt`` again) and is no longer that checkpoint: the
                push fails rather than secure it under the old step. None: not checked.
            source: the folder the job saved the files in when ``local_dir`` is a copy of them
                (``guard.secure.snapshots``): the record's placement; default ``local_dir``.
            part: the folder is this node's part of a many-node checkpoint (``CheckpointInfo.part``: not complete
                on its own): with ``nodes`` > 1 it is put as node ``node_rank``'s part and the record waits for every
                node's; otherwise (default) the folder is a whole checkpoint, secured as on one node.

        Returns:
            The verified ``PushResult`` (``revision``: the record's, see ``PushResult``).

        Raises:
            PushFailedError: no files, a file marked suspect, a torn file, no time left, a non-retryable error
                (auth, permission, a local read error), or the retries ran out of time; its message lists every
                attempt. ``CheckpointRewrittenError`` (a subclass): a file was written again after ``saved_by_s``.
                ``WeightsNotFiniteError`` (a subclass): a weight file holds a NaN or an infinity
                (``guard.secure.weights``, read before any byte moves; its file and tensor named).
        """
        folder = Path(local_dir)
        nodes, node_rank = (self.nodes, self.node_rank) if part and self.nodes > 1 else (1, 0)
        if files is None:
            files = list_files(folder) if folder.is_dir() else []
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
            # before the push and in every attempt, where the store can still tell a rewrite after it (folder, Hub:
            # once the copy's first signatures are taken, compared again after the copy; S3: once the bytes are
            # there), so a retry after "changed while copied" never secures the next save as this step
            rewritten = rewritten_after(folder, files, saved_by_s) if saved_by_s is not None else None
            if rewritten is not None:
                raise self._rewritten(what, folder / rewritten[0], rewritten[1], step)
            refuse_torn(what, folder, files, "local", str(self.destination), parts=nodes > 1)

        still_that_save()
        # the weights read before any byte moves (a NaN save never reaches the destination, staging included)
        read_s = refuse_not_finite(what, folder, files, str(self.destination), deadline=deadline, clock=self._clock,
                                   log=self._log)
        where = placement(Path(source) if source else folder)

        def recorded(record: Record) -> None:
            if self.on_recorded is not None:
                self.on_recorded(step, _revision(record))

        def attempt() -> str:
            store = self.store
            requires = formats.requires(folder) if nodes > 1 and folder.is_dir() else None
            put = store.put_part(folder, files, run_id=self.run_id, step=step, node_rank=node_rank, nodes=nodes,
                                 place=where["place"], source=where["output_dir"], deadline=deadline,
                                 requires=requires, check=still_that_save)
            parts = [put] if nodes == 1 else self._await_whole(store, step, deadline)
            return _revision(store.write_record(parts, deadline=deadline, recorded=recorded))

        return self._push(what, folder, files, step, attempt, deadline, read_s=read_s)

    def push_final(self, output_dir: str | os.PathLike[str], *, files: Collection[str] | None = None,
                   deadline: float) -> PushResult:
        """Secure the final model files of ``output_dir`` (see ``final_model_files``; ``files``: only those) at the
        destination's root, verified; unchanged files are not uploaded again where the store can tell (the Hub
        client compares oids at preupload; a folder destination compares size and sha256).

        Raises:
            PushFailedError: as ``push_checkpoint``; also when ``output_dir`` has no final model files.
        """
        folder = Path(output_dir)
        names = final_model_files(folder, files) if folder.is_dir() else []
        if not names:
            raise PushFailedError(f"cannot secure the final model: {folder} has no model files",
                                  destination=str(self.destination),
                                  hint="the job wrote no final model to its output folder; check --output-dir")
        refuse_torn("the final model", folder, names, "local", str(self.destination))
        read_s = refuse_not_finite("the final model", folder, names, str(self.destination), deadline=deadline,
                                   clock=self._clock, log=self._log)
        return self._push("the final model", folder, names, None,
                          lambda: _revision(self.store.put_final(folder, names, deadline=deadline)), deadline,
                          read_s=read_s)

    def restore_checkpoint(self, *, step: int, revision: str, from_step: int | None = None,
                           deadline: float) -> PushResult:
        """Move the destination's record back to an older record, step ``step`` at ``revision`` (the newest good
        one this run secured, or the one a resumed run was fetched from), after a taint reached the checkpoint the
        record names (step ``from_step``); nothing is uploaded again: a folder swaps back the copy it kept aside, a
        Hub repo makes one record commit naming the older commit's files (copied server-side), S3 writes its
        record again (the store's ``restore_record``). ``on_recorded`` is called once the record moved.

        Returns:
            a ``PushResult`` of the record now in place (``files`` and ``size_bytes`` as it records them).

        Raises:
            PushFailedError: the store cannot restore (it keeps no older record, or no longer holds step ``step``:
                the caller pushes that checkpoint again instead), or the retries ran out of time.
        """
        start = self._clock()
        store = self.store
        restore = getattr(store, "restore_record", None)
        what = f"restoring checkpoint step {step}"
        if restore is None:
            raise PushFailedError(f"{what}: {self.destination} cannot move its record back",
                                  destination=str(self.destination), hint="the checkpoint is pushed again instead")
        older = Record(step=step, run_id=self.run_id, files={}, revision=revision, restored_from=from_step)
        self._log.warning("%s at %s over the suspect step %s", what, self.destination, from_step)
        record, attempts = self._with_retries(what, lambda: restore(older, deadline=deadline), deadline, push=True)
        if self.on_recorded is not None:
            self.on_recorded(step, _revision(record))
        files = tuple(sorted(record.files))
        return PushResult(str(self.destination), _revision(record), files,
                          sum(fs.size_bytes for fs in record.files.values()), self._clock() - start, attempts, step)

    def release_kept(self) -> None:
        """The destination's record can no longer turn suspect: the older record a store keeps aside to move back
        to goes (a folder's ``.last-checkpoint.kept``); a store that keeps none aside (Hub, S3: their history and
        previous record stay) is not even made. Logged, never raised."""
        release = getattr(store_class(self.destination.kind), "release_kept", None)
        if release is None:
            return
        try:
            release(self.store)
        except (GuardError, OSError) as exc:
            self._log.warning("cannot remove the older record kept at %s: %s", self.destination, exc)

    def _await_whole(self, store: Store, step: int, deadline: float) -> list[PartManifest]:
        """Many nodes: this node's part of ``step`` is in; wait for every node's (``guard.secure.meeting``)."""
        shared = parts_store(store, destination=str(self.destination), kind=self.destination.kind, nodes=self.nodes)
        return await_whole(shared, run_id=self.run_id, step=step, node_rank=self.node_rank, nodes=self.nodes,
                           deadline=deadline, destination=str(self.destination), clock=self._clock,
                           sleep=self._sleep, log=self._log)

    def tidy(self, *, until_s: float | None = None, nodes: int | None = None) -> None:
        """After the run (its pushes are over): what a push killed part way left at the destination goes (a
        folder's staging folder or previous copy aside; a push whose process still lives, not reaped yet, keeps its
        own: ``worker.reap_killed`` first; after a job of several nodes, a Hub repo's node parts that no record
        takes, ``HubStore.tidy``). A store whose puts leave nothing to tidy (``Store.leaves_staging`` and, with
        several nodes, ``leaves_parts_staging`` False: S3, the Hub after one node) is not made for it: an S3
        store's client took 0.28 s after the VERDICT. ``until_s``: the run's deadline (epoch seconds; None: none):
        the store's requests end 1 s before it (a guard killed at the platform's limit would exit 137, not with its
        VERDICT's code), and none is made with less left. ``nodes``: the job's node count when each node secured its
        own part (default: this securer's). Never raises."""
        try:
            kind, nodes = store_class(self.destination.kind), self.nodes if nodes is None else nodes
            if self._store is None and not kind.leaves_staging and not (nodes > 1 and kind.leaves_parts_staging):
                return
            left_s = math.inf if until_s is None else until_s - time.time() - 1.0
            if left_s <= 0:
                self._log.info("no time left before the deadline to tidy %s", self.destination)
                return
            self.store.tidy(deadline=None if math.isinf(left_s) else time.monotonic() + left_s, nodes=nodes)
        except (GuardError, OSError) as exc:
            self._log.warning("cannot tidy %s after the run: %s", self.destination, exc)

    def _rewritten(self, what: str, path: Path, later_s: float, step: int) -> CheckpointRewrittenError:
        when = "missing now" if math.isinf(later_s) else f"modified {later_s:.1f}s later"
        return CheckpointRewrittenError(
            f"cannot secure {what}: {path} was rewritten after that save ({when}), so it no longer holds step {step}",
            destination=str(self.destination),
            hint="the job saves its checkpoint in place; its newer save is secured under its own step (save each "
                 "checkpoint under a new name, e.g. ckpt-STEP.pt, so an older good one survives a later bad save)")

    # -- reading back -----------------------------------------------------------------------------------------

    def peek_last_checkpoint(self, *, deadline: float) -> SecuredRecord | None:
        """What the guard secured last, without downloading it, or None when nothing is (the store's
        ``read_record``: on a Hub the newest record commit, never one of the guard's unverified uploads; a folder's
        ``last-checkpoint`` and its manifest's step; the S3 record).

        Raises:
            HubError: the destination cannot be read before ``deadline``.
        """
        record = self._read(deadline)
        return None if record is None else SecuredRecord(_revision(record), record.step, record.source, record.place)

    def newest_parts(self, *, nodes: int, deadline: float) -> dict[str, object] | None:
        """Many nodes: what the destination holds of this run's newest step any node put a part of
        (``guard.secure.meeting.newest_part``), or None when no part of the run is there. Keys: ``step``,
        ``complete`` (every node's part there, their union whole), ``missing`` (the VERDICT's ``missing=`` value:
        ``node1``, ``files``, ``conflict``; empty when whole), ``present`` (the nodes whose part is there),
        ``missing_files`` (the first 20 required files no part holds). ``nodes``: the job's node count.

        Raises:
            PushFailedError: the store keeps no node parts. HubError: the destination cannot be read before
                ``deadline``.
        """
        shared = parts_store(self.store, destination=str(self.destination), kind=self.destination.kind,
                             nodes=nodes)
        found, _ = self._with_retries("reading the nodes' parts", lambda: newest_part(
            shared, run_id=self.run_id, nodes=nodes, deadline=deadline), deadline, push=False)
        if found is None:
            return None
        return {"step": found.step, "complete": found.complete, "missing": found.missing_text(),
                "present": list(found.present), "missing_files": list(found.missing_files[:20])}

    def _read(self, deadline: float) -> Record | None:
        result, _ = self._with_retries(f"reading {CHECKPOINT_FOLDER}'s record",
                                       lambda: self.store.read_record(deadline=deadline), deadline, push=False)
        return result

    def fetch_last_checkpoint(self, into_dir: str | os.PathLike[str], *, deadline: float,
                              revision: str | None = None) -> FetchedCheckpoint | None:
        """Download the destination's ``last-checkpoint/`` at the revision the guard recorded (``revision``, else
        ``peek_last_checkpoint``'s; never a later unrelated HEAD), verify every file, and place it as
        ``into_dir/checkpoint-<step>`` (or where its record says it lay). A copy already there is kept when it holds
        the same files, else moved aside to a hidden ``.checkpoint-<step>.replaced-<time>-<pid>`` (never deleted).

        Returns:
            The fetched checkpoint, or None when the destination (or its ``last-checkpoint/``) does not exist.

        Raises:
            HubError: a file differs from what the destination records (corrupt or partial download), the step
                cannot be told, or the deadline passed.
        """
        into = Path(into_dir)
        into.mkdir(parents=True, exist_ok=True)
        record = Record(step=None, run_id=None, files={}, revision=revision) if revision is not None else \
            self._read(deadline)
        if record is None:
            return None
        chosen = record
        result, _ = self._with_retries(f"fetching {CHECKPOINT_FOLDER}@{_revision(chosen)[:12]}",
                                       lambda: self.store.fetch(chosen, into, deadline=deadline), deadline, push=False)
        return result

    # -- retries ----------------------------------------------------------------------------------------------

    def _push(self, what: str, folder: Path, files: list[str], step: int | None, attempt: Callable[[], str],
              deadline: float, *, read_s: float = 0.0) -> PushResult:
        start = self._clock()
        size = sum((folder / rel).stat().st_size for rel in files)  # before: the job may rotate the folder out later
        self._log.info("securing %s (%d files, %s) at %s", what, len(files), format_size(size),
                       self.destination)
        from guard.observe.telemetry import Progress

        PROGRESS.append(Progress(f"securing {what}", size, clock=self._clock, logger=self._log))
        try:
            revision, attempts = self._with_retries(f"securing {what}", attempt, deadline, push=True)
        finally:
            PROGRESS.pop()
        # the weights check reads the same bytes once more: its seconds count in the throughput the margin learns
        attempt_s = self.last_attempt_s + read_s if self.last_attempt_s is not None else None
        result = PushResult(str(self.destination), revision, tuple(files), size, self._clock() - start + read_s,
                            attempts, step, attempt_s=attempt_s)
        self._log.info("secured %s at %s in %.1fs (%.1f MB/s)", what, result.pushed, result.elapsed_s,
                       result.bytes_per_s / 1e6)
        return result

    def _fail(self, what: str, tried: list[str], reason: str, hint: str, push: bool) -> HubError:
        message = f"{what} at {self.destination} failed: {reason}"
        if tried and not (len(tried) == 1 and tried[0].endswith(reason)):
            shown = tried if len(tried) <= 5 else [*tried[:2], f"... {len(tried) - 4} more", *tried[-2:]]
            message += f" (attempts: {'; '.join(shown)})"
        if push:
            return PushFailedError(message, destination=str(self.destination), attempts=len(tried), hint=hint)
        return HubError(message, destination=str(self.destination), hint=hint)

    def _with_retries(self, what: str, attempt: Callable[[], T], deadline: float, *, push: bool) -> tuple[T, int]:
        tried: list[str] = []
        pause, mismatches = self._backoff_s, 0
        asked_s: float | None = None  # the last Retry-After the Hub sent

        def fail(reason: str, hint: str) -> HubError:
            return self._fail(what, tried, reason, hint, push)

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

