"""Hub checks with the real ``huggingface_hub`` client against the local Hub server (tests/hubserver.py).

Why the autouse fixture below: ``huggingface_hub`` reads ``HF_HUB_OFFLINE``, ``HF_HUB_DISABLE_XET`` and
``HF_HUB_DISABLE_TELEMETRY`` into module constants when it is first imported, and tests/conftest.py sets
``HF_HUB_OFFLINE=1`` for every test, so whichever test imports it first would leave it offline for the whole
session. The fixture patches the constants for each test here (the client reads them on every call), and every
``HfApi`` gets ``endpoint=hub.url`` explicitly (the endpoint constant is frozen at import). The checks themselves
take the job's environment as a mapping (``environ=``), so nothing here touches ``os.environ``. The last test runs
the whole preflight in a child process whose environment is set before its first import.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.preflight import PreflightOptions, run_preflight
from guard.preflight._job import HubTarget
from guard.preflight.hub import HubProbe, RepoRef, check_hub_auth, check_hub_repos
from tests.hubserver import TOKENS, HubServer

pytestmark = pytest.mark.hub

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _online_client(monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)  # the client's default (tests/xetcas.py)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repo("alice/private-model", {"config.json": b"{}"}, private=True)
        server.add_repo("acme/dash", {"app.py": b""}, repo_type="space", private=True)
        yield server


@pytest.fixture(autouse=True)
def _no_faults(hub: HubServer) -> Iterator[None]:
    yield
    hub.reset_faults()


def environ(hub: HubServer, tmp_path: Path, token: str | None = None) -> dict[str, str]:
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)}
    if token:
        env["HF_TOKEN"] = TOKENS[token]
    return env


def probe(hub: HubServer, tmp_path: Path, token: str | None, timeout_s: float = 3.0) -> HubProbe:
    from huggingface_hub import HfApi

    return HubProbe(environ(hub, tmp_path, token), HfApi(endpoint=hub.url), timeout_s)


def auth(hub: HubServer, tmp_path: Path, token: str | None, repo_id: str | None = "acme/new-run") -> Any:
    target = HubTarget("model", repo_id, f"--push-to hf://{repo_id}")
    rows = check_hub_auth(target, environ=environ(hub, tmp_path, token), probe=probe(hub, tmp_path, token))
    assert len(rows) == 1
    return rows[0]


# -- hub-auth: one test per distinct outcome -----------------------------------------------------------------


@pytest.mark.parametrize(("token", "repo_id"), [("write", "acme/new-run"), ("write", "alice/x"),
                                                 ("fine_alice", "alice/x"), ("other", "bob/x"), ("write", None)])
def test_tokens_that_can_write_pass(hub: HubServer, tmp_path: Path, token: str, repo_id: str | None) -> None:
    row = auth(hub, tmp_path, token, repo_id)
    assert row.status == "pass", row


def test_token_missing(hub: HubServer, tmp_path: Path) -> None:
    row = auth(hub, tmp_path, None)
    assert row.status == "fail" and row.seen.startswith("token missing")


def test_token_invalid(hub: HubServer, tmp_path: Path) -> None:
    row = auth(hub, tmp_path, "invalid")
    assert row.status == "fail" and row.seen.startswith("token invalid: the Hub answered 401")
    assert TOKENS["invalid"] not in row.seen


def test_read_only_token(hub: HubServer, tmp_path: Path) -> None:
    row = auth(hub, tmp_path, "read")
    assert row.status == "fail" and row.seen == "read-only token of alice: cannot write to acme/new-run"


def test_no_access_to_the_namespace(hub: HubServer, tmp_path: Path) -> None:
    row = auth(hub, tmp_path, "other", "acme/new-run")
    assert row.status == "fail" and row.seen.startswith("no access to namespace acme: the token's user bob")
    assert "acme" in row.hint


def test_fine_grained_token_without_repo_write_there(hub: HubServer, tmp_path: Path) -> None:
    row = auth(hub, tmp_path, "fine_alice", "acme/new-run")
    assert row.status == "fail" and "fine-grained token of alice has no repo.write for acme/new-run" in row.seen
    assert "user alice" in row.seen


def test_offline_with_a_hub_destination_fails_without_asking(hub: HubServer, tmp_path: Path) -> None:
    before = len(hub.requests)
    target = HubTarget("model", "acme/x", "--push-to hf://acme/x")
    rows = check_hub_auth(target, environ={**environ(hub, tmp_path, "write"), "HF_HUB_OFFLINE": "1"},
                          probe=probe(hub, tmp_path, "write"))
    assert [r.status for r in rows] == ["fail"] and "HF_HUB_OFFLINE=1" in rows[0].seen
    assert len(hub.requests) == before


def test_a_hub_that_does_not_answer_is_a_bounded_warning(hub: HubServer, tmp_path: Path) -> None:
    hub.inject(latency_s=30, path_contains="whoami")
    row = check_hub_auth(HubTarget("model", "acme/x", "o"), environ=environ(hub, tmp_path, "write"),
                         probe=probe(hub, tmp_path, "write", timeout_s=0.3))[0]
    assert row.status == "warn" and row.seen == "no answer from the Hub in 0.3 s (whoami)"


def test_a_hub_that_is_down_is_a_warning(hub: HubServer, tmp_path: Path) -> None:
    hub.set_down(True)
    row = auth(hub, tmp_path, "write")
    assert row.status == "warn" and row.seen.startswith("could not ask the Hub")


# -- hub-repos ---------------------------------------------------------------------------------------------


def repos(hub: HubServer, tmp_path: Path, token: str | None, *refs: RepoRef) -> tuple[list, int | None]:
    return check_hub_repos(list(refs), environ=environ(hub, tmp_path, token), probe=probe(hub, tmp_path, token))


def test_existing_model_and_dataset_pass_and_the_model_size_is_read(hub: HubServer, tmp_path: Path) -> None:
    rows, size = repos(hub, tmp_path, "write", RepoRef("model", "acme/tiny-gpt2", "--require-model"),
                       RepoRef("dataset", "acme/wikitext-mini", "--require-dataset"))
    assert [r.status for r in rows] == ["pass", "pass"]
    assert size == 64 and "weights 64 B" in rows[0].seen


def test_gated_without_access_is_its_own_failure(hub: HubServer, tmp_path: Path) -> None:
    rows, _ = repos(hub, tmp_path, "write", RepoRef("model", "acme/gated-model", "script"))
    assert rows[0].status == "fail" and "is gated and the token's user has no access" in rows[0].seen
    granted, _ = repos(hub, tmp_path, "other", RepoRef("model", "acme/gated-model", "script"))
    assert granted[0].status == "pass"
    anonymous, _ = repos(hub, tmp_path, None, RepoRef("model", "acme/gated-model", "script"))
    assert anonymous[0].status == "fail" and "no HF token was sent" in anonymous[0].seen


def test_missing_ids_get_did_you_mean_candidates(hub: HubServer, tmp_path: Path) -> None:
    rows, _ = repos(hub, tmp_path, "write", RepoRef("model", "acme/tiny-gtp2", "--require-model"),
                    RepoRef("dataset", "acme/wikitxt-mini", "--require-dataset"))
    assert rows[0].status == "fail" and rows[0].seen.endswith("did you mean: acme/tiny-gpt2?")
    assert rows[1].status == "fail" and "did you mean: acme/wikitext-mini, acme/wikitext-small?" in rows[1].seen


def test_missing_id_with_nothing_similar_has_no_candidates(hub: HubServer, tmp_path: Path) -> None:
    rows, _ = repos(hub, tmp_path, "write", RepoRef("model", "nobody/zzzzqqq", "script"))
    assert rows[0].status == "fail" and "did you mean" not in rows[0].seen


def test_private_repo_without_a_token_looks_missing_and_says_why(hub: HubServer, tmp_path: Path) -> None:
    rows, _ = repos(hub, tmp_path, None, RepoRef("model", "alice/private-model", "script"))
    assert rows[0].status == "fail" and "no HF token was sent" in rows[0].seen
    owner, _ = repos(hub, tmp_path, "write", RepoRef("model", "alice/private-model", "script"))
    assert owner[0].status == "pass"


def test_slow_repo_answers_are_bounded(hub: HubServer, tmp_path: Path) -> None:
    hub.inject(latency_s=30, path_contains="auth-check")
    rows = check_hub_repos([RepoRef("model", "acme/tiny-gpt2", "script")], environ=environ(hub, tmp_path, "write"),
                           probe=probe(hub, tmp_path, "write", timeout_s=0.3))[0]
    assert rows[0].status == "warn" and "no answer from the Hub in 0.3 s" in rows[0].seen


def test_a_required_repo_the_hub_cannot_confirm_fails_and_a_script_id_warns(tmp_path: Path) -> None:
    """Issue 36: with the Hub unreachable, --require-model was a warning and `jobguard preflight` passed, so a
    mistyped id reached the GPU job."""
    import socket

    from huggingface_hub import HfApi

    with socket.socket() as free:  # a port nothing listens on: connection refused
        free.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{free.getsockname()[1]}"
    env = {"HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf"), "HOME": str(tmp_path)}
    rows, _ = check_hub_repos([RepoRef("model", "acme/tiny-gtp2", "--require-model"),
                               RepoRef("dataset", "acme/tiny-txt", "named in train.py")],
                              environ=env, probe=HubProbe(env, HfApi(endpoint=url), 3.0))
    assert [r.status for r in rows] == ["fail", "warn"], rows
    assert "cannot be connected to (--require-model)" in rows[0].seen
    assert "--skip-check hub-repos=REASON" in (rows[0].hint or "")


def test_space_privacy_is_read_from_the_hub(hub: HubServer, tmp_path: Path) -> None:
    p = probe(hub, tmp_path, "write")
    assert p.space_private("acme/dash") is True
    assert p.space_private("acme/no-such-space") is None


# -- the whole preflight ----------------------------------------------------------------------------------------


def test_script_ids_are_checked_and_the_model_size_sets_the_disk_estimate(hub: HubServer, tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    script = tmp_path / "train.py"
    script.write_text('from datasets import load_dataset\nfrom transformers import AutoModel\n'
                      'AutoModel.from_pretrained("acme/tiny-gpt2")\nload_dataset("acme/tiny-txt")\n')
    report = run_preflight(PreflightOptions(script=script, push_to="hf://alice/run", skip_checks={"python": "t"}),
                           environ=environ(hub, tmp_path, "write"), hf_api=HfApi(endpoint=hub.url))
    rows = {(r.name, r.status): r.seen for r in report.results}
    assert "token of alice (role write) can write to alice/run" in rows[("hub-auth", "pass")]
    assert rows[("hub-repos", "pass")].startswith("model acme/tiny-gpt2 accessible (named in train.py)")
    assert "dataset acme/tiny-txt not found" in rows[("hub-repos", "fail")]
    assert "did you mean: acme/tiny-text" in rows[("hub-repos", "fail")]
    assert any("estimate: 7 x the model's 64 B" in r.seen for r in report.results if r.name == "storage")
    assert report.failed is not None and report.failed.name == "hub-repos"


def test_trackio_space_privacy_from_the_hub_in_a_full_run(hub: HubServer, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import HfApi

    (tmp_path / "pkgs" / "trackio").mkdir(parents=True)
    (tmp_path / "pkgs" / "trackio" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    report = run_preflight(PreflightOptions(skip_checks={"gpu": "t"}),
                           environ={**environ(hub, tmp_path, "write"), "TRACKIO_SPACE_ID": "acme/dash"},
                           hf_api=HfApi(endpoint=hub.url))
    tracking = [r for r in report.results if r.name == "tracking"]
    assert [r.status for r in tracking] == ["pass"] and "exists and is private" in tracking[0].seen


def test_default_client_in_a_child_process_whose_environment_is_set_before_import(hub: HubServer,
                                                                                  tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from guard.preflight import PreflightOptions, run_preflight\n"
        "opts = PreflightOptions(push_to='hf://acme/run', require_models=('acme/tiny-gpt2',),\n"
        "                        require_datasets=('acme/tiny-text',), skip_checks={'gpu': 'no GPU here'})\n"
        "print(json.dumps(run_preflight(opts).to_json()))\n"
    )
    child_env = {**hub.env(token=TOKENS["read"], hf_home=tmp_path / "hf"), "PATH": "/usr/bin:/bin",
                 "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    by_name = {(r["name"], r["status"]) for r in rows}
    assert ("hub-auth", "fail") in by_name  # the read token cannot write to acme
    assert sum(1 for r in rows if r["name"] == "hub-repos" and r["status"] == "pass") == 2
    assert TOKENS["read"] not in proc.stdout + proc.stderr


def test_a_hub_that_cannot_be_resolved_fails_hub_auth(tmp_path: Path) -> None:
    from huggingface_hub import HfApi

    env = {"HF_ENDPOINT": "http://no-such-hub.invalid", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": TOKENS["write"]}
    rows = check_hub_auth(HubTarget("model", "acme/x", "--push-to hf://acme/x"), environ=env,
                          probe=HubProbe(env, HfApi(endpoint=env["HF_ENDPOINT"]), 10.0))
    assert [r.status for r in rows] == ["fail"], rows
    assert "cannot be resolved" in rows[0].seen and "--skip-check hub-auth=" in (rows[0].hint or "")
