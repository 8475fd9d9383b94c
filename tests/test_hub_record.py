"""What resume trusts is written only after every file verified, and a file cut short never replaces a secured copy
(guard.secure.securer, its stores and guard.secure.formats), against the local Hub server and a folder destination."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from guard.errors import HubError, PushFailedError  # noqa: E402
from guard.secure.dest.base import MANIFEST_NAME  # noqa: E402
from guard.secure.securer import Securer  # noqa: E402
from tests.hubserver import TOKENS  # noqa: E402
from tests.test_hub import TamperingApi, api, hub, local_files, remote_checkpoint, repo_id  # noqa: E402,F401


def real_checkpoint(root: Path, step: int, *, size: int = 2000) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    torch.manual_seed(step)
    torch.save({"w": torch.randn(size), "step": step}, folder / "model.pt")
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8, "step": step}))
    return folder


def cut_short(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


@pytest.mark.hub
def test_a_push_that_fails_verification_is_never_the_record(hub, repo_id, tmp_path):  # noqa: F811
    good = real_checkpoint(tmp_path / "a", 10)
    Securer(repo_id, api=TamperingApi(endpoint=hub.url, token=TOKENS["write"], times=0)).push_checkpoint(
        good, step=10, deadline=time.monotonic() + 60)
    newer = real_checkpoint(tmp_path / "b", 20)
    tampering = TamperingApi(endpoint=hub.url, token=TOKENS["write"], times=10)
    with pytest.raises(PushFailedError):
        Securer(repo_id, api=tampering).push_checkpoint(newer, step=20, deadline=time.monotonic() + 60)
    # the failed upload commits are in the history (HEAD holds the tampered files), but none is the record
    assert "not verified" in hub.commits(repo_id)[-1].title
    securer = Securer(repo_id, api=tampering)
    record = securer.peek_last_checkpoint(deadline=time.monotonic() + 60)
    assert record is not None and record.step == 10
    fetched = securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert fetched is not None and fetched.step == 10 and fetched.revision == record.revision
    assert local_files(fetched.path) == local_files(good)  # the manifest itself is not put into the job's folder
    assert MANIFEST_NAME not in local_files(fetched.path)


@pytest.mark.hub
@pytest.mark.parametrize("before", ["nothing", "a user's own last-checkpoint"])
def test_an_unverified_upload_is_never_resumed_when_no_record_exists_yet(hub, api, repo_id, tmp_path,  # noqa: F811
                                                                        before):
    """Issue 33 item 7: the first push of a run failed verification, so the repo has the guard's upload commit at
    HEAD and no record. Resume used to fall back to HEAD and restore the half-written files as the secured step;
    now it reads below every unverified upload: nothing, or what something else pushed there before."""
    from huggingface_hub import CommitOperationAdd

    api.create_repo(repo_id, private=True, exist_ok=True)
    own = None
    if before != "nothing":
        own = real_checkpoint(tmp_path / "own", 7)
        (own / "trainer_state.json").write_text(json.dumps({"global_step": 7}))  # a Trainer's, pushed by hand
        api.create_commit(repo_id, [CommitOperationAdd(f"last-checkpoint/{p.name}", p.read_bytes())
                                    for p in sorted(own.iterdir())], commit_message="my own checkpoint")
    tampering = TamperingApi(endpoint=hub.url, token=TOKENS["write"], times=10)
    with pytest.raises(PushFailedError):
        Securer(repo_id, api=tampering).push_checkpoint(real_checkpoint(tmp_path / "b", 20), step=20,
                                                        deadline=time.monotonic() + 60)
    assert "not verified" in hub.commits(repo_id)[-1].title  # HEAD is the guard's unverified upload
    securer = Securer(repo_id, api=api)
    record = securer.peek_last_checkpoint(deadline=time.monotonic() + 60)
    fetched = securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert record is not None and record.revision != hub.commits(repo_id)[-1].oid
    if own is None:
        assert fetched is None
    else:
        assert fetched is not None and fetched.step == 7 and local_files(fetched.path) == local_files(own)


@pytest.mark.hub
def test_fetch_checks_every_file_against_the_manifest(hub, api, repo_id, tmp_path):  # noqa: F811
    from huggingface_hub import CommitOperationAdd

    securer = Securer(repo_id, api=api)
    securer.push_checkpoint(real_checkpoint(tmp_path / "a", 5), step=5, deadline=time.monotonic() + 60)
    manifest = json.loads(hub.repo_files(repo_id)[f"last-checkpoint/{MANIFEST_NAME}"])
    manifest["files"]["model.pt"]["sha256"] = "0" * 64  # what the tree lists and what was verified disagree
    api.create_commit(repo_id, [CommitOperationAdd(f"last-checkpoint/{MANIFEST_NAME}",
                                                   json.dumps(manifest).encode())],
                      commit_message="guard: checkpoint step 6")
    with pytest.raises(HubError) as info:
        securer.fetch_last_checkpoint(tmp_path / "resume", deadline=time.monotonic() + 60)
    assert "model.pt differs from the size and sha256 recorded" in info.value.message


@pytest.mark.hub
def test_a_file_cut_short_is_never_pushed_to_the_hub(hub, api, repo_id, tmp_path):  # noqa: F811
    securer = Securer(repo_id, api=api)
    good = real_checkpoint(tmp_path / "a", 10)
    securer.push_checkpoint(good, step=10, deadline=time.monotonic() + 60)
    before = len(hub.commits(repo_id))
    torn = real_checkpoint(tmp_path / "b", 20)
    cut_short(torn / "model.pt")
    with pytest.raises(PushFailedError) as info:
        securer.push_checkpoint(torn, step=20, deadline=time.monotonic() + 60)
    assert "model.pt: not a whole zip archive" in info.value.message and "left as it was" in info.value.message
    assert len(hub.commits(repo_id)) == before and remote_checkpoint(hub, repo_id) == local_files(good)


def test_a_file_cut_short_never_replaces_the_secured_folder_copy(tmp_path):
    securer = Securer(str(tmp_path / "dest"))
    good = real_checkpoint(tmp_path / "a", 10)
    securer.push_checkpoint(good, step=10, deadline=time.monotonic() + 60)
    torn = real_checkpoint(tmp_path / "b", 20)
    cut_short(torn / "model.pt")
    with pytest.raises(PushFailedError):
        securer.push_checkpoint(torn, step=20, deadline=time.monotonic() + 60)
    secured = tmp_path / "dest" / "last-checkpoint"
    assert torch.load(secured / "model.pt")["step"] == 10
    assert json.loads((secured / MANIFEST_NAME).read_text())["step"] == 10


def test_the_copy_is_checked_by_format_before_the_swap(tmp_path, monkeypatch):
    """A file whose bytes change during the copy with its size, mtime and inode restored (so the signature check
    cannot see it) is still refused: the staged copy itself is checked before it is swapped in."""
    from guard.secure.dest import local

    securer = Securer(str(tmp_path / "dest"))
    good = real_checkpoint(tmp_path / "a", 10)
    securer.push_checkpoint(good, step=10, deadline=time.monotonic() + 60)
    newer = real_checkpoint(tmp_path / "b", 20)
    real_copy = local.copy_and_hash

    def tearing_copy(src: Path, dst: Path) -> tuple[int, str]:
        found = real_copy(src, dst)
        if dst.name == "model.pt":
            data = dst.read_bytes()
            dst.write_bytes(data[:-22] + b"\0" * 22)  # the end-of-central-directory record gone
        return found

    monkeypatch.setattr(local, "copy_and_hash", tearing_copy)
    with pytest.raises(PushFailedError) as info:
        securer.push_checkpoint(newer, step=20, deadline=time.monotonic() + 60)
    assert "copied files are not whole" in info.value.message
    assert torch.load(tmp_path / "dest" / "last-checkpoint" / "model.pt")["step"] == 10
