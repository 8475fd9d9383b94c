"""The config and split a script asks of a Hub dataset exist (the real client, the local Hub server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from guard.preflight import PreflightOptions, run_preflight
from guard.preflight.data import HubSplit, check_hub_splits, find_hub_splits
from guard.preflight.hub import HubProbe
from tests.hubserver import HubServer

pytestmark = pytest.mark.hub


@pytest.fixture(autouse=True)
def _online_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)  # the client's default (tests/xetcas.py)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo("acme/corpus", {"data/train-00000-of-00001.parquet": b"PAR1...PAR1",
                                        "data/test-00000-of-00001.parquet": b"PAR1...PAR1",
                                        "README.md": b"# corpus\n"}, repo_type="dataset")
        server.add_repo("acme/multi", {"en/train.jsonl": b"{}\n", "fr/train.jsonl": b"{}\n"}, repo_type="dataset")
        yield server


def script(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text("from datasets import load_dataset\n" + text)
    return path


def test_the_scripts_load_dataset_calls_are_read(tmp_path: Path) -> None:
    path = script(tmp_path, 'a = load_dataset("acme/corpus", split="train[:10%]+test")\n'
                            'b = load_dataset("acme/multi", "fr", split="train")\n'
                            'c = load_dataset("acme/corpus")\n'
                            'd = load_dataset("parquet", data_files="x/*.parquet", split="train")\n')
    assert find_hub_splits(path) == [HubSplit("acme/corpus", None, ("train", "test")),
                                     HubSplit("acme/multi", "fr", ("train",))]


def test_splits_and_configs_from_the_file_listing(hub: HubServer, tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    probe = HubProbe({"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path)}, HfApi(endpoint=hub.url))

    def info_of(repo_id: str) -> object:
        return probe.call("dataset_info", repo_id)

    wants = [HubSplit("acme/corpus", None, ("train", "test")), HubSplit("acme/corpus", None, ("validation",)),
             HubSplit("acme/multi", "fr", ("train",)), HubSplit("acme/multi", "de", ("train",)),
             HubSplit("acme/missing", None, ("train",))]
    rows = check_hub_splits(wants, info_of=info_of, required=["acme/corpus"])
    assert [(r.status, r.seen) for r in rows] == [
        ("pass", "acme/corpus: split train, test exists (file listing)"),
        ("fail", "acme/corpus: no split 'validation' (splits: test, train)"),
        ("pass", "acme/multi config 'fr': split train exists (file listing)"),
        ("warn", "acme/multi config 'de': no such config (no YAML configs in its card, no folder de/)"),
    ]  # the missing repo is the hub-repos row's


def test_run_preflight_puts_a_missing_split_in_the_data_rows(hub: HubServer, tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    path = script(tmp_path, 'ds = load_dataset("acme/corpus", split="validation")\n')
    report = run_preflight(PreflightOptions(script=path, require_datasets=("acme/corpus",),
                                            skip_checks={"gpu": "none", "python": "not this test's"}),
                           environ={"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")},
                           hf_api=HfApi(endpoint=hub.url))
    assert report.failed is not None and report.failed.name == "data"
    assert report.failed.seen == "acme/corpus: no split 'validation' (splits: test, train)"
