"""Which rank's failure caused the others': a rank killed by a signal, a lost peer, a collective timeout's late rank.

In a job of many ranks one failure shows up everywhere: a rank killed by SIGKILL (the kernel's OOM killer, a lost
node, a user's kill; skypilot #1410) leaves its peers with "Connection reset by peer" or "Connection closed by
peer" in their next collective, and a rank that is late to a collective leaves the others with a timeout naming
no one (open-r1 #620). The launcher says which rank died of what (torchrun's failure summary: ``rank : R``,
``exitcode : -9``, read by ``guard.run.output``); the agents say which ranks were there (``hello``) and what each
raised. Plain functions over ``JobFacts``.
"""

from __future__ import annotations

import signal

from guard.contract import signal_name
from guard.core.state import JobFacts

__all__ = ["PEER_LOST", "TIMED_OUT", "is_peer_lost", "is_timeout", "late_ranks", "peer_hint", "signal_hint",
           "signalled_rank", "timeout_hint"]

#: What a rank raises when a peer went away (gloo ``pair.cc``, NCCL, the TCP store).
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited",
             "Connection refused", "NCCL communicator was aborted", "ProcessGroupNCCL is aborted",
             "failed to recv, got 0 bytes", "Socket closed")
#: What a rank raises when a collective did not complete in time (gloo, NCCL's watchdog, the store).
TIMED_OUT = ("Timed out waiting", "collective operation timeout", "Watchdog caught collective operation timeout",
             "timed out after", "Socket Timeout", "DistStoreError: Timed out")
#: Signals that the launcher itself sends to the other ranks once one failed: a rank ended by one of these is
#: named only when no rank died of another signal.
_TEARDOWN = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def is_peer_lost(text: str | None) -> bool:
    """``text`` (an exception's ``Type: message``) says a peer went away."""
    return bool(text) and any(marker in str(text) for marker in PEER_LOST)


def is_timeout(text: str | None) -> bool:
    """``text`` says a collective (or the store) timed out."""
    return bool(text) and any(marker in str(text) for marker in TIMED_OUT)


def signalled_rank(facts: JobFacts) -> tuple[int, int] | None:
    """The rank that died of a signal in torchrun's failure summary and its signal number, or None.

    A signal other than SIGTERM/SIGINT/SIGHUP (SIGKILL, SIGSEGV, SIGBUS ...) names its rank whatever else failed.
    torchrun itself sends SIGTERM to the other ranks once one failed, and lists them under ``Failures:``: a rank
    ended by one of those is named only when no rank exited with an error of its own (then the root cause, the
    entry printed last, is the one)."""
    killed = [(rank, -code) for rank, code in facts.rank_exits.items() if code < 0]
    hard = [(rank, signum) for rank, signum in killed if signum not in _TEARDOWN]
    if hard:
        return hard[0]
    if not killed or any(code > 0 for code in facts.rank_exits.values()):
        return None
    return killed[-1]


def late_ranks(facts: JobFacts) -> list[int]:
    """The ranks seen on this node that raised no collective timeout nor lost a peer while some rank did: the late
    ones (still computing, hung, or dead without a word). Empty when every rank seen here waited."""
    waited = {rank for rank, text in facts.rank_exceptions.items() if is_timeout(text) or is_peer_lost(text)}
    return sorted(facts.ranks_seen - waited) if waited else []


def signal_hint(rank: int, signum: int, node: int | None) -> str:
    """The hint of a rank killed by a signal nobody in the job sent."""
    where = f" on node {node}" if node is not None else ""
    return (f"rank {rank}{where} died of {signal_name(signum)}, sent by no process of the job (the kernel's OOM "
            "killer, a lost node, the scheduler or a user's kill): the other ranks' errors (a connection reset, a "
            "collective timeout) follow from it; check the platform's events and the kernel log (dmesg) of that "
            "node, then resume")


def peer_hint(rank: int, text: str) -> str:
    """The hint of a rank that failed because a peer went away (its own error is a consequence)."""
    return (f"rank {rank} lost its connection to another rank ({text[:200]}): a consequence, not the cause; the "
            "cause is another rank's failure: on another node when the launcher's summary here names no other, "
            "and that node's VERDICT names it (reason=killed or crash with rank=); a node lost whole, its guard too, "
            "leaves none: its scheduler's or platform's events say why")


def timeout_hint(rank: int, text: str, late: list[int]) -> str:
    """The hint of a collective timeout: the rank that waited is named as the witness, the late ranks as the cause."""
    if late:
        names = ", ".join(map(str, late))
        return (f"a collective timed out on rank {rank} ({text[:200]}) waiting for rank{'s' if len(late) > 1 else ''}"
                f" {names}, which never reached it: see what rank {late[0]} was doing (its last output, its stack "
                "in the log); a rank that is slower for good (uneven data, a save on one rank only) needs the same "
                "work on every rank, or a longer timeout (init_process_group(timeout=...))")
    return (f"a collective timed out on rank {rank} ({text[:200]}), as on every rank of this node: the late rank is "
            "on another node; its node's log shows what it was doing")
