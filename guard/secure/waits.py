"""The output folder's scans as the loop asks for them, and the hooks' work that waits for a fresh one.

Scans run on the file system thread (``guard.secure.scans``), one in flight at most (the first may be stuck in
``stat()`` on a hung mount): a scan asked for meanwhile follows it. A failure and the job's end act on what a scan
started after them found, so their work waits (:meth:`ScanWaits.hold`) until that scan answered, or ``FS_WAIT_S`` at
most and never past ``secure_by``, then goes on without it. ``guard.secure.securing.Securing`` holds one
``ScanWaits``; it starts each scan and handles its answer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from guard.secure import checkpoints, scans
from guard.secure.link import JobLink

__all__ = ["FS_WAIT_S", "ScanWaits"]

log = logging.getLogger("guard.secure")

FS_WAIT_S = 5.0  # how long a failure or the job's end waits for a fresh scan of the output folder (a hung mount)

#: A hook's work that waited: called with the loop (None when no hook gave one yet) and the clock's now.
Then = Callable[[JobLink | None, float], None]


@dataclass
class _Hold:
    """A hook's work that waits for the answer of scan number ``after``, or until ``until`` (clock seconds)."""

    after: int
    until: float
    what: str
    then: Then
    settle_at: float | None = None  # then a fresh scan is asked for (the job's last files settled), and waited for
    final: bool = False


class ScanWaits:
    """The scans' numbers and the holds waiting for them, on the loop.

    Args:
        port: the file system thread's port (its answers are handed back by :meth:`pump`).
        start: ``(number, final, stable_for_s) -> None``: submit scan ``number`` of the output folder (its answer
            handler calls :meth:`answered`, then :meth:`follow_up`).
        output_dir: ``() -> str | None``: the output folder now (no scan without one).
        link: ``() -> JobLink | None``: the loop, as the last hook got it (for the holds' work).
    """

    def __init__(self, port: scans.Port, start: Callable[[int, bool, float], None],
                 output_dir: Callable[[], str | None], link: Callable[[], JobLink | None]) -> None:
        self.port = port
        self._start, self._output_dir, self._link = start, output_dir, link
        self.in_flight = False
        self._rescan: bool | None = None  # a scan is wanted once the one in flight returns (True: a final one)
        self._asked = self._done = 0
        self.holds: list[_Hold] = []
        self._pumping = False

    def request(self, *, final: bool = False, stable_for_s: float = checkpoints.STABLE_FOR_S) -> int:
        """Scan the output folder on the file system thread unless a scan is in flight (then one follows it);
        returns the number of the scan whose answer is fresh."""
        if not self._output_dir():
            return self._done
        if self.in_flight:
            self._rescan = bool(self._rescan) or final
            return self._asked + 1
        self._asked += 1
        number = self._asked
        self.in_flight = True
        self._start(number, final, stable_for_s)
        return number

    def answered(self, number: int) -> None:
        """Scan ``number`` answered (first thing in its answer's handler)."""
        self.in_flight = False
        self._done = number

    def follow_up(self) -> None:
        """The scan asked for while one was in flight, now (last thing in a scan answer's handler)."""
        if self._rescan is not None:
            final, self._rescan = self._rescan, None
            self.request(final=final)

    def hold(self, what: str, then: Then, now: float, secure_by: Callable[[], float], *, final: bool = False,
             settle_at: float | None = None, stable_for_s: float = checkpoints.STABLE_FOR_S) -> None:
        """Run ``then`` once a scan started from now answered, or ``FS_WAIT_S`` from now (before ``secure_by``);
        with ``settle_at`` (clock seconds), once a second scan asked for at that time answered too. ``what``: the
        work, for the log when the scan does not answer; ``secure_by``: the plan's, once the scan is asked for. The
        caller pumps next."""
        after = self.request(final=final, stable_for_s=stable_for_s)
        # FS_WAIT_S at most in all, the settle scan's wait included (a hung mount answers neither)
        self.holds.append(_Hold(after, min(now + FS_WAIT_S, max(now, secure_by())), what, then,
                                settle_at=settle_at, final=final))

    def pump(self, now: float) -> None:
        """Hand back the file system calls that finished (in order), then the holds whose scan answered or whose
        wait is over. Never waits."""
        if self._pumping:
            return  # an answer's own events: the loop outside goes on draining
        self._pumping = True
        try:
            self.port.drain()
            self._release(self._link(), now)
        finally:
            self._pumping = False

    def _release(self, sup: JobLink | None, now: float) -> None:
        while self.holds:
            hold = self.holds[0]
            answered = self._done >= hold.after
            if hold.settle_at is not None and now < hold.until:
                if now < hold.settle_at:
                    return
                self.holds[0] = dataclasses.replace(hold, after=self.request(final=hold.final), settle_at=None)
                continue
            if not answered and now < hold.until:
                return
            self.holds.pop(0)
            if not answered:
                log.warning("the output folder %s did not answer within %.0fs (a hung file system?): %s without "
                            "its scan", self._output_dir(), FS_WAIT_S, hold.what)
            hold.then(sup, now)

    def due_at(self) -> float | None:
        """When the first hold has work (its settle time, else the end of its wait), or None without one."""
        if not self.holds:
            return None
        hold = self.holds[0]
        return hold.until if hold.settle_at is None else hold.settle_at
