"""The launcher's command (torchrun, ``python -m torch.distributed.run``, ``accelerate launch``) and the launch smoke.

``parse_launch`` reads a job command such as ``torchrun --nnodes 2 --nproc-per-node 4 train.py --lr 1e-4`` into
its world arguments and the script it runs (read, never run), so the ``python`` and ``distributed`` rows check
``train.py`` as they would for ``python -m guard train.py``.

``run_launch_smoke`` runs the same launcher with the same world arguments on a tiny script
(``guard/preflight/_smoke_job.py``) that initialises the process group (NCCL when CUDA is there, else gloo),
all-reduces a one-hot tensor (every rank present exactly once) and checks the world size. It is bounded by
``timeout_s``; past it the smoke's whole process group is killed (``psutil``) and the row says what did not form.

Sources: torchrun's options and their defaults (``torch.distributed.run.get_args_parser``: ``--nnodes`` default
``1:1``, ``--nproc-per-node`` default 1, switches ``--standalone``, ``-m``/``--module``, ``--no-python``,
``--run-path``, ``--virtual-local-rank``; underscore spellings are aliases); ``accelerate launch`` options
(``accelerate.commands.launch.launch_command_parser``: ``--num_processes`` counts every machine's processes,
``--num_machines``, ``--machine_rank``, ``--main_process_ip``, ``--main_process_port``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from guard.core.durations import format_duration_s
from guard.preflight._common import one_line
from guard.preflight._models import CheckResult, GpuInfo
from guard.preflight.misc import gpu_fit_rows, master_rows

__all__ = ["SMOKE_SCRIPT", "LaunchCommand", "check_launch", "parse_launch", "run_launch_smoke", "smoke_wanted"]

log = logging.getLogger("guard.preflight.launch")

NAME = "distributed"

#: The script the launch smoke runs under the job's launcher (stdlib + torch only).
SMOKE_SCRIPT = Path(__file__).with_name("_smoke_job.py")

_TORCHRUN_SWITCHES = frozenset({"--standalone", "-m", "--module", "--no-python", "--run-path",
                                "--virtual-local-rank", "--use-env"})
_ACCELERATE_SWITCHES = frozenset({
    "-q", "--quiet", "--cpu", "--multi-gpu", "--tpu", "--enable-cpu-affinity", "--dynamo-use-fullgraph",
    "--dynamo-use-dynamic", "--dynamo-use-regional-compilation", "--use-deepspeed", "--use-fsdp",
    "--use-parallelism-config", "--use-megatron-lm", "--same-network", "-m", "--module", "--no-python",
    "--tpu-cluster", "--no-tpu-cluster", "--tpu-use-sudo", "--downcast-bf16", "--fp8-use-autocast-during-eval",
    "--debug"})
#: Switches that make the target something other than a script path; dropped from the smoke's command.
_TARGET_SWITCHES = frozenset({"-m", "--module", "--no-python", "--run-path"})
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def _norm(flag: str) -> str:
    return flag if not flag.startswith("--") else "--" + flag[2:].replace("_", "-")


@dataclass(frozen=True)
class LaunchCommand:
    """A job command that starts ranks through a launcher.

    Attributes:
        launcher: ``torchrun`` (also ``python -m torch.distributed.run``) or ``accelerate``.
        prefix: the command up to the launcher's own options (``("torchrun",)``, ``("accelerate", "launch")``).
        options: the launcher's options as given, in order (value tokens included).
        target: the script (or module, or program) the launcher starts.
        target_kind: ``script``, ``module`` (``-m``) or ``program`` (``--no-python``).
        script_args: the arguments after the target.
        values: option -> value, flags normalised to dashes (``--nproc-per-node``); switches map to ``""``.
    """

    launcher: str
    prefix: tuple[str, ...]
    options: tuple[str, ...]
    target: str
    target_kind: str
    script_args: tuple[str, ...]
    values: Mapping[str, str]

    @property
    def script(self) -> Path | None:
        """The Python script the ranks run, or None (a module, a program)."""
        return Path(self.target) if self.target_kind == "script" and self.target.endswith(".py") else None

    def _get(self, *flags: str) -> str | None:
        return next((self.values[f] for f in flags if f in self.values), None)

    @property
    def nodes(self) -> tuple[int, int] | None:
        """``(min, max)`` nodes (``--nnodes 2`` -> ``(2, 2)``, ``1:4`` -> ``(1, 4)``), None when unreadable."""
        text = self._get("--nnodes", "--num-machines") or "1"
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", text)
        return (int(m.group(1)), int(m.group(2) or m.group(1))) if m else None

    @property
    def procs_per_node(self) -> int | None:
        """Processes per node; None when the launcher decides (``gpu``, ``auto``, an accelerate config file)."""
        if self.launcher == "accelerate":
            total, nodes = self._get("--num-processes"), self.nodes
            if total is None or not total.strip().isdigit() or nodes is None:
                return None
            return max(1, int(total) // max(1, nodes[0]))
        text = self._get("--nproc-per-node") or "1"
        return int(text) if text.strip().isdigit() else None

    @property
    def world_size(self) -> int | None:
        """Every rank in the world when fixed (``nnodes x nproc-per-node``), else None (elastic, unknown)."""
        nodes, procs = self.nodes, self.procs_per_node
        if nodes is None or procs is None or nodes[0] != nodes[1]:
            return None
        return nodes[0] * procs

    @property
    def master(self) -> tuple[str | None, str | None]:
        """``(address, port)`` of the rendezvous: ``--master-addr``/``--master-port``, else ``--rdzv-endpoint``."""
        addr = self._get("--master-addr", "--main-process-ip")
        port = self._get("--master-port", "--main-process-port")
        endpoint = self._get("--rdzv-endpoint")
        if endpoint and not addr:
            host, _, p = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", "")
            addr, port = host or endpoint, port or p or None
        return addr, port

    def describe(self) -> str:
        """``torchrun: 2 nodes x 4 processes (world 8) running train.py``."""
        nodes, procs = self.nodes, self.procs_per_node
        node_text = "? nodes" if nodes is None else (f"{nodes[0]} node{'s' if nodes[0] != 1 else ''}"
                                                     if nodes[0] == nodes[1] else f"{nodes[0]}-{nodes[1]} nodes")
        proc_text = f"{procs} process{'es' if procs != 1 else ''}" if procs is not None else "? processes"
        world = f" (world {self.world_size})" if self.world_size is not None else ""
        return f"{self.launcher}: {node_text} x {proc_text}{world} running {self.target}"

    def smoke_command(self, script: Path, script_args: Sequence[str]) -> list[str]:
        """The same launcher and world options, running ``script`` instead of the job (no restarts for torchrun)."""
        kept: list[str] = []
        tokens = list(self.options)
        i = 0
        while i < len(tokens):
            flag = _norm(tokens[i].split("=", 1)[0])
            if flag in _TARGET_SWITCHES:
                i += 1
                continue
            kept.append(tokens[i])
            i += 1
        extra = ["--max-restarts=0"] if self.launcher == "torchrun" else []
        return [*self.prefix, *kept, *extra, str(script), *script_args]


def parse_launch(command: Sequence[str]) -> LaunchCommand | None:
    """Read a job command as a launcher command, or None when it is not one.

    Recognised: ``torchrun ...``, ``python[3[.X]] [-u ...] -m torch.distributed.run|torch.distributed.launch ...``
    and ``accelerate launch ...``.
    """
    argv = list(command)
    if not argv:
        return None
    base = os.path.basename(argv[0])
    if base == "torchrun":
        launcher, prefix, rest = "torchrun", argv[:1], argv[1:]
    elif base == "accelerate" and argv[1:2] == ["launch"]:
        launcher, prefix, rest = "accelerate", argv[:2], argv[2:]
    elif _PYTHON.match(base):
        i = 1
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
            i += 1
        if argv[i:i + 1] != ["-m"] or i + 1 >= len(argv):
            return None
        if argv[i + 1] in ("torch.distributed.run", "torch.distributed.launch"):
            launcher = "torchrun"
        elif argv[i + 1] == "accelerate.commands.launch":
            launcher = "accelerate"
        else:
            return None
        prefix, rest = argv[:i + 2], argv[i + 2:]
    else:
        return None
    switches = _TORCHRUN_SWITCHES if launcher == "torchrun" else _ACCELERATE_SWITCHES
    values: dict[str, str] = {}
    i = 0
    while i < len(rest) and rest[i].startswith("-") and rest[i] != "--":
        flag, eq, value = rest[i].partition("=")
        flag = _norm(flag)
        if eq or flag in switches:
            values[flag] = value
            i += 1
        else:
            values[flag] = rest[i + 1] if i + 1 < len(rest) else ""
            i += 2
    options = tuple(rest[:i])
    if i < len(rest) and rest[i] == "--":
        i += 1
    if i >= len(rest):
        return None
    kind = "module" if "-m" in values or "--module" in values else \
        "program" if "--no-python" in values else "script"
    return LaunchCommand(launcher, tuple(prefix), options, rest[i], kind, tuple(rest[i + 1:]), values)


def smoke_wanted(mode: str, launch: LaunchCommand | None, gpus: Sequence[GpuInfo] | None) -> tuple[bool, str]:
    """Whether ``--launch-smoke MODE`` runs for this command, and why (for the ``n/a`` row).

    ``auto`` runs it for a launcher command with more than one process or node; ``gpu``/``auto`` process counts
    are read from the visible GPUs when known.
    """
    if mode == "off":
        return False, "off by --launch-smoke off"
    if launch is None:
        return False, "not a launcher command (torchrun, python -m torch.distributed.run, accelerate launch)"
    if launch.target_kind == "program" and mode == "auto":
        return False, "the launcher runs a program (--no-python): --launch-smoke on tests the world anyway"
    if mode == "on":
        return True, "--launch-smoke on"
    nodes, procs = launch.nodes, launch.procs_per_node
    if procs is None and launch.launcher == "torchrun" and gpus is not None:
        procs = len(gpus) or None
    if procs is None and launch.launcher == "accelerate":
        return False, ("the process count is not on the command line (accelerate's config file decides): "
                       "--launch-smoke on tests it")
    if (nodes is not None and nodes[1] > 1) or procs is None or procs > 1:
        return True, "auto: more than one process or node"
    return False, "one process on one node: no world to form (--launch-smoke on runs it anyway)"


def check_launch(
    launch: LaunchCommand,
    *,
    gpus: Sequence[GpuInfo] | None,
    timeout_s: float,
    resolve: Callable[..., object],
) -> list[CheckResult]:
    """Static rows from the launcher's command: what it starts, processes against GPUs, the master resolves.

    Args:
        launch: the parsed command.
        gpus: the GPUs this node sees, None when unknown.
        timeout_s: bound of the name lookup, in seconds.
        resolve: ``socket.getaddrinfo`` or a stand-in.
    """
    rows: list[CheckResult] = []
    facts = [launch.describe()]
    procs = launch.procs_per_node
    if launch.nodes is None:
        rows.append(CheckResult(NAME, "fail", f"--nnodes {launch.values.get('--nnodes')!r} is not N or MIN:MAX",
                                "write --nnodes 2 or --nnodes 1:4"))
    if procs is not None:
        rows += gpu_fit_rows(NAME, procs, f"{procs} processes per node", gpus)
    addr, port = launch.master
    master_rows(rows, facts, NAME, addr or "", port, timeout_s=timeout_s, resolve=resolve,
                addr_label="master address", resolved_label="master", port_label="master port ",
                addr_hint="set --master-addr to the first node's host name or IP")
    if not any(row.status == "fail" for row in rows):
        rows.insert(0, CheckResult(NAME, "pass", "; ".join(facts)))
    return rows


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """SIGTERM the smoke's process group and every descendant (some may have left the group), SIGKILL leftovers."""
    import psutil

    try:
        procs = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
        if not procs:
            break
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
        pass


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(str(r) for r in ranks)


def _read_notes(folder: Path) -> list[dict[str, object]]:
    notes = []
    for path in sorted(folder.glob("rank-*.json")):
        try:
            notes.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return notes


def _tail(log_path: Path, limit: int = 240) -> str:
    try:
        lines = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return ""
    errors = [ln for ln in lines if re.search(r"Error|error:|Exception|refused|timed out", ln)]
    return one_line((errors or lines or [""])[-1], limit)


def run_launch_smoke(
    launch: LaunchCommand,
    *,
    timeout_s: float,
    environ: Mapping[str, str],
    clock: Callable[[], float] = time.monotonic,
) -> CheckResult:
    """Run the launch smoke under the job's launcher; one ``distributed`` row saying what formed.

    Args:
        launch: the job's launcher command.
        timeout_s: the smoke's time limit in seconds (``--launch-smoke-timeout``).
        environ: the job's environment, given to the launcher.
        clock: monotonic seconds.

    Returns:
        ``pass`` with the world that formed and the time taken, or ``fail`` with what did not form (ranks
        missing, no rank started, timeout, backend error).
    """
    addr, port = launch.master
    where = f" at {addr}:{port or '?'}" if addr else ""
    with tempfile.TemporaryDirectory(prefix="guard-smoke-") as tmp:
        folder = Path(tmp)
        args = ["--result-dir", str(folder), "--timeout-s", f"{timeout_s:g}"]
        if launch.world_size is not None:
            args += ["--expect-world", str(launch.world_size)]
        cmd = launch.smoke_command(SMOKE_SCRIPT, args)
        log_path = folder / "output.log"
        log.debug("launch smoke: %s", cmd)
        start = clock()
        with open(log_path, "wb") as out:
            try:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=dict(environ), start_new_session=True)
            except OSError as exc:
                return CheckResult(NAME, "fail", f"launch smoke: cannot start {cmd[0]}: {exc.strerror or exc}",
                                   "check the launcher's path inside the container")
            timed_out = False
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                code = proc.returncode
        took = clock() - start
        notes = _read_notes(folder)
        tail = _tail(log_path)
    return _smoke_row(launch, notes, timed_out=timed_out, code=code, took_s=took, timeout_s=timeout_s,
                      where=where, tail=tail)


_HINT = ("every node must run the same command at the same time; --master-addr must reach node 0 (firewall, "
         "port); NCCL_DEBUG=INFO shows backend errors; --launch-smoke off skips this check")

_NO_WORLD_HINT = ("accelerate launch starts one process on a machine without GPUs or with --cpu: use torchrun "
                  "--nproc-per-node N there, or --multi_gpu on GPUs; --launch-smoke off skips this check")


def _smoke_row(launch: LaunchCommand, notes: list[dict[str, object]], *, timed_out: bool, code: int | None,
               took_s: float, timeout_s: float, where: str, tail: str) -> CheckResult:
    took = f"{took_s:.1f}s"
    nodes = launch.nodes
    node_text = f"{nodes[0]} node{'s' if nodes[0] != 1 else ''}" if nodes and nodes[0] == nodes[1] else "the nodes"
    done = [n for n in notes if n.get("stage") == "done"]
    errors = [n for n in notes if n.get("stage") == "error"]
    if errors:
        first = errors[0]
        if first.get("no_world"):
            return CheckResult(NAME, "fail", f"launch smoke: {launch.launcher} started one plain process (no RANK, "
                               f"WORLD_SIZE), not a world of {launch.world_size} (after {took})",
                               _NO_WORLD_HINT if launch.launcher == "accelerate" else _HINT)
        return CheckResult(NAME, "fail", f"launch smoke: rank {first.get('rank')} ({first.get('backend', '?')}): "
                           f"{one_line(first.get('error'), 200)} (after {took})", _HINT)
    if done and not timed_out and code == 0:
        first = done[0]
        world = first.get("world_size")
        ranks = sorted(int(str(n.get("rank"))) for n in done)
        label = "rank" if len(ranks) == 1 else "ranks"
        mine = f"{label} {_ranks_text(ranks)} on this node of world {world}" if len(ranks) != world else \
            f"{label} {_ranks_text(ranks)}"
        return CheckResult(NAME, "pass", f"launch smoke: world of {world} formed ({first.get('backend')}), "
                           f"all_reduce ok, {mine}, in {took}")
    if timed_out:
        waiting = [n for n in notes if n.get("stage") in ("init", "started")]
        reducing = [n for n in notes if n.get("stage") == "all_reduce"]
        if not notes:
            what = (f"the rendezvous did not complete: no rank started on this node (expected {node_text}{where}): "
                    "a node missing, a wrong master address, or a firewall")
        elif reducing:
            what = (f"ranks {_ranks_text([int(str(n['rank'])) for n in reducing])} stuck in all_reduce: "
                    "a rank missing from the collective or a broken interconnect")
        else:
            what = (f"ranks {_ranks_text([int(str(n['rank'])) for n in waiting])} waiting in init_process_group"
                    f"{where}: the other ranks did not join")
        return CheckResult(NAME, "fail", f"launch smoke: no world in {format_duration_s(timeout_s)}: {what}", _HINT)
    if done:
        return CheckResult(NAME, "fail", f"launch smoke: the launcher exited {code} after the ranks finished: "
                           f"{tail or 'no output'}", _HINT)
    return CheckResult(NAME, "fail", f"launch smoke: {launch.launcher} exited {code} after {took}, no rank finished: "
                       f"{tail or 'no output'}", _HINT)
