"""Tests for ``guard.secure.sharing``: whether the nodes share the output folder, found out by probe files."""

from __future__ import annotations

from pathlib import Path

from guard.secure.sharing import SharingProbe, probe_folder


def test_two_nodes_on_one_folder_find_it_shared(tmp_path: Path) -> None:
    probes = [SharingProbe(tmp_path, "run-1", node, 2, bound_s=30).start() for node in (0, 1)]
    answers = [probe.wait(30) for probe in probes]
    assert all(a.shared is True and a.nodes_seen == (0, 1) for a in answers), answers
    for probe in probes:
        probe.close()
    assert not (tmp_path / ".guard" / "nodes").exists()  # nothing left behind


def test_each_node_in_its_own_folder_finds_it_local_after_the_bound(tmp_path: Path) -> None:
    probes = [SharingProbe(tmp_path / f"out{node}", "run-1", node, 2, bound_s=1.0).start() for node in (0, 1)]
    answers = [probe.wait(30) for probe in probes]
    assert [(a.shared, a.nodes_seen) for a in answers] == [(False, (0,)), (False, (1,))]
    assert "within 1s" in answers[0].why


def test_a_node_that_takes_node_0s_run_id_finds_their_shared_folder_shared(tmp_path: Path) -> None:
    """No run id every node shares: each probe starts under its node's own; once node 1 takes node 0's (read from
    the job's store), its probe moves there and both find the folder shared; its first probe is gone. Before,
    the probes never met and both said local after the bound."""
    probes = [SharingProbe(tmp_path, f"own-{node}", node, 2, bound_s=30).start() for node in (0, 1)]
    assert all(probe.wait(0.5).shared is None for probe in probes)  # under two run ids: no answer yet
    probes[1].adopt("own-0")
    answers = [probe.wait(30) for probe in probes]
    assert all(a.shared is True and a.nodes_seen == (0, 1) for a in answers), answers
    assert probes[1].run_id == "own-0" and not probe_folder(tmp_path, "own-1").exists()
    for probe in probes:
        probe.close()
    assert not (tmp_path / ".guard" / "nodes").exists()


def test_another_runs_probe_is_not_a_node_of_this_run(tmp_path: Path) -> None:
    old = probe_folder(tmp_path, "run-0")
    old.mkdir(parents=True)
    (old / "node-1.json").write_text("{}")  # a guard of an earlier run, killed before it cleaned up
    answer = SharingProbe(tmp_path, "run-1", 0, 2, bound_s=0.5).start().wait(30)
    assert answer.shared is False


def test_a_folder_that_cannot_be_written_is_unknown(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    answer = SharingProbe(blocker, "run-1", 0, 2, bound_s=0.5).start().wait(30)
    assert answer.shared is None and "cannot write the probe" in answer.why


def test_a_shared_folder_is_fetched_into_once_the_other_node_waits_then_finds_it(tmp_path: Path) -> None:
    import threading
    import time

    from guard.secure.sharing import once_per_folder

    events: list[str] = []

    def fetch(node: int) -> str:
        events.append(f"start {node}")
        if not (tmp_path / "checkpoint-20").exists():
            time.sleep(0.5)  # the download
            (tmp_path / "checkpoint-20").mkdir()
            events.append(f"fetched {node}")
        events.append(f"end {node}")
        return f"node {node}"

    results: dict[int, str] = {}

    def node(rank: int) -> None:
        results[rank] = once_per_folder(tmp_path, "run-1", rank, "fetch", lambda: fetch(rank),
                                        deadline=time.monotonic() + 30, abort=lambda: False)

    first = threading.Thread(target=node, args=(0,))
    first.start()
    while not (tmp_path / ".guard" / "nodes" / "run-1" / "fetch.lock").exists():
        time.sleep(0.01)
    second = threading.Thread(target=node, args=(1,))
    second.start()
    first.join(30)
    second.join(30)
    assert events == ["start 0", "fetched 0", "end 0", "start 1", "end 1"], events  # fetched once, then found
    assert results == {0: "node 0", 1: "node 1"}
    probe = SharingProbe(tmp_path, "run-1", 0, 2)
    probe.close()  # the run's end: node 0's claim goes with its probe
    assert not (tmp_path / ".guard" / "nodes" / "run-1" / "fetch.lock").exists()


def test_each_node_with_its_own_folder_fetches_its_own_copy(tmp_path: Path) -> None:
    import time

    from guard.secure.sharing import once_per_folder

    done = [once_per_folder(tmp_path / f"out{n}", "run-1", n, "fetch", lambda n=n: n, deadline=time.monotonic() + 5,
                            abort=lambda: False) for n in (0, 1)]
    assert done == [0, 1]


def test_on_a_shared_folder_every_node_says_what_node_0_secured(tmp_path: Path) -> None:
    from guard.contract import RunResult
    from guard.run.relay import agree_with_node_0

    def stopped(secured: str, code: int) -> RunResult:
        return RunResult("INTERRUPTED", "signal", code, extra={"secured": secured, "signal": "SIGTERM"})

    common = {"output_dir": str(tmp_path), "run_id": "run-1", "end_s": None, "grace_s": 2.0}
    node1 = stopped("no", 143)
    agree_with_node_0(node1, shared=True, node_rank=1, **common)  # node 0 said nothing: waited the grace, stands
    assert (node1.exit_code, node1.extra["secured"]) == (143, "no")
    node0 = stopped("yes", 75)
    node0.extra.update(pushed="/dest/last-checkpoint", checkpoint="out/checkpoint-34")
    agree_with_node_0(node0, shared=True, node_rank=0, **common)
    agree_with_node_0(node1, shared=True, node_rank=1, **common)
    assert (node1.exit_code, node1.extra["secured"], node1.extra["pushed"]) == (75, "yes", "/dest/last-checkpoint")
    assert node1.extra["signal"] == "SIGTERM" and "node 0's guard secured" in (node1.hint or "")
    local = stopped("no", 143)
    agree_with_node_0(local, shared=False, node_rank=1, **common)  # a folder per node: node 0's word is not this one's
    assert local.exit_code == 143


def test_node_1_waits_for_node_0s_word_until_the_platforms_kill(tmp_path: Path) -> None:
    """Node 0's guard, slow on a loaded machine, secures and says so 3 s into the 4 s left before the kill: node 1
    waits for its word until shortly before that kill and says the same (exit 75). Before, node 1 waited half the
    grace (2 s), then said exit=143 secured=no while node 0 said exit=75 secured=yes (seen in CI: 8.7 s late at a
    deadline, where node 1 waited 10 s)."""
    import threading
    import time

    from guard.contract import RunResult
    from guard.run.relay import agree_with_node_0

    def stopped(secured: str, code: int) -> RunResult:
        return RunResult("INTERRUPTED", "signal", code, extra={"secured": secured, "signal": "SIGTERM"})

    common = {"output_dir": str(tmp_path), "grace_s": 4.0}
    node0, node1 = stopped("yes", 75), stopped("no", 143)
    node0.extra.update(pushed="/dest/last-checkpoint", secured_step=40)
    late = threading.Timer(3.0, lambda: agree_with_node_0(node0, shared=True, node_rank=0, run_id="run-1",
                                                          end_s=None, **common))
    late.start()
    try:
        agree_with_node_0(node1, shared=True, node_rank=1, run_id="run-1", end_s=time.time() + 4.0, **common)
    finally:
        late.join()
    assert (node1.exit_code, node1.extra["secured"], node1.extra.get("secured_step")) == (75, "yes", 40), node1
    unsecured = stopped("no", 143)  # node 0 secured nothing: it posts nothing, the output folder keeps nothing
    agree_with_node_0(unsecured, shared=True, node_rank=0, run_id="run-2", end_s=None, **common)
    assert not probe_folder(tmp_path, "run-2").exists()
