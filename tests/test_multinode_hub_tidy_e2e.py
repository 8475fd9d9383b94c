"""Many nodes at a Hub repo (issue 34): node parts go into commits under ``.guard/staging/``; after the run, staging
that no record takes is removed (``guard.secure.dest.hub_parts.tidy_staging``), never what the record or a run still
going may need. Two torchrun nodes on 127.0.0.1, each in its own folder under its own guard, the local Hub (Xet
on). The fixtures and helpers are ``test_multinode_parts_e2e``'s."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import test_multinode_parts_e2e as parts
from conftest import JOBS
from multinode import Nodes, logs
from test_multinode_parts_e2e import FAST, Dest

pytestmark = [pytest.mark.slow, pytest.mark.hub]

#: The fixtures of test_multinode_parts_e2e, used here under the same names.
hub = parts.hub


def _seed(dest: Dest, tmp_path: Path, run: str, step: int) -> None:
    """Node 0's part of ``run``'s step ``step`` in the repo (as that run's guard puts it)."""
    folder = tmp_path / "seed" / run / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    dest.store.put_part(folder, ["__0_0.distcp"], run_id=run, step=step, node_rank=0, nodes=2, place=folder.name,
                        source="out", deadline=time.monotonic() + 60)


def _staged(hub: parts.HubServer) -> dict[str, set[str]]:
    """``{run: its step folders}`` under .guard/staging/ at the repo's head."""
    found: dict[str, set[str]] = {}
    for path in hub.repo_files("alice/many-nodes"):
        names = path.split("/")
        if path.startswith(".guard/staging/") and len(names) > 4:
            found.setdefault(names[2], set()).add(names[3])
    return found


def test_after_the_run_staging_no_record_takes_goes_and_the_records_and_a_live_runs_stay(
        tmp_path: Path, hub: parts.HubServer) -> None:
    """The repo holds an earlier run's staging left a day ago (its node 1 never put its part) and another run's
    put just now. A Trainer on two nodes trains to its end, securing both nodes' parts of its saves (node 0 then
    pushes the final model): after both VERDICTs the earlier run's staging is gone in one tidy commit; the other
    run's and the record's own step stay (another node may still be reading or putting them), and the record
    still fetches whole. Before, nothing was ever removed: each run's last staged step and every other run's
    staging stayed in the repo for good."""
    dest = Dest("hub", tmp_path, None, hub)
    with hub.dated("2020-01-02T03:04:05.000Z"):
        _seed(dest, tmp_path, "run-gone", 40)
    _seed(dest, tmp_path, "run-live", 60)
    nodes = Nodes(tmp_path, 2, JOBS / "ddp_trainer.py",
                  guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to],
                  job_args=["--output-dir", "{out}", "--step-s", "0.1", "--save-steps", "20", "--max-steps", "60"],
                  env=dest.env).start()
    runs = nodes.wait(120)
    assert [run.story() for run in runs] == [("PASS", "ok", "0")] * 2, logs(runs)
    record = dest.record()
    assert record is not None and record.run_id == "multinode-run" and record.step is not None, logs(runs)
    staged = _staged(hub)
    assert "run-gone" not in staged and staged.get("run-live") == {"step-60"}, (staged, logs(runs))
    assert f"step-{record.step}" in staged.get("multinode-run", set()), (staged, record.step)
    tidied = [c for c in hub.commits("alice/many-nodes") if c.title == "guard: remove node parts' staging that no "
                                                                       "record takes"]
    assert len(tidied) == 1, [c.title for c in hub.commits("alice/many-nodes")[-6:]]
    (tmp_path / "fresh").mkdir()
    fetched = dest.store.fetch(record, tmp_path / "fresh", deadline=time.monotonic() + 60)
    assert fetched is not None and {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= \
        {p.name for p in fetched.path.iterdir()}
