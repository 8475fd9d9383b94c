"""Securing's file system work, off the supervisor's loop: the output folder's scans, the description of each
save, the final model's listing, the suspect markers.

On a hung NFS or Lustre hard mount a ``stat()`` never returns. None of these calls runs on the loop: securing
submits them to the file system thread (``guard.core.helpers.FS_HELPERS``) through a :class:`Port`, and their
results come back on a later loop turn, in the order they were submitted, as calls on the loop's side
(``Port.drain``), from which securing feeds the plan its events (``CheckpointSeen``, ...). A scan that never
returns holds up only the calls queued behind it on that thread; the deadline, signals, stalls and the VERDICT
go on (``Securing`` waits for a scan's answer a bounded time at most, ``FS_WAIT_S``).

:class:`Disk` is the state the file system thread owns (which folders the job said it finished, the files it
saved with ``torch.save``, which (folder, reason) pairs were logged): it is read and written on that thread only.
Its ``stat`` is the seam through which tests make a scan block (an ``os.stat`` that waits for an event).
"""

from __future__ import annotations

import logging
import math
import os
import re
import stat as stat_module
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.core.helpers import Pending, Submitter
from guard.errors import GuardError
from guard.secure import checkpoints, layout, snapshots, suspects
from guard.secure.checkpoints import CheckpointInfo, StatFn

__all__ = ["Disk", "FileSeen", "Port", "ReportSeen", "ScanAsked", "ScanFound"]

log = logging.getLogger("guard.secure")

#: accelerate's folders whose N may not be the agent's step: automatic naming's ``checkpoint_N`` counts the saves
#: (``ProjectConfiguration(automatic_checkpoint_naming=True)``), its examples' ``epoch_N`` the epochs, and their
#: ``step_N`` may not go on from the resumed step
_SAVE_COUNT_RE = re.compile(r"(?:checkpoint|step|epoch)_[0-9]+")
#: Files at the top of a working folder that belong to a final model when the job wrote them (weights, configs,
#: tokenizer files): the final model pushed from a working folder is never its sources, data or logs.
_FINAL_MODEL_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json", ".model", ".tiktoken")

Apply = Callable[[Any, BaseException | None], None]


class Port:
    """Calls submitted to a file system thread, their results handed back on the loop in submission order.

    Args:
        helpers: where the calls run (``FS_HELPERS``; a test may pass a ``Submitter`` that runs them inline).
    """

    def __init__(self, helpers: Submitter) -> None:
        self._helpers = helpers
        self._queue: deque[tuple[Pending[Any], Apply]] = deque()

    def submit(self, func: Callable[..., Any], *args: Any, apply: Apply | None = None) -> None:
        """Queue ``func(*args)`` on the thread; returns at once. ``apply(value, error)`` runs on the loop once the
        call and every call submitted before it are done (``drain``)."""
        self._queue.append((self._helpers.submit(func, *args), apply or (lambda value, error: None)))

    def drain(self) -> int:
        """On the loop: hand back every finished call at the head of the queue (a call still running holds back
        the ones behind it, so that results arrive in order); returns how many were handed back. Never waits."""
        count = 0
        while self._queue and self._queue[0][0].done():
            pending, apply = self._queue.popleft()
            count += 1
            apply(pending.result(), pending.error)
        return count

    @property
    def in_flight(self) -> int:
        """Calls submitted and not handed back yet."""
        return len(self._queue)


@dataclass(frozen=True)
class ScanAsked:
    """One scan of the output folder (``checkpoints.newest_complete``), with what it needs from the loop.

    Attributes:
        output_dir: the folder. now_s: the wall clock at submission, epoch seconds.
        loose: also consider loose model files (no Trainer seen). since_s: the job's start (epoch s), or None.
        resumed: the checkpoint this run resumed from (counts although older). known: checkpoints fed to the plan,
            whose files are checked for a rewrite since (``checkpoints.rewritten_after``).
        final: also list the final model files (``hub.holds_final_model``) and whether the folder holds any file
            (the VERDICT's hint): the scan after the job's exit.
        reported: folders every rank said it finished (no mtime rule for them). world_size: the job's ranks.
        stable_for_s: the settle rule's time (0 after the job exited 0: nothing writes any more).
        waiting: ``(folder, reason)`` of reported folders some ranks' parts are missing from (skipped unless their
            layout says every rank wrote: ``checkpoints.newest_complete``'s ``waiting``).
        parts: the job has several nodes, each with its own disk: a folder holding this node's part of a sharded
            checkpoint is found (``CheckpointInfo.part``; ``checkpoints.newest_complete``'s ``parts``).
        run_id: this run's id: another run's suspect markers are void (``checkpoints.newest_complete``).
    """

    output_dir: str
    now_s: float
    loose: bool = True
    since_s: float | None = None
    resumed: frozenset[str] = frozenset()
    known: tuple[CheckpointInfo, ...] = ()
    final: bool = False
    reported: frozenset[str] = frozenset()
    world_size: int = 1
    waiting: tuple[tuple[str, str], ...] = ()
    stable_for_s: float = checkpoints.STABLE_FOR_S
    parts: bool = False
    run_id: str | None = None


@dataclass(frozen=True)
class ScanFound:
    """What one scan found.

    Attributes:
        found: the newest complete checkpoint, or None. unchanged: for each of ``ScanAsked.known`` (by
        :func:`key`), whether its files are still as they were saved. final_model: the output folder holds final
        model files (None: not asked). holds_files: it holds any file at all (None: not asked). final_files: the
        final model's files when the output folder is not the job's own (``Disk.final_files``), else None.
        followed: saves made under a temporary name and found since under their final one (``Disk.followed``),
        oldest first. renamed: ``(temporary path, final path)`` of each of them, so that what was known of the save
        under its first name (the agent saw a tensor of it that is not finite) follows it.
    """

    found: CheckpointInfo | None
    unchanged: dict[tuple[str, int | None, float], bool] = field(default_factory=dict)
    final_model: bool | None = None
    holds_files: bool | None = None
    final_files: tuple[str, ...] | None = None
    followed: tuple[CheckpointInfo, ...] = ()
    renamed: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ReportSeen:
    """A ``checkpoint_saved`` message, checked and described on the thread: ``path`` None when refused
    (``refused`` says why); ``info`` None when not described (``describe_error`` says why, or ``zero`` was
    False)."""

    path: str | None
    refused: GuardError | None = None
    info: CheckpointInfo | None = None
    describe_error: GuardError | None = None


@dataclass(frozen=True)
class FileSeen:
    """A ``file_saved`` message, looked at on the thread.

    Attributes:
        output_dir: the output folder of the save (``layout.output_dir_of_save``: the folder above its checkpoint
            folder, else its own), when it may serve as one; None for a special file or an implausible folder.
        info: the checkpoint the save belongs to, or None (not a candidate: a special file, gone, saved again).
        following: the save lies under a temporary name (``tmp.pth.tar``) that the job is about to rename: the
            scans follow it by its signature (``Disk.followed``).
        special: what the path is when it is no regular file (``"a character device"``, ``"a FIFO"``...), else
            None: never a checkpoint.
    """

    output_dir: str | None = None
    info: CheckpointInfo | None = None
    following: bool = False
    special: str | None = None


def key(info: CheckpointInfo) -> tuple[str, int | None, float]:
    """A checkpoint's identity for ``ScanFound.unchanged``: its path, step and newest mtime."""
    return str(info.path), info.step, info.newest_mtime_s


class Disk:
    """The file system thread's side of securing; every method runs on that thread (or inline in tests).

    Args:
        stat: ``os.stat``-like callable for the scans, the saves' descriptions and the rewrite checks (the seam
            tests use to make a scan block); default ``os.stat``.
    """

    def __init__(self, stat: StatFn = os.stat) -> None:
        self.stat = stat
        self.saved_files = checkpoints.SavedFiles()  # torch.save calls the agent saw return
        self.seen: set[tuple[str, str]] = set()  # (folder, reason) pairs already logged
        #: accelerate's ``save_state`` folders -> the agent's step at the last ``torch.save`` into each (its
        #: optimizer.bin, scheduler.bin, ...): automatic ``checkpoint_N`` counts saves, and a script's own ``step_N``
        #: may not go on from the resumed step (accelerate's complete_nlp_example after a resume mid-epoch)
        self.save_count_steps: dict[Path, int] = {}
        self.snapshots = snapshots.Snapshots(stat)  # copies of the files saved in place faster than a push starts
        #: saves under a temporary name, followed until renamed: path -> (step, signature, rank, output folder)
        self.following: dict[str, tuple[int | None, snapshots.Signature, int | None, str | None]] = {}
        self.renamed: list[tuple[str, str]] = []  # (temporary path, final path) of followed saves, for the next scan
        self._special_logged: set[str] = set()
        #: checkpoint folders the agent saw a ``torch.save`` into (resolved): the scans' settle rule is no news for
        #: them (the save was seen and is judged at it), so their "still being written" is logged at debug only
        self.saved_folders: set[str] = set()

    def scan(self, asked: ScanAsked) -> ScanFound:
        """Scan the output folder (``checkpoints.newest_complete``); raises OSError as it does."""
        found = self._newest(asked)
        unchanged = {key(info): checkpoints.rewritten_after(info.folder, info.files, info.newest_mtime_s,
                                                            stat=self.stat) is None for info in asked.known}
        final_model = holds_files = None
        final_files: tuple[str, ...] | None = None
        if asked.final:
            from guard.secure.dest.local import holds_final_model  # lazily: needed only at the end

            final_files = self.final_files(asked.output_dir, asked.since_s)
            final_model = holds_final_model(asked.output_dir, final_files)
            holds_files = layout.holds_any_file(asked.output_dir)
        followed = self.followed(final=asked.final, now_s=asked.now_s)
        renamed, self.renamed = tuple(self.renamed), []
        return ScanFound(found, unchanged, final_model, holds_files, final_files, followed, renamed)

    def older(self, asked: ScanAsked, before_step: int, bound_s: float) -> CheckpointInfo | None:
        """The newest complete checkpoint of the output folder saved before ``before_step`` whose saved weights are
        finite (``guard.secure.weights``, read within ``bound_s`` seconds), or None (``Plan``'s ``LookOlder``).
        Raises OSError as a scan does, ``weights.CheckTimedOut`` past the bound."""
        from guard.secure import weights

        until = time.monotonic() + bound_s

        def vet(info: CheckpointInfo) -> str | None:
            bad = weights.check_files(info.folder, info.files, deadline=until).bad
            return None if bad is None else f"its weights are not finite ({bad.describe()})"

        return self._newest(asked, vet=vet, refuse=lambda step, mtime_s: None if step is not None and step < before_step
                            else f"saved at or after step {before_step}, the first suspect save")

    def _newest(self, asked: ScanAsked, **more: Any) -> CheckpointInfo | None:
        """``checkpoints.newest_complete`` of the output folder as ``asked`` says, with this thread's own state
        (its stat, the skips already logged, accelerate's save counts, the folders saved into); ``more``: its other
        keyword arguments (``vet``, ``refuse``)."""
        return checkpoints.newest_complete(asked.output_dir, now_s=asked.now_s, stat=self.stat, seen=self.seen,
                                           stable_for_s=asked.stable_for_s,
                                           steps={str(p): s for p, s in self.save_count_steps.items()},
                                           reported=set(asked.reported), loose=asked.loose,
                                           since_s=asked.since_s, resumed=asked.resumed,
                                           world_size=asked.world_size, waiting=dict(asked.waiting),
                                           parts=asked.parts, run_id=asked.run_id, quiet=self.saved_folders, **more)

    def part_at(self, asked: ScanAsked, step: int) -> CheckpointInfo | None:
        """This node's part of ``step`` in the output folder (``checkpoints.newest_complete`` with ``only_step``,
        as ``asked`` says), when complete and a part, else None; raises OSError as it does."""
        found = checkpoints.newest_complete(asked.output_dir, now_s=asked.now_s, stat=self.stat, seen=self.seen,
                                            stable_for_s=asked.stable_for_s, reported=set(asked.reported),
                                            loose=False, since_s=asked.since_s, resumed=asked.resumed,
                                            world_size=asked.world_size, parts=True, run_id=asked.run_id,
                                            only_step=step)
        return found if found is not None and found.part else None

    def final_files(self, output_dir: str, since_s: float | None) -> tuple[str, ...] | None:
        """The files of the output folder that are the final model: all of them (None), unless the folder is not
        the job's own (the working folder, from ``--save model.pt``; one above it): then only the files the job
        saved at its top (``torch.save``) and the model, config and tokenizer files written there since it started
        (``since_s``, epoch seconds; a Trainer's ``save_model`` with ``--output_dir .``), never its sources, data
        and logs."""
        if layout.is_plausible_output_dir(output_dir):
            return None
        names = set(self.saved_files.names_in(output_dir))
        since = since_s if since_s is not None else math.inf
        try:
            with os.scandir(output_dir) as entries:
                for entry in entries:
                    if (entry.name.endswith(_FINAL_MODEL_SUFFIXES) or entry.name in ("vocab.txt", "merges.txt")) \
                            and not entry.name.startswith((".", "_")) \
                            and entry.is_file(follow_symlinks=False) and entry.stat().st_mtime >= since:
                        names.add(entry.name)
        except OSError:
            pass
        return tuple(sorted(names))

    def size_of_newest(self, output_dir: str, now_s: float) -> int | None:
        """Before the job starts: the size of the newest complete checkpoint already there, or None."""
        try:
            found = checkpoints.newest_complete(output_dir, now_s=now_s, stat=self.stat)
        except OSError:
            return None
        return found.size_bytes if found is not None else None

    def reported(self, message: dict[str, Any], output_dir: str | None, *, parts: bool = False,
                 world_size: int = 1) -> ReportSeen:
        """Check the path of a ``checkpoint_saved`` message (``layout.check_reported_path``) and, from rank 0
        (``zero``), describe it (``checkpoints.describe``, with ``parts`` and the job's ``world_size``: a node's
        part of a many-node checkpoint is found as such)."""
        try:
            path = str(layout.check_reported_path(message.get("path"), output_dir=output_dir))
        except GuardError as exc:
            return ReportSeen(None, refused=exc)
        if not message.get("zero", True):
            return ReportSeen(path)
        try:
            return ReportSeen(path, info=checkpoints.describe(path, step=message.get("step"), stat=self.stat,
                                                              parts=parts, world_size=world_size))
        except GuardError as exc:
            return ReportSeen(path, describe_error=exc)

    def file_saved(self, path: str, step: int | None, output_dir: str | None, rank: int | None = None,
                   signature: snapshots.Signature | None = None) -> FileSeen:
        """A file ``torch.save`` wrote, as a checkpoint candidate of its own (``checkpoints.SavedFiles``): its
        output folder (``FileSeen.output_dir``) and its checkpoint (its files of that step, or its checkpoint
        folder) when it lies in ``output_dir`` (the folder the run was given; None: none) or in a folder that may
        serve as one (``layout.output_dir_of_save``). A save into accelerate's ``checkpoint_N``/``step_N`` by rank 0
        (``rank`` None or 0) records the agent's ``step`` for that folder (N counts saves there, not steps).

        Never a candidate: a path that is no regular file (``/dev/null``, a FIFO, a socket: ``FileSeen.special``).
        ``signature``: ``(size, mtime_ns, inode)`` the agent reported right after the save. A file that no longer
        has it under its name was renamed (timm's ``tmp.pth.tar`` -> ``last.pth.tar``; a rename keeps all three)
        and is found in its folder by it, or was saved again since (that save's report follows): no checkpoint. A
        save still under a temporary name is followed by the scans (``followed``). A file saved in place again
        within ``snapshots.SNAPSHOT_BELOW_S`` is copied now and its checkpoint is the copy
        (``snapshots.Snapshots.take``)."""
        where = Path(os.path.abspath(path))
        try:
            st = self.stat(str(where))
        except OSError:
            st = None
        special = _special(st)
        if special is not None:
            if str(where) not in self._special_logged:
                self._special_logged.add(str(where))
                log.info("the job saved to %s, %s: not a checkpoint", where, special)
            return FileSeen(special=special)
        if signature is not None and (st is None or snapshots.sig_of(st) != signature):
            renamed = self._renamed(where.parent, signature)
            if renamed is None and checkpoints.is_scratch_name(where.parent.name):
                renamed = self._renamed_folder(where, signature)
            if renamed is None:
                return FileSeen()  # gone, or saved again since: its newer save is reported on its own
            log.debug("the job renamed its save %s to %s", where.name, renamed.name)
            where = renamed
        elif signature is not None and checkpoints.is_scratch_name(where.name):
            self.following[str(where)] = (step, signature, rank, output_dir)
            return FileSeen(self._output_dir_of(where), following=True)
        return self._candidate(where, step, output_dir, rank, signature)

    def _candidate(self, where: Path, step: int | None, output_dir: str | None, rank: int | None,
                   signature: snapshots.Signature | None) -> FileSeen:
        """``file_saved`` for a file under its own (final) name."""
        wanted = self.snapshots.saved(where, step, signature)
        if _SAVE_COUNT_RE.fullmatch(where.parent.name) and isinstance(step, int) and rank in (None, 0):
            self.save_count_steps[where.parent.resolve()] = step
        learnt = self._output_dir_of(where)
        inside = output_dir is not None and where.resolve().is_relative_to(Path(output_dir).resolve())
        if not inside and learnt is None:
            return FileSeen()
        info = self.saved_files.add(where, step, stat=self.stat)
        if info is None:
            return FileSeen(learnt)
        if info.admitted_by == "saved-folder":
            self.saved_folders.add(os.path.realpath(info.path))
            return FileSeen(learnt, info)  # judged whole once the job trained on (``saved_folder``)
        if not all(self.snapshots.current(info.folder / rel) for rel in info.files):
            return FileSeen(learnt)  # saved again since: its newer save is reported on its own
        if wanted:
            info = self.snapshots.take(info)
        return FileSeen(learnt, info)

    @staticmethod
    def _output_dir_of(where: Path) -> str | None:
        learnt = layout.output_dir_of_save(where)
        return str(learnt) if learnt is not None else None

    def _renamed(self, folder: Path, signature: snapshots.Signature) -> Path | None:
        """The file of ``folder`` that has ``signature`` (a save renamed after its report), or None. Of several
        names for it (a hard link: timm's ``checkpoint-N.pth.tar`` beside ``last.pth.tar``), the one with no digit
        in its name (the name the next save takes over), else the first by name."""
        found = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        st = self.stat(entry.path)
                    except OSError:
                        continue
                    if _special(st) is None and snapshots.sig_of(st) == signature:
                        found.append(Path(entry.path))
        except OSError:
            return None
        found.sort(key=lambda p: (any(c.isdigit() for c in p.name), p.name))
        return found[0] if found else None

    def _renamed_folder(self, where: Path, signature: snapshots.Signature) -> Path | None:
        """A save whose temporary folder was renamed after its report (``tmp-checkpoint-N/model.pt`` ->
        ``checkpoint-N/model.pt``, the pattern of transformers #29399, in a plain loop): the file of the same name
        and ``signature`` in a folder beside the temporary one (a rename keeps size, mtime and inode), or None.
        Before, such a save was taken for gone, and a loop that renames right after each save (faster than the
        guard's look) was never found: SIGTERM said 'no complete checkpoint to secure'."""
        try:
            with os.scandir(where.parent.parent) as entries:
                for entry in entries:
                    if not entry.is_dir(follow_symlinks=False):
                        continue
                    candidate = Path(entry.path) / where.name
                    try:
                        st = self.stat(str(candidate))
                    except OSError:
                        continue
                    if _special(st) is None and snapshots.sig_of(st) == signature:
                        return candidate
        except OSError:
            return None
        return None

    def followed(self, *, final: bool = False, now_s: float | None = None) -> tuple[CheckpointInfo, ...]:
        """The saves made under a temporary name (``file_saved``) that now lie under their final one, as
        checkpoints, oldest first; one still under its temporary name, unchanged, is taken as it is at the final
        scan (``final``: the job ended) or once unchanged for ``checkpoints.STABLE_FOR_S`` (the job keeps it);
        one gone with no file of its signature is dropped."""
        taken: list[CheckpointInfo] = []
        for name, (step, signature, rank, output_dir) in list(self.following.items()):
            where = Path(name)
            try:
                st: os.stat_result | None = self.stat(name)
            except OSError:
                st = None
            if st is not None and snapshots.sig_of(st) == signature:
                settled = now_s is not None and st.st_mtime <= now_s - checkpoints.STABLE_FOR_S
                if not (final or settled):
                    continue
                found: Path | None = where
            else:
                found = self._renamed(where.parent, signature)
            del self.following[name]
            if found is None:
                continue
            if found != where:
                self.renamed.append((name, str(found)))
            seen = self._candidate(found, step, output_dir, rank, signature)
            if seen.info is not None and seen.info.admitted_by != "saved-folder":
                taken.append(seen.info)
        return tuple(taken)

    def saved_folder(self, info: CheckpointInfo, now_s: float, world_size: int,
                     parts: bool = False) -> CheckpointInfo | None:
        """A checkpoint folder the job saved into (``FileSeen.info`` with ``admitted_by`` ``"saved-folder"``), once
        the job trained on: the folder as it is now when complete by its completion files and formats
        (``checkpoints.saved_folder``; ``parts``: a node's part is one), else None (the scans judge it later;
        logged at debug)."""
        found, why = checkpoints.saved_folder(info.path, now_s=now_s, stat=self.stat, world_size=world_size,
                                              steps={str(p): s for p, s in self.save_count_steps.items()},
                                              parts=parts)
        if found is None:
            log.debug("checkpoint folder %s: not taken at its save (%s); the scans judge it", info.path, why)
        return found

    @staticmethod
    def record_taint(folders: tuple[str, ...], taint: suspects.RunTaint) -> None:
        """Write the run's taint beside each of ``folders`` (``suspects.record_taint``: logged, never raised)."""
        for folder in folders:
            suspects.record_taint(folder, taint)

    @staticmethod
    def close_taints(folder: str, run_id: str | None, at_s: float) -> None:
        """This run starts on ``folder``: other runs' open taints there end at ``at_s`` (``suspects.close_taints``)."""
        suspects.close_taints(folder, run_id=run_id, at_s=at_s)

    def describe(self, path: str, step: int | None, parts: bool = False, world_size: int = 1) -> CheckpointInfo:
        """``checkpoints.describe`` through the seam's ``stat`` (a reported folder once every rank's part is in;
        ``parts``, ``world_size`` as there); raises ``GuardError`` as it does."""
        return checkpoints.describe(path, step=step, stat=self.stat, parts=parts, world_size=world_size)

    @staticmethod
    def mark_suspect(path: str, step: int | None, first_bad_step: int, run_id: str | None = None) -> None:
        """Write the suspect marker of a checkpoint (``suspects.mark_suspect``: logged, never raised)."""
        suspects.mark_suspect(path, step=step, first_non_finite_step=first_bad_step, run_id=run_id)


def _special(st: os.stat_result | None) -> str | None:
    """What a path is when it exists and is no regular file (never a checkpoint), else None."""
    if st is None or stat_module.S_ISREG(st.st_mode):
        return None
    for test, what in ((stat_module.S_ISCHR, "a character device"), (stat_module.S_ISBLK, "a block device"),
                       (stat_module.S_ISFIFO, "a FIFO"), (stat_module.S_ISSOCK, "a socket"),
                       (stat_module.S_ISDIR, "a folder")):
        if test(st.st_mode):
            return what
    return "no regular file"

