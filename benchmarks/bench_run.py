"""What the guard costs a supervised run, measured in one run of this script and reported as ratios.

1. ``step``: per-step overhead of the in-job agent on a tiny CPU training loop (~7-10 ms steps,
   ``jobs/train_loop.py``), gated: each of ``--runs`` runs starts a plain and a guarded job together, both pinned to
   one core, and their loops take turns of ``SEGMENT_STEPS`` steps (``jobs/gate.py``; which goes first alternates),
   the guard process and this one on the other core. The two then see the machine at the same speed within tens
   of milliseconds, where back-to-back runs saw it move by 10-40 %. A job's time is its turns' loop time plus the
   CPU its process used while it waited (the agent's threads); the ratio is the median of the runs' ratios.
   Target: ratio <= 1.02, and the job's CPU time per step <= 1.01. Diagnostic: the agent's hook alone timed in one
   process (fastest of alternating blocks of tiny ``.backward()`` calls with and without it).
2. ``lines``: output passthrough of 1M lines written with ``print()`` (``jobs/print_lines.py``), stdout to a file
   in both cases. The streaming alone is gated as the step is (turns of ``SEGMENT_LINES`` lines, each ending with a
   flush); each side's fixed start-up and shut-down is measured with 0 lines, and the whole ratio is the streaming
   time plus that fixed time, guard over plain. Whole runs back to back are shown beside it, with the guard's own
   CPU time, and the plain job with ``PYTHONUNBUFFERED=1`` (what the guard avoids). Target: whole <= 1.25,
   streaming <= 1.05.
3. ``first_line``: time added before the job's first output line: from just before the process is started to
   the first line read on its stdout pipe, guard minus plain (medians). Target: <= +0.15 s. Preflight is left out
   (``--no-preflight``, when the guard has it).
4. ``rss``: the guard process's own peak resident memory (``VmHWM`` of ``/proc/PID/status``, sampled every
   20 ms while it runs; the job is a separate process and does not count), the largest over every guarded run
   above. Target: <= 30 MB (10^6 bytes).
5. ``startup``: start-up of a job that imports torch (``jobs/torch_first_line.py``) to its first output line,
   ``python -m guard`` with preflight on (its default: the import check included) over plain ``python``, medians
   of ``--startup-runs``. Target: ratio <= 1.5.

Every guarded run must end with exit 0 and a ``VERDICT: PASS`` line, and the step benchmark checks that the guard
saw the sanity pass (so the agent's hook was really on); otherwise the script stops with an error.

Run: ``python benchmarks/bench_run.py [--runs 9] [--steps 300] [--lines 1000000] [--only step,lines,...] [--json]``
``--profile lines|first_line|step`` runs that benchmark's guarded command once under ``cProfile`` and prints the
top functions (where the guard process spends its time) instead of the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
JOBS = Path(__file__).resolve().parent / "jobs"
BENCHMARKS = ("step", "lines", "first_line", "rss", "startup")
#: step: wall ratio (and the job's CPU time per step, ratio ``step_cpu``); lines: the whole wall ratio (and the
#: streaming alone, without the fixed start-up and shut-down, ``lines_streaming``); first_line: seconds added;
#: rss: bytes; startup: ratio of the time to the first line of a job that imports torch, preflight on.
TARGETS = {"step": 1.02, "step_cpu": 1.01, "lines": 1.25, "lines_streaming": 1.05, "first_line": 0.15, "rss": 30e6,
           "startup": 1.5}
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def base_env() -> dict[str, str]:
    """The environment of every run: no ``GUARD_*`` from the shell, no network, the repo importable.

    ``PYTHONUNBUFFERED`` is dropped (the plain job runs as a user's would; the guard sets it for its job itself)
    and so is ``PYTHONDONTWRITEBYTECODE``, so that imports use cached bytecode as an installed package does
    (``__pycache__`` is git-ignored).
    """
    dropped = ("PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_") and k not in dropped}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.update({"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"})
    return env


def guard_argv() -> list[str]:
    """``python -m guard``, with ``--no-preflight`` when this version of the guard has it."""
    help_text = subprocess.run([sys.executable, "-m", "guard", "--help"], capture_output=True, text=True,
                               env=base_env(), cwd=REPO).stdout
    return [sys.executable, "-m", "guard"] + (["--no-preflight"] if "--no-preflight" in help_text else [])


class HwmSampler(threading.Thread):
    """Reads ``VmHWM`` (peak resident set, kB) of one process every ``every_s`` until it exits."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.path = f"/proc/{pid}/status"
        self.every_s = every_s
        self.peak_bytes = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            self.read()
            self._done.wait(self.every_s)

    def read(self) -> None:
        try:
            with open(self.path) as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        self.peak_bytes = max(self.peak_bytes, int(line.split()[1]) * 1024)
                        return
        except (OSError, ValueError):
            pass

    def stop(self) -> int:
        self._done.set()
        self.join()
        return self.peak_bytes


@dataclass
class Run:
    argv: list[str]
    returncode: int
    wall_s: float
    stdout: str = ""
    stderr: str = ""
    peak_rss_bytes: int = 0
    own_cpu_s: float = 0.0  # the process's own CPU time (user + system), its children's not included


def run(argv: list[str], *, env: dict[str, str], stdout_path: Path | None = None, sample_rss: bool = False) -> Run:
    """Run one command to its end; stdout to ``stdout_path`` (a file) or captured, stderr to a temporary file."""
    with tempfile.TemporaryFile() as err, (open(stdout_path, "wb") if stdout_path else tempfile.TemporaryFile()) as out:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, cwd=REPO)
        sampler = HwmSampler(proc.pid) if sample_rss else None
        if sampler:
            sampler.start()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: its /proc entry still there
        wall_s = time.perf_counter() - started
        own_cpu_s = _own_cpu_s(proc.pid)
        proc.wait()
        peak = sampler.stop() if sampler else 0
        err.seek(0)
        stderr = err.read().decode("utf-8", "replace")
        stdout = ""
        if stdout_path is None:
            out.seek(0)
            stdout = out.read().decode("utf-8", "replace")
    return Run(argv, proc.returncode, wall_s, stdout, stderr, peak, own_cpu_s)


def _own_cpu_s(pid: int) -> float:
    """utime + stime of an exited, not yet reaped process (``/proc/PID/stat`` fields 14 and 15): the guard's own
    CPU time, robust to other load on the machine (the job's is in fields 16-17, as a reaped child's)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def check_guarded(result: Run, what: str) -> None:
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    verdict = lines[-1] if lines else ""
    if result.returncode != 0 or not verdict.startswith("VERDICT: PASS"):
        sys.exit(f"bench_run: the guarded {what} run failed (exit {result.returncode}, last stdout line "
                 f"{verdict!r}):\n{result.stderr[-3000:]}")


@dataclass
class Results:
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    rss_peaks: dict[str, int] = field(default_factory=dict)


def order(i: int) -> tuple[str, str]:
    """Alternate which variant goes first: plain, guard, guard, plain, plain, guard, ..."""
    return ("plain", "guard") if i % 2 == 0 else ("guard", "plain")


# ---------------------------------------------------------------------------------------------------------------
# The benchmarks
# ---------------------------------------------------------------------------------------------------------------

_LOOP = re.compile(r"bench: steps=(\d+) loop_s=([0-9.]+) cpu_s=([0-9.]+) wait_cpu_s=([0-9.]+)")
#: Steps per turn of the gated step benchmark: ~70 ms at this loop's 7 ms steps, short against the seconds over
#: which this machine's speed moves, long against a turn's hand-over (a Unix-socket round trip, ~0.1 ms).
SEGMENT_STEPS = 10
#: Lines per turn of the gated streaming benchmark: ~70 ms of ``print()`` here, 100 pipe-fulls (64 KiB) of output.
SEGMENT_LINES = 100_000


@dataclass
class GatedPair:
    """One gated run: per job (``plain``, ``guard``), each turn's wall and CPU seconds, the CPU its process used
    while it waited for its turns, and the guard process's peak RSS."""

    seg_s: dict[str, list[float]]
    seg_cpu_s: dict[str, list[float]]
    wait_cpu_s: dict[str, float]
    peak_rss_bytes: int

    def charged_s(self, label: str) -> float:
        """The job's measured wall time plus what its process used while it waited (charged to its work)."""
        return sum(self.seg_s[label]) + self.wait_cpu_s[label]

    def charged_cpu_s(self, label: str) -> float:
        return sum(self.seg_cpu_s[label]) + self.wait_cpu_s[label]

    def ratio(self) -> float:
        return self.charged_s("guard") / self.charged_s("plain")

    def cpu_ratio(self) -> float:
        return self.charged_cpu_s("guard") / self.charged_cpu_s("plain")

    def turn_ratios(self) -> list[float]:
        return [g / p for p, g in zip(self.seg_s["plain"], self.seg_s["guard"], strict=True)]


#: Reads what a gated job left (label, exit code, stdout file, stderr file) and returns its ``wait_cpu_s``; exits
#: the script with the reason when the job failed.
Finish = Callable[[str, int, Path, Path], float]


def gated_pair(argvs: dict[str, list[str]], turns: int, cpu: int, others: set[int], tmp: Path,
               finish: Finish) -> GatedPair:
    """A plain and a guarded job (``argvs["plain"]``, ``argvs["guard"]``, each given ``--gate PATH --label LABEL
    --cpu CPU``) started together, both pinned to ``cpu``, their measured work run in ``turns`` turns (which goes
    first alternates turn by turn): the two see the machine at the same speed within tens of milliseconds. The
    guard process and this one run on ``others`` (the other cores; ``{cpu}`` on a one-core machine), so that
    neither's wake-ups land in one job's turns and not the other's. stdout of each goes to a file in ``tmp``."""
    path = str(tmp / "gate.sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(2)
    server.settimeout(180)
    outs = {label: tmp / f"{label}.out" for label in argvs}
    errs = {label: tmp / f"{label}.err" for label in argvs}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for label, argv in argvs.items():
        with open(outs[label], "wb") as out, open(errs[label], "wb") as err:
            procs[label] = subprocess.Popen([*argv, "--gate", path, "--label", label, "--cpu", str(cpu)],
                                            stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=base_env(),
                                            cwd=REPO)
        with contextlib.suppress(OSError):  # the guard process (and this one) off the jobs' core, when there is one
            os.sched_setaffinity(procs[label].pid, others)
    sampler = HwmSampler(procs["guard"].pid)
    sampler.start()
    conns: dict[str, tuple[socket.socket, Any]] = {}
    seg_s: dict[str, list[float]] = {"plain": [], "guard": []}
    seg_cpu_s: dict[str, list[float]] = {"plain": [], "guard": []}
    try:
        while len(conns) < 2:
            conn, _ = server.accept()
            conn.settimeout(180)
            reader = conn.makefile("r")
            label = reader.readline().split()[1]
            conns[label] = (conn, reader)
        for turn in range(turns):
            for label in order(turn):
                conn, reader = conns[label]
                conn.sendall(b"g")
                _, wall, cpu_s = reader.readline().split()
                seg_s[label].append(float(wall))
                seg_cpu_s[label].append(float(cpu_s))
        for conn, _ in conns.values():
            conn.sendall(b"q")
    except (OSError, ValueError, IndexError) as exc:
        for proc in procs.values():
            proc.kill()
        sys.exit(f"bench_run: the gated run failed ({exc!r}):\n"
                 + "\n".join(_read(errs[label])[-2000:] for label in errs))
    finally:
        server.close()
        for conn, reader in conns.values():
            reader.close()
            conn.close()
    wait_cpu_s = {}
    for label, proc in procs.items():
        proc.wait(timeout=180)
        wait_cpu_s[label] = finish(label, proc.returncode, outs[label], errs[label])
    return GatedPair(seg_s, seg_cpu_s, wait_cpu_s, sampler.stop())


def gated_runs(runs: int, one: Callable[[int, set[int], Path], GatedPair]) -> list[GatedPair]:
    """``runs`` gated runs, the jobs' core changing run by run, this process on the other cores meanwhile."""
    allowed = os.sched_getaffinity(0)
    cpus = sorted(allowed)
    pairs = []
    try:
        for i in range(runs):
            cpu = cpus[i % len(cpus)]
            others = (allowed - {cpu}) or {cpu}
            os.sched_setaffinity(0, others)
            with tempfile.TemporaryDirectory(prefix="bench-gate-") as folder:
                pairs.append(one(cpu, others, Path(folder)))
    finally:
        os.sched_setaffinity(0, allowed)
    return pairs


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", "replace")


def _finish_loop(label: str, returncode: int, out: Path, err: Path) -> float:
    stdout, stderr = _read(out), _read(err)
    if label == "guard":
        check_guarded(Run([], returncode, 0, stdout, stderr), "train_loop")
        if "sanity pass" not in stderr:
            sys.exit("bench_run: the guard did not see the training loop's losses (no sanity pass):\n"
                     + stderr[-3000:])
    match = _LOOP.search(stdout)
    if returncode != 0 or match is None:
        sys.exit(f"bench_run: train_loop ({label}) printed no loop time:\n{stderr[-3000:]}")
    return float(match.group(4))


def bench_step(res: Results, guard: list[str], runs: int, steps: int) -> None:
    job = [str(JOBS / "train_loop.py"), "--steps", str(steps), "--segment-steps", str(SEGMENT_STEPS)]
    argvs = {"plain": [sys.executable, *job],
             "guard": [*guard, "--sanity-steps", "5", "--check-every", "10", *job]}
    turns = -(-steps // SEGMENT_STEPS)
    pairs = gated_runs(runs, lambda cpu, others, tmp: gated_pair(argvs, turns, cpu, others, tmp, _finish_loop))
    ratios = [p.ratio() for p in pairs]
    cpu_ratios = [p.cpu_ratio() for p in pairs]
    ratio, cpu_ratio = statistics.median(ratios), statistics.median(cpu_ratios)
    plain = statistics.median(p.charged_s("plain") for p in pairs)
    guarded = statistics.median(p.charged_s("guard") for p in pairs)
    turn_ratios = [r for pair in pairs for r in pair.turn_ratios()]
    agent_wait_ms = statistics.median(p.wait_cpu_s["guard"] for p in pairs) * 1000
    hook_us, backward_us = hook_cost_us()
    res.rows["step"] = {
        "what": f"per-step time, CPU loop ({steps} steps, in turns of {SEGMENT_STEPS})",
        "plain": f"{steps / plain:.1f} steps/s ({plain / steps * 1000:.2f} ms)",
        "guard": f"{steps / guarded:.1f} steps/s ({guarded / steps * 1000:.2f} ms)",
        "value": ratio, "shown": f"ratio {ratio:.3f} (CPU {cpu_ratio:.3f})",
        "target": "<= 1.02 (CPU <= 1.01)",
        "ok": ratio <= TARGETS["step"] and cpu_ratio <= TARGETS["step_cpu"],
        "samples": {"ratios": ratios, "cpu_ratios": cpu_ratios,
                    "seg_s": [p.seg_s for p in pairs], "wait_cpu_s": [p.wait_cpu_s for p in pairs]},
        "diagnostic": f"median of {runs} runs, each a plain and a guarded job on one core taking turns every "
                      f"{SEGMENT_STEPS} steps; the runs' wall ratios {min(ratios):.3f}-{max(ratios):.3f}, CPU "
                      f"{min(cpu_ratios):.3f}-{max(cpu_ratios):.3f}; single turns {min(turn_ratios):.2f}-"
                      f"{max(turn_ratios):.2f} (median {statistics.median(turn_ratios):.3f}); the guarded job's "
                      f"process used {agent_wait_ms:.1f} ms of CPU while it waited for its turns (its agent's "
                      "threads), counted in its time; "
                      f"the agent's hook alone, timed in one process: +{hook_us:.1f} µs per .backward() "
                      f"(a bare tiny backward: {backward_us:.1f} µs), {hook_us / (plain / steps * 1e6) * 100:.2f} % "
                      "of a step of this loop",
    }
    res.rss_peaks["step"] = max(p.peak_rss_bytes for p in pairs)


HOOK_COST = r"""
import time, torch
from guard.inside.agent import _core as agent_module
from guard.inside.agent import Agent, _torch
from guard.run.config import AgentSettings
torch.set_num_threads(1)
agent_module._AGENT = Agent(AgentSettings(socket_path=None, sanity_steps=5, check_every=10))
original = torch.Tensor.backward
_torch.patch(torch)
wrapped = torch.Tensor.backward
w = torch.ones(1, requires_grad=True)
best = {"plain": float("inf"), "hooked": float("inf")}
for block in range(14):
    name = "plain" if block % 2 == 0 else "hooked"
    torch.Tensor.backward = original if name == "plain" else wrapped
    started = time.process_time()
    for _ in range(3000):
        (w * 2.0).sum().backward()
    best[name] = min(best[name], (time.process_time() - started) / 3000)
print(f"hook_us={(best['hooked'] - best['plain']) * 1e6:.2f} backward_us={best['plain'] * 1e6:.2f}")
"""


def hook_cost_us() -> tuple[float, float]:
    """The agent's added CPU time per ``.backward()`` (µs), timed in one process: the fastest of 7 blocks of
    3000 tiny backward calls with and without the hook, alternating (robust to other load on the machine)."""
    out = subprocess.run([sys.executable, "-c", HOOK_COST], capture_output=True, text=True, env=base_env(),
                         cwd=REPO, check=True).stdout
    match = re.search(r"hook_us=(-?[0-9.]+) backward_us=([0-9.]+)", out)
    assert match is not None, out
    return float(match.group(1)), float(match.group(2))


_WAIT = re.compile(r"bench: wait_cpu_s=([0-9.]+)")


def _lines_finisher(lines: int) -> Finish:
    def finish(label: str, returncode: int, out: Path, err: Path) -> float:
        text, stderr = out.read_bytes(), _read(err)
        expected = lines + (1 if label == "guard" else 0)  # the VERDICT line
        written = text.count(b"\n")
        if returncode != 0 or written != expected:
            sys.exit(f"bench_run: print_lines ({label}) wrote {written} lines, not {expected} "
                     f"(exit {returncode}):\n{stderr[-3000:]}")
        if label == "guard":
            check_guarded(Run([], returncode, 0, text[-500:].decode(), stderr), "print_lines")
        match = _WAIT.search(stderr)
        if match is None:
            sys.exit(f"bench_run: print_lines ({label}) printed no wait time:\n{stderr[-3000:]}")
        return float(match.group(1))
    return finish


def bench_lines(res: Results, guard: list[str], runs: int, lines: int, tmp: Path) -> None:
    job = [str(JOBS / "print_lines.py"), "--lines", str(lines)]
    # The streaming alone, gated: both jobs on one core taking turns of SEGMENT_LINES lines, the guard process on
    # the other core (as it is whenever the machine has a core to spare).
    gated_job = [*job, "--segment-lines", str(SEGMENT_LINES)]
    argvs = {"plain": [sys.executable, *gated_job], "guard": [*guard, *gated_job]}
    turns = -(-lines // SEGMENT_LINES)
    finish = _lines_finisher(lines)
    pairs = gated_runs(runs, lambda cpu, others, tmp_run: gated_pair(argvs, turns, cpu, others, tmp_run, finish))
    streaming = statistics.median(p.ratio() for p in pairs)
    stream_s = {label: statistics.median(p.charged_s(label) for p in pairs) for label in ("plain", "guard")}
    # Whole runs back to back (which goes first alternates), and the same jobs with 0 lines: each side's fixed
    # start-up and shut-down, which the first-line benchmark also measures on its own.
    out = tmp / "lines.out"
    wall: dict[str, list[float]] = {"plain": [], "guard": [], "plain_empty": [], "guard_empty": [],
                                    "plain_unbuffered": []}
    guard_cpu: dict[str, list[float]] = {"lines": [], "empty": []}  # the guard process's own CPU time
    empty = [str(JOBS / "print_lines.py"), "--lines", "0"]
    peak = max(p.peak_rss_bytes for p in pairs)
    for i in range(runs):
        for variant in order(i):
            argv = [sys.executable, *job] if variant == "plain" else [*guard, *job]
            result = run(argv, env=base_env(), stdout_path=out, sample_rss=variant == "guard")
            expected = lines + (1 if variant == "guard" else 0)  # the VERDICT line
            text = out.read_bytes()
            written = text.count(b"\n")
            if result.returncode != 0 or written != expected:
                sys.exit(f"bench_run: print_lines ({variant}) wrote {written} lines, not {expected} "
                         f"(exit {result.returncode}):\n{result.stderr[-3000:]}")
            wall[variant].append(result.wall_s)
            empty_run = run([*argv[:-len(job)], *empty], env=base_env(), stdout_path=out)
            wall[f"{variant}_empty"].append(empty_run.wall_s)
            if variant == "guard":
                check_guarded(Run([], result.returncode, 0, text[-500:].decode()), "print_lines")
                check_guarded(Run([], empty_run.returncode, 0, _read(out)), "print_lines (0 lines)")
                peak = max(peak, result.peak_rss_bytes)
                guard_cpu["lines"].append(result.own_cpu_s)
                guard_cpu["empty"].append(empty_run.own_cpu_s)
        if i < 3:  # what the guard avoids; slow (seconds), so a few runs
            unbuffered = {**base_env(), "PYTHONUNBUFFERED": "1"}
            wall["plain_unbuffered"].append(run([sys.executable, *job], env=unbuffered, stdout_path=out).wall_s)
    plain_empty, guard_empty = statistics.median(wall["plain_empty"]), statistics.median(wall["guard_empty"])
    whole = (stream_s["guard"] + guard_empty) / (stream_s["plain"] + plain_empty)
    back_to_back = [g / p for p, g in zip(wall["plain"], wall["guard"], strict=True)]
    unbuffered_s = statistics.median(wall["plain_unbuffered"])
    plain = statistics.median(wall["plain"])
    cpu_lines, cpu_empty = statistics.median(guard_cpu["lines"]), statistics.median(guard_cpu["empty"])
    turn_ratios = [r for pair in pairs for r in pair.turn_ratios()]
    res.rows["lines"] = {
        "what": f"output passthrough, {lines:,} lines to a file (wall)",
        "plain": f"{stream_s['plain'] + plain_empty:.2f} s", "guard": f"{stream_s['guard'] + guard_empty:.2f} s",
        "value": whole, "shown": f"ratio {whole:.2f} (streaming {streaming:.3f})",
        "target": "<= 1.25 (streaming <= 1.05)",
        "ok": whole <= TARGETS["lines"] and streaming <= TARGETS["lines_streaming"],
        "samples": {**wall, "guard_cpu_s": guard_cpu, "streaming_ratios": [p.ratio() for p in pairs],
                    "stream_s": [{label: p.charged_s(label) for label in ("plain", "guard")} for p in pairs]},
        "diagnostic": f"streaming: median of {runs} runs, each a plain and a guarded job on one core writing in "
                      f"turns of {SEGMENT_LINES:,} lines (the guard process on the other core); the runs' ratios "
                      f"{min(p.ratio() for p in pairs):.3f}-{max(p.ratio() for p in pairs):.3f}, single turns "
                      f"{min(turn_ratios):.2f}-{max(turn_ratios):.2f}; whole = streaming time plus each side's "
                      f"start-up and shut-down alone (0 lines, median of {runs}: plain {plain_empty:.3f} s, guard "
                      f"{guard_empty:.3f} s); the same whole runs back to back (plain median {plain:.2f} s): pair "
                      f"ratios {min(back_to_back):.2f}-{max(back_to_back):.2f}, median "
                      f"{statistics.median(back_to_back):.2f}; the guard process's own CPU time (median): "
                      f"{cpu_lines:.2f} s with the lines, {cpu_empty:.2f} s with none, so "
                      f"{(cpu_lines - cpu_empty) / max(lines, 1) * 1e9:.0f} ns a line; for comparison a plain job with "
                      f"PYTHONUNBUFFERED=1 (what the guard avoids): {unbuffered_s:.2f} s, ratio "
                      f"{unbuffered_s / plain:.2f}",
    }
    res.rss_peaks["lines"] = peak


def first_line_s(argv: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env=base_env(), cwd=REPO)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    took_s = time.perf_counter() - started
    proc.stdout.read()
    proc.wait()
    if not line.startswith(b"ready") or proc.returncode != 0:
        sys.exit(f"bench_run: first_line run failed: first line {line!r}, exit {proc.returncode}")
    return took_s


def bench_first_line(res: Results, guard: list[str], runs: int) -> None:
    job = str(JOBS / "first_line.py")
    took: dict[str, list[float]] = {"plain": [], "guard": []}
    first_line_s([sys.executable, job]), first_line_s([*guard, job])  # warm-up (bytecode, page cache): not timed
    for i in range(runs):
        for variant in order(i):
            took[variant].append(first_line_s([sys.executable, job] if variant == "plain" else [*guard, job]))
    plain, guarded = statistics.median(took["plain"]), statistics.median(took["guard"])
    res.rows["first_line"] = {
        "what": "time to the job's first output line",
        "plain": f"{plain:.3f} s", "guard": f"{guarded:.3f} s",
        "value": guarded - plain, "shown": f"+{guarded - plain:.3f} s", "target": "<= +0.15 s",
        "ok": guarded - plain <= TARGETS["first_line"], "samples": took,
    }


def bench_startup(res: Results, runs: int) -> None:
    """Start-up of a job that imports torch (``jobs/torch_first_line.py``) to its first output line: ``python -m
    guard`` with preflight on, as by default (the import check included), over plain ``python``; medians."""
    job = str(JOBS / "torch_first_line.py")
    took: dict[str, list[float]] = {"plain": [], "guard": []}
    guarded_argv = [sys.executable, "-m", "guard", job]
    first_line_s([sys.executable, job]), first_line_s(guarded_argv)  # warm-up (bytecode, page cache): not timed
    for i in range(runs):
        for variant in order(i):
            took[variant].append(first_line_s([sys.executable, job] if variant == "plain" else guarded_argv))
    plain, guarded = statistics.median(took["plain"]), statistics.median(took["guard"])
    res.rows["startup"] = {
        "what": "start-up of an `import torch` job to its first line, preflight on",
        "plain": f"{plain:.2f} s", "guard": f"{guarded:.2f} s",
        "value": guarded / plain, "shown": f"ratio {guarded / plain:.2f}", "target": "<= 1.5",
        "ok": guarded / plain <= TARGETS["startup"], "samples": took,
    }


def rss_row(res: Results) -> None:
    if not res.rss_peaks:
        return
    worst = max(res.rss_peaks, key=lambda k: res.rss_peaks[k])
    peak = res.rss_peaks[worst]
    res.rows["rss"] = {
        "what": "guard process peak RSS (VmHWM)",
        "plain": "-", "guard": ", ".join(f"{k}: {v / 1e6:.1f} MB" for k, v in res.rss_peaks.items()),
        "value": peak, "shown": f"{peak / 1e6:.1f} MB", "target": "<= 30 MB", "ok": peak <= TARGETS["rss"],
        "samples": res.rss_peaks,
    }


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    try:
        import torch  # only for its version

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
        "torch": torch_version, "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def markdown(res: Results, info: dict[str, Any]) -> str:
    lines = [f"Measured {info['date']} on {info['cpus']} CPUs, Python {info['python']}, torch {info['torch']} "
             f"({info['platform']}); load average (1 min) {info['load_before']} before, {info['load_avg_1m']} "
             "after.", "",
             "| # | benchmark | plain `python` | `python -m guard` | result | target | met |",
             "|---|---|---|---|---|---|---|"]
    for i, key in enumerate(BENCHMARKS, start=1):
        row = res.rows.get(key)
        if row:
            lines.append(f"| {i} | {row['what']} | {row['plain']} | {row['guard']} | {row['shown']} | "
                         f"{row['target']} | {'yes' if row['ok'] else '**no**'} |")
    for row in res.rows.values():
        if row.get("diagnostic"):
            lines.append(f"\n{row['what']}: {row['diagnostic']}")
    return "\n".join(lines)


def profile(which: str, guard: list[str], steps: int, lines: int, tmp: Path) -> None:
    import pstats

    job = {"lines": [str(JOBS / "print_lines.py"), "--lines", str(lines)],
           "first_line": [str(JOBS / "first_line.py")],
           "step": [str(JOBS / "train_loop.py"), "--steps", str(steps)]}[which]
    prof = tmp / "guard.prof"
    argv = [sys.executable, "-m", "cProfile", "-o", str(prof), *guard[1:], *job]
    result = run(argv, env=base_env(), stdout_path=tmp / "profile.out")
    print(f"guarded {which}: exit {result.returncode}, wall {result.wall_s:.2f} s (under cProfile)")
    stats = pstats.Stats(str(prof))
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(25)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="runs of each variant (default 9)")
    parser.add_argument("--first-line-runs", type=int, default=9, help="runs for the first-line benchmark")
    parser.add_argument("--startup-runs", type=int, default=5, help="runs for the start-up benchmark (default 5)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run (default 300)")
    parser.add_argument("--lines", type=int, default=1_000_000, help="lines for the passthrough (default 1M)")
    parser.add_argument("--only", default=",".join(BENCHMARKS), help="comma list of: " + ", ".join(BENCHMARKS))
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of Markdown")
    parser.add_argument("--profile", choices=("lines", "first_line", "step"),
                        help="profile the guard process of one benchmark with cProfile instead")
    args = parser.parse_args(argv)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    unknown = only - set(BENCHMARKS)
    if unknown:
        parser.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}")
    guard = guard_argv()
    load_before = round(os.getloadavg()[0], 2)
    res = Results()
    with tempfile.TemporaryDirectory(prefix="bench-run-") as folder:
        tmp = Path(folder)
        if args.profile:
            profile(args.profile, guard, args.steps, args.lines, tmp)
            return 0
        if "step" in only:
            bench_step(res, guard, args.runs, args.steps)
        if "lines" in only:
            bench_lines(res, guard, args.runs, args.lines, tmp)
        if "first_line" in only:
            bench_first_line(res, guard, args.first_line_runs)
        if "rss" in only and not res.rss_peaks:  # rss alone: sample one guarded run of each heavy job
            bench_step(res, guard, 1, args.steps)
            bench_lines(res, guard, 1, args.lines, tmp)
            res.rows.pop("step"), res.rows.pop("lines")
        if "rss" in only:
            rss_row(res)
        if "startup" in only:
            bench_startup(res, args.startup_runs)
    info = {**machine(), "load_before": load_before}
    if args.json:
        print(json.dumps({"machine": info, "guard_argv": guard[1:], "results": res.rows}, indent=2, default=str))
    else:
        print(markdown(res, info))
    return 0 if all(row["ok"] for row in res.rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
