"""The checkpoints the job's ranks reported (``checkpoint_saved``), and which ranks' parts of each are in.

A reported checkpoint reaches the plan only once every rank expected to save a part of it reported that part
(:meth:`Reported.missing`); until then it waits here, with the reason a scan gives for not taking it either
(:meth:`Reported.waiting`). ``guard.secure.securing.Securing`` hands every report's answer from the file system
thread to :meth:`Reported.heard` and takes the complete ones from :meth:`Reported.complete`, oldest first. Plain
state on the loop: no I/O here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from guard.core.durations import format_size, step_text
from guard.core.state import Message
from guard.secure import budget, checkpoints, scans
from guard.secure.link import JobLink

__all__ = ["Reported"]

log = logging.getLogger("guard.secure")


class Reported:
    """The ranks' reports of their saves, kept on the loop.

    Attributes:
        saved_ranks: checkpoint path -> the ranks that reported their part of it.
        saving_ranks: the ranks that reported their parts of earlier complete checkpoints.
        awaiting: checkpoint path -> its description, for those reported by some ranks, not yet by every one
            (None: the world's process zero has not reported it yet).
        paths: the folders every rank said it finished: no mtime rule for them (the scans' ``reported``).
    """

    def __init__(self) -> None:
        self.saved_ranks: dict[str, set[int]] = {}
        self.saving_ranks: set[int] = set()
        self.awaiting: dict[str, checkpoints.CheckpointInfo | None] = {}
        self._awaiting_logged: set[tuple[str, str]] = set()
        self._requested: dict[str, bool | None] = {}  # path -> the save answered the guard's request (rank 0's word)
        self.paths: set[str] = set()
        self._save_logged = False

    def heard(self, message: Message, seen: scans.ReportSeen, estimator: budget.MarginEstimator) -> bool:
        """A report's answer from the file system thread (``scans.Disk.reported``, the path checked): the sender's
        part noted and, from the world's process zero, the checkpoint's description (its size to ``estimator``).
        Returns whether the reports may have completed a checkpoint (False: nothing was taken from this one)."""
        if seen.path is None:
            refused = seen.refused
            if refused is not None:
                log.warning("%s (hint: %s)", refused.message, refused.hint)
            return False
        path = seen.path
        rank = message.get("rank")
        parts = self.saved_ranks.setdefault(path, set())
        if rank is not None:
            parts.add(int(rank))
        if message.get("zero", True):
            saved = seen.info
            if saved is None:
                if seen.describe_error is not None:
                    log.warning("%s", seen.describe_error.message)
                return False
            if message.get("save_s"):
                estimator.observe_save(float(message["save_s"]), saved.size_bytes)
            else:
                estimator.observe_size(saved.size_bytes)
            self.awaiting[path] = saved
            requested = message.get("requested")
            self._requested[path] = requested if isinstance(requested, bool) else None
            # The first save at INFO; later ones are counted in the heartbeat (``saves=``), their detail at DEBUG.
            first, self._save_logged = not self._save_logged, True
            log.log(logging.INFO if first else logging.DEBUG, "checkpoint saved by the job: %s (%s, %s)%s",
                    saved.path, step_text(saved.step), format_size(saved.size_bytes),
                    "; later saves are counted in the heartbeat" if first else "")
        elif path not in self.awaiting and path not in self.paths:
            self.awaiting[path] = None  # the world's process zero reports the checkpoint itself
        return True

    def missing(self, sup: JobLink, path: str, info: checkpoints.CheckpointInfo) -> list[int]:
        """The ranks whose part of the reported checkpoint ``path`` is not reported yet.

        Expected are the ranks that reported their parts of earlier complete checkpoints; before the first one,
        every training rank, except one that trained on past the save's step without reporting it (a loop whose
        rank 0 alone saves and reports). One rank alone expects nothing more.
        """
        parts = self.saved_ranks.get(path, set())
        if self.saving_ranks:
            return sorted(self.saving_ranks - parts) if len(self.saving_ranks | parts) > 1 else []
        expected = sup.training_ranks() | parts
        if len(expected) <= 1:
            return []
        steps = sup.rank_steps()
        return sorted(r for r in expected - parts if info.step is None or steps.get(r, -1) <= info.step)

    def _waiting_reason(self, sup: JobLink, path: str, info: checkpoints.CheckpointInfo | None) -> str:
        missing = self.missing(sup, path, info) if info is not None else []
        if not missing:
            return "waiting for the report of the world's process zero"
        return f"waiting for rank(s) {','.join(map(str, missing))} to report their part"

    def waiting(self, sup: JobLink | None) -> tuple[tuple[str, str], ...]:
        """Each waiting checkpoint's path with what it waits for (a scan's ``waiting``); none without the loop."""
        if sup is None:
            return ()
        return tuple((path, self._waiting_reason(sup, path, info)) for path, info in self.awaiting.items())

    def complete(self, sup: JobLink,
                 each: Callable[[str, checkpoints.CheckpointInfo, bool | None, bool], None]) -> None:
        """Hand ``each`` the reported checkpoints whose every rank's part is reported, oldest first, as
        ``(path, info, requested, several)`` (``requested``: it answered the guard's request, the world's process
        zero's word; ``several``: more than one rank reported a part of it); a waiting one older than a complete one
        is dropped (the newer one is secured)."""
        done: list[tuple[str, checkpoints.CheckpointInfo]] = []
        for path, info in self.awaiting.items():
            if info is None:
                continue  # its description (the world's process zero's report) is still to come
            missing = self.missing(sup, path, info)
            if not missing:
                done.append((path, info))
            elif (path, str(missing)) not in self._awaiting_logged:
                self._awaiting_logged.add((path, str(missing)))
                log.info("checkpoint %s (%s): waiting for rank(s) %s to report their part; not pushed before",
                         path, step_text(info.step), ",".join(map(str, missing)))
        for path, info in sorted(done, key=lambda item: item[1].step if item[1].step is not None else -1):
            del self.awaiting[path]
            self.saving_ranks |= self.saved_ranks.get(path, set())
            self.paths.add(path)
            requested = self._requested.pop(path, None)
            each(path, info, requested, len(self.saved_ranks.get(path, ())) > 1)
        if done:
            step = max((info.step or -1) for _, info in done)
            for path, waiting in list(self.awaiting.items()):
                if waiting is not None and (waiting.step or -1) < step:
                    log.info("checkpoint %s: a newer one is complete; its missing parts are no longer waited for",
                             path)
                    del self.awaiting[path]
