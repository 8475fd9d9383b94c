"""The local Hub test server, exercised with the real ``huggingface_hub`` client (in-process, endpoint explicit;
see the module docstring of ``tests/hubserver.py``) and, once, from a subprocess configured by environment."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.hubserver import TOKENS, HubServer, client_constants

hf = pytest.importorskip("huggingface_hub")
httpx = pytest.importorskip("httpx2")
from huggingface_hub import HfApi  # noqa: E402
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError  # noqa: E402

pytestmark = pytest.mark.hub


@pytest.fixture(scope="module")
def hub():
    with client_constants(), HubServer() as server:
        yield server


@pytest.fixture(autouse=True)
def _clean_faults(hub):
    yield
    hub.reset_faults()


@pytest.fixture
def api(hub):
    return HfApi(endpoint=hub.url, token=TOKENS["write"])


def new_repo_id(namespace: str = "alice") -> str:
    return f"{namespace}/r-{uuid.uuid4().hex[:10]}"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


# -- identities and permissions -------------------------------------------------------------------------------


@pytest.mark.parametrize(("token", "user", "role"), [
    ("write", "alice", "write"), ("read", "alice", "read"), ("fine_alice", "alice", "fineGrained"),
    ("other", "bob", "write"),
])
def test_whoami_per_token(api, token, user, role):
    info = api.whoami(token=TOKENS[token])
    assert info["name"] == user
    assert info["auth"]["accessToken"]["role"] == role
    assert [o["name"] for o in info["orgs"]] == (["acme"] if user == "alice" else [])
    if role == "fineGrained":
        scoped = info["auth"]["accessToken"]["fineGrained"]["scoped"]
        permissions = ["repo.content.read", "repo.write"]
        assert scoped == [{"entity": {"type": "user", "name": "alice"}, "permissions": permissions}]


def test_invalid_token_is_refused(api):
    with pytest.raises(HfHubHTTPError) as info:
        api.whoami(token=TOKENS["invalid"])
    assert info.value.response.status_code == 401


def test_create_repo_private_and_exist_ok(hub, api):
    repo_id = new_repo_id()
    url = api.create_repo(repo_id, private=True)
    assert url.repo_id == repo_id and hub.is_private(repo_id)
    assert api.create_repo(repo_id, exist_ok=True).repo_id == repo_id
    with pytest.raises(HfHubHTTPError) as info:
        api.create_repo(repo_id)
    assert info.value.response.status_code == 409
    files = hub.repo_files(repo_id)
    assert list(files) == [".gitattributes"] and hub.commits(repo_id)[0].title == "initial commit"
    assert len(api.model_info(repo_id).sha) == 40


@pytest.mark.parametrize(("token", "namespace", "allowed"), [
    ("write", "alice", True), ("write", "acme", True), ("read", "alice", False), ("other", "acme", False),
    ("fine_alice", "alice", True), ("fine_alice", "acme", False),
])
def test_create_repo_needs_write_access_to_the_namespace(hub, api, token, namespace, allowed):
    repo_id = new_repo_id(namespace)
    if allowed:
        api.create_repo(repo_id, token=TOKENS[token])
        assert hub.repo_exists(repo_id)
    else:
        with pytest.raises(HfHubHTTPError) as info:
            api.create_repo(repo_id, token=TOKENS[token])
        assert info.value.response.status_code == 403 and not hub.repo_exists(repo_id)


def test_private_repos_are_hidden_from_others(hub, api):
    repo_id = new_repo_id("acme")
    api.create_repo(repo_id, private=True)
    assert api.repo_exists(repo_id) is True
    assert api.repo_exists(repo_id, token=TOKENS["other"]) is False
    assert api.repo_exists(repo_id, token=False) is False
    assert api.repo_exists(new_repo_id()) is False
    with pytest.raises(RepositoryNotFoundError):
        api.model_info(repo_id, token=TOKENS["other"])


def test_auth_check_write(api):
    api.auth_check("alice/existing-model", write=True)
    with pytest.raises(HfHubHTTPError) as info:
        api.auth_check("alice/existing-model", write=True, token=TOKENS["read"])
    assert info.value.response.status_code == 403


def test_gated_repo_needs_granted_access(api, tmp_path):
    for token in (TOKENS["write"], False):
        with pytest.raises(GatedRepoError):
            api.hf_hub_download("acme/gated-model", "config.json", cache_dir=tmp_path / "c", token=token)
    with pytest.raises(GatedRepoError):
        api.auth_check("acme/gated-model")
    path = api.hf_hub_download("acme/gated-model", "config.json", cache_dir=tmp_path / "b", token=TOKENS["other"])
    assert json.loads(Path(path).read_text())["model_type"] == "gpt2"
    assert api.model_info("acme/gated-model").gated == "manual"


def test_search_models_and_datasets(api):
    assert [m.id for m in api.list_models(search="gpt")] == ["acme/tiny-gpt2"]
    assert {d.id for d in api.list_datasets(search="wikitext")} == {"acme/wikitext-mini", "acme/wikitext-small"}
    assert len(list(api.list_datasets(author="acme", limit=2))) == 2
    assert "alice/existing-model" in {m.id for m in api.list_models(author="alice")}


# -- uploads and downloads ------------------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "upload"
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "sub" / "notes.txt").write_text("hello")
    (root / "model.safetensors").write_bytes(os.urandom(64 * 1024))
    (root / "big.dat").write_bytes(os.urandom(11 * 1024 * 1024))  # over 10 MB: LFS whatever its name
    return root


def test_upload_folder_stores_identical_bytes(hub, api, folder):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    info = api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message="upload")
    assert hub.commits(repo_id)[-1].oid == info.oid
    files = hub.repo_files(repo_id)
    for rel in ("config.json", "sub/notes.txt", "model.safetensors", "big.dat"):
        assert files[rel] == (folder / rel).read_bytes()
    assert sorted(api.list_repo_files(repo_id)) == sorted([".gitattributes", *[
        "big.dat", "config.json", "model.safetensors", "sub/notes.txt"]])
    entries = {e.path: e for e in api.get_paths_info(repo_id, ["config.json", "big.dat", "sub", "nope"], expand=True)}
    assert set(entries) == {"config.json", "big.dat", "sub"}
    big = (folder / "big.dat").read_bytes()
    assert entries["big.dat"].lfs.sha256 == hashlib.sha256(big).hexdigest() and entries["big.dat"].size == len(big)
    assert entries["config.json"].lfs is None
    assert entries["config.json"].blob_id == git_blob_sha1((folder / "config.json").read_bytes())
    assert entries["config.json"].last_commit.oid == info.oid


def test_unchanged_upload_makes_no_commit_and_no_lfs_transfer(hub, api, folder):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    first = api.upload_folder(repo_id=repo_id, folder_path=folder)
    hub.requests.clear()
    again = api.upload_folder(repo_id=repo_id, folder_path=folder)
    assert again.oid == first.oid
    assert not [r for r in hub.requests if r.method == "PUT" or "/commit/" in r.path]


def test_commit_deletes_and_history(hub, api, folder):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    api.upload_folder(repo_id=repo_id, folder_path=folder, path_in_repo="ckpt")
    (folder / "sub" / "notes.txt").unlink()
    api.upload_folder(repo_id=repo_id, folder_path=folder, path_in_repo="ckpt", delete_patterns="*",
                      commit_message="replace")
    last = hub.commits(repo_id)[-1]
    assert last.title == "replace" and last.deleted == ("ckpt/sub/notes.txt",)
    assert "ckpt/sub/notes.txt" not in hub.repo_files(repo_id)
    titles = [c.title for c in api.list_repo_commits(repo_id)]
    assert titles[0] == "replace" and titles[-1] == "initial commit" and len(titles) == 3


def test_downloads_round_trip(hub, api, folder, tmp_path):
    repo_id = new_repo_id()
    api.create_repo(repo_id, private=True)
    api.upload_folder(repo_id=repo_id, folder_path=folder)
    path = api.hf_hub_download(repo_id, "big.dat", cache_dir=tmp_path / "cache")
    assert Path(path).read_bytes() == (folder / "big.dat").read_bytes()
    snapshot = Path(api.snapshot_download(repo_id, local_dir=tmp_path / "snap", allow_patterns=["sub/*", "*.json"]))
    assert (snapshot / "sub" / "notes.txt").read_text() == "hello"
    assert (snapshot / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    assert not (snapshot / "big.dat").exists()


def test_corrupt_changes_served_bytes_but_not_the_record(hub, api, folder, tmp_path):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    api.upload_folder(repo_id=repo_id, folder_path=folder)
    hub.corrupt(repo_id, "model.safetensors")
    original = (folder / "model.safetensors").read_bytes()
    served = Path(api.hf_hub_download(repo_id, "model.safetensors", cache_dir=tmp_path / "c")).read_bytes()
    assert served != original and len(served) == len(original)
    (entry,) = api.get_paths_info(repo_id, ["model.safetensors"])
    assert entry.lfs.sha256 == hashlib.sha256(original).hexdigest()


# -- HTTP/1.1 details, faults ---------------------------------------------------------------------------------


def test_keep_alive_connection_serves_errors_chunked_bodies_and_ranges(hub):
    conn = http.client.HTTPConnection("127.0.0.1", int(hub.url.rsplit(":", 1)[1]), timeout=10)
    try:
        conn.request("GET", "/api/models/acme/nope")  # an error answer must not break the connection
        missing = conn.getresponse()
        assert missing.status == 401 and missing.getheader("X-Error-Code") == "RepoNotFound"  # anonymous
        missing.read()
        body = (json.dumps({"content": "x", "repoType": "model"}).encode(),)
        conn.request("POST", "/api/validate-yaml", body=iter(body), encode_chunked=True,
                     headers={"Transfer-Encoding": "chunked", "Content-Type": "application/json"})
        answer = conn.getresponse()
        assert answer.status == 200 and json.loads(answer.read()) == {"errors": [], "warnings": []}
        conn.request("GET", "/acme/tiny-gpt2/resolve/main/config.json", headers={"Range": "bytes=2-9"})
        part = conn.getresponse()
        assert part.status == 206 and part.getheader("Content-Range").startswith("bytes 2-9/")
        assert len(part.read()) == 8 and len(part.getheader("X-Repo-Commit")) == 40
        conn.request("HEAD", "/acme/tiny-gpt2/resolve/main/nope.bin")
        head = conn.getresponse()
        assert head.status == 404 and head.getheader("X-Error-Code") == "EntryNotFound"
        head.read()
    finally:
        conn.close()
    paths = [r.path for r in hub.requests[-4:]]
    assert paths[0] == "/api/models/acme/nope" and paths[-1] == "/acme/tiny-gpt2/resolve/main/nope.bin"


def test_injected_status_applies_to_the_next_write_requests_only(hub, api):
    hub.inject(status=503, count=1)
    api.model_info("acme/tiny-gpt2")  # a read: not matched
    repo_id = new_repo_id()
    with pytest.raises(HfHubHTTPError) as info:
        api.create_repo(repo_id)
    assert info.value.response.status_code == 503
    api.create_repo(repo_id)
    assert [r.status for r in hub.requests if r.path == "/api/repos/create"][-2:] == [503, 200]


def test_injected_latency_and_down_server_fail_fast(hub):
    url = f"{hub.url}/api/models/acme/tiny-gpt2"
    with httpx.Client() as client:
        assert client.get(url).status_code == 200
        hub.inject(latency_s=5)
        with pytest.raises(httpx.ReadTimeout):
            client.get(url, timeout=0.2)
        hub.reset_faults()
        hub.set_down(True)
        with pytest.raises(httpx.TransportError):
            client.get(url, timeout=5)  # the pooled keep-alive connection is dropped without an answer
        with httpx.Client() as fresh, pytest.raises(httpx.TransportError):
            fresh.get(url, timeout=5)  # and so is a new one
        hub.set_down(False)
        assert client.get(url).status_code == 200
    assert 0 in {r.status for r in hub.requests}


def test_a_request_woken_by_reset_is_logged_before_reset_returns(hub):
    """A request a test gave up on (its client timed out during injected latency) must not be logged into the
    next test's ``requests``: ``reset_faults`` returns once the woken request is logged."""
    url = f"{hub.url}/api/models/acme/tiny-gpt2"
    with httpx.Client() as client:
        hub.inject(latency_s=30, methods=("GET",))
        with pytest.raises(httpx.ReadTimeout):
            client.get(url, timeout=0.2)
        hub.requests.clear()
        hub.reset_faults()
        assert [(r.method, r.path) for r in hub.requests] == [("GET", "/api/models/acme/tiny-gpt2")]


def test_subprocess_configured_by_environment(hub, tmp_path):
    code = ("from huggingface_hub import hf_hub_download, whoami; import json, sys;"
            "p = hf_hub_download('alice/existing-model', 'config.json');"
            "print(json.dumps({'user': whoami()['name'], 'type': json.load(open(p))['model_type']}))")
    env = {**os.environ, **hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"user": "alice", "type": "gpt2"}
