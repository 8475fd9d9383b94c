"""A real S3 server for tests and benchmarks (``moto_server`` on 127.0.0.1) and a small fault proxy in front of it.

- :class:`MotoServer` runs ``moto_server -H 127.0.0.1 -p PORT`` (``moto[server]`` from the package index: a real
  HTTP S3 server with multipart uploads, SHA-256 checksums and conditional writes, ``If-None-Match``/``If-Match``)
  as a child process on a free port; ``bucket()`` creates a fresh bucket. moto keeps the ``x-amz-checksum-sha256``
  a client sends without checking it against the bytes (real S3 refuses a mismatch with ``BadDigest``); the tests
  that need a wrong checksum get it from the proxy.
- :class:`FaultProxy` forwards every request to the server and, for the requests a :class:`Fault` matches, stalls
  (holds the request without an answer), answers 5xx or ``503 SlowDown`` (S3's throttling answer, an XML body),
  cuts the connection after reading part of a request body (a multipart part cut mid-transfer), or rewrites the
  ``x-amz-checksum-sha256`` header of the answer (a stored object whose checksum is not the one sent).
  ``requests`` logs ``(method, path_and_query, status)`` of every request (status 0: stalled or cut).
- ``env(url)`` is the standard AWS configuration a user would set (``AWS_ENDPOINT_URL``, keys, region), for a
  guard run as a subprocess.

Both are context managers and usable as pytest fixtures (``tests/test_dest_s3.py``).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CREDENTIALS", "Fault", "FaultProxy", "MotoServer", "env", "free_port"]

#: Any keys work with moto; these look like AWS's (and are masked by the guard like real ones).
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIAGUARDTESTKEY0001", "AWS_SECRET_ACCESS_KEY": "guard-test-secret-key-0001",
               "AWS_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env(url: str) -> dict[str, str]:
    """The standard AWS variables for a client of the server at ``url`` (no profile, no instance metadata)."""
    return {**CREDENTIALS, "AWS_ENDPOINT_URL": url, "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


class MotoServer:
    """``moto_server`` as a child process on 127.0.0.1 (a free port); ``url``; ``stop()`` ends it."""

    def __init__(self, log_dir: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
        if exe is None:
            raise RuntimeError("moto_server not found: pip install 'moto[server]' (the test extra)")
        log = open(log_dir / "moto.log", "wb") if log_dir else subprocess.DEVNULL  # noqa: SIM115
        self._proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        # not a job's process: a test that runs the guard's process tree code in this process (a worker that also
        # holds a session-wide server) must not take it for one of the job's survivors or orphans
        from guard.core.children import CHILDREN, HELPER

        CHILDREN.add(self._proc.pid, HELPER)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self._proc.returncode}")
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/")
                conn.getresponse().read()
                conn.close()
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto_server did not answer within 30 s")

    def client(self, url: str | None = None, **config: Any) -> Any:
        """A boto3 S3 client of the server (or of ``url``: a proxy in front of it)."""
        import boto3
        from botocore.config import Config

        return boto3.session.Session(aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                                     region_name="us-east-1").client(
            "s3", endpoint_url=url or self.url, config=Config(**config) if config else None)

    def bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket (a unique name unless given) and return its name."""
        name = name or f"guard-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        from guard.core.children import CHILDREN

        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        CHILDREN.discard(self._proc.pid)

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Fault:
    """What to do to the next ``count`` requests whose method is in ``methods`` (all when empty) and whose path and
    query contain ``path_contains``.

    ``action``: ``"stall"`` (hold the request ``stall_s`` seconds, then drop it), ``"status"`` (answer ``status``
    with an S3 error body, ``code``: ``"SlowDown"`` for 503 throttling), ``"cut"`` (read ``cut_after_bytes`` of the
    body, then close the connection), ``"checksum"`` (forward, then replace the answer's SHA-256 checksum header).
    """

    action: str
    count: int = 1
    methods: tuple[str, ...] = ()
    path_contains: str = ""
    status: int = 500
    code: str = "InternalError"
    stall_s: float = 60.0
    cut_after_bytes: int = 65536
    hits: int = field(default=0)

    def matches(self, method: str, path: str) -> bool:
        return self.hits < self.count and (not self.methods or method in self.methods) and self.path_contains in path


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` (``http://127.0.0.1:PORT``) that injects faults."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, int]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def reset(self) -> None:
        with self._lock:
            self.faults.clear()

    def _take(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None

    def _log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append((method, path, status))

    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        method, path = h.command, h.path
        fault = self._take(method, path)
        length = int(h.headers.get("Content-Length") or 0)
        if fault and fault.action == "stall":
            self._log(method, path, 0)
            self._stop.wait(fault.stall_s)
            h.close_connection = True
            return
        if fault and fault.action == "cut":
            h.rfile.read(min(length, fault.cut_after_bytes))
            self._log(method, path, 0)
            h.close_connection = True
            with contextlib.suppress(OSError):
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        body = h.rfile.read(length) if length else b""
        if fault and fault.action == "status":
            text = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                    f"<Message>injected by the test proxy</Message></Error>").encode()
            h.send_response(fault.status)
            h.send_header("Content-Type", "application/xml")
            h.send_header("Content-Length", str(len(text)))
            h.end_headers()
            h.wfile.write(text)
            self._log(method, path, fault.status)
            return
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(method, path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            h.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() in ("connection", "keep-alive", "transfer-encoding", "server", "date") or (
                        key.lower() == "content-length" and method != "HEAD"):
                    continue
                if fault and fault.action == "checksum" and key.lower() == "x-amz-checksum-sha256":
                    value = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
                h.send_header(key, value)
            if method != "HEAD":
                h.send_header("Content-Length", str(len(data)))
            h.end_headers()
            if method != "HEAD":
                h.wfile.write(data)
            self._log(method, path, answer.status)
        finally:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def serve(log_dir: Path | None = None) -> Iterator[MotoServer]:
    """A moto server for the duration of the block."""
    server = MotoServer(log_dir)
    try:
        yield server
    finally:
        server.stop()
