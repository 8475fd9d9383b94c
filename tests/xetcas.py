"""A Xet storage (CAS) server inside the local Hub test server (``tests/hubserver.py``): stdlib only.

The Hub's default transfer is Xet: ``huggingface_hub`` uploads every LFS file through ``hf_xet`` whenever it is
installed and ``HF_HUB_DISABLE_XET`` is unset, and downloads through it when the resolve answer names a Xet hash.
This module plays the storage side of that protocol, so the tests run the client's real default.

The protocol is public (huggingface/hub-docs ``docs/xet/``: ``auth.md``, ``api.md``, ``upload-protocol.md``,
``download-protocol.md``, ``shard.md``, ``xorb.md``); the requests ``huggingface_hub`` 2.4 and ``hf_xet`` 1.8 make, in
order, are in ``shared/reference/object-stores.md``:

- ``GET /api/{models|datasets|spaces}/{repo}/xet-{write|read}-token/{rev}`` (a Hub route, ``Routes.xet_token``)
  answers the headers ``X-Xet-Cas-Url`` (this server's ``/cas``), ``X-Xet-Access-Token`` (minted here, scoped to
  the repo and to read or write) and ``X-Xet-Token-Expiration`` (``huggingface_hub.utils._xet``).
- ``GET /cas/v1/chunks/{prefix}/{hash}``: global deduplication; always 404 (nothing to dedupe against).
- ``POST /cas/v1/xorb-grants/{prefix}/{hash}``: not in the published spec; 404, which the client tolerates (it
  then uploads the xorb directly).
- ``POST /cas/v1/xorbs/{prefix}/{hash}``: a serialized xorb; its chunk headers are parsed (``xorb.md``) and kept as
  an index (chunk -> byte range, compression, length). ``{"was_inserted": bool}``.
- ``POST /cas/v1/shards`` and ``POST /cas/v2/shards``: the shard (``shard.md``, no footer) names each uploaded
  file's xet hash, its terms (xorb, chunk range) and its SHA-256 (the metadata extension the Hub requires for git
  repos). Each file is rebuilt from its xorbs here (LZ4 and byte-grouping decoded in pure Python) and its SHA-256
  checked against the shard's: the bytes then become an LFS object of the token's repo, so the commit's
  ``lfsFile`` (oid = that SHA-256) commits exactly what was uploaded and ``get_paths_info`` returns the SHA-256 the
  client computed. v2 answers NDJSON events ending with ``{"type":"result","result":1}`` (or ``{"type":"error"}``).
- ``GET /cas/v2/reconstructions/{file_id}`` (and the deprecated ``/v1/reconstructions``): the terms of a file (an
  optional ``Range``) with one fetch entry per run of chunks, each a URL on ``/cas/xorb-data/{hash}`` that serves
  the xorb's stored bytes for a single ``Range``, so that ``hf_xet`` downloads through Xet too.
- ``HEAD /cas/v1/files/{file_id}`` and ``HEAD /cas/v1/xorbs/{prefix}/{hash}``: existence and size.

What is not checked: chunk, xorb and file hashes are BLAKE3 (``hashing.md``), which the standard library does not
have, so the server takes the client's hashes as given; the file's SHA-256 over the rebuilt bytes is the integrity
check (a wrong xorb or term gives a different SHA-256 and the shard is refused). Files uploaded over plain LFS have
no xet hash: they are served over plain HTTP whatever the client's setting.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from tests.hubstate import HttpError

if TYPE_CHECKING:
    from tests.hubroutes import Routes

__all__ = ["XetCas", "XetFile", "hash_from_str", "hash_to_str", "lz4_decompress"]

_SHARD_HEADER_BYTES = 48
_ENTRY_BYTES = 48
_BOOKEND = b"\xff" * 32
_FLAG_VERIFICATION = 1 << 31
_FLAG_METADATA_EXT = 1 << 30
_CHUNK_HEADER_BYTES = 8
_LZ4_FRAME_MAGIC = 0x184D2204
TOKEN_LIFETIME_S = 3600


def hash_to_str(raw: bytes) -> str:
    """A 32-byte Xet hash as the protocol writes it in paths and headers: each 8-byte group reversed (each group a
    little-endian u64 in hex; ``api.md``, "Converting Hashes to Strings")."""
    return "".join(raw[i:i + 8][::-1].hex() for i in range(0, 32, 8))


def hash_from_str(text: str) -> bytes:
    """The 32 bytes of a Xet hash written as a string (the inverse of ``hash_to_str``)."""
    return b"".join(bytes.fromhex(text[i:i + 16])[::-1] for i in range(0, 64, 16))


# -- chunk decoding (xorb.md: compression schemes 0 none, 1 LZ4, 2 byte grouping of 4 then LZ4) ---------------------


def _lz4_block(src: memoryview, out: bytearray, end: int | None = None) -> None:
    """Decode one LZ4 block (the LZ4 block format: sequences of a token, literals, a 2-byte offset and a match)
    from ``src[:end]``, appending to ``out`` (earlier bytes of ``out`` are the window)."""
    i, n = 0, len(src) if end is None else end
    while i < n:
        token = src[i]
        i += 1
        literals = token >> 4
        if literals == 15:
            while True:
                extra = src[i]
                i += 1
                literals += extra
                if extra != 255:
                    break
        if literals:
            out += src[i:i + literals]
            i += literals
        if i >= n:
            return  # the last sequence has literals only
        offset = src[i] | (src[i + 1] << 8)
        i += 2
        match = token & 15
        if match == 15:
            while True:
                extra = src[i]
                i += 1
                match += extra
                if extra != 255:
                    break
        match += 4
        if offset == 0 or offset > len(out):
            raise ValueError(f"LZ4: offset {offset} outside the {len(out)} bytes decoded")
        start = len(out) - offset
        if offset >= match:
            out += out[start:start + match]
        else:  # the match overlaps what it writes: a repeated pattern of ``offset`` bytes
            pattern = bytes(out[start:])
            out += (pattern * (match // offset + 1))[:match]


def lz4_decompress(data: bytes | memoryview) -> bytes:
    """Decode LZ4 data: the LZ4 frame format (magic ``0x184D2204``, one or more blocks; checksums not checked) or a
    bare LZ4 block.

    Raises:
        ValueError: the data is not valid LZ4.
    """
    src = memoryview(data)
    out = bytearray()
    try:
        if len(src) >= 7 and struct.unpack_from("<I", src, 0)[0] == _LZ4_FRAME_MAGIC:
            flags = src[4]
            i = 6 + (8 if flags & 0x08 else 0) + (4 if flags & 0x01 else 0) + 1  # FLG BD [size] [dict] HC
            block_checksum = bool(flags & 0x10)
            while True:
                (size,) = struct.unpack_from("<I", src, i)
                i += 4
                if size == 0:
                    break  # end mark (a content checksum may follow)
                raw, size = bool(size & 0x80000000), size & 0x7FFFFFFF
                block = src[i:i + size]
                if raw:
                    out += block
                else:
                    window = len(out)
                    tail = bytearray(out[max(0, window - 65536):])  # matches reach back at most 64 KiB
                    keep = len(tail)
                    _lz4_block(block, tail)
                    out += tail[keep:]
                i += size + (4 if block_checksum else 0)
        else:
            _lz4_block(src, out)
    except (IndexError, struct.error) as err:
        raise ValueError(f"LZ4: truncated data ({err})") from err
    return bytes(out)


def _ungroup4(grouped: bytes) -> bytes:
    """Undo the byte grouping of ``ByteGrouping4LZ4``: group k holds bytes k, k+4, k+8, ...; the first
    ``len % 4`` groups are one byte longer."""
    n = len(grouped)
    out = bytearray(n)
    base, extra = divmod(n, 4)
    at = 0
    for k in range(4):
        size = base + (1 if k < extra else 0)
        out[k::4] = grouped[at:at + size]
        at += size
    return bytes(out)


class ChunkRef(NamedTuple):
    """A chunk inside a stored xorb: where its header starts, its serialized length (header included), its
    compression scheme and its decoded length."""

    offset: int
    length: int
    scheme: int
    size: int


def parse_xorb(body: bytes) -> list[ChunkRef]:
    """The chunks of a serialized xorb, in order (``xorb.md``: each an 8-byte header, version 0, 3-byte LE compressed
    size, 1-byte scheme, 3-byte LE uncompressed size, then the data). Parsing stops at the end or at anything that is
    not a chunk header (a trailing footer some clients append).

    Raises:
        HttpError: 400 when no chunk could be read.
    """
    chunks: list[ChunkRef] = []
    at, n = 0, len(body)
    while at + _CHUNK_HEADER_BYTES <= n:
        version = body[at]
        compressed = int.from_bytes(body[at + 1:at + 4], "little")
        scheme = body[at + 4]
        size = int.from_bytes(body[at + 5:at + 8], "little")
        if version != 0 or scheme > 2 or at + _CHUNK_HEADER_BYTES + compressed > n or size == 0:
            break
        chunks.append(ChunkRef(at, _CHUNK_HEADER_BYTES + compressed, scheme, size))
        at += _CHUNK_HEADER_BYTES + compressed
    if not chunks:
        raise HttpError(400, "xorb: no chunk could be read")
    return chunks


def decode_chunk(body: bytes, ref: ChunkRef) -> bytes | memoryview:
    """The decoded bytes of one chunk (a view into ``body`` when it is stored uncompressed).

    Raises:
        ValueError: the data does not decode to the recorded length.
    """
    data = memoryview(body)[ref.offset + _CHUNK_HEADER_BYTES:ref.offset + ref.length]
    out: bytes | memoryview
    if ref.scheme == 0:
        out = data
    elif ref.scheme == 1:
        out = lz4_decompress(data)
    else:
        out = _ungroup4(lz4_decompress(data))
    if len(out) != ref.size:
        raise ValueError(f"chunk at {ref.offset}: decoded {len(out)} bytes, the header says {ref.size}")
    return out


# -- shards (shard.md) ----------------------------------------------------------------------------------------------


class Term(NamedTuple):
    xorb: str  # the xorb hash, as a string
    start: int  # chunk index range [start, end)
    end: int
    size: int  # unpacked bytes


@dataclass(frozen=True)
class XetFile:
    """A file registered by a shard: its xet hash (the file id), its SHA-256 (hex) and its terms."""

    file_id: str
    sha256: str | None
    terms: tuple[Term, ...]

    @property
    def size(self) -> int:
        return sum(term.size for term in self.terms)


def parse_shard(body: bytes) -> tuple[list[XetFile], list[str]]:
    """The files (file info section) and the xorbs (CAS info section) of an uploaded shard.

    Raises:
        HttpError: 400 for a malformed shard (``shard.md``: header version 2, bookends, entry counts).
    """
    try:
        if len(body) < _SHARD_HEADER_BYTES or struct.unpack_from("<Q", body, 32)[0] != 2:
            raise HttpError(400, "shard: not a version 2 shard header")
        at = _SHARD_HEADER_BYTES
        files: list[XetFile] = []
        while True:
            raw_hash = body[at:at + 32]
            flags, count = struct.unpack_from("<II", body, at + 32)
            at += _ENTRY_BYTES
            if raw_hash == _BOOKEND:
                break
            terms = []
            for _ in range(count):
                xorb = hash_to_str(body[at:at + 32])
                _flags, size, start, end = struct.unpack_from("<IIII", body, at + 32)
                terms.append(Term(xorb, start, end, size))
                at += _ENTRY_BYTES
            if flags & _FLAG_VERIFICATION:
                at += count * _ENTRY_BYTES
            sha256 = None
            if flags & _FLAG_METADATA_EXT:
                # stored like every Xet hash: its string form (hash_to_str) is the usual SHA-256 hex (seen with
                # hf_xet 1.8: the plain hex of the 32 bytes matched no SHA-256 of the file)
                sha256 = hash_to_str(body[at:at + 32])
                at += _ENTRY_BYTES
            files.append(XetFile(hash_to_str(raw_hash), sha256, tuple(terms)))
        xorbs: list[str] = []
        while at + _ENTRY_BYTES <= len(body):
            raw_hash = body[at:at + 32]
            (count,) = struct.unpack_from("<I", body, at + 36)
            at += _ENTRY_BYTES
            if raw_hash == _BOOKEND:
                break
            xorbs.append(hash_to_str(raw_hash))
            at += count * _ENTRY_BYTES
        return files, xorbs
    except struct.error as err:
        raise HttpError(400, f"shard: truncated ({err})") from err


# -- the server side --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Grant:
    repo: tuple[str, str]  # (repo type, repo id)
    write: bool
    expires_at_s: float


class _Xorb(NamedTuple):
    body: bytes
    chunks: list[ChunkRef]


_HASH = r"[0-9a-f]{64}"


class XetCas:
    """The Xet storage of one ``HubServer``: xorbs, registered files, access tokens (thread-safe).

    Attributes:
        xorbs: xorb hash -> stored bytes and chunk index.
        files: file id (xet hash) -> ``XetFile``.
        by_sha256: SHA-256 (hex) -> file id, for the resolve route's ``X-Xet-Hash``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.xorbs: dict[str, _Xorb] = {}
        self.files: dict[str, XetFile] = {}
        self.by_sha256: dict[str, str] = {}
        self._grants: dict[str, _Grant] = {}

    def mint(self, repo_type: str, repo_id: str, *, write: bool) -> tuple[str, int]:
        """A new access token for the repo (write or read scope) and its expiry (epoch seconds)."""
        token = f"xet_{'w' if write else 'r'}_{secrets.token_hex(12)}"
        expires = int(time.time()) + TOKEN_LIFETIME_S
        with self._lock:
            self._grants[token] = _Grant((repo_type, repo_id), write, expires)
        return token, expires

    def file_id_for(self, sha256: str) -> str | None:
        with self._lock:
            return self.by_sha256.get(sha256)

    def _grant(self, routes: Routes, *, write: bool) -> _Grant:
        header = routes.headers.get("Authorization") or ""
        grant = self._grants.get(header.removeprefix("Bearer ").strip())
        if grant is None or grant.expires_at_s < time.time():
            raise HttpError(401, "xet: missing, unknown or expired access token")
        if write and not grant.write:
            raise HttpError(403, "xet: this token has read scope; the call needs write scope")
        return grant

    # -- routing --------------------------------------------------------------------------------------------

    def route(self, routes: Routes, raw: list[str]) -> tuple[int, Any, dict[str, str]]:
        """Serve ``/cas/<raw...>``; returns (status, payload, headers) like the Hub routes."""
        method, path = routes.method, "/".join(raw)
        if method == "GET" and len(raw) == 2 and raw[0] == "xorb-data":
            return self.serve_xorb(routes, raw[1])  # the "signed URL" of a fetch entry: no Authorization
        if method == "GET" and re.fullmatch(rf"v1/chunks/[\w-]+/{_HASH}", path):
            self._grant(routes, write=False)
            raise HttpError(404, "xet: chunk not tracked by global deduplication")
        if method == "POST" and re.fullmatch(rf"v1/xorb-grants/[\w-]+/{_HASH}", path):
            self._grant(routes, write=True)
            raise HttpError(404, "xet: no xorb grants here; upload the xorb directly")
        if method in ("POST", "HEAD") and re.fullmatch(rf"v1/xorbs/[\w-]+/{_HASH}", path):
            return self.put_xorb(routes, raw[3]) if method == "POST" else self.head_xorb(routes, raw[3])
        if method == "POST" and path in ("v1/shards", "v2/shards"):
            return self.put_shard(routes, streaming=path.startswith("v2"))
        if method == "GET" and re.fullmatch(rf"v[12]/reconstructions/{_HASH}", path):
            return self.reconstruction(routes, raw[2], v2=path.startswith("v2"))
        if method == "HEAD" and re.fullmatch(rf"v1/files/{_HASH}", path):
            self._grant(routes, write=False)
            with self._lock:
                found = self.files.get(raw[2])
            if found is None:
                raise HttpError(404, "xet: no such file")
            return 200, None, {"Content-Length": str(found.size)}
        raise HttpError(404, f"xet: no route for {method} /cas/{path}")

    # -- uploads --------------------------------------------------------------------------------------------

    def put_xorb(self, routes: Routes, xorb_hash: str) -> tuple[int, Any, dict[str, str]]:
        self._grant(routes, write=True)
        body = bytes(routes.body)
        chunks = parse_xorb(body)
        with self._lock:
            inserted = xorb_hash not in self.xorbs
            if inserted:
                self.xorbs[xorb_hash] = _Xorb(body, chunks)
        return 200, {"was_inserted": inserted}, {}

    def head_xorb(self, routes: Routes, xorb_hash: str) -> tuple[int, Any, dict[str, str]]:
        self._grant(routes, write=False)
        with self._lock:
            found = self.xorbs.get(xorb_hash)
        if found is None:
            raise HttpError(404, "xet: no such xorb")
        return 200, None, {"Content-Length": str(len(found.body))}

    def rebuild(self, xet_file: XetFile) -> bytes:
        """The bytes of a registered file, decoded from its xorbs.

        Raises:
            ValueError: a term names a missing xorb or chunks it does not have, or a chunk does not decode.
        """
        parts: list[bytes | memoryview] = []
        for term in xet_file.terms:
            with self._lock:
                xorb = self.xorbs.get(term.xorb)
            if xorb is None:
                raise ValueError(f"term names xorb {term.xorb[:12]}.., which was not uploaded")
            if not 0 <= term.start < term.end <= len(xorb.chunks):
                raise ValueError(f"term [{term.start}, {term.end}) outside xorb {term.xorb[:12]}.. "
                                 f"({len(xorb.chunks)} chunks)")
            decoded = [decode_chunk(xorb.body, ref) for ref in xorb.chunks[term.start:term.end]]
            if sum(map(len, decoded)) != term.size:
                raise ValueError(f"term of xorb {term.xorb[:12]}.. decodes to {sum(map(len, decoded))} bytes, "
                                 f"the shard says {term.size}")
            parts.extend(decoded)
        return b"".join(parts)

    def put_shard(self, routes: Routes, *, streaming: bool) -> tuple[int, Any, dict[str, str]]:
        grant = self._grant(routes, write=True)
        files, _xorbs = parse_shard(bytes(routes.body))
        rebuilt: dict[str, bytes] = {}
        try:
            for xet_file in files:
                data = self.rebuild(xet_file)
                digest = hashlib.sha256(data).hexdigest()
                if xet_file.sha256 is not None and digest != xet_file.sha256:
                    raise ValueError(f"file {xet_file.file_id[:12]}.. rebuilds to sha256 {digest[:12]}.., the "
                                     f"shard says {xet_file.sha256[:12]}..")
                rebuilt[digest] = data
        except ValueError as err:
            if not streaming:
                raise HttpError(400, f"xet: shard refused: {err}") from err
            return 200, _ndjson({"type": "error", "message": f"shard refused: {err}"}), _ndjson_headers()
        with self._lock:
            for xet_file, digest in zip(files, rebuilt, strict=True):
                self.files[xet_file.file_id] = xet_file
                self.by_sha256[digest] = xet_file.file_id
        routes.hub._xet_uploaded(grant.repo, rebuilt)
        if not streaming:
            return 200, {"result": 1}, {}
        events = [{"type": "validating", "verified": len(files), "total": len(files)},
                  {"type": "committing", "stage": "syncing"}, {"type": "result", "result": 1}]
        return 200, _ndjson(*events), _ndjson_headers()

    # -- downloads ------------------------------------------------------------------------------------------

    def reconstruction(self, routes: Routes, file_id: str, *, v2: bool) -> tuple[int, Any, dict[str, str]]:
        self._grant(routes, write=False)
        with self._lock:
            xet_file = self.files.get(file_id)
            xorbs = {term.xorb: self.xorbs.get(term.xorb) for term in xet_file.terms} if xet_file else {}
        if xet_file is None:
            raise HttpError(404, "xet: no such file")
        size = xet_file.size
        first, last = 0, size - 1
        match = re.fullmatch(r"bytes=(\d*)-(\d*)", routes.headers.get("Range", "") or "")
        if match:
            first = int(match[1] or 0)
            last = min(int(match[2]) if match[2] else size - 1, size - 1)
            if first >= size:
                raise HttpError(416, "xet: the range starts past the end of the file")
        # the file's chunks in order: (xorb, chunk index, its first byte in the file)
        terms: list[dict[str, Any]] = []
        runs: dict[str, list[tuple[int, int]]] = {}
        offset_into_first: int | None = None
        at = 0
        for term in xet_file.terms:
            xorb = xorbs[term.xorb]
            if xorb is None:
                raise HttpError(500, f"xet: xorb {term.xorb} of a registered file is gone")
            chosen: list[int] = []
            for index in range(term.start, term.end):
                length = xorb.chunks[index].size
                if at + length > first and at <= last:
                    if offset_into_first is None:
                        offset_into_first = first - at
                    chosen.append(index)
                at += length
            if chosen:
                unpacked = sum(xorb.chunks[i].size for i in chosen)
                terms.append({"hash": term.xorb, "unpacked_length": unpacked,
                              "range": {"start": chosen[0], "end": chosen[-1] + 1}})
                runs.setdefault(term.xorb, []).append((chosen[0], chosen[-1] + 1))
        base = f"{routes.hub.url}/cas/xorb-data"
        fetch: dict[str, list[dict[str, Any]]] = {}
        for xorb_hash, spans in runs.items():
            chunks = xorbs[xorb_hash].chunks  # type: ignore[union-attr]
            for start, end in _merge(spans):
                first_byte, last_byte = chunks[start].offset, chunks[end - 1].offset + chunks[end - 1].length - 1
                url = f"{base}/{xorb_hash}?range={first_byte}-{last_byte}"
                entry_v2 = {"url": url, "ranges": [{"chunks": {"start": start, "end": end},
                                                   "bytes": {"start": first_byte, "end": last_byte}}]}
                entry_v1 = {"range": {"start": start, "end": end}, "url": url,
                            "url_range": {"start": first_byte, "end": last_byte}}
                fetch.setdefault(xorb_hash, []).append(entry_v2 if v2 else entry_v1)
        answer = {"offset_into_first_range": offset_into_first or 0, "terms": terms,
                  ("xorbs" if v2 else "fetch_info"): fetch}
        return 200, answer, {}

    def serve_xorb(self, routes: Routes, xorb_hash: str) -> tuple[int, Any, dict[str, str]]:
        with self._lock:
            xorb = self.xorbs.get(xorb_hash)
        if xorb is None:
            raise HttpError(404, "xet: no such xorb")
        data = memoryview(xorb.body)
        match = re.fullmatch(r"bytes=(\d+)-(\d+)", routes.headers.get("Range", "") or "")
        if not match:
            return 200, data, {}
        start, end = int(match[1]), min(int(match[2]), len(data) - 1)
        if start > end:
            raise HttpError(416, "xet: range not satisfiable")
        return 206, data[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(data)}"}


def _ndjson_headers() -> dict[str, str]:
    return {"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"}  # a new dict: the sender adds to it


def _ndjson(*events: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(event).encode() + b"\n" for event in events)


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Chunk ranges [start, end) sorted and joined where they overlap or touch."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
