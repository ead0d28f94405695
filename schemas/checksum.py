"""File checksums recorded in the manifest and verified on read."""

from __future__ import annotations

import hashlib
import os

_CHUNK = 8 << 20


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
