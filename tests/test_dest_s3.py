"""The S3 destination (guard/secure/dest/s3.py) against a real S3 server (moto, tests/s3server.py) and a fault proxy
in front of it: put, verify, record, fetch, final, taints, discard, probe, and the faults a store gives."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.errors import DestinationError, TransientDestinationError, UsageError
from guard.secure.dest import local
from guard.secure.dest.base import PartManifest, Store, Taint
from guard.secure.dest.s3 import RECORD_NAME, S3Record, S3Store, parse_s3_url
from guard.secure.dest.s3io import composite_checksum
from tests.s3server import CREDENTIALS, Fault, FaultProxy, MotoServer

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def proxy(moto: MotoServer) -> Iterator[FaultProxy]:
    with FaultProxy(moto.url) as p:
        yield p


def make_store(moto: MotoServer, url: str | None = None, *, bucket: str | None = None, prefix: str = "runs/r1",
               **kwargs: Any) -> S3Store:
    config: dict[str, Any] = {"retries": {"mode": "standard", "total_max_attempts": 3}, "connect_timeout": 2,
                              "read_timeout": kwargs.pop("read_timeout", 10), "request_checksum_calculation":
                              "when_required", "response_checksum_validation": "when_required"}
    return S3Store(bucket or moto.bucket(), prefix, client=moto.client(url, **config), **kwargs)


def deadline(seconds: float = 60.0) -> float:
    return time.monotonic() + seconds


def checkpoint(root: Path, step: int, *, big_bytes: int = 0, seed: int = 0) -> tuple[Path, list[str]]:
    folder = root / f"checkpoint-{step}"
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"step": step, "seed": seed}))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (folder / "sub" / "rng_state_0.pth").write_bytes(os.urandom(1000))
    if big_bytes:
        (folder / "model.safetensors").write_bytes(os.urandom(big_bytes))
    return folder, sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def put(store: S3Store, folder: Path, files: list[str], step: int, *, run_id: str = "run1", node: int = 0,
        nodes: int = 1) -> PartManifest:
    return store.put_part(folder, files, run_id=run_id, step=step, node_rank=node, nodes=nodes,
                          place=folder.name, source="out", deadline=deadline())


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://ckpts/run1") == ("ckpts", "run1")
    assert parse_s3_url("s3://ckpts/a/b/") == ("ckpts", "a/b")
    assert parse_s3_url("s3://ckpts") == ("ckpts", "")
    for bad in ("s3://A_B/x", "s3://ab", "s3://ckpts/a/../b", "s3://ckpts/a//b", "ckpts/run1"):
        with pytest.raises(UsageError):
            parse_s3_url(bad)


def test_store_protocol(moto: MotoServer) -> None:
    store: Store = make_store(moto)
    assert store.kind == "s3"
    assert str(store).startswith("s3://guard-") and str(store).endswith("/runs/r1")


def test_tidy_after_the_run_makes_no_s3_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard tidies its destination after the VERDICT: an S3 push leaves nothing to tidy (staged objects lie
    under their run's id), so no store and no client is made for it (making one took 0.28 s, boto3's import and
    client, after the VERDICT); a folder's tidy still runs (tests/test_folder_swap.py)."""
    from guard.secure import securer
    from guard.secure.dest import s3

    made: list[object] = []
    monkeypatch.setattr(s3, "make_client", lambda **kw: made.append(kw) or (object(), None))
    securer.Securer("s3://guard-tidy/runs/r1").tidy()
    assert made == []
    securer.Securer("s3://guard-tidy/runs/r1").store.tidy()  # the store itself, made on purpose: one client
    assert len(made) == 1


def test_put_record_fetch_round_trip(moto: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(moto, part_size_bytes=5 * MIB, multipart_threshold_bytes=5 * MIB)
    folder, files = checkpoint(tmp_path, 20, big_bytes=12 * MIB + 3)  # 3 parts
    seen: list[tuple[int, int]] = []
    part = store.put_part(folder, files, run_id="run1", step=20, node_rank=0, nodes=1, place="checkpoint-20",
                          source="out", deadline=deadline(), progress=lambda d, t: seen.append((d, t)))
    assert part.files["model.safetensors"].sha256 == sha(folder / "model.safetensors")
    assert seen[-1][0] == seen[-1][1] == sum((folder / f).stat().st_size for f in files)
    client, bucket = store.io.client, store.bucket
    head = client.head_object(Bucket=bucket, Key="runs/r1/.guard/staging/run1/step-20/node-0/model.safetensors",
                              ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].split("-")[0] == composite_checksum(
        hashlib.sha256(c).digest() for c in _chunks(folder / "model.safetensors", 5 * MIB)).split("-")[0]
    assert store.read_record(deadline=deadline()) is None
    assert [p.node_rank for p in store.parts(run_id="run1", step=20, deadline=deadline())] == [0]

    record = store.write_record([part], deadline=deadline())
    assert (record.step, record.run_id, set(record.files)) == (20, "run1", set(files))
    body = json.loads(client.get_object(Bucket=bucket, Key=f"runs/r1/{RECORD_NAME}")["Body"].read())
    assert body["files"]["config.json"]["key"] == ".guard/staging/run1/step-20/node-0/config.json"
    again = store.read_record(deadline=deadline())
    assert again is not None and again.revision == record.revision and again.files == record.files

    into = tmp_path / "resume"
    synced: list[Path] = []
    real_fsync_dir = local.fsync_dir
    monkeypatch.setattr(local, "fsync_dir", lambda path: (synced.append(Path(path)), real_fsync_dir(path)))
    fetched = store.fetch(again, into, deadline=deadline())
    assert fetched.path == into / "checkpoint-20" and fetched.step == 20
    assert all(sha(into / "checkpoint-20" / f) == sha(folder / f) for f in files)
    # placed as every store places (local.place_fetched): the rename made durable, the folder's default mode (not
    # the 0700 of a temporary folder), and an identical copy kept as it is on the next fetch
    assert synced == [into]
    assert (into / "checkpoint-20").stat().st_mode & 0o777 == into.stat().st_mode & 0o777 != 0o700
    inode = (into / "checkpoint-20").stat().st_ino
    store.fetch(again, into, deadline=deadline())
    assert (into / "checkpoint-20").stat().st_ino == inode and not list(into.glob(".checkpoint-20.replaced-*"))
    # a differing local copy is moved aside, never deleted
    (into / "checkpoint-20" / "config.json").write_text("changed")
    store.fetch(again, into, deadline=deadline())
    assert sha(into / "checkpoint-20" / "config.json") == sha(folder / "config.json")
    assert [p.name for p in into.iterdir() if p.name.startswith(".checkpoint-20.replaced-")]


def _chunks(path: Path, size: int) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


def test_record_moves_forward_only_and_conditionally(moto: MotoServer, tmp_path: Path) -> None:
    store = make_store(moto)
    f10, files10 = checkpoint(tmp_path, 10)
    f20, files20 = checkpoint(tmp_path, 20)
    p10, p20 = put(store, f10, files10, 10), put(store, f20, files20, 20)
    assert store.write_record([p20], deadline=deadline()).step == 20
    # an older step of the same run never moves the record back: the newer record is the answer
    assert store.write_record([p10], deadline=deadline()).step == 20
    # the previous record is kept; a restore moves back and says from where
    r10_store = make_store(moto, bucket=store.bucket)
    restored = r10_store.restore_record(S3Record(10, "run1", p10.files, ""), deadline=deadline())
    assert (restored.step, restored.restored_from) == (10, 20)
    # another run's checkpoint replaces it
    p5 = put(store, f10, files10, 5, run_id="run2")
    assert store.write_record([p5], deadline=deadline()).run_id == "run2"
    previous = json.loads(store.io.client.get_object(
        Bucket=store.bucket, Key="runs/r1/.guard/previous/last-checkpoint.json")["Body"].read())
    assert (previous["run_id"], previous["step"]) == ("run1", 10)


def test_two_writers_never_interleave(moto: MotoServer, tmp_path: Path, proxy: FaultProxy) -> None:
    """The second writer's conditional write is refused (412) and it reads again: its step 30 goes in over the
    first writer's 40 only if newer, which it is not."""
    bucket = moto.bucket()
    a, b = make_store(moto, bucket=bucket), make_store(moto, proxy.url, bucket=bucket)
    f30, files30 = checkpoint(tmp_path, 30)
    f40, files40 = checkpoint(tmp_path, 40)
    p30, p40 = put(a, f30, files30, 30), put(a, f40, files40, 40)
    a.write_record([p30], deadline=deadline())
    # b has read the record (step 30) and is about to write 40: a writes 40 in between; b's write is refused
    original = b._get_json

    def read_then_race(rel: str, dl: float) -> Any:
        got = original(rel, dl)
        if rel == RECORD_NAME and not getattr(read_then_race, "raced", False):
            read_then_race.raced = True  # type: ignore[attr-defined]
            a.write_record([p40], deadline=deadline())
        return got

    b._get_json = read_then_race  # type: ignore[method-assign]
    assert b.write_record([p40], deadline=deadline()).step == 40
    record_puts = [s for m, path, s in proxy.requests if m == "PUT" and path.endswith(f"/r1/{RECORD_NAME}")]
    assert record_puts == [412]


def test_record_refuses_an_object_replaced_after_its_put(moto: MotoServer, tmp_path: Path) -> None:
    store = make_store(moto)
    folder, files = checkpoint(tmp_path, 10)
    part = put(store, folder, files, 10)
    store.io.client.put_object(Bucket=store.bucket, Key="runs/r1/.guard/staging/run1/step-10/node-0/config.json",
                               Body=b"{}", ChecksumAlgorithm="SHA256")
    with pytest.raises(DestinationError, match="does not verify"):
        store.write_record([part], deadline=deadline())
    assert store.read_record(deadline=deadline()) is None


def test_a_checksum_the_store_did_not_keep_fails_the_put(moto: MotoServer, proxy: FaultProxy,
                                                          tmp_path: Path) -> None:
    store = make_store(moto, proxy.url)
    folder, files = checkpoint(tmp_path, 10)
    proxy.inject(Fault("checksum", methods=("HEAD",), path_contains="config.json"))
    with pytest.raises(DestinationError, match=r"config\.json does not verify"):
        put(store, folder, files, 10)


def test_many_nodes_record_waits_for_every_part(moto: MotoServer, tmp_path: Path) -> None:
    store = make_store(moto)
    f0, _ = checkpoint(tmp_path / "n0", 50)
    f1, _ = checkpoint(tmp_path / "n1", 50)
    (f1 / "rng_state_1.pth").write_bytes(b"node1")
    p0 = put(store, f0, ["config.json", "sub/rng_state_0.pth"], 50, nodes=2)
    with pytest.raises(DestinationError, match="one node each"):
        store.write_record([p0], deadline=deadline())
    put(store, f1, ["rng_state_1.pth"], 50, node=1, nodes=2)
    parts = store.parts(run_id="run1", step=50, deadline=deadline())
    record = store.write_record(parts, deadline=deadline())
    assert record.nodes == 2 and set(record.files) == {"config.json", "sub/rng_state_0.pth", "rng_state_1.pth"}
    fetched = store.fetch(record, tmp_path / "back", deadline=deadline())
    assert (fetched.path / "rng_state_1.pth").read_bytes() == b"node1"


def test_final_model_at_the_prefix_replaces_the_earlier_one(moto: MotoServer, tmp_path: Path) -> None:
    store = make_store(moto)
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"m1")
    (out / "old.bin").write_bytes(b"old")
    store.put_final(out, ["model.safetensors", "old.bin"], deadline=deadline())
    (out / "model.safetensors").write_bytes(b"m2")
    final = store.put_final(out, ["model.safetensors"], deadline=deadline())
    keys = {o["Key"] for o in store.io.client.list_objects_v2(Bucket=store.bucket, Prefix="runs/r1/")["Contents"]}
    assert "runs/r1/model.safetensors" in keys and "runs/r1/old.bin" not in keys
    assert final.files["model.safetensors"].sha256 == hashlib.sha256(b"m2").hexdigest() and final.revision


def test_taints_keep_the_first_step(moto: MotoServer) -> None:
    store = make_store(moto)
    store.write_taint(Taint("run1", 30, "loss"), deadline=deadline())
    store.write_taint(Taint("run1", 40, "grad_norm"), deadline=deadline())
    store.write_taint(Taint("run2", 7, "weights"), deadline=deadline())
    found = sorted((t.run_id, t.first_step, t.witness) for t in store.taints(deadline=deadline()))
    assert found == [("run1", 30, "loss"), ("run2", 7, "weights")]


def test_discard_keeps_what_a_record_names(moto: MotoServer, tmp_path: Path) -> None:
    store = make_store(moto, part_size_bytes=5 * MIB, multipart_threshold_bytes=5 * MIB)
    f10, files10 = checkpoint(tmp_path, 10)
    f20, files20 = checkpoint(tmp_path, 20)
    store.write_record([put(store, f10, files10, 10)], deadline=deadline())
    put(store, f20, files20, 20)
    client = store.io.client
    client.create_multipart_upload(Bucket=store.bucket, Key="runs/r1/.guard/staging/run1/step-20/node-0/x.bin")
    store.discard(run_id="run1", step=None, deadline=deadline())
    left = {o["Key"] for o in client.list_objects_v2(Bucket=store.bucket, Prefix="runs/r1/.guard/staging/")
            .get("Contents", [])}
    assert left and all("/step-10/" in k for k in left)
    assert not client.list_multipart_uploads(Bucket=store.bucket, Prefix="runs/r1/.guard/staging/run1/step-20/")\
        .get("Uploads")
    record = store.read_record(deadline=deadline())
    assert record is not None and store.fetch(record, tmp_path / "back", deadline=deadline()).step == 10


# -- faults ---------------------------------------------------------------------------------------------------


def test_slowdown_once_is_retried_by_the_client(moto: MotoServer, proxy: FaultProxy, tmp_path: Path) -> None:
    store = make_store(moto, proxy.url)
    folder, files = checkpoint(tmp_path, 10)
    proxy.inject(Fault("status", status=503, code="SlowDown", methods=("PUT",), path_contains="config.json"))
    part = put(store, folder, files, 10)
    assert part.files["config.json"].sha256 == sha(folder / "config.json")
    assert [s for m, p, s in proxy.requests if m == "PUT" and "config.json" in p] == [503, 200]


def test_slowdown_that_persists_is_transient(moto: MotoServer, proxy: FaultProxy, tmp_path: Path) -> None:
    store = make_store(moto, proxy.url)
    folder, files = checkpoint(tmp_path, 10)
    proxy.inject(Fault("status", count=100, status=503, code="SlowDown", methods=("PUT",)))
    with pytest.raises(TransientDestinationError, match="SlowDown"):
        put(store, folder, files, 10)


def test_server_error_on_the_record_leaves_it_as_it_was(moto: MotoServer, proxy: FaultProxy,
                                                        tmp_path: Path) -> None:
    store = make_store(moto, proxy.url)
    f10, files10 = checkpoint(tmp_path, 10)
    f20, files20 = checkpoint(tmp_path, 20)
    store.write_record([put(store, f10, files10, 10)], deadline=deadline())
    p20 = put(store, f20, files20, 20)
    proxy.inject(Fault("status", count=100, status=500, methods=("PUT",), path_contains=RECORD_NAME))
    with pytest.raises(TransientDestinationError):
        store.write_record([p20], deadline=deadline())
    record = store.read_record(deadline=deadline())
    assert record is not None and record.step == 10


def test_a_stalled_endpoint_ends_at_the_deadline(moto: MotoServer, proxy: FaultProxy, tmp_path: Path) -> None:
    store = make_store(moto, proxy.url, read_timeout=30)
    folder, files = checkpoint(tmp_path, 10)
    proxy.inject(Fault("stall", count=100, methods=("PUT",), stall_s=30))
    started = time.monotonic()
    with pytest.raises(DestinationError, match="before the deadline"):
        store.put_part(folder, files, run_id="run1", step=10, node_rank=0, nodes=1, place=None, source=None,
                       deadline=time.monotonic() + 2.0)
    assert time.monotonic() - started < 10  # a bound, not a timing measurement: the stall lasts 30 s


def test_connection_cut_mid_multipart(moto: MotoServer, proxy: FaultProxy, tmp_path: Path) -> None:
    """A part's connection cut mid-body is retried by the client (the part is sent again whole); a cut that
    persists fails the put as transient and the unfinished upload is aborted."""
    store = make_store(moto, proxy.url, part_size_bytes=5 * MIB, multipart_threshold_bytes=5 * MIB)
    folder, files = checkpoint(tmp_path, 10, big_bytes=11 * MIB)
    proxy.inject(Fault("cut", methods=("PUT",), path_contains="partNumber=2", cut_after_bytes=MIB))
    part = put(store, folder, files, 10)
    assert part.files["model.safetensors"].sha256 == sha(folder / "model.safetensors")
    assert any(s == 0 and "partNumber=2" in p for _, p, s in proxy.requests)

    proxy.inject(Fault("cut", count=100, methods=("PUT",), path_contains="partNumber=3", cut_after_bytes=MIB))
    with pytest.raises(TransientDestinationError):
        put(store, folder, files, 11)
    uploads = store.io.client.list_multipart_uploads(Bucket=store.bucket, Prefix="runs/r1/.guard/staging/run1/"
                                                                                 "step-11/")
    assert not uploads.get("Uploads")


# -- probe (preflight) ----------------------------------------------------------------------------------------


def test_probe_passes_and_leaves_nothing(moto: MotoServer) -> None:
    store = make_store(moto)
    store.probe(deadline=deadline())
    assert not store.io.client.list_objects_v2(Bucket=store.bucket).get("Contents")


def test_probe_missing_bucket(moto: MotoServer) -> None:
    store = make_store(moto, bucket="no-such-bucket-here")
    with pytest.raises(DestinationError) as err:
        store.probe(deadline=deadline())
    assert "bucket no-such-bucket-here does not exist" in err.value.message, err.value.message


def test_probe_no_credentials(monkeypatch: pytest.MonkeyPatch, moto: MotoServer) -> None:
    for name in CREDENTIALS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    store = S3Store.from_url(f"s3://{moto.bucket()}/x")
    with pytest.raises(DestinationError, match="no AWS credentials") as err:
        store.probe(deadline=deadline())
    assert "AWS_ACCESS_KEY_ID" in err.value.hint


def test_standard_configuration_reaches_the_endpoint(monkeypatch: pytest.MonkeyPatch, moto: MotoServer) -> None:
    """AWS_ENDPOINT_URL, the keys and AWS_REGION (not AWS_DEFAULT_REGION) are all the store needs."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    store = S3Store.from_url(f"s3://{moto.bucket()}/x")
    assert store.io.client.meta.region_name == "eu-west-3"
    store.probe(deadline=deadline())


def test_probe_endpoint_that_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.s3server import free_port

    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    store = S3Store.from_url("s3://some-bucket/x", request_timeout_s=2)
    with pytest.raises(TransientDestinationError) as err:
        store.probe(deadline=deadline(20))
    assert "AWS_ENDPOINT_URL" in err.value.hint


def test_the_aws_secrets_are_masked() -> None:
    """The standard AWS variables are secrets by the contract's rule (names with KEY, SECRET, TOKEN)."""
    from guard.core.masking import MASK, Masker

    environ = {**CREDENTIALS, "AWS_SESSION_TOKEN": "IQoJb3JpZ2luX2VjEJr//////////wEaCXVzLWVhc3QtMSJHMEUCIQ",
               "AWS_ENDPOINT_URL": "http://127.0.0.1:9000", "AWS_PROFILE": "training"}
    masker = Masker.from_environ(environ)
    line = " ".join(environ.values()).encode()
    masked = masker.mask(line).decode()
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        assert environ[name] not in masked
    assert masked.count(MASK.decode()) >= 3 and "http://127.0.0.1:9000" in masked and "training" in masked
