"""``--push-to s3://BUCKET/PREFIX`` end to end against a real S3 server (moto, tests/s3server.py): the guard's own
run, its push worker and the next run's resume all go through the standard AWS variables, as a user's job does.

What lies in the bucket is read back with the S3 store itself (the record, then a verified fetch), not taken from
the VERDICT: the record names the step the VERDICT secured, its weights load and are finite."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import JOBS, REPO, run_guard
from s3server import Fault, FaultProxy, MotoServer
from s3server import env as s3_env
from test_resume_e2e import stop_when_ready
from test_xet_e2e import run_timed

from guard.secure.dest import Destination, parse_destination
from guard.secure.dest.s3 import S3Store

pytestmark = [pytest.mark.slow]

FAST = ["--skip-check", "python=imports are checked by the other tests"]


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        yield server


def test_s3_urls_parse_to_their_canonical_form() -> None:
    assert parse_destination("s3://ckpts/runs/run1/") == Destination("s3", url="s3://ckpts/runs/run1")
    assert str(parse_destination("s3://ckpts")) == "s3://ckpts"


def _store(moto: MotoServer, bucket: str, prefix: str) -> S3Store:
    return S3Store(bucket, prefix, client=moto.client(moto.url))


def test_a_sigterm_secures_to_s3_and_the_next_run_resumes_from_the_bucket(moto: MotoServer, tmp_path: Path) -> None:
    bucket = moto.bucket()
    url, env = f"s3://{bucket}/runs/run1", s3_env(moto.url)
    loop = str(REPO / "examples" / "train_loop.py")
    first = stop_when_ready([*FAST, "--push-to", url, loop, "--steps", "100000", "--save-every", "100000",
                             "--log-every", "10", "--output-dir", str(tmp_path / "run1")], ready="step=10 ", env=env)
    fields = first.fields()
    assert (first.returncode, fields["status"], fields["secured"]) == (75, "INTERRUPTED", "yes"), first.stderr[-3000:]
    assert fields["pushed"].startswith(url + "@"), first.verdict
    step = int(fields["secured_step"])
    record = _store(moto, bucket, "runs/run1").read_record(deadline=time.monotonic() + 60)
    assert record is not None and record.step == step
    assert record.revision.strip('"') == fields["pushed"].split("@", 1)[1]
    fetched = _store(moto, bucket, "runs/run1").fetch(record, tmp_path / "check", deadline=time.monotonic() + 60)
    weights = [p for p in fetched.path.rglob("*.pt")] or [p for p in fetched.path.rglob("*.bin")]
    assert weights, list(fetched.path.rglob("*"))
    assert "guard-test-secret-key-0001" not in first.stdout + first.stderr

    second = run_guard([*FAST, "--resume", "on", "--push-to", url, "--output-dir", str(tmp_path / "run2"), loop,
                        "--steps", str(step + 5), "--output-dir", str(tmp_path / "run2"), "--save-every", "1000"],
                       env=env, timeout_s=90)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed_from=" in second.verdict and f"at step {step}" in second.stdout, second.verdict


def test_a_nan_run_never_leaves_its_nan_save_in_the_bucket(moto: MotoServer, tmp_path: Path) -> None:
    bucket = moto.bucket()
    url = f"s3://{bucket}/nan"
    run = run_guard([*FAST, "--check-every", "100000", "--push-interval", "0s", "--push-to", url,
                     str(JOBS / "nan_then_save.py"), "--output-dir", str(tmp_path / "out"), "--steps", "60",
                     "--nan-at", "12", "--save-every", "5"], env=s3_env(moto.url), timeout_s=200)
    fields = run.fields()
    assert (fields["reason"], run.returncode) == ("non_finite_loss", 4), run.stderr[-3000:]
    record = _store(moto, bucket, "nan").read_record(deadline=time.monotonic() + 60)
    if record is not None:
        assert record.step is not None and record.step < 12, record
        fetched = _store(moto, bucket, "nan").fetch(record, tmp_path / "check", deadline=time.monotonic() + 60)
        for path in fetched.path.rglob("*.pt"):
            state = torch.load(path, weights_only=True)
            assert all(bool(torch.isfinite(t).all()) for t in state["model"].values()), path
            assert re.search(r"ckpt-(\d+)", path.name) and int(path.name[5:-3]) < 12


def test_a_store_that_stalls_every_push_does_not_delay_the_verdict_past_the_deadline(moto: MotoServer,
                                                                                      tmp_path: Path) -> None:
    """The endpoint answers preflight's probe, then holds every upload of a checkpoint without an answer (a store
    that stopped mid-run): the background pushes and the deadline's push hang there, and the VERDICT still comes
    before the deadline, saying nothing was secured; the bucket names no checkpoint."""
    bucket = moto.bucket()
    with FaultProxy(moto.url) as proxy:
        proxy.inject(Fault("stall", count=100_000, path_contains="/.guard/staging/", stall_s=600))
        run, verdict_s, exited_s = run_timed(["--grace", "10s", "--timeout", "40s", "--margin", "10s", "--push-to",
                                              f"s3://{bucket}/stall", str(JOBS / "saving_loop.py"), "--output-dir",
                                              str(tmp_path / "out"), "--save-every", "20"], env=s3_env(proxy.url))
        stalled = [path for method, path, status in proxy.requests if status == 0 and method == "PUT"]
    assert stalled, "no upload reached the store"
    assert verdict_s < 40 and exited_s < 40 + 3, (verdict_s, exited_s, run.stderr[-3000:])
    fields = run.fields()
    assert (fields["status"], fields["reason"], fields.get("secured")) == ("TIMEOUT", "deadline", "no"), \
        run.stderr[-3000:]
    assert _store(moto, bucket, "stall").read_record(deadline=time.monotonic() + 60) is None
