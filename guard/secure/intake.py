"""The job's saves as its agents tell of them, turned into checkpoints for securing.

Two messages tell of a save: ``file_saved`` (the agent saw ``torch.save`` write a file: a loop that may never use the
guard's API) and ``checkpoint_saved`` (the job reported a finished save, each rank its own part). Each is checked and
described on the file system thread (``guard.secure.scans.Disk.file_saved``, ``Disk.reported``), its answer handled
here on a later turn of the loop. The files of one ``torch.save``'d set are taken once the job trains on past them
or ``FILE_SETTLE_S`` passes without another (:meth:`Intake.settle`); a reported checkpoint once every rank's part of
it is in (``guard.secure.reported``); a complete checkpoint a scan of the output folder found, once newer than the
job's newest (:meth:`Intake.scan_found`). Each goes to the plan as ``CheckpointSeen`` (:meth:`Intake.seen`), unless
this node holds it for node 0's part of its step (many nodes, ``peers.Peers.holds``).
``guard.secure.securing.Securing`` holds one ``Intake``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

from guard.core.durations import format_size, step_text
from guard.core.state import Message
from guard.errors import GuardError
from guard.secure import budget, checkpoints, scans, snapshots
from guard.secure.events import CheckpointSeen, Event
from guard.secure.link import JobLink
from guard.secure.peers import Peers
from guard.secure.reported import Reported

__all__ = ["FILE_SETTLE_S", "Intake"]

log = logging.getLogger("guard.secure")

FILE_SETTLE_S = 1.0  # a torch.save'd file counts as a whole checkpoint after this long without another file

Answer = Callable[[object, BaseException | None], None]
#: ``(sup, event, now) -> None``: an event to the plan, its actions carried out (``actions.Actions.feed``).
Feed = Callable[[JobLink | None, Event, float | None], None]


class Intake:
    """The job's saves, from the agents' messages to checkpoints.

    Args:
        port, disk: the file system thread's port and the state it owns (``guard.secure.scans``).
        estimator: told each save's size and duration (``budget.MarginEstimator``).
        peers: this node among the job's nodes (parts mode: this node's ranks describe their node's part).
        clock, wall: monotonic and epoch seconds.
        output_dir: ``() -> str | None``: the run's output folder now.
        saved_in: ``(folder) -> None``: rank 0 saved with ``torch.save`` in ``folder`` (the output folder may follow).
        feed: an event to the plan (``CheckpointSeen``). known: ``(info) -> None``: ``info`` went to the plan (the
            scans check it for a rewrite). check_node: ``(sup) -> None``: learn this node's part (its rank may come
            with the saves).
        link: ``() -> JobLink | None``: the loop, as the last hook got it. pump: ``(sup, now) -> None``: hand back the
            file system thread's answers.

    Attributes:
        latest_reported: this run's newest checkpoint (the job's save, or the one the run resumed from), or None.
        pending_file: a save that may still grow (another file of the set may follow), with the clock time heard.
        not_finite: paths (files and their folders) the agent saw saved with a tensor that is not finite.
        reports: the ranks' reports of their saves (``reported.Reported``).
    """

    def __init__(self, *, port: scans.Port, disk: scans.Disk, estimator: budget.MarginEstimator, peers: Peers,
                 clock: Callable[[], float], wall: Callable[[], float], output_dir: Callable[[], str | None],
                 saved_in: Callable[[str], None], feed: Feed, known: Callable[[checkpoints.CheckpointInfo], None],
                 check_node: Callable[[JobLink], None], link: Callable[[], JobLink | None],
                 pump: Callable[[JobLink, float], None]) -> None:
        self.port, self.disk, self.estimator, self.peers = port, disk, estimator, peers
        self.clock, self.wall = clock, wall
        self._output_dir, self._saved_in = output_dir, saved_in
        self._feed, self._known, self._check_node = feed, known, check_node
        self._link, self._pump = link, pump
        self.latest_reported: checkpoints.CheckpointInfo | None = None
        self.pending_file: tuple[checkpoints.CheckpointInfo, float] | None = None
        self.not_finite: set[str] = set()
        self.reports = Reported()

    def on_file_saved(self, sup: JobLink, message: Message) -> None:
        """The agent saw ``torch.save`` write a file (a loop that may never use the guard's API): complete (the call
        returned), with the agent's step at the save; the files of one save form one checkpoint."""
        path = message.get("path")
        if not path:
            return
        self.port.submit(self.disk.file_saved, str(path), message.get("step"), self._output_dir(),
                         message.get("rank"), snapshots.signature_of(message),
                         apply=lambda seen, error: self._file_seen(message, seen, error))
        self._pump(sup, self.clock())

    def _file_seen(self, message: Message, seen: object, error: BaseException | None) -> None:
        """``on_file_saved``'s answer from the file system thread (``scans.Disk.file_saved``)."""
        sup = self._link()
        if not isinstance(seen, scans.FileSeen):
            log.debug("cannot look at the saved file %s: %r", message.get("path"), error)
            return
        if seen.output_dir is not None and message.get("rank") in (None, 0):
            self._saved_in(seen.output_dir)
        info = seen.info
        if message.get("finite") is False:  # the agent saw a tensor of it that is not finite (file_saved)
            where = Path(str(message["path"]))
            output_dir = self._output_dir()
            folder = {str(where.parent)} if output_dir is None or where.parent != Path(output_dir) else set()
            self.not_finite |= {str(where), *folder} | (
                {str(info.path), *(str(info.folder / rel) for rel in info.files)} if info is not None else set())
            log.warning("the job saved %s with a tensor that is not finite (%s): never secured", where,
                        message.get("bad_tensor") or "?")
        if info is None:
            return
        if message.get("save_s"):
            self.estimator.observe_save(float(message["save_s"]), info.size_bytes)
        else:
            self.estimator.observe_size(info.size_bytes)
        if message.get("rank") not in (None, 0) and not (self.peers.parts_mode() and self.peers.node_rank != 0):
            return  # another rank's shard: rank 0's save names the checkpoint (on node 0: another node's ranks
            # name their node's part)
        # A loop may save model.pt, then optim.pt: the set is taken once the job trains on (a later step) or a
        # moment passes without another file (see settle).
        self.pending_file = (info, self.clock())
        if sup is not None:
            sup.wake()

    def settle(self, sup: JobLink, now: float, *, force: bool = False) -> None:
        """Take the pending ``torch.save``'d set once the job trained on past it or ``FILE_SETTLE_S`` passed without
        another file (``force``: now)."""
        if self.pending_file is None:
            return
        info, at = self.pending_file
        step = sup.state.progress.step
        stepped_on = step is not None and info.step is not None and step > info.step
        if not (force or now - at >= FILE_SETTLE_S or stepped_on):
            return
        self.pending_file = None
        if info.admitted_by == "saved-folder":
            # a checkpoint folder the job saved into and trained on past: judged whole now, on the file system
            # thread, by its completion files and formats (no settle time)
            def judged(found: object, error: BaseException | None) -> None:
                if isinstance(found, checkpoints.CheckpointInfo):
                    self.taken(found)

            self.port.submit(self.disk.saved_folder, info, self.wall(), sup.world_size(), self.peers.parts_mode(),
                             apply=judged)
            self._pump(sup, now)
            return
        self.taken(info, now)

    def taken(self, info: checkpoints.CheckpointInfo, now: float | None = None) -> None:
        """A save of the job taken as a checkpoint: this run's newest, to the plan."""
        sup = self._link()
        self.latest_reported = info
        log.info("the job saved %s (%s, %s)", info.path, step_text(info.step), format_size(info.size_bytes))
        if sup is not None:
            self._check_node(sup)
        self.seen(sup, info, now)

    def scan_found(self, found: scans.ScanFound) -> None:
        """A scan's answer, once the output folder took it in (``folder.Folder``): saves under a temporary name, now
        under their own, are taken; a complete checkpoint newer than the job reported becomes ``CheckpointSeen``."""
        for followed in found.followed:
            self.taken(followed)
        newest = found.found
        if newest is not None and (self.latest_reported is None or (newest.step or -1) > (self.latest_reported.step
                                                                                          or -1)):
            self.reports.awaiting.pop(str(newest.path), None)  # complete by its layout (every rank's part is there)
            self.estimator.observe_size(newest.size_bytes)
            self.seen(self._link(), newest)

    def seen(self, sup: JobLink | None, info: checkpoints.CheckpointInfo, now: float | None = None, *,
             requested: bool | None = None) -> None:
        """``CheckpointSeen(info, requested=...)`` to the plan; ``info`` is checked for a rewrite by the scans from
        now on."""
        if self.peers.holds(info, requested):
            return  # many nodes: to the plan once node 0 put its part of that step (``peers.Peers.holds``)
        self.to_plan(sup, info, now, requested)

    def to_plan(self, sup: JobLink | None, info: checkpoints.CheckpointInfo, now: float | None,
                requested: bool | None) -> None:
        """``info`` to the plan now (``finite`` False: the agent saw a tensor of it that is not finite)."""
        self._known(info)
        bad = self.not_finite
        finite = False if bad and (str(info.path) in bad or any(str(info.folder / rel) in bad for rel in info.files)) \
            else None
        self._feed(sup, CheckpointSeen(info, requested=requested, finite=finite), now)

    def on_checkpoint_saved(self, sup: JobLink, message: Message) -> None:
        """The job reported a finished save (``checkpoint_saved``, with the sender's ``rank``): its path is checked
        and described on the file system thread (``scans.Disk.reported``), the answer handled when it comes."""
        asked, parts = dict(message), self.peers.parts_mode()
        if parts and self.peers.node_rank != 0:
            asked["zero"] = True  # the world's process zero is on node 0: this node's ranks describe their part
        self.port.submit(functools.partial(self.disk.reported, parts=parts, world_size=sup.world_size()), asked,
                         self._output_dir(), apply=lambda seen, error: self._reported(asked, seen, error))
        self._pump(sup, self.clock())

    def _reported(self, message: Message, seen: object, error: BaseException | None) -> None:
        """``on_checkpoint_saved``'s answer from the file system thread."""
        sup = self._link()
        if not isinstance(seen, scans.ReportSeen):
            log.warning("cannot look at the checkpoint the job reported (%s): %r", message.get("path"), error)
            return
        if self.reports.heard(message, seen, self.estimator) and sup is not None:
            self.complete_reports(sup)

    def complete_reports(self, sup: JobLink) -> None:
        """Hand ``complete`` the reported checkpoints whose every rank's part is reported, oldest first
        (``reported.Reported.complete``)."""
        def each(path: str, info: checkpoints.CheckpointInfo, requested: bool | None, several: bool) -> None:
            if several:
                # described at the world's process zero's report: the other ranks' files came after it (rank 1's
                # rng_state_1.pth), so the folder is described again (on the file system thread) now that every
                # part is there; answers come back in order, so the checkpoints still reach the plan oldest first
                self.port.submit(self.disk.describe, path, info.step, self.peers.parts_mode(), sup.world_size(),
                                 apply=self._described(requested))
            else:
                self._complete(info, requested)

        self.reports.complete(sup, each)

    def _described(self, requested: bool | None) -> Answer:
        """The answer handler of a reported checkpoint described again once every rank's part is in."""
        def apply(value: object, error: BaseException | None) -> None:
            if not isinstance(value, checkpoints.CheckpointInfo):
                log.warning("cannot describe the checkpoint every rank reported: %s",
                            error.message if isinstance(error, GuardError) else repr(error))
                return
            self._complete(value, requested)
        return apply

    def _complete(self, info: checkpoints.CheckpointInfo, requested: bool | None) -> None:
        """A reported checkpoint whose every rank's part is in, described: to the plan (``requested``: it answered
        the guard's request, the world's process zero's word)."""
        sup = self._link()
        newest = self.latest_reported
        if newest is None or (info.step or -1) >= (newest.step or -1):
            self.latest_reported = info
        if sup is not None:
            self._check_node(sup)
        self.seen(sup, info, requested=requested)
