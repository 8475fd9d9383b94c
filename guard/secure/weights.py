"""The saved weights read by the guard itself: a save holding a NaN or an infinity is never secured, never resumed.

The agent checks the tensors the job saves where it sees them (``torch.save``), on their device. This module reads
what lies on disk, in the guard's own processes (the push worker, the resume's look at the output folder), for the
files whose format it reads without a framework:

- **safetensors** (the format's spec, ``huggingface/safetensors`` README): an 8-byte little-endian header length,
  a JSON header naming every tensor's ``dtype``, ``shape`` and ``data_offsets`` (begin, end, relative to the end of
  the header), then the raw little-endian data. The floating dtypes are checked: ``F64``, ``F32``, ``F16``,
  ``BF16``, ``F8_E5M2`` and ``F8_E4M3``; integer and boolean tensors hold no NaN.
- **torch.save zip** (``torch.save``'s default since PyTorch 1.6): its ``data.pkl`` names every storage with its
  type (``FloatStorage``, ``DoubleStorage``, ``HalfStorage``, ``BFloat16Storage``) and the tensors built on it; it
  is read with the stub unpickler of ``guard.secure.formats`` (no class imported, no code of the file run), and each
  storage's bytes, stored uncompressed in its zip record, are read as a safetensors tensor's are
  (``formats.torch_zip_storages``). A whole storage is read (a view saves all of it). Storages without a typed name
  (the 8-bit floats: ``UntypedStorage``) and the legacy (pre-1.6) pickle layout are not read; the agent's
  ``torch.save`` witness checks every tensor in the job, before the file is reported.

How a value is told non-finite without numpy (which the guard does not depend on): an IEEE value is NaN or
infinite exactly when its exponent bits are all ones. The byte holding the sign and the top exponent bits is
taken for every element at once (``bytes[k::width]``, in C) and the bytes that could be such a value are kept
(``bytes.translate`` with the other 250-odd values deleted): for ``F16`` and the 8-bit floats that byte holds the
whole exponent, so the test is exact; for ``F32``, ``BF16`` and ``F64`` it holds all but the lowest exponent
bit(s), so only a value of magnitude at least 2**127 (2**1023 for ``F64``) passes, and such a chunk is tested
exactly: the chunk as one integer, each element's exponent masked and one added below it, a carry into the sign
bit of any element is a non-finite value (no carry crosses elements). About 1.3 GB/s from the page cache on one
core of the project's test machine (``benchmarks/bench_destinations.py``); a non-finite chunk costs one integer
pass more.

An attention mask kept as a buffer holds -inf by design: a tensor whose name ends in ``mask``
(``guard.protocol.mask_allows_minus_inf``, the agent's rule too) may hold -inf, never a NaN nor a +inf. Its chunks
all look suspect by their top byte (a -inf's is a NaN's), so each is read further (``_mask_non_finite``: the sum of
its elements, or its lanes for the 16- and 8-bit floats).

The reading is bounded: ``deadline`` (monotonic seconds) is looked at between chunks of ``CHUNK_BYTES``;
past it, ``CheckTimedOut`` is raised. It never runs on the guard's loop (its callers are the push worker and the
resume's file system thread).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from guard.protocol import mask_allows_minus_inf

__all__ = ["CHECKED_DTYPES", "CHUNK_BYTES", "TORCH_STORAGES", "CheckTimedOut", "NonFinite", "WeightsCheck",
           "check_files", "first_non_finite"]

#: Bytes read at a time (a multiple of every element width).
CHUNK_BYTES = 16 << 20
_MAX_HEADER_BYTES = 100_000_000  # the spec's limit on the header length


@dataclasses.dataclass(frozen=True)
class _Dtype:
    """How a floating dtype is tested: element ``width`` in bytes, ``top`` the byte index (little-endian) holding
    the sign and the top exponent bits, ``suspect`` those of its 256 values that may be a non-finite element,
    ``exact`` whether that byte alone tells (its whole exponent is in it), ``exponent`` the exponent's bits in
    the element, and ``infinity`` whether the dtype has one (else every non-finite value is a NaN)."""

    width: int
    top: int
    suspect: bytes
    exact: bool
    exponent: int
    infinity: bool = True

    @property
    def others(self) -> bytes:
        """The top-byte values that cannot be a non-finite element (deleted by ``translate``)."""
        return bytes(sorted(set(range(256)) - set(self.suspect)))


def _top_bytes(mask: int) -> bytes:
    return bytes(value for value in range(256) if value & mask == mask)


#: The safetensors dtypes that can hold a NaN or an infinity, and how each is tested. ``F8_E4M3`` (``float8_e4m3fn``)
#: has no infinity: its NaN is S.1111.111 (the top byte is the element).
CHECKED_DTYPES: dict[str, _Dtype] = {
    "F64": _Dtype(8, 7, _top_bytes(0x7F), False, 0x7FF0_0000_0000_0000),
    "F32": _Dtype(4, 3, _top_bytes(0x7F), False, 0x7F80_0000),
    "BF16": _Dtype(2, 1, _top_bytes(0x7F), False, 0x7F80),
    "F16": _Dtype(2, 1, _top_bytes(0x7C), True, 0x7C00),
    "F8_E5M2": _Dtype(1, 0, _top_bytes(0x7C), True, 0x7C),
    "F8_E4M3": _Dtype(1, 0, _top_bytes(0x7F), True, 0x7F, infinity=False),
}
_OTHERS = {name: kind.others for name, kind in CHECKED_DTYPES.items()}
#: ``torch.save``'s typed storage names (``torch.storage.TypedStorage._pickle_storage_type``) -> the dtype read.
TORCH_STORAGES = {"DoubleStorage": "F64", "FloatStorage": "F32", "BFloat16Storage": "BF16", "HalfStorage": "F16"}


class CheckTimedOut(Exception):
    """The check did not end by its deadline (``path``: the file it was reading)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"the weights check of {path} did not end before its deadline")
        self.path = path


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first non-finite tensor found: ``file`` (relative to the checkpoint folder), ``tensor`` (its name in
    the file), ``dtype`` (the safetensors dtype)."""

    file: str
    tensor: str
    dtype: str

    def describe(self) -> str:
        """``"model.safetensors: tensor lm_head.weight (F32)"``."""
        return f"{self.file}: tensor {self.tensor} ({self.dtype})"


#: Names of the files read: safetensors, and ``torch.save``'s (the Trainer's ``optimizer.pt``, ``pytorch_model.bin``,
#: a loop's ``ckpt.pt``, timm's ``last.pth.tar``).
_READ_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".tar")


@dataclasses.dataclass(frozen=True)
class WeightsCheck:
    """What ``check_files`` read: ``bad`` (the first non-finite tensor, None when all were finite), ``files`` (the
    safetensors files and ``torch.save`` zips read), ``size_bytes`` (their size), ``elapsed_s`` (seconds)."""

    bad: NonFinite | None
    files: int
    size_bytes: int
    elapsed_s: float


def _exactly_non_finite(chunk: bytes | bytearray, kind: _Dtype, *, mask: bool = False) -> bool:
    """Whether an element of ``chunk`` (whole elements) has every exponent bit set: each element's exponent masked,
    plus one below it, carries into its sign bit exactly then; no sum crosses into the next element. ``mask``: a
    -inf does not count (``protocol.mask_allows_minus_inf``): such an element must also have a mantissa (a NaN:
    the mantissa masked plus itself carries into the exponent's lowest bit, moved up to the sign bit) or a clear
    sign bit (+inf)."""
    lanes = len(chunk) // kind.width
    if lanes == 0:
        return False
    low = kind.exponent & -kind.exponent  # the exponent's lowest bit
    top = 8 * kind.width - 1

    def spread(value: int) -> int:
        return int.from_bytes(value.to_bytes(kind.width, "little") * lanes, "little")

    value = int.from_bytes(chunk[:lanes * kind.width], "little")
    signs = spread(1 << top)
    found = ((value & spread(kind.exponent)) + spread(low)) & signs
    if not (found and mask and kind.infinity):
        return bool(found)
    mantissa = spread(low - 1)
    nan = (((value & mantissa) + mantissa) & spread(low)) << (top - low.bit_length() + 1)
    return bool(found & (nan | (signs & ~value)))


#: Top bytes of a 16-bit float (and whole 8-bit E5M2 values) that are a NaN or a +inf whatever follows: sign 0 and
#: exponent all ones, or sign 1, exponent all ones and a mantissa bit in the top byte. ``0xFC`` is -inf (with a low
#: byte of 0 for ``F16``).
_NAN_OR_PLUS_INF_TOPS = bytes((0x7C, 0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF))
_NOT_NAN_OR_PLUS_INF_TOPS = bytes(sorted(set(range(256)) - set(_NAN_OR_PLUS_INF_TOPS)))
#: A ``bytes.translate`` table: ``0xFC`` -> ``0xFF``, every other byte -> 0.
_MINUS_INF_TOP = bytes(0xFF if value == 0xFC else 0 for value in range(256))


def _mask_non_finite(chunk: bytes | bytearray, dtype: str) -> bool:
    """Whether a chunk of a tensor allowed -inf (a mask) holds a NaN or a +inf. Every chunk of a mask looks suspect
    by its top bytes, so this is its common path; it is faster than the integer test (a 4096x4096 mask on the
    project's test machine, 2 cores at load 3.6: float32 3.5 s that way, 0.2 s this way; bfloat16 0.4 s, float16
    0.35 s):

    - ``F32``, ``F64``, ``BF16`` (widened to ``F32`` by placing its two bytes above two zero bytes: its bits are
      a ``F32``'s upper half), on a little-endian host: the elements' sum (``sum`` adds Python floats in C). It is
      finite or -inf only when no element is a NaN or a +inf (either propagates to the end); a NaN or a +inf sum
      may also come from finite elements that overflow, so it is told by the integer test.
    - ``F16`` and ``F8_E5M2``: a top byte of ``_NAN_OR_PLUS_INF_TOPS`` is a NaN or a +inf; a ``F16`` element of top
      byte ``0xFC`` is a NaN when its low byte is not 0 (the two lanes marked and ANDed as integers)."""
    kind = CHECKED_DTYPES[dtype]
    whole = len(chunk) - len(chunk) % kind.width
    data = memoryview(chunk)[:whole]
    if dtype in ("F16", "F8_E5M2"):
        tops = bytes(data[kind.top::kind.width])
        if tops.translate(None, _NOT_NAN_OR_PLUS_INF_TOPS):
            return True
        if dtype == "F8_E5M2":
            return False
        marks = tops.translate(_MINUS_INF_TOP)
        return bool(int.from_bytes(marks, "little") & int.from_bytes(data[0::2], "little"))
    if sys.byteorder == "little":
        if dtype == "BF16":
            wide = bytearray(2 * whole)
            wide[2::4], wide[3::4] = data[0::2], data[1::2]
            data = memoryview(wide)
        total = sum(data.cast("d" if dtype == "F64" else "f"))
        if not (math.isnan(total) or total == math.inf):
            return False
    return _exactly_non_finite(chunk, kind, mask=True)


def _chunk_non_finite(chunk: bytes | bytearray, dtype: str, *, mask: bool = False) -> bool:
    kind = CHECKED_DTYPES[dtype]
    if not chunk[kind.top::kind.width].translate(None, _OTHERS[dtype]):
        return False  # no element's top byte could be one (the common case: one C pass)
    if mask and kind.infinity:
        return _mask_non_finite(chunk, dtype)  # a -inf's top byte is a NaN's: the rest tells
    return kind.exact or _exactly_non_finite(chunk, kind)


def _tensors(header: dict[str, object]) -> list[tuple[int, int, str, str]]:
    """``(begin, end, name, dtype)`` of every tensor of a checked dtype, in file order."""
    found = []
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        dtype, offsets = entry.get("dtype"), entry.get("data_offsets")
        if dtype in CHECKED_DTYPES and isinstance(offsets, list) and len(offsets) == 2 \
                and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]:
            found.append((offsets[0], offsets[1], name, str(dtype)))
    return sorted(found)


def _span_non_finite(file: Any, begin: int, length: int, dtype: str, buffer: bytearray, *, where: str, mask: bool,
                     deadline: float | None, clock: Callable[[], float]) -> bool | None:
    """Whether ``length`` bytes of ``dtype`` elements from ``begin`` in ``file`` hold a non-finite one (``mask``: a
    -inf does not count); None when the file ends first (cut short: ``formats``' to say)."""
    view = memoryview(buffer)
    file.seek(begin)
    left = length
    while left > 0:
        if deadline is not None and clock() > deadline:
            raise CheckTimedOut(where)
        got = file.readinto(view[:min(left, len(buffer))])
        if not got:
            return None
        left -= got
        if _chunk_non_finite(buffer[:got] if got < len(buffer) else buffer, dtype, mask=mask):
            return True
    return False


def first_non_finite(path: str | os.PathLike[str], *, deadline: float | None = None,
                     clock: Callable[[], float] = time.monotonic) -> tuple[str, str] | None:
    """The first tensor (in file order) of the safetensors file or ``torch.save`` zip at ``path`` holding a NaN or
    an infinity, as ``(name, dtype)`` (a safetensors dtype), or None when every checked tensor is finite or the file
    is of neither format, or not readable as one (its structure is ``guard.secure.formats``' to judge). A -inf in a
    tensor named as a mask is not counted (``protocol.mask_allows_minus_inf``, the agent's rule too).

    Args:
        path: the file.
        deadline: ``clock()`` value after which the reading stops (looked at between chunks); None: no bound.
        clock: monotonic seconds.

    Raises:
        CheckTimedOut: ``deadline`` passed before the check ended.
        OSError: the file cannot be read.
    """
    from guard.secure.formats import kind_of, torch_zip_storages

    where = os.fspath(path)
    kind = kind_of(where)
    if kind == "safetensors":
        spans = _safetensors_spans(where)
    elif kind == "torch-zip":
        storages = torch_zip_storages(where)
        spans = None if storages is None else [(st.offset, st.size_bytes, st.tensor, TORCH_STORAGES[st.kind])
                                               for st in storages if st.kind in TORCH_STORAGES]
    else:
        return None
    if not spans:
        return None
    buffer = bytearray(CHUNK_BYTES)
    with open(where, "rb", buffering=0) as file:
        for begin, length, name, dtype in spans:
            found = _span_non_finite(file, begin, length, dtype, buffer, where=where,
                                     mask=mask_allows_minus_inf(name), deadline=deadline, clock=clock)
            if found is None:
                return None
            if found:
                return name, dtype
    return None


def _safetensors_spans(where: str) -> list[tuple[int, int, str, str]] | None:
    """``(file offset, length, name, dtype)`` of every tensor of a checked dtype, in file order; None when the
    header cannot be read."""
    with open(where, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return None
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _MAX_HEADER_BYTES:
            return None
        try:
            header = json.loads(file.read(header_len))
        except ValueError:
            return None
    if not isinstance(header, dict):
        return None
    start = 8 + header_len
    return [(start + begin, end - begin, name, dtype) for begin, end, name, dtype in _tensors(header)]


def _data_bytes(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def check_files(folder: str | os.PathLike[str], files: Iterable[str], *, deadline: float | None = None,
                clock: Callable[[], float] = time.monotonic) -> WeightsCheck:
    """Read every safetensors file and ``torch.save`` zip of ``files`` (relative to ``folder``; told by
    ``guard.secure.formats.kind_of``) and return the first non-finite tensor, if any. Other files are not read (see
    the module docstring).

    Raises:
        CheckTimedOut: ``deadline`` passed first.
        OSError: a file cannot be read.
    """
    from guard.secure.formats import kind_of

    base, started = Path(folder), clock()
    read, size = 0, 0
    for rel in sorted(files):
        path = base / rel
        if not rel.endswith(_READ_SUFFIXES) or kind_of(path) not in ("safetensors", "torch-zip"):
            continue
        read, size = read + 1, size + _data_bytes(path)
        bad = first_non_finite(path, deadline=deadline, clock=clock)
        if bad is not None:
            return WeightsCheck(NonFinite(rel, bad[0], bad[1]), read, size, clock() - started)
    return WeightsCheck(None, read, size, clock() - started)
