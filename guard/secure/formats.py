"""Structural checks of checkpoint files by format: a file cut short or still being rewritten is never secured.

A check reads the file's framing only (headers, directories, pickle opcodes, never the tensors' bytes) and
answers None (the file is whole, or of no format known here) or one line on what is wrong. The formats:

- **torch zip** (``torch.save``'s default since PyTorch 1.6): a zip archive (``PK\\x03\\x04``) whose central
  directory, written *last* by ``PyTorchFileWriter``, is present and names its records, each record lying inside
  the file, with a ``*/data.pkl`` record (``torch/serialization.py``). A truncated archive has no end-of-central-
  directory record, which is what ``torch.load``'s "failed finding central directory" means.
- **legacy torch pickle** (``_use_new_zipfile_serialization=False``) and plain pickles (accelerate's
  ``random_states_0.pkl``): the pickle stream ends (``pickletools.genops`` reaches ``STOP``); for the legacy torch
  layout (magic number, protocol, system info, the object, the storage keys, then each storage as an 8-byte
  little-endian element count and its bytes, ``torch/serialization.py::_legacy_save``) every storage is present and
  the file ends right after the last one. The object is read with a stub unpickler that builds no real class and
  runs no code of the file.
- **safetensors**: an 8-byte little-endian header length, a JSON header that parses, every tensor's
  ``data_offsets`` inside the data, and the file exactly as long as header plus data (the format's spec,
  ``huggingface/safetensors`` README).
- **JSON** (``trainer_state.json``, ``config.json``): the text parses.
- **a torch.distributed.checkpoint set**: ``.metadata`` (written last, by the coordinator's ``finish``) parses,
  names every ``*.distcp`` shard of the folder, and each item it records (``_StorageInfo``: ``relative_path``,
  ``offset``, ``length``) lies inside its shard (``torch/distributed/checkpoint/filesystem.py``).

The format is told from the file's first bytes (a ``.safetensors`` name counts only when the file starts like one: a
header length, then ``{``). A model file (``*.pt``, ``*.pth``, ``*.bin``, ``*.safetensors``, ``*.ckpt``, ``*.pkl``)
of zero bytes is refused; one of no format known here (raw bytes a job wrote itself) is taken as it is, which the
debug log says; the settle rule of ``guard.secure.checkpoints`` still applies to it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import pickletools
import re
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

__all__ = ["DISTCP_METADATA", "MEGATRON_COMMON", "MEGATRON_METADATA", "MODEL_SUFFIXES", "RECORDED_STEP_KEYS",
           "TorchStorage", "check_file", "check_files", "kind_of", "missing_required", "recorded_step", "requires",
           "torch_zip_storages"]

log = logging.getLogger("guard.formats")

#: The file ``torch.distributed.checkpoint.FileSystemWriter`` writes last, naming every shard.
DISTCP_METADATA = ".metadata"
#: Suffixes of files that must be of a known format (and not empty) to be secured.
MODEL_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER
_SAFETENSORS_MAX_HEADER = 100_000_000  # the spec's limit on the header length (bytes)
#: Bytes per element of the legacy storage types (``torch.<Name>Storage``).
_ELEMENT_BYTES = {"DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2,
                  "LongStorage": 8, "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1,
                  "BoolStorage": 1, "ComplexDoubleStorage": 16, "ComplexFloatStorage": 8, "UntypedStorage": 1,
                  "QInt8Storage": 1, "QUInt8Storage": 1, "QInt32Storage": 4, "QUInt4x2Storage": 1,
                  "QUInt2x4Storage": 1}


class _Stub:
    """What the stub unpickler builds for every class or function the pickle names: it keeps its arguments and
    state, so that ``.metadata``'s records can be read without importing torch or running the file's code."""

    _qualname = "?"
    args: tuple[Any, ...]
    state: Any
    items: dict[Any, tuple[Any, Any]]

    def __new__(cls, *args: Any, **kwargs: Any) -> _Stub:
        self = object.__new__(cls)
        self.args, self.state, self.items = args, None, {}
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[id(key)] = (key, value)

    def __hash__(self) -> int:
        return id(self)

    def append(self, value: Any) -> None:
        self.items[len(self.items)] = (None, value)

    def extend(self, values: Iterable[Any]) -> None:
        for value in values:
            self.append(value)


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.storages: dict[str, tuple[str, int]] = {}  # key -> (storage type name, element count)

    def find_class(self, module: str, name: str) -> Any:
        return type(name, (_Stub,), {"_qualname": f"{module}.{name}"})

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage":
            kind = getattr(pid[1], "__name__", str(pid[1]))
            if isinstance(pid[2], str) and isinstance(pid[4], int):
                self.storages[pid[2]] = (kind, pid[4])
        return None


def kind_of(path: str | os.PathLike[str]) -> str | None:
    """The format of the file at ``path`` from its first bytes and name: ``"torch-zip"``, ``"pickle"``,
    ``"safetensors"``, ``"json"``, ``"distcp"`` (a shard of a ``torch.distributed.checkpoint`` set),
    ``"distcp-metadata"``, ``"empty"``, or None (not known here). Raises OSError when it cannot be read."""
    where = Path(path)
    if where.name == DISTCP_METADATA:
        return "distcp-metadata"
    if where.suffix == ".distcp":
        return "distcp"
    with open(where, "rb") as file:
        head = file.read(8)
    if not head:
        return "empty"
    if where.suffix == ".safetensors" and (len(head) < 8 or _safetensors_head(where)):
        return "safetensors"
    if head.startswith(_ZIP_MAGIC):
        return "torch-zip"
    if (head[:1] == b"\x80" and where.suffix != ".safetensors") or where.suffix == ".pkl":
        return "pickle"  # (a .safetensors file is never a pickle, whatever its first byte)
    if where.suffix == ".json":
        return "json"
    return None


def _safetensors_head(path: Path) -> bool:
    """The file starts like a safetensors file: a header length within the spec's limit, then ``{``."""
    with open(path, "rb") as file:
        head = file.read(9)
    return len(head) == 9 and struct.unpack("<Q", head[:8])[0] <= _SAFETENSORS_MAX_HEADER and head[8:] == b"{"


#: Top-level keys of a ``torch.save``d dict that record the job's own step, in the order they are looked for: nanoGPT's
#: ``iter_num`` (karpathy/nanoGPT ``train.py``: 0-based, saved before that iteration runs), ``global_step``
#: (Lightning, many loops), ``step``, ``iteration``.
RECORDED_STEP_KEYS = ("iter_num", "global_step", "step", "iteration")
_DATA_PKL_LIMIT = 64 << 20  # a data.pkl larger than this (a dict of many small Python objects) is not read


def _top_level(path: str | os.PathLike[str]) -> dict[Any, Any] | None:
    """The top-level dict of a ``torch.save``d zip, read from its ``data.pkl`` with the stub unpickler (no tensor
    bytes, no code of the file run), or None (another format, not a dict, unreadable); never raises."""
    try:
        where = Path(path)
        if kind_of(where) != "torch-zip":
            return None
        with zipfile.ZipFile(where) as archive:
            record = next((r for r in archive.infolist()
                           if r.filename == "data.pkl" or r.filename.endswith("/data.pkl")), None)
            if record is None or record.file_size > _DATA_PKL_LIMIT:
                return None
            with archive.open(record) as handle:
                obj = _StubUnpickler(handle).load()
    except Exception:  # noqa: BLE001 - a file of any content: never an error here
        return None
    return obj if isinstance(obj, dict) else None


class _StorageRef:
    """A storage as the stub unpickler's ``persistent_load`` gives it: its key and type name."""

    def __init__(self, key: str, kind: str) -> None:
        self.key, self.kind = key, kind


class _StorageUnpickler(_StubUnpickler):
    def persistent_load(self, pid: Any) -> Any:
        super().persistent_load(pid)
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage" and isinstance(pid[2], str):
            return _StorageRef(pid[2], getattr(pid[1], "__name__", str(pid[1])))
        return None


@dataclasses.dataclass(frozen=True)
class TorchStorage:
    """One storage of a ``torch.save`` zip: ``record`` (its zip record, ``PREFIX/data/KEY``), ``kind`` (its
    storage type's name: ``FloatStorage``, ``BFloat16Storage``...), ``tensor`` (the name of the first tensor built on
    it, its keys joined by dots: ``model.fc.weight``; the key when none names it), ``offset`` and ``size_bytes``
    (where its bytes lie in the file, stored uncompressed as ``torch.save`` writes them)."""

    record: str
    kind: str
    tensor: str
    offset: int
    size_bytes: int


def _storage_names(root: Any, limit: int = 1_000_000) -> dict[str, str]:
    """Storage key -> the dotted name of the first tensor (depth first, in the pickle's order) built on it."""
    names: dict[str, str] = {}
    stack: list[tuple[str, Any]] = [("", root)]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        name, value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        children: list[tuple[str, Any]] = []
        if isinstance(value, _StorageRef):
            names.setdefault(value.key, name or value.key)
        elif isinstance(value, _Stub):
            if value.args and isinstance(value.args[0], _StorageRef):  # torch._utils._rebuild_tensor_v2(storage, ...)
                names.setdefault(value.args[0].key, name or value.args[0].key)
                continue
            children = [(_dotted(name, key if key is not None else index), item)
                        for index, (key, item) in enumerate(value.items.values())]
            children += [(name, arg) for arg in value.args] + [(name, value.state)]
        elif isinstance(value, dict):
            children = [(_dotted(name, key), item) for key, item in value.items()]
        elif isinstance(value, (list, tuple)):
            children = [(_dotted(name, index), item) for index, item in enumerate(value)]
        stack.extend(reversed(children))
    return names


def _dotted(name: str, key: Any) -> str:
    return f"{name}.{key}" if name else str(key)


def torch_zip_storages(path: str | os.PathLike[str]) -> list[TorchStorage] | None:
    """Every storage of the ``torch.save`` zip at ``path``, in file order, read from its ``data.pkl`` with the stub
    unpickler (no code of the file run, no tensor bytes read) and its records' local headers; None when the file is
    not one, or its storages cannot be told (a record compressed, missing or outside the file: ``check_file``'s to
    judge). Raises OSError when it cannot be read."""
    where = Path(path)
    if kind_of(where) != "torch-zip":
        return None
    try:
        with zipfile.ZipFile(where) as archive:
            records = {r.filename: r for r in archive.infolist()}
            pkl = next((r for name, r in records.items() if name == "data.pkl" or name.endswith("/data.pkl")), None)
            if pkl is None or pkl.file_size > _DATA_PKL_LIMIT:
                return None
            prefix = pkl.filename[: -len("data.pkl")]
            with archive.open(pkl) as handle:
                reader = _StorageUnpickler(handle)
                names = _storage_names(reader.load())
    except Exception:  # noqa: BLE001 - a file of any content: never an error here
        return None
    found = []
    with open(where, "rb") as file:
        for key, (kind, _) in reader.storages.items():
            record = records.get(f"{prefix}data/{key}")
            if record is None or record.compress_type != zipfile.ZIP_STORED:
                return None
            file.seek(record.header_offset)
            header = file.read(30)
            if len(header) < 30 or header[:4] != _ZIP_MAGIC:
                return None
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            found.append(TorchStorage(record.filename, kind, names.get(key, key),
                                      record.header_offset + 30 + name_len + extra_len, record.file_size))
    return sorted(found, key=lambda storage: storage.offset)


def recorded_step(path: str | os.PathLike[str]) -> tuple[str, int] | None:
    """The step a ``torch.save``d dict records itself: ``(key, value)`` for the first of ``RECORDED_STEP_KEYS`` that
    its top level holds as a non-negative int, else None (another format, no such key, unreadable). Reads only the
    zip's ``data.pkl`` record, with the stub unpickler (no tensor bytes, no code of the file run); never raises."""
    obj = _top_level(path)
    if obj is None:
        return None
    for key in RECORDED_STEP_KEYS:
        value = obj.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return key, value
    return None


def _check_zip(path: Path, size_bytes: int) -> str | None:
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
    except zipfile.BadZipFile as exc:
        return f"not a whole zip archive ({exc}): cut short or still being written"
    if not records:
        return "a zip archive with no records"
    for record in records:
        end = record.header_offset + 30 + len(record.filename.encode()) + record.compress_size
        if end > size_bytes:
            return f"its record {record.filename} ends at byte {end}, past the file's {size_bytes}"
    if path.suffix in (".pt", ".pth", ".bin", ".ckpt") and not any(
            r.filename == "data.pkl" or r.filename.endswith("/data.pkl") for r in records):
        return "a zip archive without the data.pkl record of torch.save"
    return None


def _pickle_ends(file: IO[bytes]) -> bool:
    """Read one pickle from ``file`` with ``pickletools.genops``; True when it reached ``STOP``."""
    last = None
    for opcode, _, _ in pickletools.genops(file):
        last = opcode.name
    return last == "STOP"


def _check_pickle(path: Path, size_bytes: int) -> str | None:
    with open(path, "rb") as file:
        try:
            magic = _StubUnpickler(file).load() if file.peek(1)[:1] == b"\x80" else None
        except Exception:  # noqa: BLE001 - any failure to read the first pickle: cut short or garbage
            magic = None
        if magic != _LEGACY_MAGIC:
            file.seek(0)
            try:
                if not _pickle_ends(file):
                    return "the pickle stream does not end (no STOP): cut short"
            except Exception as exc:  # noqa: BLE001 - a truncated stream raises from genops
                return f"the pickle stream does not end ({exc}): cut short"
            return None
        try:
            _StubUnpickler(file).load()  # protocol version
            _StubUnpickler(file).load()  # system info
            reader = _StubUnpickler(file)
            reader.load()
            keys = _StubUnpickler(file).load()
        except Exception as exc:  # noqa: BLE001 - truncated or garbage: cut short
            return f"the legacy torch pickle stream does not end ({type(exc).__name__}): cut short"
        if not isinstance(keys, list):
            return "the legacy torch pickle has no list of storage keys"
        at = file.tell()
    for key in keys:
        kind, count = reader.storages.get(str(key), ("?", -1))
        element = _ELEMENT_BYTES.get(kind)
        if element is None:
            return None  # a storage type not known here: the pickles ended, which is what can be told
        if at + 8 > size_bytes:
            return f"storage {key} is missing (the file ends at byte {size_bytes}): cut short"
        with open(path, "rb") as file:
            file.seek(at)
            (stored,) = struct.unpack("<q", file.read(8))
        at += 8 + stored * element
        if stored != count and count >= 0:
            return f"storage {key} records {stored} elements, its tensor {count}"
        if at > size_bytes:
            return f"storage {key} ends at byte {at}, past the file's {size_bytes}: cut short"
    if at != size_bytes:
        return f"{size_bytes - at} bytes after the last storage (not what torch.save wrote)"
    return None


def _check_safetensors(path: Path, size_bytes: int) -> str | None:
    if size_bytes < 8:
        return f"{size_bytes} bytes: shorter than the 8-byte header length"
    with open(path, "rb") as file:
        (header_len,) = struct.unpack("<Q", file.read(8))
        if header_len > _SAFETENSORS_MAX_HEADER or 8 + header_len > size_bytes:
            return f"the header length {header_len} runs past the file's {size_bytes} bytes: cut short"
        try:
            header = json.loads(file.read(header_len))
        except ValueError as exc:
            return f"the header does not parse ({exc})"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"tensor {name} has no valid data_offsets"
        data_end = max(data_end, offsets[1])
    expected = 8 + header_len + data_end
    if expected != size_bytes:
        return (f"the header says {expected} bytes, the file has {size_bytes}"
                + (": cut short" if size_bytes < expected else ""))
    return None


def check_file(path: str | os.PathLike[str]) -> str | None:
    """Whether the file at ``path`` is structurally whole (see the module docstring).

    Returns:
        None when it is (or its format is not one checked here and its name is not a model file's), else one line
        on what is wrong. A ``.distcp`` shard is checked with its set (``check_files``), not here: None.
    """
    where = Path(path)
    try:
        size_bytes = where.stat().st_size
        kind = kind_of(where)
        if kind == "empty":
            return "empty (0 bytes)" if where.suffix in MODEL_SUFFIXES or where.suffix == ".pkl" else None
        if kind == "torch-zip":
            return _check_zip(where, size_bytes)
        if kind == "pickle":
            return _check_pickle(where, size_bytes)
        if kind == "safetensors":
            return _check_safetensors(where, size_bytes)
        if kind == "json":
            try:
                json.loads(where.read_bytes())
            except ValueError as exc:
                return f"the JSON does not parse ({exc}): cut short"
            return None
        if kind in ("distcp", "distcp-metadata"):
            return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if where.suffix in MODEL_SUFFIXES:
        log.debug("%s: no format checked here (not torch.save, pickle or safetensors): taken as it is", where)
    return None


def _walk_stubs(root: Any, limit: int = 1_000_000) -> Iterable[_Stub]:
    """Every stub reachable from ``root`` (through stub args, state, items, dicts, lists, tuples)."""
    stack: list[Any] = [root]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, _Stub):
            yield value
            stack.extend([value.args, value.state, *(kv for pair in value.items.values() for kv in pair)])
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)


def _storage_records(metadata: Any) -> list[tuple[str, int, int]]:
    """``(relative_path, offset, length)`` of every ``_StorageInfo`` in a ``.metadata`` read by the stub."""
    out = []
    for stub in _walk_stubs(metadata):
        state = stub.state
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # a dataclass with __slots__: (dict, slots)
        if isinstance(state, dict) and isinstance(state.get("relative_path"), str):
            offset, length = state.get("offset"), state.get("length")
            if isinstance(offset, int) and isinstance(length, int):
                out.append((state["relative_path"], offset, length))
    return out


def _check_distcp(folder: Path, names: list[str], parts: bool = False) -> list[str]:
    shards = sorted(n for n in names if n.endswith(".distcp"))
    if DISTCP_METADATA not in names:
        if parts:
            return []  # another node's disk holds the coordinator's .metadata
        return [f"{DISTCP_METADATA} missing: the torch.distributed.checkpoint save is not finished "
                f"({len(shards)} shards written)"]
    try:
        with open(folder / DISTCP_METADATA, "rb") as file:
            metadata = _StubUnpickler(file).load()
    except Exception as exc:  # noqa: BLE001 - truncated or garbage
        return [f"{DISTCP_METADATA} does not parse ({type(exc).__name__}): cut short"]
    records = _storage_records(metadata)
    named = {rel for rel, _, _ in records}
    problems = [f"{rel} is not named by {DISTCP_METADATA} (another save's shard, or one still being written)"
                for rel in shards if rel not in named]
    ends: dict[str, int] = {}
    for rel, offset, length in records:
        ends[rel] = max(ends.get(rel, 0), offset + length)
    for rel, end in sorted(ends.items()):
        try:
            size_bytes = (folder / rel).stat().st_size
        except OSError:
            if not parts:  # with parts: on another node's disk (checked as a union, formats.requires)
                problems.append(f"{rel}, named by {DISTCP_METADATA}, is missing")
            continue
        if size_bytes < end:
            problems.append(f"{rel} has {size_bytes} bytes, {DISTCP_METADATA} records data up to byte {end}: "
                            "cut short")
    return problems


def check_files(folder: str | os.PathLike[str], files: Iterable[str], *, parts: bool = False) -> list[str]:
    """Structural problems of a checkpoint's ``files`` (relative POSIX paths under ``folder``), as
    ``"REL: why"`` lines; empty when every file is whole. ``*.distcp`` shards are checked as a set per folder
    against its ``.metadata`` (every shard named, every record inside its shard). ``parts``: this node's part of a
    checkpoint spread over several nodes' disks: a ``.metadata`` or shard that is not here is not a problem (the
    union is checked against ``requires``), a shard cut short here still is."""
    base = Path(folder)
    problems: list[str] = []
    by_dir: dict[str, list[str]] = {}
    for rel in files:
        parent, _, name = rel.rpartition("/")
        by_dir.setdefault(parent, []).append(name)
        why = check_file(base / rel)
        if why is not None:
            problems.append(f"{rel}: {why}")
    for parent, names in sorted(by_dir.items()):
        if any(n.endswith(".distcp") for n in names) or DISTCP_METADATA in names:
            prefix = f"{parent}/" if parent else ""
            problems += [f"{prefix}{line}" for line in _check_distcp(base / parent, names, parts)]
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Sharded layouts: what a checkpoint's own manifest says must be there (on one node, or as the union of the nodes')
# ---------------------------------------------------------------------------------------------------------------

#: Megatron dist-checkpointing's metadata file (``megatron/core/dist_checkpointing/core.py``, ``CONFIG_FNAME``)
#: and the common state rank 0 saves beside the shards (``serialization.py``, ``COMMON_STATE_FNAME``).
MEGATRON_METADATA = "metadata.json"
MEGATRON_COMMON = "common.pt"
#: DeepSpeed's per-rank files (``deepspeed/runtime/engine.py``: ``_get_ckpt_name``, ``_get_zero_ckpt_name``):
#: model states per model-parallel rank (ZeRO-3: per data-parallel rank too), ZeRO optimizer states per
#: data-parallel rank (``bf16_`` with the BF16 optimizer).
_DS_MODEL_RE = re.compile(r"(?:zero_pp_rank_([0-9]+)_)?mp_rank_([0-9]+)_model_states\.pt")
_DS_OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_([0-9]+)_mp_rank_([0-9]+)_optim_states\.pt")
#: One file per rank: the Trainer's ``rng_state_<r>.pth`` (``Trainer._save_rng_state``), accelerate's
#: ``random_states_<r>.pkl`` (``accelerate/checkpointing.py``).
_RANK_FILE_RE = re.compile(r"(rng_state_|random_states_)([0-9]+)\.(pth|pkl)")


def requires(folder: str | os.PathLike[str], *, world_size: int | None = None) -> dict[str, int]:
    """What the checkpoint folder's own format says it must hold: ``{relative posix path: least size in bytes}``.

    Read from what is there, so that the parts on several nodes can be checked as a union (the requirement found
    in any node's part, satisfied by the files of all of them):

    - a ``torch.distributed.checkpoint`` set (a folder holding ``.metadata`` or ``*.distcp`` shards; Megatron's
      ``torch_dist`` backend too): the ``.metadata`` the coordinator writes last, and every ``relative_path`` its
      ``storage_data`` names, with at least ``offset + length`` bytes (``torch/distributed/checkpoint/
      filesystem.py``);
    - Megatron dist-checkpointing (``metadata.json`` naming a ``sharded_backend``): also ``common.pt``;
    - DeepSpeed (``*_model_states.pt``, ``*_optim_states.pt``): every model-parallel rank's model states and every
      data-parallel rank's ZeRO optimizer file, the world sizes read from a model-states file's ``dp_world_size``
      and ``mp_world_size`` (``DeepSpeedEngine._save_checkpoint``), else from the highest rank seen;
    - per-rank files of the Trainer (``rng_state_<r>.pth``) and accelerate (``random_states_<r>.pkl``): one for
      every rank below ``world_size`` (default: the highest rank seen, plus one).

    Files no format names are not listed (a plain folder: ``{}``); subfolders are read too (a Trainer's
    ``global_stepN/`` under ``checkpoint-N/``). Never raises: an unreadable folder requires nothing.
    """
    base = Path(folder)
    out: dict[str, int] = {}
    try:
        walked = [(Path(root), sorted(names)) for root, _, names in os.walk(base)]
    except OSError:
        return out
    for root, names in walked:
        prefix = "" if root == base else root.relative_to(base).as_posix() + "/"
        for rel, least in _requires_here(root, names, world_size).items():
            out[prefix + rel] = max(out.get(prefix + rel, 0), least)
    return out


def _requires_here(folder: Path, names: list[str], world_size: int | None) -> dict[str, int]:
    """``requires`` for the files of one folder (not its subfolders)."""
    out: dict[str, int] = {}
    if DISTCP_METADATA in names or any(name.endswith(".distcp") for name in names):
        out[DISTCP_METADATA] = 1
        try:
            with open(folder / DISTCP_METADATA, "rb") as file:
                records = _storage_records(_StubUnpickler(file).load())
        except Exception:  # noqa: BLE001 - cut short: the check of its files says so
            records = []
        for rel, offset, length in records:
            out[rel] = max(out.get(rel, 1), offset + length)
    if MEGATRON_METADATA in names:
        try:
            meta = json.loads((folder / MEGATRON_METADATA).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            meta = None
        if isinstance(meta, dict) and "sharded_backend" in meta:
            out[MEGATRON_METADATA] = 1
            out[MEGATRON_COMMON] = 1
    out.update(_deepspeed_requires(folder, names))
    by_kind: dict[tuple[str, str], int] = {}
    for name in names:
        if (m := _RANK_FILE_RE.fullmatch(name)) is not None:
            key = (m[1], m[3])
            by_kind[key] = max(by_kind.get(key, 0), int(m[2]) + 1)
    for (stem, suffix), seen in by_kind.items():
        for rank in range(max(seen, world_size or 0)):
            out[f"{stem}{rank}.{suffix}"] = 1
    return out


def _deepspeed_requires(folder: Path, names: list[str]) -> dict[str, int]:
    """DeepSpeed's per-rank files a tag folder must hold (see ``requires``)."""
    models = [(m, name) for name in names if (m := _DS_MODEL_RE.fullmatch(name)) is not None]
    optims = [m for name in names if (m := _DS_OPTIM_RE.fullmatch(name)) is not None]
    if not models and not optims:
        return {}
    dp = max([int(m[2]) + 1 for m in optims] + [int(m[1]) + 1 for m, _ in models if m[1] is not None] + [1])
    mp = max([int(m[3]) + 1 for m in optims] + [int(m[2]) + 1 for m, _ in models] + [1])
    for _, name in models:
        state = _top_level(folder / name) or {}
        dp_said, mp_said = state.get("dp_world_size"), state.get("mp_world_size")
        if isinstance(dp_said, int) and dp_said > 0:
            dp = max(dp, dp_said)
        if isinstance(mp_said, int) and mp_said > 0:
            mp = max(mp, mp_said)
        break  # every rank's model states say the same
    zero3 = any(m[1] is not None for m, _ in models)
    out = {}
    for m_rank in range(mp):
        if zero3:
            out.update({f"zero_pp_rank_{r}_mp_rank_{m_rank:02d}_model_states.pt": 1 for r in range(dp)})
        else:
            out[f"mp_rank_{m_rank:02d}_model_states.pt"] = 1
        if optims:
            bf16 = "bf16_" if any(m[1] for m in optims) else ""
            out.update({f"{bf16}zero_pp_rank_{r}_mp_rank_{m_rank:02d}_optim_states.pt": 1 for r in range(dp)})
    return out


def missing_required(required: dict[str, int], present: dict[str, int]) -> list[str]:
    """What ``required`` (``requires``' answer, or the union of several nodes') lacks in ``present`` (``{rel:
    size}``, the union of the nodes' files): ``"REL (missing)"`` or ``"REL (N of M bytes)"`` lines, sorted."""
    out = []
    for rel, least in sorted(required.items()):
        size = present.get(rel)
        if size is None:
            out.append(f"{rel} (missing)")
        elif size < least:
            out.append(f"{rel} ({size} of {least} bytes)")
    return out
