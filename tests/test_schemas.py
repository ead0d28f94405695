"""The contract: row invariants, the manifest and its JSON Schema, the fingerprint."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pytest

from pipeline.config import VerifyTokens
from schemas import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ROW_SCHEMA,
    SCHEMA_PATH,
    BadRowPolicy,
    BuildInputs,
    DatasetInputs,
    FormatVersionError,
    LossMasking,
    Manifest,
    ManifestError,
    Overflow,
    PackingAlgorithm,
    PackingStats,
    ShardError,
    ShardInfo,
    TokenizerInputs,
    compute_fingerprint,
    read_manifest,
    validate_manifest,
    validate_table,
    write_manifest,
)
from schemas.manifest import (
    _SCHEMA_KEYWORDS,
    ADDED_IN_VERSION_2,
    ADDED_IN_VERSION_3,
    ADDED_IN_VERSION_5,
    ADDED_IN_VERSION_6,
    SOURCE_LISTS,
    manifest_digest,
    shards_digest,
)

SCHEMA = json.loads(SCHEMA_PATH.read_text())
SCHEMA_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


# Rows.


def good_rows() -> list[dict[str, Any]]:
    """Two valid rows of capacity 8: two segments (2 + 3 tokens), then one of 3 tokens."""
    return [
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 1, 1, 0, 1], "cu_seqlens": [0, 2, 5], "max_seqlen": 3,
         "num_tokens": 5, "example_ids": [10, 11], "example_offsets": [0, 0]},
        {"input_ids": [6, 7, 8], "loss_mask": [1, 1, 1], "cu_seqlens": [0, 3], "max_seqlen": 3,
         "num_tokens": 3, "example_ids": [12], "example_offsets": [8]},
    ]


def table_of(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=ROW_SCHEMA)


def test_valid_rows_pass() -> None:
    validate_table(table_of(good_rows()), 8, "shard-00000.arrow")
    validate_table(table_of(good_rows()), 5, "shard-00000.arrow")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cu_seqlens": [0, 2]}, "cu_seqlens does not end at the row's token count"),
        ({"cu_seqlens": [0, 4]}, "cu_seqlens does not end at the row's token count"),
        ({"cu_seqlens": [1, 3]}, "cu_seqlens does not start at 0"),
        ({"cu_seqlens": [0, 0, 3], "example_ids": [12, 13], "example_offsets": [0, 0]}, "cu_seqlens is not strictly increasing"),
        (
            {"cu_seqlens": [0, 2, 1, 3], "example_ids": [1, 2, 3], "example_offsets": [0, 0, 0]},
            "cu_seqlens is not strictly increasing",
        ),
        ({"cu_seqlens": [0]}, "cu_seqlens must hold at least"),
        ({"max_seqlen": 2}, "max_seqlen is not the longest segment"),
        ({"num_tokens": 4}, "num_tokens disagrees with the length of input_ids"),
        ({"loss_mask": [1, 1]}, "loss_mask length differs from input_ids length"),
        ({"loss_mask": [1, 2, 1]}, "loss_mask holds a value other than 0 or 1"),
        ({"example_ids": [12, 13]}, "example_ids needs one entry per segment"),
        ({"example_offsets": []}, "example_offsets needs one entry per segment"),
        ({"input_ids": [], "loss_mask": [], "cu_seqlens": [0], "num_tokens": 0, "max_seqlen": 0}, "is empty"),
    ],
)
def test_a_broken_row_is_named(change: dict[str, Any], message: str) -> None:
    rows = good_rows()
    rows[1].update(change)
    with pytest.raises(ShardError, match=f"^shard-00007.arrow row 1: {message}") as caught:
        validate_table(table_of(rows), 8, "shard-00007.arrow")
    assert caught.value.shard == "shard-00007.arrow" and caught.value.row == 1


def test_a_row_over_capacity_is_named() -> None:
    with pytest.raises(ShardError, match="^s.arrow row 0: holds more than the capacity of 4 tokens"):
        validate_table(table_of(good_rows()), 4, "s.arrow")


def test_a_wrong_schema_is_rejected() -> None:
    table = table_of(good_rows()).drop_columns(["example_offsets"])
    with pytest.raises(ShardError, match=r"^s.arrow: schema .* does not match the packed-row schema"):
        validate_table(table, 8, "s.arrow")
    widened = table_of(good_rows()).cast(ROW_SCHEMA.set(0, pa.field("input_ids", pa.list_(pa.int64()), nullable=False)))
    with pytest.raises(ShardError, match="does not match the packed-row schema"):
        validate_table(widened, 8, "s.arrow")


def test_nulls_and_empty_tables_are_rejected() -> None:
    table = table_of(good_rows())
    columns = [
        pa.array([None, [1, 1, 1]], field.type) if field.name == "loss_mask" else table.column(field.name)
        for field in ROW_SCHEMA
    ]
    with pytest.raises(ShardError, match="column 'loss_mask' has nulls"):
        validate_table(pa.Table.from_arrays(columns, schema=ROW_SCHEMA), 8, "s.arrow")
    with pytest.raises(ShardError, match="^s.arrow: holds no rows"):
        validate_table(table.slice(0, 0), 8, "s.arrow")


def test_sliced_and_chunked_tables_are_validated_by_their_own_rows() -> None:
    rows = good_rows()
    rows[1]["max_seqlen"] = 1
    table = table_of(rows + good_rows())
    validate_table(table.slice(2), 8, "s.arrow")
    with pytest.raises(ShardError, match="row 1: max_seqlen"):
        validate_table(pa.concat_tables([table.slice(0, 1), table.slice(1, 1)]), 8, "s.arrow")


def test_shard_error_without_a_row_names_only_the_file() -> None:
    err = ShardError("shards/shard-00001.arrow", "checksum mismatch")
    assert str(err) == "shards/shard-00001.arrow: checksum mismatch" and err.row is None


# Manifests.


def build_inputs() -> BuildInputs:
    return BuildInputs(
        dataset=DatasetInputs(id="openai/gsm8k", split="test", content_hash="ab" * 32, revision="main", num_examples=3),
        tokenizer=TokenizerInputs(name="mistral-7b", content_hash="cd" * 32, vocab_size=32768, bos_token_id=1, eos_token_id=2),
        template="{question}\n{answer}",
        loss_masking="given",
        max_len=8,
        overflow="split",
        packing="best_fit_decreasing",
        seed=0,
        package_version="0.1.0",
    )


def make_manifest() -> Manifest:
    """A valid manifest of two shards (3 + 1 rows) at capacity 8."""
    inputs = build_inputs()
    stats = PackingStats(examples=6, segments=7, tokens=28, rows=4, capacity_tokens=32, examples_split=1,
                         tokens_split=10, segments_per_row={"1": 2, "2": 1, "3": 1}, num_example_ids=7)
    return Manifest(
        fingerprint=compute_fingerprint(inputs),
        inputs=inputs,
        capacity=8,
        rows_per_shard=3,
        shards=[
            ShardInfo(path="shard-00000.arrow", rows=3, tokens=22, sha256="0" * 64, bytes=2000),
            ShardInfo(path="shard-00001.arrow", rows=1, tokens=6, sha256="f" * 64, bytes=900),
        ],
        stats=stats,
        created_at="2026-01-01T00:00:00+00:00",
    )


def schema_accepts(data: Any) -> bool:
    return SCHEMA_VALIDATOR.is_valid(data)


def code_accepts(data: Any) -> bool:
    try:
        validate_manifest(data)
    except ManifestError:
        return False
    return True


def test_the_schema_file_is_valid_json_schema_and_a_manifest_satisfies_it() -> None:
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    data = make_manifest().to_dict()
    SCHEMA_VALIDATOR.validate(data)
    validate_manifest(data)


def walk_schema(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every sub-schema of ``schema``, itself included."""
    yield schema
    for sub in schema.get("properties", {}).values():
        yield from walk_schema(sub)
    for key in ("items", "additionalProperties", "if", "then"):
        if isinstance(schema.get(key), dict):
            yield from walk_schema(schema[key])


def test_the_schema_uses_only_keywords_the_code_applies() -> None:
    used = {keyword for node in walk_schema(SCHEMA) for keyword in node}
    assert used <= _SCHEMA_KEYWORDS, f"validate_manifest does not apply {used - _SCHEMA_KEYWORDS}"


def test_the_schema_enums_are_the_code_enums() -> None:
    inputs = SCHEMA["properties"]["inputs"]["properties"]
    assert inputs["overflow"]["enum"] == [policy.value for policy in Overflow]
    assert inputs["packing"]["enum"] == [algorithm.value for algorithm in PackingAlgorithm]
    assert inputs["on_bad_row"]["enum"] == [policy.value for policy in BadRowPolicy]
    assert SCHEMA["if"] == {"properties": {"format_version": {"minimum": 4}}}
    then_inputs = SCHEMA["then"]["properties"]["inputs"]["properties"]
    assert then_inputs["loss_masking"]["enum"] == [masking.value for masking in LossMasking]
    assert SCHEMA["properties"]["format_version"]["minimum"] == 1
    assert SCHEMA["properties"]["stats"]["properties"]["token_check"]["enum"] == [mode.value for mode in VerifyTokens]


def test_the_schema_lists_every_field_the_code_writes() -> None:
    data = make_manifest().to_dict()
    properties = SCHEMA["properties"]
    added = set(ADDED_IN_VERSION_2[""]) | set(ADDED_IN_VERSION_3[""]) | set(ADDED_IN_VERSION_5[""])
    assert set(data) == set(properties) == set(SCHEMA["required"]) | added
    # Written only when set: the shard and group sizes (absent, the defaults), chat turns, the source files and columns,
    # and what a preference build records.
    optional = {
        "inputs": {"rows_per_shard", "examples_per_group", "format", "preference_layout", "group_cut"},
        "stats": {"chat_turns", "dangling_turns_dropped", "token_check", "special_token_text", "pairs", "bad_pairs", *SOURCE_LISTS},
    }
    for key in ("inputs", "stats"):
        assert not optional[key] & set(data[key])
        assert set(data[key]) | optional[key] == set(properties[key]["properties"])
        added = set(ADDED_IN_VERSION_2[key]) | set(ADDED_IN_VERSION_5.get(key, ())) | set(ADDED_IN_VERSION_6.get(key, ()))
        assert set(properties[key]["required"]) == set(data[key]) - added
    for key in ("dataset", "tokenizer"):
        assert set(data["inputs"][key]) == set(properties["inputs"]["properties"][key]["properties"])
    assert set(data["shards"][0]) == set(properties["shards"]["items"]["properties"])


WRONG_TYPES: list[Any] = ["text", 7, 2.5, True, None, [], {}]
JSON_TYPES = {
    "string": str, "integer": int, "number": (int, float), "boolean": bool, "null": type(None), "array": list, "object": dict
}
DELETE = object()


def is_json_type(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return name == "boolean"
    return isinstance(value, JSON_TYPES[name])


def schema_breaking_changes(
    data: Any, schema: dict[str, Any], path: tuple[Any, ...] = ()
) -> Iterator[tuple[str, tuple[Any, ...], Any]]:
    """(description, path, new value or DELETE) for each change of one field that breaks ``schema``."""
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types or []
    name = ".".join(map(str, path)) or "(root)"
    for value in WRONG_TYPES:
        if types and not any(is_json_type(value, t) for t in types):
            yield f"{name} = {value!r}", path, value
    if "minimum" in schema:
        yield f"{name} below minimum", path, schema["minimum"] - 1
    if "maximum" in schema:
        yield f"{name} above maximum", path, schema["maximum"] + (1 if "integer" in types else 0.5)
    if "pattern" in schema:
        yield f"{name} breaks pattern", path, "X\x1bYZ"  # no pattern takes an escape (created_at's refuses controls)
    if "enum" in schema or "const" in schema:
        yield f"{name} not allowed", path, "bogus"
    if isinstance(data, dict):
        for key in schema.get("required", []):
            yield f"{name}.{key} missing", path + (key,), DELETE
        if "propertyNames" in schema:
            yield f"{name} has a key that breaks propertyNames", path + ("XYZ",), 1
        if schema.get("additionalProperties") is False:
            yield f"{name} has an unknown field", path + ("unexpected",), 1
        for key, sub in schema.get("properties", {}).items():
            if key in data:
                yield from schema_breaking_changes(data[key], sub, path + (key,))
        if isinstance(schema.get("additionalProperties"), dict):
            for key in data:
                yield from schema_breaking_changes(data[key], schema["additionalProperties"], path + (key,))
    if isinstance(data, list) and data and "items" in schema:
        yield from schema_breaking_changes(data[0], schema["items"], path + (0,))
    if "then" in schema:  # the condition holds for BASE, a manifest of the current format version
        yield from schema_breaking_changes(data, schema["then"], path)


def changed(data: dict[str, Any], path: tuple[Any, ...], value: Any) -> Any:
    """A deep copy of ``data`` with the field at ``path`` set to ``value`` (or deleted)."""
    if not path:
        return value
    result = copy.deepcopy(data)
    parent = result
    for key in path[:-1]:
        parent = parent[key]
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return result


BASE = make_manifest().to_dict()
BREAKING = list(schema_breaking_changes(BASE, SCHEMA))


def test_there_are_many_breaking_changes_to_check() -> None:
    assert len(BREAKING) > 150


@pytest.mark.parametrize(("path", "value"), [(path, value) for _, path, value in BREAKING], ids=[d for d, _, _ in BREAKING])
def test_the_code_rejects_what_the_schema_rejects(path: tuple[Any, ...], value: Any) -> None:
    data = changed(BASE, path, value)
    assert not schema_accepts(data)
    assert not code_accepts(data)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("inputs", "dataset", "revision"), None),
        (("inputs", "dataset", "revision"), DELETE),
        (("inputs", "dataset", "num_examples"), None),
        (("inputs", "dataset", "num_examples"), DELETE),
        (("inputs", "tokenizer", "bos_token_id"), None),
        (("inputs", "tokenizer", "eos_token_id"), DELETE),
        (("stats", "segments_per_row", "9"), 0),
        (("stats", "fill"), 1),
        (("created_at",), ""),
    ],
)
def test_the_code_accepts_what_the_schema_accepts(path: tuple[Any, ...], value: Any) -> None:
    data = changed(BASE, path, value)
    data["fingerprint"] = compute_fingerprint(BuildInputs.from_dict(data["inputs"]))
    data["manifest_digest"] = manifest_digest(data)
    assert schema_accepts(data)
    assert code_accepts(data)
    assert Manifest.from_dict(data).to_dict()["inputs"]["dataset"]["id"] == "openai/gsm8k"


def test_before_version_4_loss_masking_is_any_string() -> None:
    """Builds written with ShardWriter before the masking was enumerated keep loading."""
    data = changed(BASE, ("inputs", "loss_masking"), "answer_only")
    data["fingerprint"] = compute_fingerprint(BuildInputs.from_dict(data["inputs"]))
    assert not schema_accepts(data) and not code_accepts(data)
    data["format_version"] = 3
    del data["manifest_digest"]
    assert schema_accepts(data) and code_accepts(data)
    assert Manifest.from_dict(data).inputs.loss_masking == "answer_only"


def test_example_ids_are_bounded_by_num_example_ids_from_version_5() -> None:
    """From version 5 ids are source row numbers, bounded by stats.num_example_ids; before, by stats.examples."""
    data = copy.deepcopy(BASE)
    del data["stats"]["num_example_ids"]
    data["manifest_digest"] = manifest_digest(data)
    assert not code_accepts(data)
    data["format_version"] = 4
    del data["manifest_digest"], data["stats"]["conversations_trimmed"]
    assert schema_accepts(data) and code_accepts(data)
    assert Manifest.from_dict(data).num_example_ids == data["stats"]["examples"]
    assert Manifest.from_dict(BASE).num_example_ids == BASE["stats"]["num_example_ids"]


def version_1(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as format version 1 wrote it: no bad-row policy, rejected rows or untrained counts."""
    old = copy.deepcopy(data)
    old["format_version"] = 1
    del old["shards_digest"], old["manifest_digest"]
    for where, names in ADDED_IN_VERSION_2.items():
        for name in names:
            del (old[where] if where else old)[name]
    old["fingerprint"] = compute_fingerprint(BuildInputs.from_dict(old["inputs"]))
    return old


def test_a_version_1_manifest_is_still_read() -> None:
    old = version_1(BASE)
    assert schema_accepts(old) and code_accepts(old)
    manifest = Manifest.from_dict(old)
    assert manifest.rejected is None and manifest.inputs.on_bad_row is None and manifest.stats.examples_untrained == 0
    assert Manifest.from_json(manifest.to_json()).fingerprint == old["fingerprint"]
    assert BASE["inputs"]["on_bad_row"] == "error" and old["fingerprint"] != BASE["fingerprint"]


@pytest.mark.parametrize("path", [("rejected",), ("inputs", "on_bad_row"), ("stats", "tokens_untrained")])
def test_a_version_2_manifest_needs_its_new_fields(path: tuple[str, ...]) -> None:
    with pytest.raises(ManifestError, match=f"missing field {'.'.join(path)}"):
        validate_manifest(changed(BASE, path, DELETE))


def test_an_edited_input_no_longer_matches_the_fingerprint() -> None:
    data = changed(BASE, ("inputs", "seed"), BASE["inputs"]["seed"] + 1)
    assert schema_accepts(data)
    with pytest.raises(ManifestError, match="does not match the manifest's inputs"):
        Manifest.from_dict(data)


def test_a_manifest_with_no_shards_is_valid() -> None:
    data = copy.deepcopy(BASE)
    data["shards"] = []
    data["shards_digest"] = shards_digest([])
    data["stats"].update(rows=0, tokens=0, capacity_tokens=0, segments_per_row={}, fill=0.0)
    assert schema_accepts(data) and code_accepts(data)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("capacity",), 16, "capacity 16 differs from inputs.max_len 8"),
        (("rows_per_shard",), 2, r"shards\[0\] holds more rows or tokens"),
        (("shards", 1, "tokens"), 9, r"shards\[1\] holds more rows or tokens"),
        (("shards", 0, "path"), "/data/shard-00000.arrow", r"shards\[0\].path must be relative"),
        (("shards", 1, "path"), "../elsewhere/shard.arrow", r"shards\[1\].path must be relative"),
        (("stats", "rows"), 5, "stats.rows/stats.tokens disagree with the shard list"),
        (("stats", "tokens"), 27, "stats.rows/stats.tokens disagree with the shard list"),
    ],
)
def test_the_code_also_checks_rules_across_fields(path: tuple[Any, ...], value: Any, message: str) -> None:
    data = changed(BASE, path, value)
    assert schema_accepts(data), "a rule the JSON Schema can state belongs in the schema file"
    with pytest.raises(ManifestError, match=f"^{MANIFEST_NAME}: {message}"):
        validate_manifest(data)


def string_leaves(data: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every string value in ``data``."""
    if isinstance(data, str):
        yield path
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from string_leaves(value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from string_leaves(value, path + (i,))


@pytest.mark.parametrize("path", [path for path in string_leaves(BASE) if path != ("format",)],  # "not a varpack manifest"
                         ids=lambda path: ".".join(map(str, path)))
def test_no_string_of_a_manifest_holds_a_nul_byte(path: tuple[Any, ...]) -> None:
    """Names and paths reach the file system and the tokenizer loader, which take no NUL."""
    original = BASE
    for key in path:
        original = original[key]
    where = "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path).lstrip(".")
    with pytest.raises(ManifestError, match=f"^{MANIFEST_NAME}: field {re.escape(where)} holds a NUL byte"):
        validate_manifest(changed(BASE, path, original[:1] + "\x00" + original[1:]))
    with pytest.raises(ManifestError, match="field rejected.by_reason has a key that holds a NUL byte"):
        validate_manifest(changed(BASE, ("rejected", "by_reason"), {"bad\x00row": 1}))


@pytest.mark.parametrize(
    ("path", "field"),
    [(("rows_per_shard",), "rows_per_shard"), (("capacity",), "capacity"), (("inputs", "max_len"), "inputs.max_len"),
     (("inputs", "rows_per_shard"), "inputs.rows_per_shard"), (("inputs", "tokenizer", "vocab_size"),
     "inputs.tokenizer.vocab_size"), (("shards", 0, "rows"), "shards[0].rows"), (("shards", 0, "tokens"), "shards[0].tokens")],
)
def test_integers_that_size_arrays_are_bounded_by_int32(path: tuple[Any, ...], field: str) -> None:
    """Row capacity, rows and tokens per shard and the vocabulary: a forged 2**62 is refused, naming the field
    (a shuffle window of four shards of 2**62 rows would overflow int64)."""
    data = changed(BASE, path, 2**62)
    assert not schema_accepts(data)
    with pytest.raises(ManifestError, match=rf"^{MANIFEST_NAME}: field {re.escape(field)} must be at most 214748364[78], "
                                            f"got {2**62}$"):
        validate_manifest(data)


def test_shard_bytes_are_bounded_by_int64() -> None:
    """A forged shards[].bytes of 10**30 is refused, naming the field; the largest int64 is a size."""
    for forged in (2**63, 10**30):
        data = changed(BASE, ("shards", 0, "bytes"), forged)
        assert not schema_accepts(data)
        with pytest.raises(ManifestError, match=rf"^{MANIFEST_NAME}: field shards\[0\].bytes must be at most "
                                                rf"{2**63 - 1}, got {forged}$"):
            validate_manifest(data)
    largest = changed(BASE, ("shards", 0, "bytes"), 2**63 - 1)
    largest["shards_digest"] = shards_digest(largest["shards"])
    assert code_accepts(largest)


@pytest.mark.parametrize("value", ["2026-01-01\n  rows 999 rows", "\x1b[31m2026", "2026-01-01T00:00:00+00:00\n",
                                   "2026\x85", "2026\x7f"])
def test_created_at_holds_no_control_character(value: str) -> None:
    """created_at reaches a terminal (varpack inspect): no newline, escape or other control character. A pattern's
    closing $ ends the string, as in JSON Schema, not before a final newline as Python's re would have it."""
    with pytest.raises(ManifestError, match=rf"^{MANIFEST_NAME}: field created_at must match "):
        validate_manifest(changed(BASE, ("created_at",), value))
    assert code_accepts(changed(BASE, ("created_at",), "2026-01-01T00:00:00+00:00"))


def test_errors_name_the_field() -> None:
    with pytest.raises(ManifestError, match=r"field shards\[0\].sha256 must match"):
        validate_manifest(changed(BASE, ("shards", 0, "sha256"), "XYZ"))
    with pytest.raises(ManifestError, match="missing field inputs.tokenizer.vocab_size"):
        validate_manifest(changed(BASE, ("inputs", "tokenizer", "vocab_size"), DELETE))
    with pytest.raises(ManifestError, match="unknown field inputs.dataset.url"):
        validate_manifest(changed(BASE, ("inputs", "dataset", "url"), "https://example.com"))
    with pytest.raises(ManifestError, match="field capacity must be of type integer, got bool"):
        validate_manifest(changed(BASE, ("capacity",), True))


def test_json_round_trip(tmp_path: Path) -> None:
    manifest = make_manifest()
    assert Manifest.from_json(manifest.to_json()) == manifest
    written = Path(write_manifest(manifest, tmp_path))
    assert written == tmp_path / MANIFEST_NAME
    assert read_manifest(tmp_path) == read_manifest(written) == manifest
    assert [p.name for p in tmp_path.iterdir()] == [MANIFEST_NAME]
    SCHEMA_VALIDATOR.validate(json.loads(written.read_text()))


def test_a_newer_format_version_is_refused(tmp_path: Path) -> None:
    data = changed(BASE, ("format_version",), FORMAT_VERSION + 1)
    data["shards_v2"] = "fields this version does not know"
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    newer = rf"^{re.escape(str(tmp_path / MANIFEST_NAME))}: format version {FORMAT_VERSION + 1} is newer .* upgrade varpack"
    with pytest.raises(FormatVersionError, match=newer):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "varpack.shards", ', "not valid JSON"),
        ("", "not valid JSON"),
        ("[1, 2]", "the manifest must be a JSON object"),
        ('{"format": "other"}', "not a varpack manifest"),
        (json.dumps(changed(BASE, ("format_version",), 0)), "field format_version must be at least 1"),
    ],
)
def test_a_malformed_manifest_file_is_named(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / MANIFEST_NAME
    path.write_text(text)
    with pytest.raises(ManifestError, match=f"^{re.escape(str(path))}: {message}"):
        read_manifest(path)


def test_a_missing_or_unreadable_manifest_is_named(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match=rf"^{re.escape(str(tmp_path / MANIFEST_NAME))}: no manifest"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_bytes(b"\xff\xfe{}")
    with pytest.raises(ManifestError, match="could not be read"):
        read_manifest(tmp_path)


def test_an_invalid_manifest_is_never_written(tmp_path: Path) -> None:
    manifest = make_manifest()
    manifest.capacity = 16
    with pytest.raises(ManifestError, match="capacity 16 differs"):
        write_manifest(manifest, tmp_path)
    assert list(tmp_path.iterdir()) == []


# The fingerprint.


def leaves(data: dict[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The path of every non-object value in ``data``."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from leaves(value, path + (key,))
        else:
            yield path + (key,)


def test_fingerprint_is_stable_and_short() -> None:
    fingerprint = compute_fingerprint(build_inputs())
    assert fingerprint == compute_fingerprint(build_inputs())
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0


def test_fingerprint_ignores_the_tokenizer_name() -> None:
    data = build_inputs().to_dict()
    data["tokenizer"]["name"] = "/another/path/to/the/same/tokenizer"
    assert compute_fingerprint(BuildInputs.from_dict(data)) == compute_fingerprint(build_inputs())


@pytest.mark.parametrize(
    "path", [p for p in leaves(build_inputs().to_dict()) if p != ("tokenizer", "name")], ids=".".join
)
def test_fingerprint_covers_every_input(path: tuple[str, ...]) -> None:
    data = build_inputs().to_dict()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    old = parent[path[-1]]
    parent[path[-1]] = old + 1 if isinstance(old, int) else f"{old}-changed"
    assert compute_fingerprint(BuildInputs.from_dict(data)) != compute_fingerprint(build_inputs())
