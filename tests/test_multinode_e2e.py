"""Many nodes, each under its own guard (tests/multinode.py: torchrun nodes on 127.0.0.1, each in its own folder
or all in one): the cause of a lost rank named on its node, a signal to every node told alike, the output folder
found shared."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from conftest import JOBS
from multinode import Nodes, logs, pid_of

pytestmark = [pytest.mark.slow]

FAST = ["--no-preflight", "--grace", "8s", "--sanity-steps", "2"]


def test_a_rank_killed_on_node_1_is_the_cause_there_and_a_consequence_on_node_0(tmp_path: Path) -> None:
    nodes = Nodes(tmp_path, 2, JOBS / "ddp_loop.py", guard_args=FAST,
                  job_args=["--steps", "100000", "--step-s", "0.05", "--pid-dir", "{out}"]).start()
    try:
        pid = pid_of(nodes.out(1), "rank1.pid", timeout_s=120)
        assert pid is not None, logs(nodes.wait(5))
        nodes.wait_for(lambda: False, 3)  # both ranks step a while
        os.kill(pid, signal.SIGKILL)  # nobody in the job sent it: a lost node, the OOM killer
        runs = nodes.wait(120)
    finally:
        nodes.close()
    node0, node1 = (run.fields() for run in runs)
    assert (node1["status"], node1["reason"], node1["exit"]) == ("FAIL", "killed", "137"), logs(runs)
    assert (node1["signal"], node1["rank"], node1["node"]) == ("SIGKILL", "1", "1")
    assert "rank 1 on node 1 died of SIGKILL" in node1["hint"]
    assert node0["status"] == "FAIL" and node0["node"] == "0", logs(runs)
    assert node0["reason"] != "killed" or node0.get("rank") != "0"  # rank 0 was not killed: never blamed for it
    if node0["reason"] == "crash" and node0.get("rank") == "0":
        assert "a consequence, not the cause" in node0["hint"], logs(runs)


@pytest.mark.parametrize("n", [2, 3])
def test_sigterm_to_every_node_is_told_alike_and_a_shared_folder_is_found_shared(tmp_path: Path, n: int) -> None:
    nodes = Nodes(tmp_path, n, JOBS / "ddp_loop.py", guard_args=[*FAST, "--output-dir", "{out}"], shared=True,
                  job_args=["--steps", "100000", "--step-s", "0.05", "--pid-dir", str(tmp_path)]).start()
    try:
        assert pid_of(tmp_path, f"rank{n - 1}.pid", timeout_s=150) is not None, logs(nodes.wait(5))
        for node in range(n):  # Slurm's time limit and scancel reach every node's step
            nodes.signal(node, signal.SIGTERM)
        runs = nodes.wait(120)
    finally:
        nodes.close()
    assert {run.story() for run in runs} == {("INTERRUPTED", "signal", "143")}, logs(runs)
    assert [run.fields()["node"] for run in runs] == [str(node) for node in range(n)]
    probes = ", ".join(map(str, range(n)))
    for run in runs:
        assert f"output folder: shared: the probes of nodes {probes}" in run.stderr, logs(runs)
    assert not (tmp_path / "shared" / ".guard" / "nodes").exists()  # the probes are gone with the run


def test_a_signal_on_node_1_alone_stops_every_node_at_one_step(tmp_path: Path) -> None:
    # A spot node reclaimed: only node 1's guard gets SIGTERM. Its ranks publish a request to save one step ahead
    # and stop in the job's store; node 0's ranks adopt it and its guard handles the signal as if received.
    nodes = Nodes(tmp_path, 2, JOBS / "ddp_trainer.py", guard_args=[*FAST, "--grace", "40s"],
                  job_args=["--output-dir", "{out}", "--step-s", "0.05"]).start()
    try:
        assert nodes.wait_for(lambda: all("sanity pass" in nodes.stderr(n) for n in (0, 1)), 150), \
            logs(nodes.wait(5))
        nodes.signal(1, signal.SIGTERM)
        runs = nodes.wait(120)
    finally:
        nodes.close()
    assert {run.story() for run in runs} == {("INTERRUPTED", "signal", "143")}, logs(runs)
    assert "every rank of the job saves at step" in runs[1].stderr, logs(runs)
    assert "SIGTERM on node 1: every rank saves at step" in runs[0].stderr, logs(runs)
    saves = [re.findall(r"rank (\d): saved at step (\d+)", run.stdout) for run in runs]
    assert saves[0] and saves[1] and saves[0][-1][1] == saves[1][-1][1], saves  # one step on both nodes



def test_a_signal_on_node_0_alone_is_interrupted_on_every_node(tmp_path: Path) -> None:
    # run_clm.py on two nodes, SIGTERM to node 0's guard only: node 0 asked every rank (through the job's store) to
    # save and stop, and node 1's job stopped at that step, but node 1's guard was never told: PASS exit=0
    nodes = Nodes(tmp_path, 2, JOBS / "ddp_trainer.py",
                  guard_args=[*FAST, "--grace", "40s", "--push-to", str(tmp_path / "dest")],
                  job_args=["--output-dir", "{out}", "--step-s", "0.05", "--save-steps", "10"]).start()
    try:
        assert nodes.wait_for(lambda: all("sanity pass" in nodes.stderr(n) for n in (0, 1)), 150), \
            logs(nodes.wait(5))
        nodes.signal(0, signal.SIGTERM)
        runs = nodes.wait(120)
    finally:
        nodes.close()
    assert [run.story()[:2] for run in runs] == [("INTERRUPTED", "signal")] * 2, logs(runs)
    assert "SIGTERM on node 0: every rank saves at step" in runs[1].stderr, logs(runs)
    saves = [re.findall(r"rank (\d): saved at step (\d+)", run.stdout) for run in runs]
    assert saves[0] and saves[1] and saves[0][-1][1] == saves[1][-1][1], saves  # one step on both nodes

def test_resume_into_a_shared_folder_fetches_once(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    first = Nodes(tmp_path / "first", 2, JOBS / "ddp_trainer.py", shared=True,
                  guard_args=[*FAST, "--grace", "30s", "--push-to", str(dest)],
                  job_args=["--output-dir", "{out}", "--step-s", "0.05", "--save-steps", "10"]).start()
    try:
        assert first.wait_for((dest / "last-checkpoint" / "trainer_state.json").exists, 150), logs(first.wait(5))
        for node in range(2):
            first.signal(node, signal.SIGTERM)
        runs = first.wait(120)
    finally:
        first.close()
    # one checkpoint in the shared folder, secured by node 0: every node says so, with the same exit code
    assert [(run.story(), run.fields().get("secured")) for run in runs] == [
        (("INTERRUPTED", "signal", "75"), "yes")] * 2, logs(runs)
    assert runs[1].fields()["pushed"] == runs[0].fields()["pushed"]
    second = Nodes(tmp_path / "second", 2, JOBS / "ddp_trainer.py", shared=True, run_id="multinode-run-2",
                   guard_args=[*FAST, "--push-to", str(dest), "--resume", "on"],
                   job_args=["--output-dir", "{out}", "--step-s", "0.05", "--max-steps", "5"]).start()
    runs = second.wait(240)
    assert [run.story()[0] for run in runs] == ["PASS", "PASS"], logs(runs)
    waited = [run.node for run in runs if "claimed it in this shared folder" in run.stderr]
    assert len(waited) == 1, logs(runs)  # one node fetched, the other waited for it and found the checkpoint there
    assert "resumed_from=" in runs[0].verdict and "resumed_from=" in runs[1].verdict, logs(runs)
    assert len(list((tmp_path / "second" / "shared").glob("checkpoint-*"))) >= 1


def test_a_collective_timeout_names_the_late_rank_not_the_one_that_waited(tmp_path: Path) -> None:
    from conftest import run_guard
    from multinode import TORCHRUN

    run = run_guard([*FAST, "--", TORCHRUN, "--standalone", "--nproc-per-node", "2", str(JOBS / "late_rank.py"),
                     "--late-rank", "1", "--late-at", "10"], timeout_s=180)
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields["rank"], fields["waited"]) == ("FAIL", "crash", "1", "0"), \
        run.stderr[-3000:]
    assert "timed out on rank 0" in fields["hint"] and "waiting for rank 1, which never reached it" in fields["hint"]


def test_a_pass_on_node_1_leaves_the_securing_to_node_0_without_a_false_hint(tmp_path: Path) -> None:
    # node 1's guard hands securing to node 0's; its PASS said "nothing was secured to DEST: the job saved nothing
    # recognisable" right after "node 1: the guard of node 0 pushes the final model" (a new user's trial, issue 36)
    dest = tmp_path / "dest"
    nodes = Nodes(tmp_path, 2, JOBS / "ddp_trainer.py", shared=True, guard_args=[*FAST, "--push-to", str(dest)],
                  job_args=["--output-dir", "{out}", "--step-s", "0.05", "--max-steps", "5"]).start()
    try:
        runs = nodes.wait(240)
    finally:
        nodes.close()
    assert [run.story()[0] for run in runs] == ["PASS", "PASS"], logs(runs)
    assert runs[0].fields().get("pushed") == str(dest), logs(runs)
    assert "nothing was secured" not in runs[1].verdict and "nothing was secured" not in runs[1].stderr, logs(runs)
