"""Many torchrun nodes on one machine, each under its own guard: the harness of the many-node tests.

``Nodes(tmp_path, n, job)`` starts n guards at once, each ``python -m guard [GUARD_ARGS] -- torchrun --nnodes n
--node-rank k --nproc-per-node P --master-addr 127.0.0.1 --master-port PORT JOB [JOB_ARGS]``, as ``srun
--ntasks-per-node=1`` does on a cluster. Each node runs in a folder of its own (``tmp_path/node-k``, its working
folder; ``{out}`` in the arguments is that node's output folder ``node-k/out``, or one shared ``tmp_path/shared``
with ``shared=True``): node-local disks without any privilege, as shared/reference/multinode.md checked. Every node
gets the same ``--run-id`` (``run_id=None``: none, as plain torchrun gives).

Each guard's stdout and stderr go to ``node-k/guard.out`` and ``guard.err`` (``stderr(k)`` reads it while it runs).
``wait()`` returns each node's ``NodeRun`` (exit code, output, VERDICT fields); whatever happens, nothing is left
running (each guard is a session of its own, killed as a group).
"""

from __future__ import annotations

import contextlib
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from conftest import guard_env, kill_quietly

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class NodeRun:
    """One node's guard, once it ended."""

    node: int
    returncode: int
    stdout: str
    stderr: str

    @property
    def verdict(self) -> str:
        lines = [line for line in self.stdout.splitlines() if line.startswith("VERDICT: ")]
        return lines[-1] if lines else ""

    def fields(self) -> dict[str, str]:
        if not self.verdict:
            return {}
        parts = shlex.split(self.verdict[len("VERDICT: "):])
        return {"status": parts[0], **dict(p.split("=", 1) for p in parts[1:] if "=" in p)}

    def story(self) -> tuple[str, str, str]:
        """What every node must tell alike: status, reason, exit."""
        fields = self.fields()
        return fields.get("status", ""), fields.get("reason", ""), fields.get("exit", "")


class Nodes:
    """n torchrun nodes on 127.0.0.1, each under its own guard (see the module's docstring).

    Args:
        tmp_path: the test's folder.
        n: the node count.
        job: the job's script; job_args: its arguments (``{out}``, ``{node}`` are replaced per node).
        guard_args: the guards' options (``{out}``, ``{node}`` likewise); ``--run-id`` is added.
        run_id: the ``--run-id`` every guard gets; None: none (each guard names its own, as with plain torchrun).
        procs: processes per node.
        shared: one output folder for every node instead of one each.
        env: extra environment for every guard.
        node_guard_args: more options for one node's guard (``{0: ["--margin", "25s"]}``).
        node_env: more environment for one node's guard (``{1: {"AWS_ENDPOINT_URL": ...}}``).
    """

    def __init__(self, tmp_path: Path, n: int, job: str | Path, *, job_args: Sequence[str] = (),
                 guard_args: Sequence[str] = (), procs: int = 1, shared: bool = False,
                 env: dict[str, str] | None = None, run_id: str | None = "multinode-run",
                 node_guard_args: dict[int, Sequence[str]] | None = None,
                 node_env: dict[int, dict[str, str]] | None = None) -> None:
        self.tmp_path, self.n, self.procs, self.shared = tmp_path, n, procs, shared
        self.job, self.job_args, self.guard_args = str(job), list(job_args), list(guard_args)
        self.env, self.run_id = dict(env or {}), run_id
        self.node_guard_args = {node: list(args) for node, args in (node_guard_args or {}).items()}
        self.node_env = dict(node_env or {})
        self.port = free_port()
        self.procs_started: list[subprocess.Popen[bytes]] = []

    def folder(self, node: int) -> Path:
        """Node ``node``'s own folder (its working folder)."""
        return self.tmp_path / f"node-{node}"

    def out(self, node: int) -> Path:
        """Node ``node``'s output folder."""
        return self.tmp_path / "shared" if self.shared else self.folder(node) / "out"

    def command(self, node: int) -> list[str]:
        def fill(items: Sequence[str]) -> list[str]:
            return [item.replace("{out}", str(self.out(node))).replace("{node}", str(node)) for item in items]

        return [sys.executable, "-m", "guard", *fill(self.guard_args), *fill(self.node_guard_args.get(node, [])),
                *(["--run-id", self.run_id] if self.run_id is not None else []), "--",
                TORCHRUN, "--nnodes", str(self.n), "--node-rank", str(node), "--nproc-per-node", str(self.procs),
                "--master-addr", "127.0.0.1", "--master-port", str(self.port), self.job, *fill(self.job_args)]

    def start(self) -> Nodes:
        for node in range(self.n):
            self.folder(node).mkdir(parents=True, exist_ok=True)
            self.out(node).mkdir(parents=True, exist_ok=True)
            with open(self.folder(node) / "guard.out", "wb") as out, open(self.folder(node) / "guard.err", "wb") as err:
                env = guard_env({**self.env, **self.node_env.get(node, {})})
                self.procs_started.append(subprocess.Popen(
                    self.command(node), stdout=out, stderr=err, env=env, cwd=self.folder(node),
                    start_new_session=True))
        return self

    def stderr(self, node: int) -> str:
        """What node ``node``'s guard wrote to stderr so far."""
        return (self.folder(node) / "guard.err").read_text(errors="replace")

    def lose(self, node: int) -> None:
        """Lose node ``node``: SIGKILL to its guard and every process of its job, at once."""
        import psutil

        guard = psutil.Process(self.procs_started[node].pid)
        for proc in [guard, *guard.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)

    def signal(self, node: int, signum: int = signal.SIGTERM) -> None:
        """Send ``signum`` to node ``node``'s guard."""
        self.procs_started[node].send_signal(signum)

    def wait_for(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``ready()`` or any guard ended or ``timeout_s`` passed; whether ``ready()`` came true."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if ready():
                return True
            if any(proc.poll() is not None for proc in self.procs_started):
                return ready()
            time.sleep(0.1)
        return False

    def wait(self, timeout_s: float) -> list[NodeRun]:
        """Every node's run once all ended (each killed after ``timeout_s`` at most)."""
        runs: list[NodeRun] = []
        deadline = time.monotonic() + timeout_s
        try:
            for node, proc in enumerate(self.procs_started):
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    kill_quietly(proc)
                    proc.wait(timeout=30)
                stdout = (self.folder(node) / "guard.out").read_text(errors="replace")
                runs.append(NodeRun(node, proc.returncode, stdout, self.stderr(node)))
        finally:
            self.close()
        return runs

    def close(self) -> None:
        for proc in self.procs_started:
            kill_quietly(proc)

    def __enter__(self) -> Nodes:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def pid_of(folder: Path, name: str, timeout_s: float) -> int | None:
    """The pid a job wrote to ``folder/name`` (waits up to ``timeout_s``), or None."""
    path = folder / name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text:
                return int(text)
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


def logs(runs: Sequence[NodeRun], tail: int = 3000) -> str:
    """Every node's stderr tail and VERDICT, for an assertion's message."""
    return "\n".join(f"--- node {run.node} rc={run.returncode}\n{run.stderr[-tail:]}\n{run.verdict}" for run in runs)


__all__ = ["TORCHRUN", "NodeRun", "Nodes", "free_port", "logs", "pid_of"]
