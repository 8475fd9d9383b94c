"""Preflight of an ``s3://BUCKET/PREFIX`` destination (guard/preflight/destination.py ``check_object_store``, the
store's probe in guard/secure/dest/s3probe.py) against a real S3 server (moto, tests/s3server.py): credentials
found, the bucket exists, this identity can write, read and delete under the prefix, the endpoint answers in time.
Each failure is one ``fail`` row saying what to do; run by the guard, it stops the job before it starts."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import JOBS, run_guard

from guard.preflight.destination import check_object_store
from tests.s3server import CREDENTIALS, Fault, FaultProxy, MotoServer, env, free_port


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with MotoServer(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The test process's AWS variables, as a user's shell has them (the client reads the process environment)."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch


def use(aws: pytest.MonkeyPatch, url: str, **override: str) -> None:
    for name, value in {**env(url), **override}.items():
        aws.setenv(name, value)


def probe(url: str) -> tuple[str, str, str]:
    rows = check_object_store(url, timeout_s=2.0)
    assert len(rows) == 1 and rows[0].name == "destination", rows
    return rows[0].status, rows[0].seen, rows[0].hint


def test_no_object_store_destination_adds_no_row() -> None:
    assert check_object_store(None, timeout_s=1.0) == []


def test_without_boto3_the_row_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 raises ImportError, as where it is not installed
    status, seen, hint = probe("s3://ckpts/run1")
    assert status == "fail" and "needs boto3" in seen, seen
    assert 'pip install "jobguard[s3]"' in hint


def test_a_writable_prefix_passes_and_the_probe_object_is_gone(moto: MotoServer, aws: pytest.MonkeyPatch) -> None:
    bucket = moto.bucket()
    with FaultProxy(moto.url) as proxy:
        use(aws, proxy.url)
        status, seen, _ = probe(f"s3://{bucket}/runs/run1")
        assert status == "pass", seen
        methods = [(method, path.split("?")[0]) for method, path, _ in proxy.requests]
    assert methods[0] == ("HEAD", f"/{bucket}")
    put = next(path for method, path in methods if method == "PUT")
    assert put.startswith(f"/{bucket}/runs/run1/.guard/probe-"), methods
    assert ("GET", put) in methods and ("POST", f"/{bucket}") in methods  # read back, then DeleteObjects
    assert moto.client().list_objects_v2(Bucket=bucket).get("KeyCount") == 0


def test_a_missing_bucket_fails_with_how_to_create_it(moto: MotoServer, aws: pytest.MonkeyPatch) -> None:
    use(aws, moto.url)
    status, seen, hint = probe("s3://no-such-bucket-here/run1")
    assert status == "fail" and "bucket no-such-bucket-here does not exist" in seen, seen
    assert "aws s3 mb s3://no-such-bucket-here" in hint and "AWS_ENDPOINT_URL" in hint


def test_no_credentials_fail_with_the_variables_to_set(moto: MotoServer, aws: pytest.MonkeyPatch) -> None:
    bucket = moto.bucket()
    use(aws, moto.url)
    aws.delenv("AWS_ACCESS_KEY_ID")
    aws.delenv("AWS_SECRET_ACCESS_KEY")
    status, seen, hint = probe(f"s3://{bucket}/run1")
    assert status == "fail" and "no AWS credentials found" in seen, seen
    assert "AWS_ACCESS_KEY_ID" in hint and "AWS_PROFILE" in hint


def test_an_endpoint_that_refuses_connections_fails(aws: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    use(aws, url)
    status, seen, hint = probe("s3://ckpts/run1")
    assert status == "fail" and f"{url} cannot be connected to" in seen, seen
    assert "AWS_ENDPOINT_URL" in hint


def test_an_endpoint_that_never_answers_fails_within_the_bound(moto: MotoServer, aws: pytest.MonkeyPatch) -> None:
    bucket = moto.bucket()
    with FaultProxy(moto.url) as proxy:
        proxy.inject(Fault("stall", count=5, methods=("PUT",), stall_s=120))
        use(aws, proxy.url)
        status, seen, hint = probe(f"s3://{bucket}/run1")
    assert status == "fail" and "no answer from" in seen and "write request" in seen, seen
    assert "--skip-check destination=REASON" in hint


def test_a_store_refusing_the_conditional_write_fails(moto: MotoServer, aws: pytest.MonkeyPatch) -> None:
    bucket = moto.bucket()
    with FaultProxy(moto.url) as proxy:
        proxy.inject(Fault("status", methods=("PUT",), status=501, code="NotImplemented"))
        use(aws, proxy.url)
        status, seen, _ = probe(f"s3://{bucket}/run1")
    assert status == "fail" and "refused a conditional write" in seen, seen


# -- identities and their permissions: moto with authentication on (its IAM users, keys and policies) -------------


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MotoServer, dict[str, dict[str, str]]]]:
    """A moto server that checks every request's keys and the user's policy; ``keys[user]`` are a user's variables.
    moto asks for ``s3:HeadBucket`` where AWS asks for ``s3:ListBucket``: both are granted."""
    grants = {"reader": ["s3:ListBucket", "s3:HeadBucket", "s3:GetObject"],
              "no-delete": ["s3:ListBucket", "s3:HeadBucket", "s3:GetObject", "s3:PutObject"]}
    with MotoServer(tmp_path_factory.mktemp("moto-auth")) as server:
        server.bucket("ckpts")
        import boto3

        iam = boto3.session.Session(aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                    aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                    region_name="us-east-1").client("iam", endpoint_url=server.url)
        keys: dict[str, dict[str, str]] = {}
        for user, actions in grants.items():
            iam.create_user(UserName=user)
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps({
                "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}))
            key = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        request = urllib.request.Request(f"{server.url}/moto-api/reset-auth", data=b"0", method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=10).read()  # from now on every request is authenticated
        yield server, keys


@pytest.mark.parametrize(("user", "url", "seen_part", "hint_part"), [
    (None, "s3://ckpts/run1", "refused these credentials for bucket ckpts", "AWS_ACCESS_KEY_ID"),
    ("reader", "s3://ckpts/runs/run1", "may not write under s3://ckpts/runs/run1",
     "s3:PutObject on arn:aws:s3:::ckpts/runs/run1/*"),
    ("no-delete", "s3://ckpts/run2", "may not delete under s3://ckpts/run2", "s3:DeleteObject"),
], ids=["unknown-keys", "read-only", "no-delete"])
def test_an_identity_without_a_permission_fails_naming_it(
        strict: tuple[MotoServer, dict[str, dict[str, str]]], aws: pytest.MonkeyPatch, user: str | None, url: str,
        seen_part: str, hint_part: str) -> None:
    server, keys = strict
    use(aws, server.url, **(keys[user] if user else {}))  # no user: CREDENTIALS, not a key of this server's users
    status, seen, hint = probe(url)
    assert status == "fail" and seen_part in seen, seen
    assert hint_part in hint


# -- the guard ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_missing_bucket_stops_the_guard_before_the_job_starts(moto: MotoServer, tmp_path: Path) -> None:
    run = run_guard(["--skip-check", "python=imports are checked by the other tests", "--push-to",
                     "s3://no-such-bucket-here/run1", str(JOBS / "echo_args.py"), "--marker"],
                    env={**env(moto.url), "HOME": str(tmp_path)}, timeout_s=60)
    fields = run.fields()
    assert (run.returncode, fields["status"], fields["reason"], fields["check"]) == (3, "FAIL", "preflight",
                                                                                  "destination"), run.stderr[-2000:]
    assert "bucket no-such-bucket-here does not exist" in run.stderr
    assert "args: --marker" not in run.stdout  # the job never ran
    assert CREDENTIALS["AWS_SECRET_ACCESS_KEY"] not in run.stdout + run.stderr
