"""File checksums recorded in the manifest and verified on read."""

from __future__ import annotations

import hashlib
import os
from typing import BinaryIO

_CHUNK = 8 << 20


def stream_sha256(f: BinaryIO) -> str:
    """Hex sha256 of what is left to read in ``f``, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    while chunk := f.read(_CHUNK):
        digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as f:
        return stream_sha256(f)
