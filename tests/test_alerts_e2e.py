"""End to end: the guard's alerts reach a webhook receiver on 127.0.0.1 (trackio's generic JSON payload).

The receiver is a small HTTP server in the test; it records each POST (time, JSON body, raw bytes). In the
``hang`` mode it reads the request and never answers, as a webhook that has stopped responding.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import JOBS, kill_quietly, run_guard, start_guard

pytestmark = [pytest.mark.slow]
pytest.importorskip("trackio")


class Receiver:
    """Records the POSTs that arrive; ``hang`` keeps each request open without an answer."""

    def __init__(self, *, hang: bool = False) -> None:
        self.hang = hang
        self.posts: list[tuple[float, dict[str, Any], bytes]] = []
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.posts.append((time.monotonic(), json.loads(raw or b"{}"), raw))
                if receiver.hang:
                    receiver.release.wait(60)
                    return
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body, _ in self.posts]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    rec = Receiver()
    yield rec
    rec.close()


def guard_args(url: str, *rest: str) -> list[str]:
    return ["--no-preflight", "--heartbeat", "0", "--alert-webhook", url, *rest]


def store_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    store = tmp_path / "trackio"
    store.mkdir(exist_ok=True)
    return {"TRACKIO_DIR": str(store), **extra}


def titled(bodies: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
    """The alerts whose title starts with ``prefix``, in arrival order."""
    return [body for body in bodies if body["title"].startswith(prefix)]


def wait_for(receiver: Receiver, count: int, timeout_s: float = 5.0) -> None:
    """POSTs come from trackio's daemon threads: the last one may land just after the guard's exit."""
    end = time.monotonic() + timeout_s
    while len(receiver.posts) < count and time.monotonic() < end:
        time.sleep(0.05)


def test_a_nan_run_sends_one_error_alert_naming_step_and_rank(receiver: Receiver, tmp_path: Path) -> None:
    run = run_guard(guard_args(receiver.url, str(JOBS / "plain_loop.py"), "--steps", "30", "--nan-at", "8"),
                    env=store_env(tmp_path))
    assert run.returncode == 4, run.stderr[-2000:]
    wait_for(receiver, 2)
    bodies = receiver.bodies()
    assert [b["level"] for b in bodies] == ["error", "error"], bodies
    # each POST runs on a thread of its own (trackio's send_webhook): they may arrive in either order
    (verdict,), (nan,) = titled(bodies, "VERDICT"), [b for b in bodies if not b["title"].startswith("VERDICT")]
    assert nan["title"] == "non-finite loss nan at step 8" and nan["step"] == 8
    assert "step=8 rank=0" in nan["text"] and "hint: lower the learning rate" in nan["text"]
    assert nan["project"] == "jobguard"  # no --trackio: a local run in the project jobguard
    assert verdict["title"] == "VERDICT FAIL reason=non_finite_loss"
    assert verdict["text"].startswith("VERDICT: FAIL reason=non_finite_loss exit=4")
    assert (tmp_path / "trackio" / "jobguard.db").exists()


def test_a_stall_sends_one_alert_naming_the_rank(receiver: Receiver, tmp_path: Path) -> None:
    run = run_guard(guard_args(receiver.url, "--stall-timeout", "3s", str(JOBS / "hang.py"),
                               "--pid-file", str(tmp_path / "pid"), "--after-steps", "2"),
                    env=store_env(tmp_path))
    assert run.verdict.startswith("VERDICT: FAIL reason=stalled"), run.stderr[-2000:]
    wait_for(receiver, 2)
    stalls = [b for b in receiver.bodies() if "stalled" in b["title"] and not b["title"].startswith("VERDICT")]
    assert len(stalls) == 1, receiver.bodies()
    assert stalls[0]["level"] == "error" and stalls[0]["title"] == "rank 0 stalled after step 2"
    assert "step=2 rank=0" in stalls[0]["text"]
    assert [b["title"] for b in titled(receiver.bodies(), "VERDICT")] == ["VERDICT FAIL reason=stalled"]


def test_a_pass_with_nothing_to_say_sends_only_the_verdict(receiver: Receiver, tmp_path: Path) -> None:
    run = run_guard(guard_args(receiver.url, str(JOBS / "plain_loop.py"), "--steps", "10"),
                    env=store_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    wait_for(receiver, 1)
    time.sleep(0.5)  # nothing else follows
    [verdict] = receiver.bodies()
    assert verdict["level"] == "info" and verdict["title"] == "VERDICT PASS reason=ok"
    assert verdict["text"].startswith("VERDICT: PASS reason=ok exit=0")


def test_alert_level_error_drops_info_from_the_webhook(receiver: Receiver, tmp_path: Path) -> None:
    run = run_guard(guard_args(receiver.url, "--alert-level", "error", str(JOBS / "plain_loop.py"),
                               "--steps", "5"), env=store_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    time.sleep(1.0)
    assert receiver.posts == []  # the PASS verdict is info: below --alert-level error


SECRET_JOB = """
import os
print("step 1 loss 1.0", flush=True)
raise RuntimeError("login refused for " + os.environ["MY_API_TOKEN"])
"""


def test_a_secret_in_the_jobs_environment_never_reaches_a_payload(receiver: Receiver, tmp_path: Path) -> None:
    secret = "s3cr3t-Value-8842"
    script = tmp_path / "leaky.py"
    script.write_text(SECRET_JOB)
    run = run_guard(guard_args(receiver.url, str(script)), env=store_env(tmp_path, MY_API_TOKEN=secret))
    assert run.verdict.startswith("VERDICT: FAIL"), run.stderr[-2000:]
    assert "RuntimeError: login refused for ***" in run.stderr  # the secret reached the guard: it is masked
    wait_for(receiver, 1)
    assert receiver.posts, run.stderr[-2000:]
    for _, _, raw in receiver.posts:
        assert secret.encode() not in raw
    assert secret not in run.stdout + run.stderr


def test_a_receiver_that_never_answers_does_not_delay_the_verdict(tmp_path: Path) -> None:
    silent = Receiver(hang=True)
    proc = start_guard(guard_args(silent.url, str(JOBS / "plain_loop.py"), "--steps", "30", "--nan-at", "8"),
                       env=store_env(tmp_path))
    try:
        assert proc.stdout is not None
        verdict_at, verdict = None, ""
        for line in proc.stdout:
            if line.startswith("VERDICT: "):
                verdict_at, verdict = time.monotonic(), line
        proc.wait(30)
        stderr = proc.stderr.read() if proc.stderr is not None else ""
    except subprocess.TimeoutExpired:
        kill_quietly(proc)
        raise
    finally:
        silent.close()
    assert verdict.startswith("VERDICT: FAIL reason=non_finite_loss"), stderr[-2000:]
    assert verdict_at is not None
    titles = [body["title"] for _, body, _ in silent.posts]
    assert sorted(titles) == ["VERDICT FAIL reason=non_finite_loss", "non-finite loss nan at step 8"]
    verdict_posted = next(at for at, body, _ in silent.posts if body["title"].startswith("VERDICT"))
    # The verdict's POST hangs (and so does the NaN alert's, started seconds before): the VERDICT follows within 1 s.
    assert verdict_at - verdict_posted < 1.0, (verdict_at - verdict_posted, stderr[-2000:])
    assert "still unanswered" in stderr


def test_a_webhook_without_trackio_is_a_preflight_failure(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text(  # the guard's process finds no trackio, as without the extra
        "import sys\nclass _NoTrackio:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'trackio':\n            raise ModuleNotFoundError('no trackio')\n"
        "sys.meta_path.insert(0, _NoTrackio())\n")
    run = run_guard(["--alert-webhook", "http://127.0.0.1:9/hook", "--no-preflight", str(JOBS / "plain_loop.py")],
                    env={"PYTHONPATH": f"{shadow}{os.pathsep}{Path(__file__).resolve().parent.parent}"})
    assert run.returncode == 3, run.stderr[-2000:]
    assert run.verdict.startswith("VERDICT: FAIL reason=preflight exit=3")
    assert "check=tracking" in run.verdict
    assert "jobguard[trackio]" in run.stderr
    assert "127.0.0.1:9" not in run.stderr  # the webhook URL is masked in the config log


def test_a_slack_url_gets_slacks_blocks_and_stays_out_of_the_log(receiver: Receiver, tmp_path: Path) -> None:
    # trackio picks the Slack format from the URL ("hooks.slack.com" in it): the receiver's path carries it
    slack = receiver.url.replace("/hook", "/hooks.slack.com/services/T0000/B0000/XXXXXXXXXXXXXXXX")
    run = run_guard(guard_args(slack, str(JOBS / "plain_loop.py"), "--steps", "5"), env=store_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    wait_for(receiver, 1)
    [body] = receiver.bodies()
    header, text, context = body["blocks"]
    assert header["text"]["text"].endswith("*[INFO] VERDICT PASS reason=ok*")
    assert text["text"]["text"].startswith("VERDICT: PASS reason=ok exit=0")
    assert context["elements"][0]["text"].startswith("Project: jobguard  •  Run: jobguard-")
    assert "XXXXXXXXXXXXXXXX" not in run.stderr  # a webhook URL is a credential: masked in the log
    assert re.search(r"--alert-webhook \*\*\* \(flag\)", run.stderr)  # the options set, masked


def test_a_refusing_webhook_is_logged_once_and_counted(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = run_guard(guard_args(f"http://127.0.0.1:{port}/hook", str(JOBS / "plain_loop.py"), "--steps", "30",
                               "--nan-at", "8"), env=store_env(tmp_path))
    assert run.returncode == 4, run.stderr[-2000:]
    said = [line for line in run.stderr.splitlines() if "alert webhook" in line]
    first = [line for line in said if "did not take an alert" in line]
    assert len(first) == 1, said  # two alerts failed (the NaN's, the verdict's): said once
    assert "Connection refused" in first[0] and f":{port}" not in run.stderr
    assert any(re.search(r"failed [12] time\(s\) in this run", line) for line in said), said


@pytest.mark.hub
def test_a_rate_limited_destination_warns_once(receiver: Receiver, tmp_path: Path) -> None:
    from tests.hubserver import TOKENS, HubServer

    with HubServer() as hub:
        hub.inject(status=429, count=1000, methods=("POST",), path_contains="/commit/")  # every commit: 429
        env = {**hub.env(token=TOKENS["write"], hf_home=tmp_path / "hf"), **store_env(tmp_path)}
        run = run_guard(guard_args(receiver.url, "--timeout", "30s", "--push-interval", "0s", "--push-to",
                                   "alice/limited", str(JOBS / "saving_loop.py"), "--output-dir",
                                   str(tmp_path / "out"), "--step-s", "0.05", "--save-every", "20"),
                        env=env, timeout_s=120)
    assert run.verdict.startswith("VERDICT: TIMEOUT reason=deadline exit=124"), run.stderr[-3000:]
    wait_for(receiver, 3)
    titles = [(b["level"], b["title"]) for b in receiver.bodies()]
    assert titles.count(("warn", "pushes are rate-limited by the destination")) == 1, titles
    assert ("info", "securing started: the deadline is near") in titles
    limited = next(b for b in receiver.bodies() if b["title"].startswith("pushes are rate-limited"))
    assert "HTTP 429" in limited["text"] and "hint: raise --push-interval" in limited["text"]
    assert [t for t in titles if t[1].startswith("VERDICT")] == [("error", "VERDICT TIMEOUT reason=deadline")]


SLOWING_JOB = """
import time
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for step in range(1, 331):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.02 if step <= 300 else 0.2)  # ~50 steps/s, then ~5
"""


def test_a_throughput_drop_warns_once(receiver: Receiver, tmp_path: Path) -> None:
    script = tmp_path / "slowing.py"
    script.write_text(SLOWING_JOB)
    run = run_guard(guard_args(receiver.url, "--check-every", "1", "--alert-throughput-window", "3s", str(script)),
                    env=store_env(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
    wait_for(receiver, 2)
    drops = [b for b in receiver.bodies() if b["title"].startswith("throughput dropped")]
    assert len(drops) == 1, receiver.bodies()
    assert drops[0]["level"] == "warn" and drops[0]["step"] > 300
    assert "under 0.5x the run's median" in drops[0]["text"]
    assert [b["title"] for b in titled(receiver.bodies(), "VERDICT")] == ["VERDICT PASS reason=ok"]


def test_a_finite_explosion_warns_once_before_the_verdict(receiver: Receiver, tmp_path: Path) -> None:
    run = run_guard(guard_args(receiver.url, str(JOBS / "diverge.py")), env=store_env(tmp_path))
    assert run.verdict.startswith("VERDICT: FAIL"), run.stderr[-2000:]
    wait_for(receiver, 2)
    bodies = receiver.bodies()
    explosions = [b for b in bodies if b["title"].startswith("the loss exploded at step")]
    assert len(explosions) == 1 and explosions[0]["level"] == "warn", bodies
    assert "its early level" in explosions[0]["text"] and "hint: lower the learning rate" in explosions[0]["text"]
    # each POST runs on a thread of its own: under load the VERDICT's may arrive first (it did, at load average 6);
    # "before" is when each alert was made, its payload's ISO 8601 UTC timestamp (trackio's generic webhook body)
    (verdict,) = titled(bodies, "VERDICT")
    assert verdict["title"].startswith("VERDICT FAIL") and verdict["level"] == "error", bodies
    made = sorted(bodies, key=lambda body: datetime.fromisoformat(body["timestamp"]))
    assert made[-1] is verdict, bodies  # the explosion's warning was made before it


def test_a_preflight_failure_still_sends_its_verdict(receiver: Receiver, tmp_path: Path) -> None:
    run = run_guard(["--alert-webhook", receiver.url, "--require-env", "SURELY_UNSET_VARIABLE",
                     "--skip-check", "python=not what this test is about", str(JOBS / "plain_loop.py")],
                    env=store_env(tmp_path))
    assert run.returncode == 3, run.stderr[-2000:]
    wait_for(receiver, 1)
    [verdict] = receiver.bodies()
    assert verdict["level"] == "error" and verdict["title"] == "VERDICT FAIL reason=preflight"
