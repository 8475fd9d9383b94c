"""The supervisor's end of the agent channel (``guard.protocol``): a Unix ``SOCK_SEQPACKET`` socket in a private
folder, and one connection per agent.

Reads are non-blocking and bounded per wake-up (output and timers get their turn); sends use ``MSG_DONTWAIT``
and drop a command an agent cannot take, so a dead or silent agent never blocks the supervisor.
"""

from __future__ import annotations

import os
import selectors
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard import protocol

__all__ = ["AgentChannel", "AgentConn", "job_env"]

MAX_MESSAGES_PER_READ = 256


def job_env(environ: Mapping[str, str], sock_path: str, *, sanity_steps: int, check_every: int,
            grace_s: float) -> dict[str, str]:
    """The job's environment: ``environ`` with the agent's start-up folder first on ``PYTHONPATH`` (its
    ``sitecustomize``), the socket path and the agent's settings (``guard.protocol`` names them).

    Not ``PYTHONUNBUFFERED``: the agent flushes a Python job's stdout every 0.1 s instead (``guard.inside.agent``).
    torchrun waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds (default 30) between its SIGTERM and SIGKILL to the
    workers (torch/distributed/run.py, ``--shutdown-timeout``): it is fitted to ``grace_s`` unless set.
    """
    env = dict(environ)
    site_dir = str(Path(__file__).resolve().parent.parent / "inside" / "_site")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site_dir, env.get("PYTHONPATH", "")) if p)
    env[protocol.ENV_SOCKET] = sock_path
    env[protocol.ENV_SANITY_STEPS] = str(sanity_steps)
    env[protocol.ENV_CHECK_EVERY] = str(check_every)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(max(1, int(grace_s))))
    return env


@dataclass
class AgentConn:
    """One agent's connection and what its ``hello`` said (pid, rank, local_rank, world_size, node_rank)."""

    sock: socket.socket
    info: dict[str, Any] = field(default_factory=dict)


class AgentChannel:
    """Listening socket and connections, registered with the supervisor's selector.

    Args:
        selector: the event loop's selector; the listener is registered with data ``"listen"``, connections
            with ``"agent"``.
    """

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._sel = selector
        self.conns: dict[int, AgentConn] = {}
        self._listener: socket.socket | None = None
        self._tmpdir: str | None = None

    def open(self) -> str:
        """Create the socket in a new private folder (mode 0700); returns its path (``GUARD_AGENT_SOCKET``)."""
        self._tmpdir = tempfile.mkdtemp(prefix="guard-")
        path = os.path.join(self._tmpdir, "agent.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(path)
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        return path

    def accept(self) -> None:
        """Accept every pending connection."""
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:  # BlockingIOError included: nothing more pending
                return
            sock.setblocking(False)
            self.conns[sock.fileno()] = AgentConn(sock)
            self._sel.register(sock, selectors.EVENT_READ, "agent")

    def receive(self, fd: int) -> Iterator[tuple[AgentConn, dict[str, Any]]]:
        """The messages waiting on one connection (at most 256); a closed connection is dropped."""
        conn = self.conns.get(fd)
        if conn is None:
            return
        for _ in range(MAX_MESSAGES_PER_READ):
            try:
                data = conn.sock.recv(protocol.MAX_MESSAGE_BYTES)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._sel.unregister(conn.sock)
                conn.sock.close()
                del self.conns[fd]
                return
            message = protocol.decode(data)
            if message is not None:
                yield conn, message

    def send(self, fd: int, message: dict[str, Any]) -> bool:
        """Send a command to one agent without blocking (False: dropped, its socket is full or closed)."""
        conn = self.conns.get(fd)
        if conn is None:
            return False
        try:
            conn.sock.send(protocol.encode(message), socket.MSG_DONTWAIT)
            return True
        except OSError:
            return False

    def broadcast(self, message: dict[str, Any]) -> int:
        """Send a command to every connected agent; returns how many got it."""
        return sum(self.send(fd, message) for fd in list(self.conns))

    def close(self) -> None:
        """Close every connection and the listener; remove the private folder."""
        for conn in list(self.conns.values()):
            conn.sock.close()
        self.conns.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
