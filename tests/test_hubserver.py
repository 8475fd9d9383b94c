"""The local Hub test server, exercised with the real ``huggingface_hub`` client (in-process, endpoint explicit;
see the module docstring of ``tests/hubserver.py``) and, once, from a subprocess configured by environment."""

from __future__ import annotations

import array
import hashlib
import http.client
import json
import os
import random
import struct
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests import xetcas
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
    # no data sent again: no LFS PUT, no Xet xorb (hf_xet hashes while it uploads, so it still registers a shard
    # naming the known chunks before the client sees that nothing changed)
    assert not [r for r in hub.requests if r.method == "PUT" or "/commit/" in r.path or "/xorbs/" in r.path]


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


# -- Xet storage (tests/xetcas.py) ----------------------------------------------------------------------------


def xet_steps(hub: HubServer) -> list[str]:
    """The requests of an upload, named by their route, repeats of one route in a row counted once."""
    names = ("preupload", "xet-write-token", "/cas/v1/chunks/", "/cas/v1/xorb-grants/", "/cas/v1/xorbs/",
             "/cas/v2/shards", "/commit/", "_lfs")
    steps: list[str] = []
    for request in hub.requests:
        name = next((n.strip("/").split("/")[-1] for n in names if n in request.path), request.path)
        if not steps or steps[-1] != name:
            steps.append(name)
    return steps


def test_xet_upload_of_a_few_mb_goes_through_the_storage_and_records_the_clients_sha256(hub, api):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = os.urandom(3_000_000)
    hub.requests.clear()
    api.upload_file(path_or_fileobj=data, path_in_repo="weights.bin", repo_id=repo_id)
    # the order shared/reference/object-stores.md lists for huggingface_hub 2.4 + hf_xet 1.8; no LFS PUT
    assert xet_steps(hub) == ["preupload", "xet-write-token", "chunks", "xorb-grants", "xorbs", "shards", "commit"]
    assert [r.status for r in hub.requests if "/cas/v1/chunks/" in r.path] == [404] * len(
        [r for r in hub.requests if "/cas/v1/chunks/" in r.path])  # no dedupe against other uploads
    (entry,) = api.get_paths_info(repo_id, ["weights.bin"])
    assert entry.lfs.sha256 == hashlib.sha256(data).hexdigest() and entry.size == len(data)
    assert entry.xet_hash == hub.cas.file_id_for(entry.lfs.sha256) and len(entry.xet_hash) == 64
    assert hub.repo_files(repo_id)["weights.bin"] == data


def test_xet_upload_of_many_small_files_stores_each_one(hub, api, tmp_path):
    root = tmp_path / "many"
    sizes = {f"shard-{i:03d}/part.bin": 4_000 + 97 * i for i in range(150)}
    for rel, size in sizes.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(os.urandom(size))
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    hub.requests.clear()
    api.upload_folder(repo_id=repo_id, folder_path=root)
    files = hub.repo_files(repo_id)
    assert all(files[rel] == (root / rel).read_bytes() for rel in sizes)
    xorbs = [r for r in hub.requests if "/cas/v1/xorbs/" in r.path]
    assert 1 <= len(xorbs) < len(sizes) // 10  # small files share xorbs
    entries = api.get_paths_info(repo_id, list(sizes))
    assert {e.path: e.lfs.sha256 for e in entries} == {
        rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in sizes}


def test_xet_compressed_chunks_are_decoded_by_the_storage(hub, api):
    rng = random.Random(7)
    files = {"model.safetensors": array.array("f", (rng.gauss(0.0, 0.02) for _ in range(300_000))).tobytes(),
             "log.bin": b"".join(b"step %d loss %.4f\n" % (i, rng.random()) for i in range(40_000))}
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    schemes = set()
    for name, data in files.items():  # one upload each: hf_xet picks a xorb's compression from its first chunks
        before = set(hub.cas.xorbs)
        api.upload_file(path_or_fileobj=data, path_in_repo=name, repo_id=repo_id)
        schemes |= {chunk.scheme for key in set(hub.cas.xorbs) - before for chunk in hub.cas.xorbs[key].chunks}
        assert hub.repo_files(repo_id)[name] == data
    assert {1, 2} <= schemes, schemes  # weights-like floats: byte grouping + LZ4; text: LZ4; both decoded


def test_xet_download_round_trip_and_a_byte_range_of_the_reconstruction(hub, api, tmp_path):
    repo_id = new_repo_id()
    api.create_repo(repo_id, private=True)
    data = os.urandom(2_500_000)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.bin", repo_id=repo_id)
    hub.requests.clear()
    path = api.hf_hub_download(repo_id, "w.bin", cache_dir=tmp_path / "cache")
    assert Path(path).read_bytes() == data
    assert any("/cas/v2/reconstructions/" in r.path for r in hub.requests)
    assert any("/cas/xorb-data/" in r.path and r.status == 206 for r in hub.requests)
    assert not [r for r in hub.requests if r.method == "GET" and "/resolve/" in r.path]  # the bytes came via Xet

    file_id = hub.cas.file_id_for(hashlib.sha256(data).hexdigest())
    auth = {"Authorization": f"Bearer {TOKENS['write']}"}
    token = httpx.get(f"{hub.url}/api/models/{repo_id}/xet-read-token/main", headers=auth).headers
    xet_auth = {"Authorization": f"Bearer {token['X-Xet-Access-Token']}"}
    first, last = 1_000_003, 1_700_000
    for version, key in (("v2", "xorbs"), ("v1", "fetch_info")):
        answer = httpx.get(f"{token['X-Xet-Cas-Url']}/{version}/reconstructions/{file_id}",
                           headers={**xet_auth, "Range": f"bytes={first}-{last}"}).json()
        assert set(answer) == {"offset_into_first_range", "terms", key}
    chunks: dict[tuple[str, int], bytes] = {}
    for xorb_hash, entries in answer_v2(hub, file_id, xet_auth, first, last)["xorbs"].items():
        for entry in entries:
            (span,) = entry["ranges"]
            got = httpx.get(entry["url"], headers={"Range": f"bytes={span['bytes']['start']}-{span['bytes']['end']}"})
            assert got.status_code == 206
            refs = xetcas.parse_xorb(got.content)
            assert len(refs) == span["chunks"]["end"] - span["chunks"]["start"]
            for index, ref in enumerate(refs, span["chunks"]["start"]):
                chunks[(xorb_hash, index)] = xetcas.decode_chunk(got.content, ref)
    answer = answer_v2(hub, file_id, xet_auth, first, last)
    rebuilt = b"".join(chunks[(t["hash"], i)] for t in answer["terms"]
                       for i in range(t["range"]["start"], t["range"]["end"]))
    skip = answer["offset_into_first_range"]
    assert rebuilt[skip:skip + last - first + 1] == data[first:last + 1]
    missing = httpx.get(f"{token['X-Xet-Cas-Url']}/v2/reconstructions/{file_id}", headers=auth)
    assert missing.status_code == 401  # a Hub token is not a Xet token


def answer_v2(hub: HubServer, file_id: str, xet_auth: dict[str, str], first: int, last: int) -> dict:
    return httpx.get(f"{hub.url}/cas/v2/reconstructions/{file_id}",
                     headers={**xet_auth, "Range": f"bytes={first}-{last}"}).json()


def shard(file_hash: bytes, term: xetcas.Term, sha256: bytes) -> bytes:
    """A one-file, one-term upload shard (hub-docs docs/xet/shard.md: header, file info with the metadata
    extension, bookend, empty CAS info, bookend; no footer)."""
    bookend = b"\xff" * 32 + b"\0" * 16
    header = b"\x48" * 32 + struct.pack("<QQ", 2, 0)
    entry = xetcas.hash_from_str(term.xorb) + struct.pack("<IIII", 0, term.size, term.start, term.end)
    ext = xetcas.hash_from_str(sha256.hex()) + b"\0" * 16  # stored like the other hashes (tests/xetcas.py)
    return header + file_hash + struct.pack("<II8x", 1 << 30, 1) + entry + ext + bookend + bookend


def test_a_shard_naming_an_unknown_xorb_or_another_sha256_is_refused(hub, api):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = os.urandom(50_000)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.bin", repo_id=repo_id)
    uploaded = hub.cas.files[hub.cas.file_id_for(hashlib.sha256(data).hexdigest())]
    assert xetcas.hash_from_str(xetcas.hash_to_str(bytes(range(32)))) == bytes(range(32))
    auth = {"Authorization": f"Bearer {TOKENS['write']}"}
    token = httpx.get(f"{hub.url}/api/models/{repo_id}/xet-write-token/main", headers=auth).headers
    xet_auth = {"Authorization": f"Bearer {token['X-Xet-Access-Token']}"}
    (term,) = uploaded.terms
    unknown = term._replace(xorb="ab" * 32)
    for body, why in ((shard(b"\1" * 32, unknown, hashlib.sha256(data).digest()), "not uploaded"),
                      (shard(b"\1" * 32, term, hashlib.sha256(b"other bytes").digest()), "sha256")):
        streamed = httpx.post(f"{hub.url}/cas/v2/shards", content=body, headers=xet_auth)
        events = [json.loads(line) for line in streamed.text.splitlines()]
        assert streamed.status_code == 200 and events[-1]["type"] == "error" and why in events[-1]["message"]
        plain = httpx.post(f"{hub.url}/cas/v1/shards", content=body, headers=xet_auth)
        assert plain.status_code == 400 and why in plain.headers["X-Error-Message"]
    good = httpx.post(f"{hub.url}/cas/v2/shards", content=shard(b"\1" * 32, term, hashlib.sha256(data).digest()),
                      headers=xet_auth)
    assert good.text.splitlines()[-1] == '{"type": "result", "result": 1}'  # the same terms, the right sha256
    read = httpx.get(f"{hub.url}/api/models/{repo_id}/xet-read-token/main", headers=auth).headers
    refused = httpx.post(f"{hub.url}/cas/v2/shards", content=b"",
                         headers={"Authorization": f"Bearer {read['X-Xet-Access-Token']}"})
    assert refused.status_code == 403  # a read token cannot upload


def test_a_hub_without_xet_answers_the_token_route_404_and_plain_lfs_still_works(hub, api):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    hub.xet = False
    try:
        with pytest.raises(Exception, match=r"404.*xet-write-token"):  # hf_xet's error: huggingface_hub #4507
            api.upload_file(path_or_fileobj=os.urandom(20_000), path_in_repo="w.bin", repo_id=repo_id)
        with client_constants(xet=False):  # the remedy the guard's hint names: HF_HUB_DISABLE_XET=1
            api.upload_file(path_or_fileobj=b"\0" + os.urandom(20_000), path_in_repo="w.bin", repo_id=repo_id)
    finally:
        hub.xet = True
    assert any(r.method == "PUT" and r.path.startswith("/_lfs/") for r in hub.requests)
    assert len(hub.repo_files(repo_id)["w.bin"]) == 20_001


def test_lz4_blocks_and_frames_decode_with_overlapping_matches():
    # a block: 3 literals "abc", then a match 3 back of 4 + 2 bytes (overlapping itself), then the last literal "d"
    block = bytes([0x32]) + b"abc" + bytes([3, 0]) + bytes([0x10]) + b"d"
    assert xetcas.lz4_decompress(block) == b"abcabcabcd"
    # the frame format (magic, FLG with block independence, BD, header checksum), one compressed block, end mark
    frame = bytes.fromhex("04224d18") + bytes([0x60, 0x40, 0x82]) + len(block).to_bytes(4, "little") + block + \
        b"\0\0\0\0"
    assert xetcas.lz4_decompress(frame) == b"abcabcabcd"
    with pytest.raises(ValueError):
        xetcas.lz4_decompress(bytes([0x32]) + b"abc" + bytes([9, 0]) + bytes([0x10]) + b"d")  # offset too far back
    assert xetcas._ungroup4(b"AEI" + b"BFJ" + b"CG" + b"DH") == b"ABCDEFGHIJ"


def test_the_deprecated_v1_reconstruction_serves_the_real_client(hub, api, tmp_path):
    repo_id = new_repo_id()
    api.create_repo(repo_id)
    data = os.urandom(1_500_000)
    api.upload_file(path_or_fileobj=data, path_in_repo="w.bin", repo_id=repo_id)
    (tmp_path / "expected").write_bytes(data)
    hub.requests.clear()
    code = (f"from huggingface_hub import hf_hub_download; p = hf_hub_download({repo_id!r}, 'w.bin');"
            f"print(open(p, 'rb').read() == open({str(tmp_path / 'expected')!r}, 'rb').read())")
    env = {**os.environ, **hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf"),
           "HF_XET_CLIENT_RECONSTRUCTION_API_VERSION": "1"}  # hf_xet's switch to the v1 route
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]
    assert any("/cas/v1/reconstructions/" in r.path and r.status == 200 for r in hub.requests)
