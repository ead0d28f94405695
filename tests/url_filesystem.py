"""``objdir://PATH``: a local directory seen through Apache Beam's filesystem API as a URL.

Importing this module registers the scheme with Beam, so ``pack --out objdir:///tmp/x`` takes the
path a build on an object store takes (attempt directories, no lock, the first manifest wins)
while the bytes land in ``/tmp/x``.
"""

from __future__ import annotations

import os

from apache_beam.io.filesystem import FileMetadata, MatchResult
from apache_beam.io.localfilesystem import LocalFileSystem

PREFIX = "objdir://"


def local(path: str) -> str:
    return path[len(PREFIX):] if path.startswith(PREFIX) else path


class ObjectDirFileSystem(LocalFileSystem):
    """Beam's local filesystem under the ``objdir`` scheme."""

    @classmethod
    def scheme(cls):
        return "objdir"

    def match(self, patterns, limits=None):
        results = super().match([local(p) for p in patterns], limits)
        return [
            MatchResult(PREFIX + r.pattern, [FileMetadata(PREFIX + m.path, m.size_in_bytes, m.last_updated_in_seconds)
                                             for m in r.metadata_list])
            for r in results
        ]

    def create(self, path, *args, **kwargs):
        return super().create(local(path), *args, **kwargs)

    def open(self, path, *args, **kwargs):
        return super().open(local(path), *args, **kwargs)

    def rename(self, source_file_names, destination_file_names):
        super().rename([local(p) for p in source_file_names], [local(p) for p in destination_file_names])

    def exists(self, path):
        return super().exists(local(path))

    def size(self, path):
        return super().size(local(path))

    def delete(self, paths):
        for path in paths:
            os.remove(local(path))
