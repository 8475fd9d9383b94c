"""Many nodes, each with its own disk: accelerate's ``Accelerator.save_state`` over two torchrun nodes on 127.0.0.1
(issue 34). Node 0's ``step_N/`` holds the model, the optimizer, the scheduler, the registered step counter and
``random_states_0.pkl``, node 1's only ``random_states_1.pkl``: every node's VERDICT tells the same story, the record
holds both processes' RNG states with the model, and fresh nodes resume from it with ``accelerator.load_state``. The
fixtures and helpers are ``test_multinode_parts_e2e``'s (a file of its own so that the test run spreads these slow
tests over its workers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import JOBS
from multinode import Nodes, logs
from safetensors.torch import load_file
from test_multinode_parts_e2e import FAST, Dest, _secured_at_the_deadline

pytestmark = [pytest.mark.slow]

#: What accelerate's save_state writes for this job: node 0's files, then each process's RNG state.
NODE0 = {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"}
WHOLE = NODE0 | {"random_states_1.pkl"}


def _accelerate(tmp_path: Path, dest: Dest, *guard_args: str, job_args: tuple[str, ...] = (),
                run_id: str = "multinode-run") -> Nodes:
    return Nodes(tmp_path, 2, JOBS / "accelerate_parts_loop.py", run_id=run_id,
                 guard_args=[*FAST, "--output-dir", "{out}", "--push-to", dest.push_to, *guard_args],
                 job_args=["{out}", "--every", "20", "--step-s", "0.05", *job_args], env=dest.env)


def test_accelerate_save_state_over_two_disks_is_secured_whole_and_resumes_on_fresh_nodes(tmp_path: Path) -> None:
    """At the deadline both nodes say TIMEOUT exit=75 with one secured_step; the record holds the model and both
    ``random_states_<r>.pkl`` of that step (node 1's disk held only its own). The next run on fresh folders
    (``--resume on``): each node fetches the whole checkpoint onto its own disk and ``accelerator.load_state`` on
    both processes restores the step counter (rank 1 reads the model and optimizer node 0 wrote) and trains on."""
    dest = Dest("folder", tmp_path, None)
    first = _accelerate(tmp_path / "first", dest, "--timeout", "40s").start()
    saved_here = first.out(1)
    step, fetched = _secured_at_the_deadline(first, tmp_path, dest)
    held = {p.name for p in fetched.iterdir() if p.is_file()}
    assert held >= WHOLE, held
    assert {p.name for p in (saved_here / f"step_{step}").iterdir()} == {"random_states_1.pkl"}  # node 1's part
    for rank in range(2):  # each process's own RNG state of that step, as load_state reads it
        assert "torch_manual_seed" in torch.load(fetched / f"random_states_{rank}.pkl", weights_only=False)
    assert torch.load(fetched / "custom_checkpoint_0.pkl", weights_only=False)["step"] == step
    assert set(load_file(fetched / "model.safetensors")) == {"weight", "bias"}

    second = _accelerate(tmp_path / "second", dest, "--resume", "on", run_id="multinode-run-2",
                         job_args=("--steps", str(step + 10))).start()
    runs = second.wait(120)
    for run in runs:
        assert f"rank {run.node}: resumed from step {step}" in run.stdout, logs(runs)
        there = {p.name for p in second.out(run.node).rglob("*") if p.is_file()}
        assert there >= WHOLE, (run.node, there)
    assert [run.story()[0] for run in runs] == ["PASS", "PASS"], logs(runs)
