"""The contract between the write side (pipeline/) and the read side (loaders/).

Imports only numpy and pyarrow, so it loads on a GPU box without Beam or datasets.
"""

from schemas.checksum import file_sha256, stream_sha256
from schemas.errors import FormatVersionError, LinkError, ManifestError, PackingError, ShardError, VarpackError, WriteError
from schemas.io import atomic_output, atomic_write, cache_dir, read_manifest, write_manifest
from schemas.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SCHEMA_PATH,
    BadRowPolicy,
    BuildInputs,
    DatasetInputs,
    ExampleKind,
    LossMasking,
    Manifest,
    Overflow,
    PackingAlgorithm,
    PackingStats,
    RejectedRows,
    ShardInfo,
    TokenizerInputs,
    compute_fingerprint,
    validate_manifest,
)
from schemas.row import PREFERENCE_ROW_SCHEMA, ROW_COLUMNS, ROW_SCHEMA, list_parts, validate_table
from schemas.validate import one_of, positive_int

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "PREFERENCE_ROW_SCHEMA",
    "ROW_COLUMNS",
    "ROW_SCHEMA",
    "SCHEMA_PATH",
    "BadRowPolicy",
    "BuildInputs",
    "DatasetInputs",
    "ExampleKind",
    "FormatVersionError",
    "LossMasking",
    "Manifest",
    "LinkError",
    "ManifestError",
    "Overflow",
    "PackingAlgorithm",
    "PackingError",
    "PackingStats",
    "RejectedRows",
    "ShardError",
    "ShardInfo",
    "TokenizerInputs",
    "VarpackError",
    "WriteError",
    "atomic_output",
    "atomic_write",
    "cache_dir",
    "compute_fingerprint",
    "file_sha256",
    "one_of",
    "positive_int",
    "stream_sha256",
    "read_manifest",
    "validate_manifest",
    "list_parts",
    "validate_table",
    "write_manifest",
]
