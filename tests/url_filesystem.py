"""``objdir://PATH``: a local directory seen through fsspec as a URL.

Importing this module registers the scheme with fsspec, so ``pack --out objdir:///tmp/x`` takes the
path a build on an object store takes (attempt directories, no lock, the first manifest wins)
while the bytes land in ``/tmp/x``.
"""

from __future__ import annotations

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.utils import stringify_path

PREFIX = "objdir://"


class ObjectDirFileSystem(LocalFileSystem):
    """fsspec's local filesystem under the ``objdir`` scheme."""

    protocol = ("objdir",)

    @classmethod
    def _strip_protocol(cls, path):
        path = stringify_path(path)
        return super()._strip_protocol(path[len(PREFIX):] if path.startswith(PREFIX) else path)

    def unstrip_protocol(self, name):
        return PREFIX + self._strip_protocol(name)


fsspec.register_implementation("objdir", ObjectDirFileSystem, clobber=True)
