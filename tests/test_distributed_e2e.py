"""End to end: torchrun with 2 ranks on the CPU (gloo), two "nodes" on localhost, and the guard as PID 1."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import JOBS, GuardRun, guard_env, kill_quietly, loaded_s, pid_alive, run_guard, signal_when, start_guard

pytestmark = [pytest.mark.slow]

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
FAST = ["--no-preflight", "--grace", "8s"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nan_on_rank_1_stops_every_rank(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    run = run_guard([*FAST, "--", TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOBS / "ddp_loop.py"),
                     "--nan-rank", "1", "--nan-at", "3", "--pid-dir", str(pids)], timeout_s=120)
    assert run.returncode == 4, run.stderr[-3000:]
    fields = run.fields()
    assert (fields["reason"], fields["rank"], fields["step"]) == ("non_finite_loss", "1", "3")
    ranks = [int(p.read_text()) for p in pids.iterdir()]
    assert len(ranks) == 2 and not any(pid_alive(pid) for pid in ranks)


def test_one_rank_blocked_outside_a_collective_is_named(tmp_path: Path) -> None:
    # --stall-timeout 20s: at load average 5 on 2 cores, the two ranks took more than 6 s to import torch and join
    # the process group, which a 6 s stall timeout called a hang of rank 0 before any step.
    run = run_guard([*FAST, "--grace", "3s", "--stall-timeout", loaded_s(10), "--check-every", "2", "--", TORCHRUN,
                     "--standalone", "--nproc-per-node", "2", str(JOBS / "ddp_loop.py"), "--block-rank", "1",
                     "--block-at", "12", "--step-s", "0.05"], timeout_s=120)
    assert run.returncode == 5, run.stderr[-3000:]
    assert run.fields()["rank"] == "1"
    assert "stacks of pid" in run.stderr and "(rank 1)" in run.stderr


def test_two_nodes_on_localhost_run_the_smoke_together_then_train_and_secure_the_last_save(tmp_path: Path) -> None:
    # preflight on (the default): each node's guard runs the launch smoke on the job's own rendezvous port, the two
    # form one world, and the job then rendezvouses on that port too
    port = free_port()
    runs = []
    for node in (0, 1):
        out = tmp_path / f"out{node}"
        runs.append(start_guard(["--grace", "8s", "--launch-smoke-timeout", "90s", "--push-to", str(tmp_path / "dest"),
                                 "--output-dir", str(out), "--",
                                 TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                                 "--master-addr", "127.0.0.1", "--master-port", str(port), str(JOBS / "ddp_trainer.py"),
                                 "--output-dir", str(out), "--step-s", "0", "--max-steps", "6"]))
    results = []
    try:
        for proc in runs:
            try:
                stdout, stderr = proc.communicate(timeout=150)
            except subprocess.TimeoutExpired:  # what each node's guard was doing goes with the failure
                for each in runs:
                    kill_quietly(each)
                ends = [each.communicate()[1][-2500:] if each.returncode is None else ""
                        for each in runs]
                pytest.fail(f"node {runs.index(proc)}'s guard did not end within 150 s:\n" + "\n---\n".join(ends))
            results.append((proc.returncode, stdout.strip().splitlines()[-1], stderr))
    finally:
        for proc in runs:
            kill_quietly(proc)
    (rc0, verdict0, err0), (rc1, verdict1, err1) = results
    assert rc0 == 0 and rc1 == 0, (err0 + err1)[-3000:]
    for node, err in enumerate((err0, err1)):
        smoke = err.index(f"launch smoke: world of 2 formed (gloo), all_reduce ok, rank {node} on this node of world 2")
        assert smoke < err.index("job started")
    # the Trainer's last save (checkpoint-6) has a part on each node's disk (node 1's: rng_state_1.pth): node 1's
    # guard learns node 0's run id through the job's store (6 steps: before, it looked once, before rank 0 had put
    # it, and its part went under its own run id), waits for node 0's part and puts its own; node 0 pushes the model
    assert "node=0" in verdict0 and f"pushed={tmp_path / 'dest'}" in verdict0
    assert "node=1" in verdict1 and f"pushed={tmp_path / 'dest' / 'last-checkpoint'}" in verdict1, err1[-3000:]
    assert "through the job's store" in err1 and "guard of node 0 pushes the final model" in err1
    record = tmp_path / "dest" / "last-checkpoint"
    assert {"rng_state_0.pth", "rng_state_1.pth", "model.safetensors"} <= {p.name for p in record.iterdir()}
    assert (tmp_path / "dest" / "model.safetensors").exists()


def _unshare_works() -> str | None:
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    try:
        done = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare failed: {exc}"
    return None if done.returncode == 0 else f"unshare --pid is not permitted here: {done.stderr.decode()[:200]}"


def test_guard_as_pid_1_reaps_orphans_and_secures_on_sigterm(tmp_path: Path) -> None:
    why = _unshare_works()
    if why:
        pytest.skip(why)
    out, dest, report = tmp_path / "out", tmp_path / "dest", tmp_path / "report.json"
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "guard",
                             *FAST, "--report", str(report), "--push-to", str(dest), "--output-dir", str(out),
                             str(JOBS / "orphans.py"), "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=guard_env())
    try:
        deadline = time.monotonic() + 60
        guard_pid = None
        while time.monotonic() < deadline and not (out / "checkpoint-10").exists():
            time.sleep(0.2)
        for child in psutil.Process(proc.pid).children(recursive=True):
            if "guard" in " ".join(child.cmdline()):
                guard_pid = child.pid
                break
        assert guard_pid is not None
        os.kill(guard_pid, signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        kill_quietly(proc)
    assert "INTERRUPTED reason=signal exit=75" in stdout, stderr[-3000:]
    data = json.loads(report.read_text())
    assert data["details"].get("orphans_reaped", 0) >= 3
    assert (dest / "last-checkpoint" / "weights.bin").exists()


def test_protect_reruns_a_script_under_the_guard(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(JOBS / "protected.py"), "--flag", "x"], capture_output=True, text=True,
                          env=guard_env(), timeout=60)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert last.startswith("VERDICT: FAIL reason=non_finite_loss exit=4") and "step=2" in last
    assert "step 1 argv=['--flag', 'x']" in proc.stdout
    assert proc.stdout.count("VERDICT:") == 1


def test_two_nodes_at_the_deadline_save_at_one_step_and_secure_it_together(tmp_path: Path) -> None:
    port = free_port()
    dest = tmp_path / "dest"
    runs = []
    timeout = loaded_s(35, start_s=20)  # one deadline for both nodes
    for node in (0, 1):
        out = tmp_path / f"out{node}"
        # the start-up part of the budget stretched with the load (two torchrun nodes and a DDP Trainer start on 2
        # cores; at load average ~4 node 0 once had no time left to secure: the full run of 03:43 UTC)
        # one run id for both nodes, as the guard asks when the launcher gives none: node 0's checkpoint-N lacks
        # rng_state_1.pth (on node 1's disk), so it is secured as the nodes' parts, which meet under one run id
        runs.append(start_guard([*FAST, "--grace", "20s", "--timeout", timeout, "--margin", "12s", "--push-to",
                                 str(dest), "--output-dir", str(out), "--run-id", "two-nodes", "--", TORCHRUN,
                                 "--nnodes", "2", "--node-rank",
                                 str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port",
                                 str(port), str(JOBS / "ddp_trainer.py"), "--output-dir", str(out), "--step-s",
                                 "0.05"]))
    results = []
    try:
        for proc in runs:
            stdout, stderr = proc.communicate(timeout=150)
            results.append((proc.returncode, stdout, stderr))
    finally:
        for proc in runs:
            kill_quietly(proc)
    (rc0, out0, err0), (_rc1, out1, err1) = results
    verdict0, verdict1 = out0.strip().splitlines()[-1], out1.strip().splitlines()[-1]
    assert rc0 == 75, (err0 + err1)[-4000:]
    assert "TIMEOUT reason=deadline" in verdict0 and "node=0" in verdict0 and "secured=yes" in verdict0
    assert "TIMEOUT reason=deadline" in verdict1 and "node=1" in verdict1 and "secured=yes" in verdict1
    saves = re.findall(r"rank (\d): saved at step (\d+)", out0 + out1)
    steps = {rank: int(step) for rank, step in saves}
    assert set(steps) == {"0", "1"} and steps["0"] == steps["1"], saves
    state = json.loads((dest / "last-checkpoint" / "trainer_state.json").read_text())
    assert state["global_step"] == steps["0"]
    assert (dest / "last-checkpoint" / "rng_state_1.pth").is_file()  # node 1's part, from node 1's disk


def test_a_rank_stopped_while_the_other_trains_on_is_stalled(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    # The stall timeout also covers the two ranks' silent start (torch imports, the process group: before the first
    # step the guard counts output, and there is none). The load can rise after the start, when the stretch was
    # computed: in a run of the suite at load 5, a 19 s timeout came while both ranks were still importing torch.
    stall = loaded_s(25)
    proc = start_guard([*FAST, "--stall-timeout", stall, "--", TORCHRUN, "--standalone", "--nproc-per-node", "2",
                        str(JOBS / "ddp_loop.py"), "--independent", "--step-s", "0.05", "--pid-dir", str(pids)])
    stopped = None
    try:
        deadline = time.monotonic() + 90
        seen = ""
        while "sanity pass" not in seen and time.monotonic() < deadline:
            seen += proc.stderr.readline()
        while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # both ranks have stepped
        assert proc.poll() is None, seen
        stopped = int((pids / "rank1.pid").read_text())
        try:
            os.kill(stopped, signal.SIGSTOP)
        except ProcessLookupError:
            kill_quietly(proc)
            out, err = proc.communicate(timeout=30)
            raise AssertionError(f"rank 1 (pid {stopped}) is gone:\n{seen}{err[:3000]}{out}") from None
        started = time.monotonic()
        stdout, stderr = proc.communicate(timeout=float(stall.removesuffix("s")) + 90)  # the stall, then the stop
    finally:
        kill_quietly(proc)
        if stopped is not None and pid_alive(stopped):
            os.kill(stopped, signal.SIGKILL)
    verdict = [line for line in stdout.splitlines() if line.startswith("VERDICT:")][-1]
    assert verdict.startswith("VERDICT: FAIL reason=stalled exit=5 "), (seen + stderr)[-3000:]
    assert " rank=1" in verdict
    fields = GuardRun(proc.returncode, stdout, stderr).fields()
    assert "rank 1 gave no stack when asked" in fields["hint"]  # SIGSTOP: it cannot answer the dump
    assert "main thread waits in" not in fields["hint"]  # rank 0's stack is not quoted as rank 1's
    # the stall timeout, then the stack dump and the stop (the whole took 62.6 s in a run at load 5-6)
    assert time.monotonic() - started < float(stall.removesuffix("s")) + 45
    assert "rank 1: no training step for" in stderr


def test_sigterm_while_rank_1_writes_its_part_never_pushes_that_checkpoint(tmp_path: Path) -> None:
    # issue 18: under torchrun the guard pushed checkpoint-N while rank 1 was still writing rng_state_1.pth (rank
    # 0's trainer_state.json was there). Rank 1 writes its part of checkpoint-40 30 s late, past --grace: the guard
    # secures the previous complete checkpoint (20), every rank's part in it, and never pushes checkpoint-40.
    out, dest, ready = tmp_path / "out", tmp_path / "dest", tmp_path / "ready"
    proc = start_guard([*FAST, "--push-to", str(dest), "--", TORCHRUN, "--standalone", "--nproc-per-node", "2",
                        str(JOBS / "ddp_trainer.py"), "--output-dir", str(out), "--step-s", "0.05",
                        "--save-steps", "20", "--slow-part", "40", "--slow-part-s", "30", "--ready", str(ready)])
    stdout, stderr = signal_when(proc, ready, signal.SIGTERM, settle_s=3.0, wait_s=120.0, timeout_s=90.0)
    assert "rank 1: writing its part of checkpoint-40" in stdout, stderr[-3000:]
    assert "rank 1: its part of checkpoint-40 written" not in stdout  # SIGTERM came while rank 1 was writing it
    assert f"securing {out / 'checkpoint-40'}" not in stderr, stderr[-3000:]
    assert "waiting for rank(s) 1 to report their part" in stderr
    secured = dest / "last-checkpoint"
    assert json.loads((secured / "trainer_state.json").read_text())["global_step"] == 20, stderr[-3000:]
    assert (secured / "rng_state_0.pth").exists() and (secured / "rng_state_1.pth").exists()
    assert "secured=yes" in stdout and proc.returncode == 75


def test_a_distributed_checkpoint_of_two_ranks_is_secured_whole_and_resumed(tmp_path: Path) -> None:
    # torch.distributed.checkpoint under torchrun (2 ranks, gloo): OUT/step_N holds one .distcp shard per rank and
    # the coordinator's .metadata, written last; the guard secures the set whole, and the next run on a fresh
    # machine (--resume on) gets it back where the job looks, loads it with dcp.load and trains on from step N
    first, second, dest = tmp_path / "machine1", tmp_path / "machine2", tmp_path / "dest"
    first.mkdir()
    second.mkdir()
    ready = tmp_path / "ready"
    proc = start_guard([*FAST, "--push-to", str(dest), "--output-dir", "out", "--", TORCHRUN, "--standalone",
                        "--nproc-per-node", "2", str(JOBS / "dcp_loop.py"), "out", "--every", "10",
                        "--ready", str(ready), "--ready-step", "30"], cwd=first)
    stdout, stderr = signal_when(proc, ready, signal.SIGTERM, settle_s=1.0, wait_s=120.0, timeout_s=60.0)
    assert proc.returncode == 75 and "secured=yes" in stdout, stderr[-3000:]
    secured = dest / "last-checkpoint"
    manifest = json.loads((secured / "guard_manifest.json").read_text())
    step = int(manifest["step"])
    assert step >= 30 and manifest["place"] == f"step_{step}", manifest
    assert sorted(p.name for p in secured.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                         "guard_manifest.json"]
    run = run_guard([*FAST, "--resume", "on", "--push-to", str(dest), "--output-dir", "out", "--", TORCHRUN,
                     "--standalone", "--nproc-per-node", "2", str(JOBS / "dcp_loop.py"), "out", "--every", "10",
                     "--steps", str(step + 15)], cwd=second, timeout_s=120)
    assert f"rank 0: resumed from step {step}" in run.stdout, run.stderr[-3000:]
    assert f"rank 1: resumed from step {step}" in run.stdout
    assert f"step {step + 15} loss" in run.stdout and run.returncode == 0, run.stderr[-3000:]


def test_sigterm_while_rank_1_writes_its_part_waits_for_it_and_every_rank_saves_at_one_step(tmp_path: Path) -> None:
    # the same, rank 1's part 4 s late, well inside --grace 25s: checkpoint-40 is pushed only after rank 1 reported
    # its part, and what is secured holds every rank's part; the save the SIGTERM asked for is made by every rank at
    # one step (a rank that went on training would save at another), and that step is what is secured
    out, dest, ready = tmp_path / "out", tmp_path / "dest", tmp_path / "ready"
    proc = start_guard([*FAST, "--grace", "25s", "--push-to", str(dest), "--", TORCHRUN, "--standalone",
                        "--nproc-per-node", "2", str(JOBS / "ddp_trainer.py"), "--output-dir", str(out), "--step-s",
                        "0.05", "--save-steps", "20", "--slow-part", "40", "--slow-part-s", "4", "--ready",
                        str(ready)])
    stdout, stderr = signal_when(proc, ready, signal.SIGTERM, settle_s=1.0, wait_s=120.0, timeout_s=90.0)
    assert "rank 1: its part of checkpoint-40 written" in stdout, stderr[-3000:]
    waiting = stderr.find(f"checkpoint {out / 'checkpoint-40'} (step 40): waiting for rank(s) 1")
    assert waiting >= 0, stderr[-3000:]
    pushed = stderr.find(f"securing {out / 'checkpoint-40'} ")
    assert pushed == -1 or pushed > waiting
    # every rank's part of what is secured (rank 1's file came after rank 0's report: pushed without it before), and
    # it is the save the guard asked for, newer than checkpoint-40 (before: securing ended after checkpoint-40)
    secured = dest / "last-checkpoint"
    assert (secured / "rng_state_0.pth").exists() and (secured / "rng_state_1.pth").exists(), stderr[-3000:]
    saves = [(rank, int(step)) for rank, step in re.findall(r"rank (\d): saved at step (\d+)", stdout)]
    newest = max(step for _, step in saves)
    assert {rank: step for rank, step in saves} == {"0": newest, "1": newest}, saves  # each rank's last save
    assert newest > 40 and json.loads((secured / "trainer_state.json").read_text())["global_step"] == newest
    assert "INTERRUPTED reason=signal exit=75" in stdout and "secured=yes" in stdout and proc.returncode == 75
