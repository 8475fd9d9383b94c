"""guard.secure.securer with the folder and Hub stores: destinations, verified pushes, bounded retries, fetching back.

Against the local Hub and tmp folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from fakes import SleepClock

from guard.errors import HubError, PushFailedError, UsageError
from guard.secure.dest import Destination, local, parse_destination
from guard.secure.dest.base import MANIFEST_NAME
from guard.secure.dest.local import final_model_files
from guard.secure.hubhttp import install_request_bounds
from guard.secure.securer import PushResult, Securer
from tests.hubserver import TOKENS, HubServer, client_constants

pytest.importorskip("huggingface_hub")
from huggingface_hub import CommitOperationAdd, HfApi

# -- destinations (no server) ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "kind", "repo_id", "repo_type", "canonical"), [
    ("hf://alice/run-1", "hub", "alice/run-1", "model", "hf://alice/run-1"),
    ("hf://alice/run-1/", "hub", "alice/run-1", "model", "hf://alice/run-1"),
    ("hf://models/alice/run.1", "hub", "alice/run.1", "model", "hf://alice/run.1"),
    ("hf://datasets/acme/ckpts", "hub", "acme/ckpts", "dataset", "hf://datasets/acme/ckpts"),
    ("acme/My_Model", "hub", "acme/My_Model", "model", "hf://acme/My_Model"),
])
def test_parse_hub_destinations(text, kind, repo_id, repo_type, canonical):
    dest = parse_destination(text)
    assert (dest.kind, dest.repo_id, dest.repo_type, dest.path) == (kind, repo_id, repo_type, None)
    assert str(dest) == canonical and parse_destination(str(dest)) == dest


@pytest.mark.parametrize("text", ["/srv/ckpt", "./out/secured", "../secured", "file:///srv/ckpt", "file://rel/dir"])
def test_parse_folder_destinations(text, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dest = parse_destination(text)
    expected = Path(os.path.abspath(text.removeprefix("file://")))
    assert dest == Destination("folder", path=expected) and str(dest) == str(expected)


@pytest.mark.parametrize("text", ["", "  ", "alice", "a/b/c", "hf://", "hf://alice", "hf://spaces/a/b",
                                  "~/ckpt", "out/ckpt/x", "hf://alice/bad--name",
                                  "alice/.hidden", "alice/x.git", "file://", "http://host/a", "alice/a b"])
def test_parse_refuses_other_forms(text):
    with pytest.raises(UsageError) as info:
        parse_destination(text)
    assert info.value.option == "--push-to"
    assert "hf://datasets/NS/NAME" in info.value.message and "file://" in info.value.message
    assert info.value.hint


def test_final_model_files_skip_checkpoints_runs_and_private_files(tmp_path):
    for rel in ("model.safetensors", "config.json", "sub/tokenizer.json", "checkpoint-5/model.safetensors",
                "last-checkpoint/x.bin", "runs/events.out", ".hidden", "_tmp/x", "sub/.DS_Store",
                "checkpoint-notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    assert final_model_files(tmp_path) == ["checkpoint-notes.txt", "config.json", "model.safetensors",
                                           "sub/tokenizer.json"]


def test_push_result_reports_pushed_and_throughput():
    result = PushResult("hf://a/b", "f" * 40, ("x",), 4_000_000, 2.0, 1, 7)
    assert result.pushed == "hf://a/b@" + "f" * 40 and result.bytes_per_s == 2_000_000
    assert PushResult("hf://a/b", "r", (), 10, 0.0, 1).bytes_per_s == 0.0


# -- Hub destinations -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub():
    with client_constants(), HubServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean_faults(request):
    yield
    if "hub" in request.fixturenames:
        request.getfixturevalue("hub").reset_faults()


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKENS["write"])


@pytest.fixture
def repo_id():
    return f"alice/run-{uuid.uuid4().hex[:10]}"


def make_checkpoint(root: Path, step: int, *, trainer_state: bool = True,
                    extra: dict[str, bytes] | None = None) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "step": step}))
    # opaque bytes: a random .pt starting with 0x80 would be read as a pickle cut short (format check), 1 in 256
    (folder / "model.safetensors").write_bytes(os.urandom(96 * 1024))
    (folder / "optimizer.pt").write_bytes(b"\0" + os.urandom(48 * 1024 - 1))
    (folder / "sub").mkdir()
    (folder / "sub" / "rng_state.txt").write_text(f"rng {step}")
    if trainer_state:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": 0.5}))
    for rel, data in (extra or {}).items():
        (folder / rel).write_bytes(data)
    return folder


def remote_checkpoint(hub: HubServer, repo_id: str) -> dict[str, bytes]:
    """The checkpoint's files at the destination, without the guard's manifest (the record, checked apart)."""
    prefix = "last-checkpoint/"
    return {p[len(prefix):]: data for p, data in hub.repo_files(repo_id).items()
            if p.startswith(prefix) and p != prefix + MANIFEST_NAME}


def remote_manifest(hub: HubServer, repo_id: str) -> dict:
    return json.loads(hub.repo_files(repo_id)["last-checkpoint/" + MANIFEST_NAME])


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.hub
def test_push_creates_private_repo_with_identical_files(hub, api, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path, 7)
    result = Securer(f"hf://{repo_id}", api=api).push_checkpoint(ckpt, step=7, deadline=time.monotonic() + 60)
    assert hub.is_private(repo_id)
    assert remote_checkpoint(hub, repo_id) == local_files(ckpt)
    *_, upload, head = hub.commits(repo_id)
    assert result.revision == head.oid and head.title == "guard: checkpoint step 7"
    # the files came in the commit before, which the record names as verified; the record holds every sha256
    manifest = remote_manifest(hub, repo_id)
    assert manifest["verified_commit"] == upload.oid and "checkpoint step" not in upload.title
    assert manifest["step"] == 7 and manifest["files"] == {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for rel, data in local_files(ckpt).items()}
    assert result.pushed == f"hf://{repo_id}@{head.oid}" and result.attempts == 1 and result.step == 7
    assert result.files == tuple(sorted(local_files(ckpt))) and result.size_bytes == sum(
        len(d) for d in local_files(ckpt).values())


@pytest.mark.hub
def test_second_push_replaces_last_checkpoint_in_one_commit(hub, api, repo_id, tmp_path):
    securer = Securer(repo_id, api=api)
    securer.push_checkpoint(make_checkpoint(tmp_path / "a", 10), step=10, deadline=time.monotonic() + 60)
    commits_before = len(hub.commits(repo_id))
    newer = make_checkpoint(tmp_path / "b", 20)
    (newer / "sub" / "rng_state.txt").unlink()
    (newer / "scheduler.pt").write_bytes(b"\x00sched")
    result = securer.push_checkpoint(newer, step=20, deadline=time.monotonic() + 60)
    commits = hub.commits(repo_id)
    assert len(commits) == commits_before + 2 and commits[-1].oid == result.revision  # the files, then the record
    assert commits[-2].deleted == ("last-checkpoint/guard_manifest.json", "last-checkpoint/sub/rng_state.txt")
    assert remote_checkpoint(hub, repo_id) == local_files(newer)


@pytest.mark.hub
def test_server_errors_are_retried_with_backoff(hub, api, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path, 3)
    hub.inject(status=500, count=2, path_contains="/commit/")
    clock = SleepClock()
    securer = Securer(repo_id, api=api, clock=clock, sleep=clock.sleep)
    hub.requests.clear()
    result = securer.push_checkpoint(ckpt, step=3, deadline=clock() + 120)
    assert result.attempts == 3 and clock.sleeps == [1.0, 2.0]
    commit_statuses = [r.status for r in hub.requests if "/commit/" in r.path]
    assert commit_statuses == [500, 500, 200, 200]  # the files, then the record
    xorbs = [r.path for r in hub.requests if r.method == "POST" and "/cas/v1/xorbs/" in r.path]
    assert xorbs and len(xorbs) == len(set(xorbs))  # the LFS files' data (Xet xorbs) sent once, not per attempt
    assert remote_checkpoint(hub, repo_id) == local_files(ckpt)


@pytest.mark.hub
def test_server_down_fails_within_the_deadline(hub, api, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path, 3)
    clock = SleepClock()
    deadline = clock() + 20
    hub.set_down(True)
    with pytest.raises(PushFailedError) as info:
        Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(ckpt, step=3, deadline=deadline)
    err = info.value
    assert err.attempts >= 3 and clock() <= deadline
    assert "#1 " in err.message and f"#{err.attempts} " in err.message and err.destination == f"hf://{repo_id}"
    assert clock.sleeps[:3] == [1.0, 2.0, 4.0]
    assert not hub.repo_exists(repo_id)


@pytest.mark.hub
def test_latency_beyond_the_deadline_fails_instead_of_hanging(hub, api, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path, 3)
    hub.inject(latency_s=30)
    outcome: list[BaseException] = []

    def push() -> None:
        try:
            Securer(repo_id, api=api).push_checkpoint(ckpt, step=3, deadline=time.monotonic() + 1.0)
        except BaseException as err:  # handed to the test thread
            outcome.append(err)

    worker = threading.Thread(target=push, daemon=True)
    worker.start()
    worker.join(timeout=20)  # a generous bound: the push itself must give up after about 1 s
    assert not worker.is_alive(), "push_checkpoint did not return although its deadline had passed"
    assert len(outcome) == 1 and isinstance(outcome[0], PushFailedError)
    assert "deadline" in outcome[0].message


@pytest.mark.hub
def test_deadline_already_passed_sends_nothing(hub, api, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path, 3)
    clock = SleepClock()
    hub.requests.clear()
    with pytest.raises(PushFailedError) as info:
        Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(ckpt, step=3, deadline=clock())
    assert info.value.attempts == 0 and hub.requests == []


@pytest.mark.hub
def test_read_only_token_fails_at_once(hub, hub_url_api_read, repo_id, tmp_path):
    clock = SleepClock()
    with pytest.raises(PushFailedError) as info:
        Securer("alice/existing-model", api=hub_url_api_read, clock=clock, sleep=clock.sleep).push_checkpoint(
            make_checkpoint(tmp_path, 1), step=1, deadline=clock() + 60)
    assert info.value.attempts == 1 and clock.sleeps == []
    assert "HTTP 403" in info.value.message and "write" in info.value.hint


@pytest.fixture
def hub_url_api_read(hub):
    return HfApi(endpoint=hub.url, token=TOKENS["read"])


@pytest.mark.hub
def test_verify_catches_files_the_hub_did_not_keep(hub, api, repo_id, tmp_path):
    api.create_repo(repo_id, private=True)
    api.upload_file(repo_id=repo_id, path_in_repo=".gitignore", path_or_fileobj=b"*.pt\n")
    clock = SleepClock()
    with pytest.raises(PushFailedError) as info:
        Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(
            make_checkpoint(tmp_path, 4), step=4, deadline=clock() + 60)
    assert "last-checkpoint/optimizer.pt missing" in info.value.message
    assert info.value.attempts == 2  # a mismatch is tried once more, not until the deadline


class TamperingApi(HfApi):
    """Sends different bytes of the same size for ``config.json`` than the local file holds, the first ``times``
    commits (as if the file had changed between the guard's read and the upload)."""

    def __init__(self, *args, times: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.times = times

    def create_commit(self, repo_id, operations, **kwargs):
        if self.times > 0:
            self.times -= 1
            operations = [CommitOperationAdd(op.path_in_repo, Path(op.path_or_fileobj).read_bytes().replace(b"8", b"9"))
                          if getattr(op, "path_in_repo", "").endswith("config.json") else op for op in operations]
        return super().create_commit(repo_id, operations, **kwargs)


@pytest.mark.hub
def test_verify_compares_regular_files_by_git_sha1_and_retries_once(hub, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path, 5)
    clock = SleepClock()
    api = TamperingApi(endpoint=hub.url, token=TOKENS["write"], times=1)
    result = Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(
        ckpt, step=5, deadline=clock() + 60)
    assert result.attempts == 2 and remote_checkpoint(hub, repo_id) == local_files(ckpt)

    api.times = 5
    with pytest.raises(PushFailedError) as info:
        Securer(repo_id, api=api, clock=clock, sleep=clock.sleep).push_checkpoint(ckpt, step=5, deadline=clock() + 60)
    assert "last-checkpoint/config.json git sha1" in info.value.message


@pytest.mark.hub
def test_push_final_uploads_only_what_differs(hub, api, repo_id, tmp_path):
    out = tmp_path / "out"
    make_checkpoint(out, 9)
    (out / "runs").mkdir()
    (out / "runs" / "events").write_text("tb")
    (out / "model.safetensors").write_bytes(os.urandom(128 * 1024))
    (out / "config.json").write_text('{"v": 1}')
    (out / "tokenizer.json").write_text('{"vocab": {}}')
    (out / ".secret").write_text("x")
    securer = Securer(repo_id, api=api)
    first = securer.push_final(out, deadline=time.monotonic() + 60)
    assert first.files == ("config.json", "model.safetensors", "tokenizer.json") and first.step is None
    assert set(hub.repo_files(repo_id)) == {".gitattributes", "config.json", "model.safetensors", "tokenizer.json"}

    (out / "config.json").write_text('{"v": 2}')
    hub.requests.clear()
    second = securer.push_final(out, deadline=time.monotonic() + 60)
    assert not [r for r in hub.requests if r.method == "PUT" or "/cas/v1/xorbs/" in r.path]  # weights not sent again
    assert hub.commits(repo_id)[-1].added == ("config.json",) and second.revision == hub.commits(repo_id)[-1].oid
    assert hub.repo_files(repo_id)["config.json"] == b'{"v": 2}'

    commits = len(hub.commits(repo_id))
    third = securer.push_final(out, deadline=time.monotonic() + 60)
    assert len(hub.commits(repo_id)) == commits and third.revision == second.revision


@pytest.mark.hub
def test_push_final_refuses_an_output_folder_without_model_files(api, repo_id, tmp_path):
    make_checkpoint(tmp_path / "out", 1)
    with pytest.raises(PushFailedError, match="no model files"):
        Securer(repo_id, api=api).push_final(tmp_path / "out", deadline=time.monotonic() + 60)


@pytest.mark.hub
@pytest.mark.parametrize("trainer_state", [True, False])
def test_fetch_round_trip(hub, api, repo_id, tmp_path, trainer_state):
    ckpt = make_checkpoint(tmp_path / "src", 42, trainer_state=trainer_state)
    securer = Securer(repo_id, api=api)
    pushed = securer.push_checkpoint(ckpt, step=42, deadline=time.monotonic() + 60)
    api.upload_file(repo_id=repo_id, path_in_repo="README.md", path_or_fileobj=b"# later commit\n")
    fetched = securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert fetched is not None and fetched.step == 42  # from trainer_state.json, or from the commit title
    assert fetched.path == tmp_path / "resume" / "checkpoint-42" and local_files(fetched.path) == local_files(ckpt)
    assert fetched.revision == pushed.revision  # the commit the guard recorded, not a later HEAD
    assert sorted(os.listdir(tmp_path / "resume")) == ["checkpoint-42"]  # no staging left behind


@pytest.mark.hub
def test_fetch_keeps_an_identical_local_copy_and_moves_a_partial_one_aside(hub, api, repo_id, tmp_path):
    ckpt = make_checkpoint(tmp_path / "src", 30)
    securer = Securer(repo_id, api=api)
    securer.push_checkpoint(ckpt, step=30, deadline=time.monotonic() + 60)
    out = tmp_path / "out"
    first = securer.fetch_last_checkpoint(out, deadline=time.monotonic() + 60)
    inode = first.path.stat().st_ino
    again = securer.fetch_last_checkpoint(out, deadline=time.monotonic() + 60)
    assert again.path == first.path and first.path.stat().st_ino == inode
    (first.path / "optimizer.pt").unlink()  # a save killed half way
    fixed = securer.fetch_last_checkpoint(out, deadline=time.monotonic() + 60)
    assert local_files(fixed.path) == local_files(ckpt)
    (aside,) = [p for p in out.iterdir() if p.name.startswith(".checkpoint-30.replaced-")]
    assert "optimizer.pt" not in local_files(aside)


@pytest.mark.hub
def test_fetch_refuses_a_corrupt_copy(hub, api, repo_id, tmp_path):
    securer = Securer(repo_id, api=api)
    securer.push_checkpoint(make_checkpoint(tmp_path / "src", 8), step=8, deadline=time.monotonic() + 60)
    hub.corrupt(repo_id, "last-checkpoint/model.safetensors")
    with pytest.raises(HubError) as info:
        securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert not isinstance(info.value, PushFailedError)
    assert "model.safetensors sha256 differs" in info.value.message
    assert os.listdir(tmp_path / "resume") == []


@pytest.mark.hub
def test_fetch_from_an_empty_destination_is_none(hub, api, tmp_path):
    for target in (f"alice/missing-{uuid.uuid4().hex[:8]}", "alice/existing-model"):
        assert Securer(target, api=api).fetch_last_checkpoint(tmp_path, deadline=time.monotonic() + 60) is None
    assert os.listdir(tmp_path) == []


def test_request_bounds_replace_the_unbounded_client():
    from huggingface_hub.utils import get_session

    install_request_bounds()
    timeout = get_session().timeout
    assert (timeout.connect, timeout.read, timeout.write) == (10.0, 60.0, 60.0)


# -- folder destinations --------------------------------------------------------------------------------------


def test_folder_push_swaps_in_a_verified_copy(tmp_path):
    dest = tmp_path / "dest"
    securer = Securer(f"file://{dest}")
    first = securer.push_checkpoint(make_checkpoint(tmp_path / "a", 1), step=1, deadline=time.monotonic() + 60)
    newer = make_checkpoint(tmp_path / "b", 2)
    (newer / "sub" / "rng_state.txt").unlink()
    result = securer.push_checkpoint(newer, step=2, deadline=time.monotonic() + 60)
    target = dest / "last-checkpoint"
    assert result.revision == first.revision == str(target) and result.pushed == str(target)
    copied = local_files(target)
    manifest = json.loads(copied.pop(MANIFEST_NAME))
    assert copied == local_files(newer)
    assert manifest["step"] == 2 and set(manifest["files"]) == set(local_files(newer))
    # no staging left; the record before it kept aside (a taint reaching step 2 swaps it back) until the run's end
    assert sorted(os.listdir(dest)) == [".last-checkpoint.kept", "last-checkpoint"]
    securer.tidy()
    assert sorted(os.listdir(dest)) == ["last-checkpoint"]


def test_folder_push_failure_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    dest = tmp_path / "dest"
    securer = Securer(str(dest))
    old = make_checkpoint(tmp_path / "a", 1)
    securer.push_checkpoint(old, step=1, deadline=time.monotonic() + 60)
    real_copy, calls = local.copy_and_hash, []

    def failing_copy(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_copy(src, dst)

    monkeypatch.setattr(local, "copy_and_hash", failing_copy)
    with pytest.raises(PushFailedError) as info:
        securer.push_checkpoint(make_checkpoint(tmp_path / "b", 2), step=2, deadline=time.monotonic() + 60)
    assert "No space left" in info.value.message and info.value.attempts == 1
    copied = local_files(dest / "last-checkpoint")
    assert json.loads(copied.pop(MANIFEST_NAME))["step"] == 1 and copied == local_files(old)
    assert sorted(os.listdir(dest)) == ["last-checkpoint"]


def test_folder_push_links_unchanged_files_from_the_previous_copy(tmp_path, monkeypatch):
    dest, src = tmp_path / "dest", tmp_path / "src"
    securer = Securer(str(dest))
    ckpt = make_checkpoint(src, 1)
    securer.push_checkpoint(ckpt, step=1, deadline=time.monotonic() + 60)
    target = dest / "last-checkpoint"
    inodes = {rel: (target / rel).stat().st_ino for rel in local_files(ckpt)}
    # The next save: the optimizer state changed, every other file is byte for byte the same (same size too).
    (ckpt / "optimizer.pt").write_bytes(b"\0" + os.urandom(48 * 1024 - 1))
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 1, "epoch": 0.6}))
    result = securer.push_checkpoint(ckpt, step=2, deadline=time.monotonic() + 60)
    copied = local_files(target)
    manifest = json.loads(copied.pop(MANIFEST_NAME))
    assert copied == local_files(ckpt) and manifest["step"] == 2 and result.size_bytes == sum(map(len, copied.values()))
    relinked = {rel for rel in copied if (target / rel).stat().st_ino == inodes[rel]}
    assert relinked == {"config.json", "model.safetensors", "sub/rng_state.txt"}
    assert securer.last_copy is not None and securer.last_copy.reused_files == 3
    assert securer.last_copy.copied_bytes == len(copied["optimizer.pt"]) + len(copied["trainer_state.json"])
    assert sorted(os.listdir(dest)) == [".last-checkpoint.kept", "last-checkpoint"]

    # A previous copy damaged on the destination's disk (same size, other bytes) is never linked into the new one.
    model = target / "model.safetensors"
    model.write_bytes(os.urandom(model.stat().st_size))
    securer.push_checkpoint(ckpt, step=3, deadline=time.monotonic() + 60)
    assert (target / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()

    # Where hard links are refused, files are copied as before.
    def no_links(*args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    securer.push_checkpoint(ckpt, step=4, deadline=time.monotonic() + 60)
    copied = local_files(target)
    assert json.loads(copied.pop(MANIFEST_NAME))["step"] == 4 and copied == local_files(ckpt)
    assert securer.last_copy.reused_files == 0


def test_folder_push_final_rewrites_only_changed_files(tmp_path):
    out, dest = tmp_path / "out", tmp_path / "dest"
    out.mkdir()
    (out / "model.safetensors").write_bytes(os.urandom(4096))
    (out / "config.json").write_text("1")
    securer = Securer(str(dest))
    securer.push_final(out, deadline=time.monotonic() + 60)
    inodes = {name: (dest / name).stat().st_ino for name in ("model.safetensors", "config.json")}
    (out / "config.json").write_text("2")
    result = securer.push_final(out, deadline=time.monotonic() + 60)
    assert result.revision == str(dest) and (dest / "config.json").read_text() == "2"
    assert (dest / "model.safetensors").stat().st_ino == inodes["model.safetensors"]
    assert (dest / "config.json").stat().st_ino != inodes["config.json"]


@pytest.mark.parametrize("trainer_state", [True, False])
def test_folder_fetch_round_trip(tmp_path, trainer_state):
    securer = Securer(str(tmp_path / "dest"))
    ckpt = make_checkpoint(tmp_path / "src", 12, trainer_state=trainer_state)
    securer.push_checkpoint(ckpt, step=12, deadline=time.monotonic() + 60)
    fetched = securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert fetched is not None and fetched.step == 12 and fetched.path.name == "checkpoint-12"
    assert local_files(fetched.path) == local_files(ckpt)  # the manifest stays at the destination


def test_folder_fetch_refuses_a_corrupt_copy_and_empty_is_none(tmp_path):
    securer = Securer(str(tmp_path / "dest"))
    assert securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60) is None
    securer.push_checkpoint(make_checkpoint(tmp_path / "src", 3), step=3, deadline=time.monotonic() + 60)
    weights = tmp_path / "dest" / "last-checkpoint" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(HubError, match=r"model\.safetensors differs from the manifest"):
        securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert os.listdir(tmp_path / "resume") == []


@pytest.mark.hub
def test_a_push_logs_its_progress_in_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:

    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(3_000_000))
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    seen: list[int] = []

    class Recorder:
        def __init__(self, *a: object, **k: object) -> None:
            self.done_bytes = 0

        def update(self, done_bytes: int | None = None) -> None:
            self.done_bytes = done_bytes or 0
            seen.append(self.done_bytes)

    # Xet off: the bytes counted are the ones the guard's HTTP transport sends (hubhttp.PROGRESS), the plain LFS
    # path; hf_xet sends its bytes through its own client, not counted there (its progress callback is off with the
    # progress bars), so with Xet on this progress stays at the API calls' bytes. A stalled push is still seen
    # (worker.py counts the process's I/O).
    with HubServer() as server, client_constants(xet=False):
        import guard.observe.telemetry

        original = guard.observe.telemetry.Progress
        guard.observe.telemetry.Progress = Recorder  # type: ignore[misc]
        try:
            api = HfApi(endpoint=server.url, token=TOKENS["write"])
            Securer("alice/progress", api=api).push_checkpoint(folder, step=3,
                                                                          deadline=time.monotonic() + 60)
        finally:
            guard.observe.telemetry.Progress = original  # type: ignore[misc]
    assert seen and seen == sorted(seen) and seen[-1] >= 3_000_000


@pytest.mark.hub
@pytest.mark.parametrize("kind", ["folder", "hub"])
def test_a_file_written_again_after_its_save_is_never_secured_under_that_step(kind, request, tmp_path, monkeypatch):
    # ckpt.pt saved at step 30 (the push gets that save's mtime), then saved again in place with step 50: the push
    # of step 30 is refused, before its copy starts and also when the rewrite lands between that check and the copy
    # (the copy's own first stat catches it); secured under step 30 it would hold step 50
    import torch

    from guard.errors import CheckpointRewrittenError

    out, dest = tmp_path / "out", tmp_path / "dest"
    out.mkdir()
    ckpt = out / "ckpt.pt"
    torch.save({"step": 30}, ckpt)
    os.utime(ckpt, (1000.0, 1000.0))
    torch.save({"step": 50}, ckpt)
    os.utime(ckpt, (1005.0, 1005.0))
    if kind == "folder":
        securer = Securer(str(dest))
    else:
        hub_server, repo_id = request.getfixturevalue("hub"), request.getfixturevalue("repo_id")
        securer = Securer(repo_id, api=request.getfixturevalue("api"))
    with pytest.raises(CheckpointRewrittenError, match=r"was rewritten after that save \(modified 5.0s later\)"):
        securer.push_checkpoint(out, step=30, files=["ckpt.pt"], saved_by_s=1000.0, deadline=time.monotonic() + 60)
    signatures = local.signatures

    def rewritten_as_the_copy_starts(folder, files):
        # the job's next save lands as the copy takes its first signatures (after the check before the push)
        torch.save({"step": 50}, ckpt)
        os.utime(ckpt, (1005.0, 1005.0))
        return signatures(folder, files)

    os.utime(ckpt, (1000.0, 1000.0))  # the file as the step-30 save left it, for the check before the push
    monkeypatch.setattr(local, "signatures", rewritten_as_the_copy_starts)
    with pytest.raises(CheckpointRewrittenError, match="no longer holds step 30"):
        securer.push_checkpoint(out, step=30, files=["ckpt.pt"], saved_by_s=1000.0, deadline=time.monotonic() + 60)
    monkeypatch.setattr(local, "signatures", signatures)
    if kind == "hub":
        assert not remote_checkpoint(hub_server, repo_id)  # nothing uploaded either time
        securer.push_checkpoint(out, step=50, files=["ckpt.pt"], saved_by_s=1005.0, deadline=time.monotonic() + 60)
        assert remote_manifest(hub_server, repo_id)["step"] == 50
        return
    assert not (dest / "last-checkpoint").exists()
    securer.push_checkpoint(out, step=50, files=["ckpt.pt"], saved_by_s=1005.0, deadline=time.monotonic() + 60)
    assert json.loads((dest / "last-checkpoint" / MANIFEST_NAME).read_text())["step"] == 50
    assert torch.load(dest / "last-checkpoint" / "ckpt.pt")["step"] == 50
