"""The run's output folder as securing sees it: where it is, the scans of it and what they found, and the run's
taint written beside every folder it used.

The folder is given (``--output-dir``, the Trainer's ``output_dir``) or followed from save to save (that of the job's
newest ``torch.save``). Every look at it runs on the file system thread (``guard.secure.scans``): the periodic scan
for a complete checkpoint the job did not report (``checkpoints.newest_complete``), the look for this node's part of
a step node 0 put (many nodes), and the look for an older good checkpoint (``LookOlder``); the answers are handled
here on a later turn of the loop. ``guard.secure.securing.Securing`` holds one ``Folder``; it feeds the plan what the
scans found (``found``) and decides when to scan.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from guard.secure import checkpoints, scans, suspects
from guard.secure.events import Event, LookedOlder, LookOlder, OutputDirKnown
from guard.secure.intake import Intake
from guard.secure.link import JobLink
from guard.secure.peers import Peers
from guard.secure.waits import ScanWaits

__all__ = ["KNOWN_CHECKED", "Folder"]

log = logging.getLogger("guard.secure")

KNOWN_CHECKED = 16  # how many of the newest checkpoints fed to the plan each scan checks for a rewrite


class Folder:
    """The run's output folder(s), its scans and this run's taint beside them.

    Args:
        output_dir: the folder given (``--output-dir``), or None: the Trainer's, else that of the job's newest save.
        port, disk: the file system thread's port and the state it owns (``guard.secure.scans``).
        wall: epoch seconds. run_id: ``() -> str``: this run's id (it names the taints).
        link: ``() -> JobLink | None``: the loop, as the last hook got it.
        intake: the job's saves (the reports' waits and paths, the saves seen non-finite).
        peers: this node among the job's nodes (parts mode; the follower a part found goes to).
        loose: ``() -> bool``: the scans take loose files too (no Trainer seen).
        feed: ``(event) -> None``: an event to the plan (``OutputDirKnown``, ``LookedOlder``).
        found: ``(answer) -> None``: a scan's ``scans.ScanFound``, once this folder's own state took it in.

    Attributes:
        output_dir: the output folder now, or None. given: it was given, not followed from the saves.
        fed: the checkpoints fed to the plan, oldest first (the scans check the newest ``KNOWN_CHECKED`` for a
            rewrite). started_s: the job's start (epoch seconds): older checkpoints are an earlier run's.
        resumed_paths: the checkpoint the run resumed from (this run's, however old).
        final_model, holds_files, final_files: what the exit's scan found (final model files; any file; the final
            model's files when not the whole folder), None while no scan said.
        waits: the scans' numbers and the hooks' work waiting for a fresh one (``waits.ScanWaits``).
    """

    def __init__(self, output_dir: str | None, *, port: scans.Port, disk: scans.Disk, wall: Callable[[], float],
                 run_id: Callable[[], str], link: Callable[[], JobLink | None], intake: Intake, peers: Peers,
                 loose: Callable[[], bool], feed: Callable[[Event], None],
                 found: Callable[[scans.ScanFound], None]) -> None:
        self.output_dir = output_dir
        self.given = output_dir is not None  # else the folder follows the job's saves
        self.port, self.disk, self.wall = port, disk, wall
        self._run_id, self._link, self._intake, self._peers = run_id, link, intake, peers
        self._loose, self._feed, self._found = loose, feed, found
        self._folders: list[str] = [output_dir] if output_dir else []  # every output folder of this run
        self._tainted_at: tuple[int, float] | None = None  # (first non-finite step, wall time heard)
        self.fed: list[checkpoints.CheckpointInfo] = []
        self._unchanged: dict[tuple[str, int | None, float], bool] = {}  # the last scan's rewrite checks
        self.started_s: float | None = None
        self.resumed_paths: set[str] = set()
        self.final_model: bool | None = None
        self.holds_files: bool | None = None
        self.final_files: tuple[str, ...] | None = None
        self.waits = ScanWaits(port, self._start_scan, lambda: self.output_dir, link)

    def known(self, info: checkpoints.CheckpointInfo) -> None:
        """``info`` was fed to the plan: the scans check it for a rewrite from now on."""
        self.fed.append(info)
        del self.fed[:-KNOWN_CHECKED]

    def still_unchanged(self, info: checkpoints.CheckpointInfo) -> bool:
        """The plan's ``unchanged``, answered on the loop without a stat: False when a checkpoint fed later shares
        a file with ``info`` and is newer (``ckpt.pt`` saved again in place), else the last scan's rewrite check
        (``checkpoints.rewritten_after``, on the file system thread), else True (not checked yet: a push of a
        rewritten file after a non-finite loss is refused by the push itself)."""
        files = {(info.folder, rel) for rel in info.files}
        for later in self.fed:
            if later.newest_mtime_s > info.newest_mtime_s + 1e-3 and files & {(later.folder, r) for r in later.files}:
                return False
        return self._unchanged.get(scans.key(info), True)

    def _start_scan(self, number: int, final: bool, stable_for_s: float) -> None:
        """Scan ``number`` of the output folder, on the file system thread (``waits.ScanWaits.request`` asks)."""
        assert self.output_dir
        self.port.submit(self.disk.scan, self.scan_asked(self.output_dir, final, stable_for_s),
                         apply=lambda value, error: self._scanned(number, value, error))

    def scan_asked(self, output_dir: str, final: bool = False,
                   stable_for_s: float = checkpoints.STABLE_FOR_S) -> scans.ScanAsked:
        """What a scan of ``output_dir`` needs from the loop (``scans.ScanAsked``)."""
        link = self._link()
        reports = self._intake.reports
        waiting = reports.waiting(link)
        if link is not None and link.job_exit_code() is not None and not link.job_alive():
            stable_for_s = 0.0  # the job's processes are gone: nothing is still being written, formats decide
        return scans.ScanAsked(output_dir, self.wall(), loose=self._loose(), since_s=self.started_s,
                               resumed=frozenset(self.resumed_paths), known=tuple(self.fed), final=final,
                               reported=frozenset(reports.paths),
                               world_size=link.world_size() if link is not None else 1, waiting=waiting,
                               stable_for_s=stable_for_s, run_id=self._run_id(), parts=self._peers.parts_mode())

    def _scanned(self, number: int, value: object, error: BaseException | None) -> None:
        """A scan's answer (on the loop): this folder's state takes it in, then ``found`` (a complete checkpoint the
        job did not report becomes ``CheckpointSeen``)."""
        self.waits.answered(number)
        if error is not None and not isinstance(error, OSError):
            log.warning("the scan of %s failed: %r", self.output_dir, error)
        if isinstance(value, scans.ScanFound):
            self._unchanged.update(value.unchanged)
            if value.final_model is not None:
                self.final_model = value.final_model
            if value.holds_files is not None:
                self.holds_files = value.holds_files
            if value.final_model is not None:
                self.final_files = value.final_files
            not_finite = self._intake.not_finite
            for old, new in value.renamed:  # a save the agent saw non-finite stays so under its final name
                if old in not_finite:
                    not_finite.add(new)
            self._found(value)
        self.waits.follow_up()

    def look_for_part(self, step: int) -> None:
        """Many nodes: look for this node's part of ``step`` (node 0 put its own) on the file system thread; found,
        it goes to the follower (``guard.secure.follow``)."""
        follower = self._peers.follower
        if not self.output_dir or follower is None:
            return

        def found(value: object, error: BaseException | None) -> None:
            if isinstance(value, checkpoints.CheckpointInfo):
                follower.hold(value)

        self.port.submit(self.disk.part_at, self.scan_asked(self.output_dir), step, apply=found)

    def look_older(self, action: LookOlder, now: float) -> None:
        """``LookOlder`` on the file system thread (``scans.Disk.older``); its answer goes to the plan as
        ``LookedOlder`` (None: none found, or a save the agent saw non-finite). Many nodes: none (a node's part
        is secured with the other nodes' parts of its step)."""
        def answer(value: object, error: BaseException | None) -> None:
            info = value if isinstance(value, checkpoints.CheckpointInfo) else None
            if error is not None:
                log.info("the look for a good checkpoint before step %d ended: %r", action.before_step, error)
            if info is not None and ({str(info.path)} | {str(info.folder / rel) for rel in info.files}) \
                    & self._intake.not_finite:
                info = None
            if info is not None:
                self.fed.append(info)  # checked for a rewrite by the scans from now on
            self._feed(LookedOlder(info))

        if not self.output_dir or self._peers.parts_mode():
            self.port.submit(lambda: None, apply=answer)
            return
        self.port.submit(self.disk.older, self.scan_asked(self.output_dir), action.before_step,
                         max(0.0, action.until - now), apply=answer)

    def started(self, started_s: float, resumed: checkpoints.CheckpointInfo | None) -> None:
        """The job starts at ``started_s`` (epoch seconds), resumed from ``resumed`` (or not): files written from
        then on are this run's, and other runs' open taints in its folders end then."""
        self.started_s = started_s
        self.resumed_paths = {str(resumed.path)} if resumed is not None else set()
        for folder in self._folders:  # what other runs write here from now on is not theirs
            self.port.submit(scans.Disk.close_taints, folder, self._run_id(), self.started_s)

    def new_folder(self, path: str) -> None:
        """The run's output folder is now ``path`` (given, the Trainer's, or that of the job's newest save): the
        final model is pushed from it and the scans look at it. A folder new to this run: other runs' open taints
        there end at this run's start, and this run's taint is recorded there too (``guard.secure.suspects``)."""
        self.output_dir = path
        self._feed(OutputDirKnown(path))
        if path in self._folders:
            return
        self._folders.append(path)
        if self.started_s is not None:
            self.port.submit(scans.Disk.close_taints, path, self._run_id(), self.started_s)
        self._record_taint((path,))

    def tainted(self, first_bad_step: int) -> None:
        """The run's losses are not finite from ``first_bad_step`` on: its taint is written beside every folder of
        this run, and beside those it reaches later."""
        self._tainted_at = (first_bad_step, self.wall())
        self._record_taint(tuple(self._folders))

    def _record_taint(self, folders: tuple[str, ...]) -> None:
        """Write this run's taint, once known, beside ``folders`` (on the file system thread)."""
        if self._tainted_at is None or not folders:
            return
        step, at = self._tainted_at
        taint = suspects.RunTaint(self._run_id(), step, self.started_s if self.started_s is not None else at, at)
        self.port.submit(scans.Disk.record_taint, folders, taint)
