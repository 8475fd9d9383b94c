"""Destinations of secured checkpoints: one ``Store`` protocol (``base``), one module per store, one factory.

- ``parse_destination``: ``--push-to`` text -> ``base.Destination``.
- ``open_store``: ``Destination`` -> its store, by ``STORES`` (``kind`` -> ``"module:Class"``). A new destination is
  one module whose class implements ``base.Store`` with an ``open(destination, **options)`` classmethod, plus one
  line in ``STORES`` (and its form in ``parse_destination``).

Stores are imported only when opened: a Hub-only run never imports boto3, a folder run never imports
``huggingface_hub``.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from guard.errors import UsageError
from guard.secure.dest.base import Destination, Store

if TYPE_CHECKING:
    from guard.secure.dest.folder import FolderStore
    from guard.secure.dest.hub import HubStore
    from guard.secure.dest.s3 import S3Store

    def _every_store_is_a_store(folder: FolderStore, hub: HubStore, s3: S3Store) -> tuple[Store, Store, Store]:
        return folder, hub, s3  # checked by mypy: a store that drifts from the protocol fails here

__all__ = ["STORES", "Destination", "open_store", "parse_destination", "store_class"]

#: ``Destination.kind`` -> ``"module:Class"`` of its store.
STORES: dict[str, str] = {
    "folder": "guard.secure.dest.folder:FolderStore",
    "hub": "guard.secure.dest.hub:HubStore",
    "s3": "guard.secure.dest.s3:S3Store",
}

_ACCEPTED_FORMS = ("hf://NS/NAME, hf://datasets/NS/NAME, NS/NAME (a Hub model repo), s3://BUCKET/PREFIX, "
                   "or a folder path (absolute, or starting with ./, ../ or file://)")
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?")


def store_class(kind: str) -> Any:
    """The store class of a ``Destination.kind`` (``STORES``), imported now (a store module imports its client
    only when a store is made: boto3 is not imported here). Raises ``KeyError`` for a kind with no store."""
    module, _, name = STORES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def open_store(destination: Destination, **options: Any) -> Store:
    """The store of ``destination`` (``STORES``), made by its class's ``open(destination, **options)``.

    Args:
        destination: where to secure.
        options: what a store may take (each ignores the others): ``log`` (a ``logging.Logger``), and for the Hub
            ``api`` (an ``HfApi``) and ``token`` (str or None).

    Raises:
        KeyError: a ``kind`` with no store.
        DestinationError: the store cannot be made here (S3: boto3 not installed, a broken AWS configuration).
    """
    return cast(Store, store_class(destination.kind).open(destination, **options))


def parse_destination(text: str) -> Destination:
    """Parse ``--push-to``: ``hf://NS/NAME``, ``hf://datasets/NS/NAME``, bare ``NS/NAME`` (a Hub model repo),
    ``s3://BUCKET/PREFIX`` (``guard.secure.dest.s3.parse_s3_url``), or a folder path (absolute, or starting with
    ``./``, ``../`` or ``file://``). Forms from ``shared/CONTRACT.md``.

    A bare ``NS/NAME`` that names an existing folder here (``checkpoints/run1``) is refused: it would mean a Hub
    repo, and with a token the guard would create one by mistake.

    Raises:
        UsageError: (``option="--push-to"``) for anything else, naming the accepted forms; for a bare form that is
            also a local folder, with "did you mean ./NAME".
    """
    raw = text.strip() if isinstance(text, str) else ""
    if raw.startswith("s3://"):
        from guard.secure.dest.s3 import parse_s3_url

        bucket, prefix = parse_s3_url(raw)
        return Destination("s3", url=f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}")
    if raw.startswith("file://") and len(raw) > len("file://"):
        return Destination("folder", path=Path(os.path.abspath(raw[len("file://"):])))
    if raw.startswith(("/", "./", "../")):
        return Destination("folder", path=Path(os.path.abspath(raw)))
    repo_type, parts = "model", raw.split("/")
    if raw.startswith("hf://"):
        parts = raw[len("hf://"):].rstrip("/").split("/")
        if len(parts) == 3 and parts[0] in ("datasets", "models"):
            repo_type, parts = ("dataset" if parts[0] == "datasets" else "model"), parts[1:]
    if len(parts) == 2 and all(_NAME.fullmatch(p) and "--" not in p and ".." not in p for p in parts) \
            and not parts[1].endswith(".git"):
        if not raw.startswith("hf://") and os.path.exists(raw):
            raise UsageError(f"--push-to {raw}: a bare NS/NAME is a Hub repo, but ./{raw} is a folder here",
                             option="--push-to",
                             hint=f"did you mean ./{raw}? (write hf://{raw} for the Hub repo)")
        return Destination("hub", repo_id="/".join(parts), repo_type=repo_type)
    raise UsageError(f"--push-to {text!r} is not a destination: use {_ACCEPTED_FORMS}", option="--push-to",
                     hint="e.g. --push-to hf://alice/my-run or --push-to ./secured")
