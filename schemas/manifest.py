"""The manifest: what a shard directory holds, how it was made, and its fingerprint.

The manifest is written last and atomically, so its presence marks a complete build. Its
JSON Schema is ``manifest.schema.json`` beside this file; ``validate_manifest`` checks the
same rules with the standard library so the read side needs nothing beyond the manifest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import FormatVersionError, ManifestError

FORMAT_NAME = "varpack.shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")

OVERFLOW_POLICIES = ("split", "truncate", "drop", "error")
PACKING_ALGORITHMS = ("best_fit_decreasing", "first_fit_decreasing", "sequential")


@dataclass(frozen=True)
class DatasetInputs:
    """Where the examples came from; ``content_hash`` covers the bytes actually read."""

    id: str
    split: str
    content_hash: str
    revision: str | None = None
    num_examples: int | None = None


@dataclass(frozen=True)
class TokenizerInputs:
    """The tokenizer by content (vocabulary, merges, special tokens), not by name."""

    name: str
    content_hash: str
    vocab_size: int
    bos_token_id: int | None = None
    eos_token_id: int | None = None


@dataclass(frozen=True)
class BuildInputs:
    """Everything the fingerprint covers: change any of it and the shards are rebuilt."""

    dataset: DatasetInputs
    tokenizer: TokenizerInputs
    template: str
    loss_masking: str
    max_len: int
    overflow: str
    packing: str
    seed: int
    package_version: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildInputs:
        return cls(
            **{
                **data,
                "dataset": DatasetInputs(**data["dataset"]),
                "tokenizer": TokenizerInputs(**data["tokenizer"]),
            }
        )


def compute_fingerprint(inputs: BuildInputs) -> str:
    """A content address for a build: sha256 over the canonical JSON of its inputs, 16 hex digits."""
    canonical = json.dumps(inputs.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ShardInfo:
    """One shard file, relative to the manifest's directory."""

    path: str
    rows: int
    tokens: int
    sha256: str
    bytes: int


@dataclass
class PackingStats:
    """What packing did: every token is accounted for as packed, truncated or dropped."""

    examples: int = 0
    segments: int = 0
    tokens: int = 0
    rows: int = 0
    capacity_tokens: int = 0
    examples_split: int = 0
    tokens_split: int = 0
    examples_truncated: int = 0
    tokens_truncated: int = 0
    examples_dropped: int = 0
    tokens_dropped: int = 0
    # {"examples in a row": "number of rows"}; JSON object keys are strings.
    segments_per_row: dict[str, int] = field(default_factory=dict)

    @property
    def fill(self) -> float:
        """Packed tokens over the token capacity of all rows."""
        return self.tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fill": self.fill}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackingStats:
        return cls(**{k: v for k, v in data.items() if k != "fill"})


@dataclass
class Manifest:
    """The complete description of one build."""

    fingerprint: str
    inputs: BuildInputs
    capacity: int
    rows_per_shard: int
    shards: list[ShardInfo]
    stats: PackingStats
    created_at: str
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "format_version": self.format_version,
            "fingerprint": self.fingerprint,
            "inputs": self.inputs.to_dict(),
            "capacity": self.capacity,
            "rows_per_shard": self.rows_per_shard,
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "stats": self.stats.to_dict(),
            "created_at": self.created_at,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        validate_manifest(data, source)
        return cls(
            fingerprint=data["fingerprint"],
            inputs=BuildInputs.from_dict(data["inputs"]),
            capacity=data["capacity"],
            rows_per_shard=data["rows_per_shard"],
            shards=[ShardInfo(**s) for s in data["shards"]],
            stats=PackingStats.from_dict(data["stats"]),
            created_at=data["created_at"],
            format=data["format"],
            format_version=data["format_version"],
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST_NAME) -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ManifestError(f"{source}: not valid JSON ({err}); rebuild the shards") from err
        return cls.from_dict(data, source)


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Load and validate a local manifest file (or the manifest inside a shard directory)."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError as err:
        raise ManifestError(f"{path}: no manifest; the build is missing or was interrupted, run the pipeline again") from err
    return Manifest.from_json(text, str(path))


def write_manifest(manifest: Manifest, directory: str | os.PathLike[str]) -> Path:
    """Write the manifest atomically: a temporary name, fsync, then rename."""
    path = Path(directory) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def _require(data: dict[str, Any], key: str, kind: type | tuple[type, ...], source: str, where: str = "") -> Any:
    if key not in data:
        raise ManifestError(f"{source}: missing field {where}{key!r}")
    value = data[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ManifestError(f"{source}: field {where}{key!r} has the wrong type ({type(value).__name__})")
    return value


def validate_manifest(data: Any, source: str = MANIFEST_NAME) -> None:
    """Check a decoded manifest against the contract; raise ManifestError naming the field."""
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: the manifest must be a JSON object")
    if data.get("format") != FORMAT_NAME:
        raise ManifestError(f"{source}: not a varpack manifest (format {data.get('format')!r})")
    version = _require(data, "format_version", int, source)
    if version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source}: format version {version} is newer than this varpack reads ({FORMAT_VERSION}); upgrade varpack"
        )
    if version < 1:
        raise ManifestError(f"{source}: format version {version} is not a valid version")
    _require(data, "fingerprint", str, source)
    _require(data, "created_at", str, source)
    capacity = _require(data, "capacity", int, source)
    rows_per_shard = _require(data, "rows_per_shard", int, source)
    if capacity < 1 or rows_per_shard < 1:
        raise ManifestError(f"{source}: capacity and rows_per_shard must be positive")

    inputs = _require(data, "inputs", dict, source)
    for key, kind in (("template", str), ("loss_masking", str), ("max_len", int), ("overflow", str),
                      ("packing", str), ("seed", int), ("package_version", str)):
        _require(inputs, key, kind, source, "inputs.")
    if inputs["overflow"] not in OVERFLOW_POLICIES:
        raise ManifestError(f"{source}: unknown overflow policy {inputs['overflow']!r}")
    if inputs["packing"] not in PACKING_ALGORITHMS:
        raise ManifestError(f"{source}: unknown packing algorithm {inputs['packing']!r}")
    dataset = _require(inputs, "dataset", dict, source, "inputs.")
    for key in ("id", "split", "content_hash"):
        _require(dataset, key, str, source, "inputs.dataset.")
    tokenizer = _require(inputs, "tokenizer", dict, source, "inputs.")
    for key, kind in (("name", str), ("content_hash", str), ("vocab_size", int)):
        _require(tokenizer, key, kind, source, "inputs.tokenizer.")

    shards = _require(data, "shards", list, source)
    for i, shard in enumerate(shards):
        where = f"shards[{i}]."
        if not isinstance(shard, dict):
            raise ManifestError(f"{source}: shards[{i}] must be an object")
        for key, kind in (("path", str), ("rows", int), ("tokens", int), ("sha256", str), ("bytes", int)):
            _require(shard, key, kind, source, where)
        if Path(shard["path"]).is_absolute() or ".." in Path(shard["path"]).parts:
            raise ManifestError(f"{source}: {where}path must be relative to the manifest's directory")
        if not 0 < shard["rows"] <= rows_per_shard or not 0 < shard["tokens"] <= shard["rows"] * capacity:
            raise ManifestError(f"{source}: {where}rows or tokens out of range")

    stats = _require(data, "stats", dict, source)
    for key in ("examples", "segments", "tokens", "rows", "capacity_tokens", "tokens_truncated", "tokens_dropped"):
        _require(stats, key, int, source, "stats.")
    _require(stats, "segments_per_row", dict, source, "stats.")
    if stats["rows"] != sum(s["rows"] for s in shards) or stats["tokens"] != sum(s["tokens"] for s in shards):
        raise ManifestError(f"{source}: stats.rows/stats.tokens disagree with the shard list")
