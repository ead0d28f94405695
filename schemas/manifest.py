"""The manifest: what a shard directory holds, how it was made, and its fingerprint.

The manifest is written last and atomically, so its presence marks a complete build. Its
JSON Schema is ``manifest.schema.json`` beside this file; ``validate_manifest`` applies that
schema itself (the small subset of JSON Schema the file uses, with the standard library) plus
the rules across fields a schema cannot state, so the read side needs nothing beyond numpy
and pyarrow and the schema file and the code cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.errors import FormatVersionError, ManifestError

FORMAT_NAME = "varpack.shards"
# 2: inputs.on_bad_row, rejected, stats.examples_untrained/tokens_untrained.
# 3: shards_digest. Version 1 and 2 manifests, which lack them, are still read.
# 4: inputs.loss_masking is one of LossMasking's values (a free string before).
# 5: manifest_digest; every shard carries its identity in its Arrow schema metadata (shard_identity.py);
#    example ids are source row numbers, below stats.num_example_ids; stats.conversations_trimmed.
# 6: stats.examples_checked and stats.examples_equal (the build's check of its tokens); the optional
#    stats.chat_turns, stats.dangling_turns_dropped and source lists (SOURCE_LISTS), written only when set;
#    the optional stats.token_check (the check's mode: "off", "sample" or "all") and stats.special_token_text
#    (special tokens whose text the data holds), written only when set.
# 7: the optional inputs.format ("preference") and inputs.preference_layout of a build of preference pairs,
#    whose shards add a roles column (schemas.row.PREFERENCE_ROW_SCHEMA), and stats.pairs and stats.bad_pairs;
#    written only for such builds, so other builds' manifests and fingerprints stay as they were.
# 8: the optional inputs.group_cut ("example") of a build that may be packed in more than one group, whose groups
#    are cut by example id rather than where a batch started; written only for such builds, which alone say format 8,
#    so one-group builds keep their fingerprints and manifests (format 7) and builds of several groups made before are
#    not taken for those made now.
FORMAT_VERSION = 8
GROUP_CUT_FORMAT_VERSION = 8
MANIFEST_NAME = "manifest.json"
SCHEMA_PATH = Path(__file__).with_name("manifest.schema.json")


class Overflow(enum.StrEnum):
    """What happens to an example longer than a row."""

    SPLIT = "split"
    TRUNCATE = "truncate"
    DROP = "drop"
    ERROR = "error"


class PackingAlgorithm(enum.StrEnum):
    """How segments are assigned to rows."""

    BEST_FIT_DECREASING = "best_fit_decreasing"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    SEQUENTIAL = "sequential"


class BadRowPolicy(enum.StrEnum):
    """What a source row that cannot become an example does to the build."""

    ERROR = "error"
    SKIP = "skip"


class ExampleKind(enum.StrEnum):
    """The kind of source example: a prompt and its response, chat messages, or plain text."""

    PROMPT_RESPONSE = "prompt_response"
    CHAT = "chat"
    TEXT = "text"
    # A prompt with a chosen and a rejected completion: text columns, or two message lists sharing their leading turns.
    PREFERENCE = "preference"
    PREFERENCE_CHAT = "preference_chat"


class BuildFormat(enum.StrEnum):
    """What a build's rows hold (``inputs.format``): examples to fine-tune on, or preference pairs."""

    SFT = "sft"
    PREFERENCE = "preference"


class GroupCut(enum.StrEnum):
    """Where a build packed in more than one group cuts its groups (``inputs.group_cut``, format 8)."""

    # Group k holds the examples whose ids lie in [k * examples_per_group, (k + 1) * examples_per_group).
    EXAMPLE = "example"


class LossMasking(enum.StrEnum):
    """Which tokens of an example are trained on, recorded as ``inputs.loss_masking``."""

    ALL_TOKENS = "all_tokens"
    ASSISTANT_TURNS = "assistant_turns"
    RESPONSE_AND_EOS = "response_and_eos"
    # The writer passed its own loss mask with the tokens (``ShardWriter``).
    GIVEN = "given"
    # Preference pairs: each completion and its end-of-turn token (or EOS), never the prompt.
    COMPLETIONS = "completions"



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
    # What a bad source row does; None in a format 1 manifest, which predates the policy.
    on_bad_row: str | None = BadRowPolicy.ERROR
    # The shard size and the packing group size, when set; None (left out, so builds made
    # with the defaults keep their fingerprints): the defaults.
    rows_per_shard: int | None = None
    examples_per_group: int | None = None
    # A build of preference pairs: "preference" and its layout (schemas.row.PreferenceLayout); None (left out): SFT.
    format: str | None = None
    preference_layout: str | None = None
    # A build that may be packed in more than one group: "example" (GroupCut); None (left out): one group, or a
    # build of format 7 or older, whose groups were cut where a batch started.
    group_cut: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for optional in ("on_bad_row", "rows_per_shard", "examples_per_group", "format", "preference_layout", "group_cut"):
            if data[optional] is None:
                del data[optional]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BuildInputs:
        return cls(
            **{
                **data,
                "dataset": DatasetInputs(**data["dataset"]),
                "tokenizer": TokenizerInputs(**data["tokenizer"]),
                "on_bad_row": data.get("on_bad_row"),
                "rows_per_shard": data.get("rows_per_shard"),
                "examples_per_group": data.get("examples_per_group"),
                "format": data.get("format"),
                "preference_layout": data.get("preference_layout"),
                "group_cut": data.get("group_cut"),
            }
        )


def written_format_version(inputs: BuildInputs) -> int:
    """The format version a build of ``inputs`` is written as: the oldest that holds each of its fields, so a build
    an older varpack made byte for byte is written as that varpack wrote it."""
    return GROUP_CUT_FORMAT_VERSION if inputs.group_cut is not None else GROUP_CUT_FORMAT_VERSION - 1


def shards_digest(shards: list[dict[str, Any]]) -> str:
    """sha256 over the ordered list of shard entries (path, rows, tokens, bytes, sha256), as hex."""
    canonical = json.dumps(shards, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def manifest_digest(data: dict[str, Any]) -> str:
    """sha256 over the canonical JSON of every field of a manifest but ``manifest_digest`` itself, as hex.

    No field is left out: the inputs, the shard list, the statistics, ``rejected`` and ``created_at``.
    """
    covered = {key: value for key, value in data.items() if key != "manifest_digest"}
    canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def compute_fingerprint(inputs: BuildInputs) -> str:
    """A content address for a build: sha256 over the canonical JSON of its inputs, 16 hex digits.

    The tokenizer counts by content alone: the same tokenizer loaded from another path or Hub
    id gives the same fingerprint.
    """
    covered = inputs.to_dict()
    del covered["tokenizer"]["name"]
    canonical = json.dumps(covered, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ShardInfo:
    """One shard file, relative to the manifest's directory."""

    path: str
    rows: int
    tokens: int
    sha256: str
    bytes: int


# PackingStats fields written only when set: the source files and columns of a pipeline build.
SOURCE_LISTS = ("source_files", "source_columns_used", "source_columns_unused")


@dataclass
class PackingStats:
    """What packing did: every token is accounted for as packed, truncated or dropped."""

    # Examples that reached packing: those kept, and those --overflow drop left out (examples_dropped).
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
    # Examples that --overflow truncate left with no trained token, dropped before packing.
    examples_untrained: int = 0
    tokens_untrained: int = 0
    # Example ids lie in [0, num_example_ids): a pipeline build's ids are source row numbers, so
    # this counts the source rows read, those left out included (format 5).
    num_example_ids: int = 0
    # Conversations dangling turns were dropped from (format 5).
    conversations_trimmed: int = 0
    # Chat turns by role: {"system": {"read": 346, "used": 346, "merged": 346}}; "used" turns reached the
    # tokens, "merged" system turns went into the first user turn (a template without a system turn).
    chat_turns: dict[str, dict[str, int]] = field(default_factory=dict)
    # Dangling chat turns dropped: {"leading_assistant": 212, "trailing_user": 3}.
    dangling_turns_dropped: dict[str, int] = field(default_factory=dict)
    # Examples checked against the reference tokenization (a sample, or all), and those equal to it (format 6).
    examples_checked: int = 0
    examples_equal: int = 0
    # Which examples the build checked (--verify-tokens: "off", "sample" or "all"); "" in older builds.
    token_check: str = ""
    # Special tokens whose text the data's own text holds, tokenized as those tokens:
    # {"</s>": {"examples": 3, "first_row": "data.jsonl line 7"}}.
    special_token_text: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Preference builds (format 7): the pairs packed, and the pairs left out by reason ({"chosen_equals_rejected": 3}).
    pairs: int = 0
    bad_pairs: dict[str, int] = field(default_factory=dict)
    # {"examples in a row": "number of rows"}; JSON object keys are strings.
    segments_per_row: dict[str, int] = field(default_factory=dict)
    # The source files read, and the source columns that reached the tokens and those that did not
    # (pipeline builds; empty for other writers and older builds).
    source_files: list[str] = field(default_factory=list)
    source_columns_used: list[str] = field(default_factory=list)
    source_columns_unused: list[str] = field(default_factory=list)

    @property
    def fill(self) -> float:
        """Packed tokens over the token capacity of all rows."""
        return self.tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    @property
    def examples_read(self) -> int:
        """Examples the source rows made: kept, or dropped under --overflow drop or truncate (untrained)."""
        return self.examples + self.examples_untrained

    @property
    def examples_kept(self) -> int:
        """Examples with tokens in the rows."""
        return self.examples - self.examples_dropped

    def to_dict(self) -> dict[str, Any]:
        data = {**dataclasses.asdict(self), "fill": self.fill}
        # Written only when set (chat builds, pipeline builds), so that other builds' manifests stay as they were.
        written_when_set = (
            "chat_turns", "dangling_turns_dropped", "token_check", "special_token_text", "pairs", "bad_pairs", *SOURCE_LISTS
        )
        return {key: value for key, value in data.items() if value or key not in written_when_set}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PackingStats:
        return cls(**{k: v for k, v in data.items() if k != "fill"})

    @classmethod
    def merged(cls, parts: list[PackingStats]) -> PackingStats:
        """The statistics of a whole build from those of its parts (packing groups, batches of rows)."""
        total = cls()
        for part in parts:
            for item in dataclasses.fields(cls):
                if item.name == "segments_per_row":
                    for count, rows in part.segments_per_row.items():
                        total.segments_per_row[count] = total.segments_per_row.get(count, 0) + rows
                elif item.name in ("chat_turns", "dangling_turns_dropped", "token_check", "special_token_text", "bad_pairs"):
                    continue  # counted while reading, not per packing group
                else:
                    setattr(total, item.name, getattr(total, item.name) + getattr(part, item.name))
        total.segments_per_row = dict(sorted(total.segments_per_row.items(), key=lambda item: int(item[0])))
        return total


@dataclass(frozen=True)
class RejectedRows:
    """Source rows left out under ``--on-bad-row skip``, by reason; ``rejected.jsonl`` lists them."""

    rows: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


@dataclass
class Manifest:
    """The complete description of one build.

    ``shards_digest`` (written from format version 3) binds the ordered shard list: a manifest
    whose entries were swapped, dropped or repeated no longer matches it and is refused.
    ``manifest_digest`` (from format version 5) covers every field: a manifest edited in any
    field (``stats``, ``created_at``, ...) is refused on read. Its shards carry their place in
    the build too (``shard_identity.py``), so a manifest rewritten as an older format, without
    the digests, is refused by whatever opens them.
    """

    fingerprint: str
    inputs: BuildInputs
    capacity: int
    rows_per_shard: int
    shards: list[ShardInfo]
    stats: PackingStats
    created_at: str
    # None in a format 1 manifest.
    rejected: RejectedRows | None = field(default_factory=RejectedRows)
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    @property
    def preference_layout(self) -> str | None:
        """The layout of a build of preference pairs (``"separate"`` or ``"shared-prompt"``); None for other builds."""
        return self.inputs.preference_layout if self.inputs.format == BuildFormat.PREFERENCE else None

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    @property
    def num_example_ids(self) -> int:
        """How many example ids the build has room for: every id lies in ``[0, num_example_ids)``, one
        weight per id. From format 5 ids are source row numbers and the build records the count; before,
        ids were numbered over the examples kept, so there were ``stats.examples``."""
        return self.stats.num_example_ids if self.format_version >= 5 else self.stats.examples

    def to_dict(self) -> dict[str, Any]:
        shards = [dataclasses.asdict(s) for s in self.shards]
        data: dict[str, Any] = {
            "format": self.format,
            "format_version": self.format_version,
            "fingerprint": self.fingerprint,
            "inputs": self.inputs.to_dict(),
            "capacity": self.capacity,
            "rows_per_shard": self.rows_per_shard,
            "shards": shards,
            "stats": self.stats.to_dict(),
            "created_at": self.created_at,
        }
        if self.format_version >= 3:
            data["shards_digest"] = shards_digest(shards)
        if self.rejected is not None:
            data["rejected"] = dataclasses.asdict(self.rejected)
        if self.format_version >= 5:
            data["manifest_digest"] = manifest_digest(data)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        validate_manifest(data, source)
        inputs = BuildInputs.from_dict(data["inputs"])
        if compute_fingerprint(inputs) != data["fingerprint"]:
            raise ManifestError(
                f"{source}: fingerprint {data['fingerprint']} does not match the manifest's inputs; "
                "the manifest was edited or is corrupt, rebuild the shards"
            )
        if "manifest_digest" in data and data["manifest_digest"] != manifest_digest(data):
            raise ManifestError(
                f"{source}: the manifest does not match its manifest_digest: a field was edited or the file is "
                "corrupt; rebuild the shards (pack --force)"
            )
        return cls(
            fingerprint=data["fingerprint"],
            inputs=inputs,
            capacity=data["capacity"],
            rows_per_shard=data["rows_per_shard"],
            shards=[ShardInfo(**s) for s in data["shards"]],
            stats=PackingStats.from_dict(data["stats"]),
            created_at=data["created_at"],
            rejected=RejectedRows(**data["rejected"]) if "rejected" in data else None,
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


# The JSON Schema keywords manifest.schema.json may use: those _check_node applies, and annotations.
_SCHEMA_KEYWORDS = frozenset(
    {"type", "const", "enum", "minimum", "maximum", "pattern", "required", "properties", "additionalProperties", "items"}
    | {"propertyNames"}
    | {"if", "then"}
    | {"$schema", "$id", "title", "description"}
)

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}


@functools.cache
def _manifest_schema() -> dict[str, Any]:
    """The JSON Schema of the manifest, read from ``manifest.schema.json``."""
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def _is_json_type(value: Any, name: str) -> bool:
    """Whether ``value`` is of JSON type ``name``; booleans are not numbers."""
    if isinstance(value, bool) and name != "boolean":
        return False
    return isinstance(value, _JSON_TYPES[name])


def _problem(value: Any, schema: dict[str, Any]) -> str | None:
    """What is wrong with ``value`` under the keywords of ``schema`` that concern it alone, or None."""
    if "const" in schema and value != schema["const"]:
        return f"must be {schema['const']!r}, got {value!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"must be one of {', '.join(map(repr, schema['enum']))}, got {value!r}"
    if "type" in schema:
        types = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(_is_json_type(value, name) for name in types):
            return f"must be of type {' or '.join(types)}, got {type(value).__name__}"
    is_number = _is_json_type(value, "number")
    if "minimum" in schema and is_number and value < schema["minimum"]:
        return f"must be at least {schema['minimum']}, got {value!r}"
    if "maximum" in schema and is_number and value > schema["maximum"]:
        return f"must be at most {schema['maximum']}, got {value!r}"
    if "pattern" in schema and isinstance(value, str) and not re.search(_ecma_pattern(schema["pattern"]), value):
        return f"must match {schema['pattern']}, got {value!r}"
    return None


def _ecma_pattern(pattern: str) -> str:
    """A JSON Schema (ECMA 262) pattern for ``re``: its closing ``$`` ends the string, as there, and does not
    also match before a final newline, as in Python."""
    return pattern[:-1] + r"\Z" if pattern.endswith("$") and not pattern.endswith(r"\$") else pattern


def _check_node(value: Any, schema: dict[str, Any], where: str, source: str) -> None:
    """Check ``value`` and its members against ``schema``; raise ManifestError naming the field at ``where``.

    Beyond the schema, no string and no key holds a NUL byte: names and paths reach the file system,
    which cannot take one.
    """
    if isinstance(value, str) and "\0" in value:
        raise ManifestError(f"{source}: field {where} holds a NUL byte, which no name or path may hold")
    problem = _problem(value, schema)
    if problem:
        raise ManifestError(f"{source}: field {where or '(the manifest)'} {problem}")
    if isinstance(value, dict):
        for key in value:
            if "\0" in key:
                raise ManifestError(f"{source}: field {where or '(the manifest)'} has a key that holds a NUL byte")
            if "propertyNames" in schema and _problem(key, schema["propertyNames"]):
                raise ManifestError(f"{source}: field {where} has key {key!r}, which {_problem(key, schema['propertyNames'])}")
        for key in schema.get("required", ()):
            if key not in value:
                raise ManifestError(f"{source}: missing field {where + '.' if where else ''}{key}")
        properties = schema.get("properties", {})
        additional = schema.get("additionalProperties", True)
        for key, item in value.items():
            inner = f"{where}.{key}" if where else key
            if key in properties:
                _check_node(item, properties[key], inner, source)
            elif additional is False:
                raise ManifestError(f"{source}: unknown field {inner}; this manifest was not written by this format version")
            elif isinstance(additional, dict):
                _check_node(item, additional, inner, source)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check_node(item, schema["items"], f"{where}[{i}]", source)
    if "then" in schema and _holds(value, schema["if"]):
        _check_node(value, schema["then"], where, source)


def _holds(value: Any, schema: dict[str, Any]) -> bool:
    """Whether ``value`` satisfies ``schema`` (the condition of an ``if``)."""
    try:
        _check_node(value, schema, "", "")
    except ManifestError:
        return False
    return True


# Fields required from format version 2 on, by the object that holds them; a version 1 manifest has none.
ADDED_IN_VERSION_2 = {"": ("rejected",), "inputs": ("on_bad_row",), "stats": ("examples_untrained", "tokens_untrained")}
ADDED_IN_VERSION_3 = {"": ("shards_digest",)}
ADDED_IN_VERSION_5 = {"": ("manifest_digest",), "stats": ("num_example_ids", "conversations_trimmed")}
ADDED_IN_VERSION_6 = {"stats": ("examples_checked", "examples_equal")}


def _check_across_fields(data: dict[str, Any], source: str) -> None:
    """The rules that tie fields together, which the JSON Schema cannot state."""
    capacity, rows_per_shard, shards, stats = data["capacity"], data["rows_per_shard"], data["shards"], data["stats"]
    if capacity != data["inputs"]["max_len"]:
        raise ManifestError(f"{source}: capacity {capacity} differs from inputs.max_len {data['inputs']['max_len']}")
    for i, shard in enumerate(shards):
        if Path(shard["path"]).is_absolute() or ".." in Path(shard["path"]).parts:
            raise ManifestError(f"{source}: shards[{i}].path must be relative to the manifest's directory")
        if shard["rows"] > rows_per_shard or shard["tokens"] > shard["rows"] * capacity:
            raise ManifestError(f"{source}: shards[{i}] holds more rows or tokens than rows_per_shard and capacity allow")
    if stats["rows"] != sum(s["rows"] for s in shards) or stats["tokens"] != sum(s["tokens"] for s in shards):
        raise ManifestError(f"{source}: stats.rows/stats.tokens disagree with the shard list")
    if stats.get("examples_equal", 0) > stats.get("examples_checked", 0):
        raise ManifestError(f"{source}: stats.examples_equal is more than stats.examples_checked")
    added_in = ((2, ADDED_IN_VERSION_2), (3, ADDED_IN_VERSION_3), (5, ADDED_IN_VERSION_5), (6, ADDED_IN_VERSION_6))
    for version, added in added_in:
        if data["format_version"] < version:
            continue
        for where, names in added.items():
            fields = data[where] if where else data
            missing = [name for name in names if name not in fields]
            if missing:
                raise ManifestError(f"{source}: missing field {where + '.' if where else ''}{missing[0]}")
    if "shards_digest" in data and data["shards_digest"] != shards_digest(shards):
        raise ManifestError(
            f"{source}: the shard list does not match shards_digest: entries were reordered, repeated, dropped or "
            "edited; rebuild the shards (pack --force)"
        )
    rejected = data.get("rejected")
    if rejected is not None and rejected["rows"] != sum(rejected["by_reason"].values()):
        raise ManifestError(f"{source}: rejected.rows differs from the sum of rejected.by_reason")
    inputs = data["inputs"]
    if "group_cut" in inputs and data["format_version"] < GROUP_CUT_FORMAT_VERSION:
        raise ManifestError(
            f"{source}: inputs.group_cut is a field of format {GROUP_CUT_FORMAT_VERSION}, but the manifest claims format "
            f"{data['format_version']}: it was edited or is corrupt; rebuild the shards (pack --force)"
        )
    if (inputs.get("format") == BuildFormat.PREFERENCE) != ("preference_layout" in inputs):
        raise ManifestError(f"{source}: inputs.format \"preference\" and inputs.preference_layout go together")


def validate_manifest(data: Any, source: str = MANIFEST_NAME) -> None:
    """Check a decoded manifest against the contract; raise ManifestError naming the field.

    A manifest of a newer format version raises FormatVersionError before anything else is
    checked, since its fields may have changed.
    """
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: the manifest must be a JSON object")
    if data.get("format") != FORMAT_NAME:
        raise ManifestError(f"{source}: not a varpack manifest (format {data.get('format')!r})")
    version: Any = data.get("format_version")  # a JSON value, checked just below
    if _is_json_type(version, "integer") and version > FORMAT_VERSION:
        raise FormatVersionError(
            f"{source}: format version {version} is newer than this varpack reads ({FORMAT_VERSION}); upgrade varpack"
        )
    _check_node(data, _manifest_schema(), "", source)
    _check_across_fields(data, source)
