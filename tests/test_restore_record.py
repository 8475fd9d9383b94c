"""Moving a destination's record back after a taint reached it (``Securer.restore_checkpoint``, each store's
``restore_record``), on every destination: a folder (the copy kept aside swapped back), the local Hub server with
Xet (one record commit copying the older commit's files server-side: no byte uploaded again) and S3 (moto: the
record written again). What each holds is read back on its bytes, and what the next run's resume fetches."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.errors import PushFailedError
from guard.secure.securer import Securer


def checkpoint(root: Path, step: int) -> Path:
    folder = root / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.bin").write_bytes(f"weights of step {step}\n".encode() * 4000)
    (folder / "config.json").write_text(f'{{"step": {step}}}')
    return folder


def resumed_bytes(securer: Securer, into: Path) -> tuple[int, bytes]:
    """What the next run's ``--resume on`` fetches: its step and model file."""
    fetched = securer.fetch_last_checkpoint(into, deadline=time.monotonic() + 60)
    assert fetched is not None
    return fetched.step, (fetched.path / "model.bin").read_bytes()


def pushed_then_restored(securer: Securer, tmp_path: Path) -> tuple[Path, str]:
    """Steps 10 and 20 secured, then the record moved back to step 10 over the suspect step 20."""
    good = checkpoint(tmp_path / "out", 10)
    first = securer.push_checkpoint(good, step=10, deadline=time.monotonic() + 60)
    securer.push_checkpoint(checkpoint(tmp_path / "out", 20), step=20, deadline=time.monotonic() + 60)
    recorded: list[tuple[int, str]] = []
    securer.on_recorded = lambda step, revision: recorded.append((step, revision))
    result = securer.restore_checkpoint(step=10, revision=first.revision, from_step=20,
                                        deadline=time.monotonic() + 60)
    assert result.step == 10 and recorded == [(10, result.revision)]
    assert "model.bin" in result.files
    return good, result.revision


def test_a_folder_swaps_back_the_record_it_kept_aside(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    securer = Securer(str(dest))
    good, _ = pushed_then_restored(securer, tmp_path)
    assert (dest / "last-checkpoint" / "model.bin").read_bytes() == (good / "model.bin").read_bytes()
    assert securer.peek_last_checkpoint(deadline=math.inf).step == 10  # type: ignore[union-attr]
    assert resumed_bytes(Securer(str(dest)), tmp_path / "resume") == (10, (good / "model.bin").read_bytes())
    assert sorted(p.name for p in dest.iterdir()) == ["last-checkpoint"]  # the suspect copy is gone
    # nothing kept aside any more: a second restore cannot, and says so (the plan pushes again instead)
    with pytest.raises(PushFailedError, match="keeps no copy of checkpoint step 10"):
        securer.restore_checkpoint(step=10, revision=str(dest / "last-checkpoint"), deadline=time.monotonic() + 5)


def test_a_folder_restore_of_a_step_it_does_not_keep_changes_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    securer = Securer(str(dest))
    securer.push_checkpoint(checkpoint(tmp_path / "out", 10), step=10, deadline=math.inf)
    newest = checkpoint(tmp_path / "out", 20)
    securer.push_checkpoint(newest, step=20, deadline=math.inf)
    with pytest.raises(PushFailedError, match="keeps no copy of checkpoint step 5"):
        securer.restore_checkpoint(step=5, revision="", deadline=time.monotonic() + 5)
    assert (dest / "last-checkpoint" / "model.bin").read_bytes() == (newest / "model.bin").read_bytes()


def test_a_folder_drops_the_record_kept_aside_once_the_newer_one_can_no_longer_turn_suspect(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    securer = Securer(str(dest))
    securer.push_checkpoint(checkpoint(tmp_path / "out", 10), step=10, deadline=math.inf)
    securer.push_checkpoint(checkpoint(tmp_path / "out", 20), step=20, deadline=math.inf)
    assert (dest / ".last-checkpoint.kept").is_dir()
    securer.release_kept()
    assert sorted(p.name for p in dest.iterdir()) == ["last-checkpoint"]
    assert securer.peek_last_checkpoint(deadline=math.inf).step == 20  # type: ignore[union-attr]
    with pytest.raises(PushFailedError, match="keeps no copy"):
        securer.restore_checkpoint(step=10, revision="", deadline=time.monotonic() + 5)


@pytest.fixture(scope="module")
def xet_hub() -> Iterator[object]:
    from tests.hubserver import HubServer, client_constants

    with client_constants(xet=True), HubServer() as server:
        yield server


@pytest.mark.hub
def test_a_hub_repo_names_the_older_commits_files_again_without_uploading_them(xet_hub: object,
                                                                                tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    from tests.hubserver import TOKENS

    hub = xet_hub
    api = HfApi(endpoint=hub.url, token=TOKENS["write"])  # type: ignore[attr-defined]
    repo_id = f"alice/restore-{tmp_path.name[-10:]}"
    securer = Securer(repo_id, api=api)
    good = checkpoint(tmp_path / "out", 10)
    first = securer.push_checkpoint(good, step=10, deadline=time.monotonic() + 60)
    securer.push_checkpoint(checkpoint(tmp_path / "out", 20), step=20, deadline=time.monotonic() + 60)
    assert any("xet" in r.path for r in hub.requests), "the pushes did not go through Xet"  # type: ignore[attr-defined]
    before = len(hub.requests)  # type: ignore[attr-defined]
    result = securer.restore_checkpoint(step=10, revision=first.revision, from_step=20,
                                        deadline=time.monotonic() + 60)
    during = [r.path for r in hub.requests[before:]]  # type: ignore[attr-defined]
    assert not any("xet" in path for path in during), during  # the model file copied server-side, not uploaded
    commits = hub.commits(repo_id)  # type: ignore[attr-defined]
    assert commits[-1].title == "guard: checkpoint step 10" and result.revision != first.revision
    record = Securer(repo_id, api=api).peek_last_checkpoint(deadline=time.monotonic() + 60)
    assert record is not None and (record.step, record.revision) == (10, result.revision)
    assert resumed_bytes(Securer(repo_id, api=api), tmp_path / "resume") == (10, (good / "model.bin").read_bytes())


def test_an_s3_record_is_written_again_naming_the_older_step(moto_server: object, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.s3server import env

    for key, value in env(moto_server.url).items():  # type: ignore[attr-defined]
        monkeypatch.setenv(key, value)
    bucket = moto_server.bucket()  # type: ignore[attr-defined]
    securer = Securer(f"s3://{bucket}/runs/r", run_id="run-a")
    good, _ = pushed_then_restored(securer, tmp_path)
    record = securer.store.read_record(deadline=time.monotonic() + 60)
    assert record is not None and (record.step, record.restored_from) == (10, 20)
    assert resumed_bytes(Securer(f"s3://{bucket}/runs/r"), tmp_path / "resume") == (
        10, (good / "model.bin").read_bytes())


def test_an_s3_record_moves_back_to_the_record_a_resumed_run_was_fetched_from(moto_server: object, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Run b resumed from run a's step 10 and recorded its own step 20, which a taint then reached: the record goes
    back to run a's step 10 (found through the previous record: run b holds no part of step 10)."""
    from tests.s3server import env

    for key, value in env(moto_server.url).items():  # type: ignore[attr-defined]
        monkeypatch.setenv(key, value)
    url = f"s3://{moto_server.bucket()}/runs/r"  # type: ignore[attr-defined]
    good = checkpoint(tmp_path / "a", 10)
    first = Securer(url, run_id="run-a").push_checkpoint(good, step=10, deadline=time.monotonic() + 60)
    resumed = Securer(url, run_id="run-b")
    resumed.push_checkpoint(checkpoint(tmp_path / "b", 20), step=20, deadline=time.monotonic() + 60)
    resumed.restore_checkpoint(step=10, revision=first.revision, from_step=20, deadline=time.monotonic() + 60)
    record = resumed.store.read_record(deadline=time.monotonic() + 60)
    assert record is not None and (record.run_id, record.step, record.restored_from) == ("run-a", 10, 20)
    assert resumed_bytes(Securer(url), tmp_path / "resume") == (10, (good / "model.bin").read_bytes())
