"""End to end, every destination (a folder, S3 on moto, the local Hub server with Xet): a taint that reaches a push
already recorded moves the destination's record back (issue 33 item 3), and what it holds is read on its bytes.

The job (``tests/jobs/saving_loop.py``) saves ``checkpoint-4`` and ``checkpoint-8`` and keeps only the newest
(``--keep 1``, ``save_total_limit=1``); step 8's update leaves weights of 1e30 (finite: its save is pushed and
recorded), and step 9's loss, their forward pass, is inf: the save of step 8 is suspect (a non-finite loss at S
makes the save at S-1 suspect). The good ``checkpoint-4`` is gone from the local disk, so it cannot be pushed
again: before, the guard tried, failed, and ended ``secured=no`` with ``DEST/last-checkpoint`` holding step 8 (weights
of 1e30, which give an infinite loss on any batch). Now the record is moved back to step 4 (no upload), the VERDICT
says ``secured_step=4``, and the next run's ``--resume on`` loads step 4.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import JOBS, run_guard

from guard.secure.securer import Securer

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]
JOB = [str(JOBS / "saving_loop.py"), "--save-every", "4", "--blow-at", "8", "--keep", "1", "--save-pause-s", "6"]


@pytest.fixture(scope="module")
def xet_hub() -> Iterator[Any]:
    from tests.hubserver import HubServer

    with HubServer() as server:
        yield server


def _where(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, str], Securer]:
    """``--push-to``, the guard's environment and a ``Securer`` that reads the destination back."""
    if kind == "hub":
        from huggingface_hub import HfApi

        from tests.hubserver import TOKENS, client_constants

        hub = request.getfixturevalue("xet_hub")
        stack = client_constants(xet=True)
        stack.__enter__()
        request.addfinalizer(lambda: stack.__exit__(None, None, None))
        repo_id = f"alice/restore-{tmp_path.name[-12:].strip('_')}"
        return repo_id, hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf"), Securer(
            repo_id, api=HfApi(endpoint=hub.url, token=TOKENS["write"]))
    destination = request.getfixturevalue("destination")
    if kind == "s3":
        monkeypatch = request.getfixturevalue("monkeypatch")
        for key, value in destination.env.items():
            monkeypatch.setenv(key, value)
    return destination.push_to, destination.env, Securer(destination.push_to)


@pytest.mark.parametrize(("kind", "destination"), [("folder", "folder"), ("s3", "s3"), ("hub", "folder")],
                         indirect=["destination"])
def test_a_recorded_push_made_suspect_by_the_next_steps_nan_is_moved_back(kind: str, destination: Any,
                                                                         request: pytest.FixtureRequest,
                                                                         tmp_path: Path) -> None:
    push_to, env, reader = _where(kind, request, tmp_path)
    out = tmp_path / "out"
    run = run_guard([*FAST, "--check-every", "1", "--push-interval", "0s", "--push-to", push_to, *JOB,
                     "--output-dir", str(out), "--steps", "30"], env=env, timeout_s=240)
    fields = run.fields()
    assert (fields["status"], fields["reason"], run.returncode) == ("FAIL", "non_finite_loss", 4), run.stderr[-4000:]
    assert fields["step"] == "9", run.verdict
    assert "moving it back to" in run.stderr and "is step 4 again" in run.stderr, run.stderr[-4000:]
    assert (fields.get("secured"), fields.get("secured_step")) == ("yes", "4"), run.verdict
    assert "was pushed before that loss was read; the destination's record was moved back" in fields["hint"]
    assert not (out / "checkpoint-4").exists()  # gone from the disk: only the destination holds it
    # the destination's bytes: the record names step 4, and its model is the save of step 4, finite
    record = reader.peek_last_checkpoint(deadline=time.monotonic() + 60)
    assert record is not None and record.step == 4, record
    fetched = reader.fetch_last_checkpoint(tmp_path / "fetched", deadline=time.monotonic() + 60)
    assert fetched is not None and fetched.step == 4
    state = torch.load(fetched.path / "model.pt", weights_only=True)
    assert state["step"] == 4 and all(float(t.abs().max()) < 1e20 for t in state["model"].values())
    # the next run's --resume on loads step 4
    second = run_guard([*FAST, "--resume", "on", "--push-to", push_to, str(JOBS / "saving_loop.py"), "--output-dir",
                        str(tmp_path / "run2"), "--steps", "10", "--save-every", "100"], env=env, timeout_s=180)
    assert "resumed at step 4 (weights sane)" in second.stdout, (second.verdict, second.stderr[-3000:])
