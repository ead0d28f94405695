"""``pack --format preference``: pairs of a prompt, a chosen and a rejected completion, packed whole.

What a pair's rows hold is checked against references made outside the build: the prompt is the
tokenizer's (or ``apply_chat_template``'s, with the generation prompt) tokens of the prompt alone,
each prompt + completion those of the whole text (or conversation), and the loss covers exactly the
tokens after the prompt. Bad pairs are listed in ``rejected.jsonl`` with their reason, a pair is
never split, and the schema's validator refuses rows that break the pair invariants.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import inspect
from pipeline.build import build, plan_build
from pipeline.config import PackConfig
from pipeline.encode.chat_templates import CHAT_TEMPLATES
from pipeline.encode.preference import PairEncoder, PairTokenChecker
from pipeline.errors import InputError, TokenMismatchError
from pipeline.pack import main
from pipeline.packing.algorithms import pack
from pipeline.packing.pairs import pair_segments
from pipeline.packing.rows import build_rows
from pipeline.read.readers import BatchRows
from schemas import PREFERENCE_ROW_SCHEMA, Overflow, Role, ShardError, read_manifest, validate_table
from tests.test_bad_rows import transformers_tokens
from tests.test_chat_templates import LLAMA3_SPECIALS, byte_level_directory

LAYOUTS = ["separate", "shared-prompt"]
TEXT_PAIRS = [
    {"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6, I think."},
    {"prompt": "Name a colour.", "chosen": "Blue, like the sky.", "rejected": "Seven."},
    {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."},
]
USER = [{"role": "user", "content": "What is 4 plus 4?"}]
CHAT_PAIRS = [
    {"chosen": [*USER, {"role": "assistant", "content": "It is 8."}],
     "rejected": [*USER, {"role": "assistant", "content": "It is 9."}]},
    {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Sure."}],
     "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "No."}]},
]
CHATML = {"chat_template": CHAT_TEMPLATES["chatml"], "special_tokens": ("<|im_start|>", "<|im_end|>")}


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """A cache of this module's (not the user's): each tokenizer is converted once for all its tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VARPACK_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def pack_pairs(tmp_path: Path, records: list[dict], **options) -> tuple[PackConfig, Path]:
    """Build ``records`` as preference pairs; the config and the build directory."""
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    settings = {"format": "preference", "max_len": 256, "progress": False, "report": False, "verify_tokens": "all", **options}
    config = PackConfig(dataset=str(data), out=str(tmp_path / "out"), **settings)
    result = build(config)
    return config, Path(result.out_dir)


def read_pairs(out_dir: Path) -> dict[int, list[tuple[int, np.ndarray, np.ndarray, int, int]]]:
    """Each pair's segments: (role, tokens, loss mask, position of its first token, row), from validated shards."""
    manifest = read_manifest(out_dir)
    pairs: dict[int, list] = {}
    row_number = 0
    for info in manifest.shards:
        table = pa.ipc.open_file(str(out_dir / info.path)).read_all()
        validate_table(table, manifest.capacity, info.path, manifest.num_example_ids, manifest.preference_layout)
        for row in table.to_pylist():
            cu = row["cu_seqlens"]
            for j, (pair, offset, role) in enumerate(zip(row["example_ids"], row["example_offsets"], row["roles"])):
                ids, mask = row["input_ids"][cu[j] : cu[j + 1]], row["loss_mask"][cu[j] : cu[j + 1]]
                pairs.setdefault(pair, []).append((role, np.array(ids), np.array(mask), offset, row_number))
            row_number += 1
    return pairs


def whole_sequences(segments: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A pair's prompt + chosen and prompt + rejected as its rows hold them, and their loss masks."""
    by_role = {role: (ids, mask) for role, ids, mask, *_ in segments}
    head = by_role.get(Role.PROMPT, (np.zeros(0, int), np.zeros(0, int)))
    chosen, rejected = by_role[Role.CHOSEN], by_role[Role.REJECTED]
    return (np.concatenate([head[0], chosen[0]]), np.concatenate([head[1], chosen[1]]),
            np.concatenate([head[0], rejected[0]]), np.concatenate([head[1], rejected[1]]))


def assert_contract_shape(segments: list, layout: str, prompt_tokens: int) -> None:
    """One row, adjacent, roles and position offsets as the contract says."""
    roles = [role for role, *_ in segments]
    assert len({row for *_, row in segments}) == 1
    if layout == "shared-prompt" and prompt_tokens > 1:
        assert roles == [Role.PROMPT, Role.CHOSEN, Role.REJECTED]
        assert [offset for *_, offset, _ in segments] == [0, prompt_tokens - 1, prompt_tokens - 1]
        assert len(segments[0][1]) == prompt_tokens - 1
        assert segments[1][1][0] == segments[2][1][0]  # the prompt's last token heads each branch
    else:
        assert roles == [Role.CHOSEN, Role.REJECTED]
        assert [offset for *_, offset, _ in segments] == [0, 0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_text_pairs_hold_the_prompt_and_each_whole_text_with_loss_on_the_completions_only(tmp_path, layout):
    config, out_dir = pack_pairs(tmp_path, TEXT_PAIRS, preference_layout=layout)
    backend = plan_build(config).tokenizer.backend()
    pairs = read_pairs(out_dir)
    assert sorted(pairs) == [0, 1, 2]
    for pair, record in enumerate(TEXT_PAIRS):
        prompt = [1, *backend.encode(record["prompt"] + "\n\n", add_special_tokens=False).ids]
        assert_contract_shape(pairs[pair], layout, len(prompt))
        chosen, chosen_mask, rejected, rejected_mask = whole_sequences(pairs[pair])
        for tokens, mask, completion in ((chosen, chosen_mask, "chosen"), (rejected, rejected_mask, "rejected")):
            whole = [1, *backend.encode(f"{record['prompt']}\n\n{record[completion]}", add_special_tokens=False).ids, 2]
            assert tokens.tolist() == whole
            assert tokens[: len(prompt)].tolist() == prompt
            assert mask.tolist() == [0] * len(prompt) + [1] * (len(whole) - len(prompt))  # the completion and EOS
    manifest = read_manifest(out_dir)
    assert (manifest.inputs.format, manifest.preference_layout, manifest.format_version) == ("preference", layout, 7)
    assert manifest.stats.pairs == 3 and manifest.stats.bad_pairs == {}
    assert manifest.stats.examples_checked == manifest.stats.examples_equal == 3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("template", ["tokenizer's own", "chatml"])
def test_message_pairs_split_at_the_shared_turns_as_apply_chat_template_renders_them(tmp_path, layout, template):
    options = CHATML if template == "chatml" else {}
    records = [{"prompt": "unused", **record} for record in CHAT_PAIRS]  # UltraFeedback's shape: a prompt column too
    config, out_dir = pack_pairs(tmp_path, records, preference_layout=layout, prompt_column="none", **options)
    plan = plan_build(config)
    pairs = read_pairs(out_dir)
    for pair, record in enumerate(CHAT_PAIRS):
        shared = record["chosen"][:-1]
        prompt = transformers_tokens_with_generation_prompt(plan, shared)
        assert_contract_shape(pairs[pair], layout, len(prompt))
        chosen, chosen_mask, rejected, rejected_mask = whole_sequences(pairs[pair])
        for tokens, mask, messages in ((chosen, chosen_mask, record["chosen"]), (rejected, rejected_mask, record["rejected"])):
            whole = transformers_tokens(plan, messages)
            while not plan.tokenizer.backend().decode(whole[-1:], skip_special_tokens=False).strip():  # the whitespace after the last turn
                whole.pop()
            assert tokens.tolist() == whole
            assert tokens[: len(prompt)].tolist() == prompt
            assert mask.tolist() == [0] * len(prompt) + [1] * (len(whole) - len(prompt))
            assert int(tokens[-1]) == plan.inputs.tokenizer.eos_token_id  # the end-of-turn token is trained on


def transformers_tokens_with_generation_prompt(plan, messages: list[dict]) -> list[int]:
    """transformers' ``apply_chat_template(messages, add_generation_prompt=True)`` with the build's tokenizer."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=plan.tokenizer.backend(), **plan.tokenizer.special_tokens())
    encoded = tokenizer.apply_chat_template(messages, chat_template=plan.example_format.chat_template, tokenize=True,
                                            add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


@pytest.mark.parametrize("shape", ["messages", "text as chat"])
def test_pairs_pack_with_a_byte_level_tokenizer_and_llama3s_template_every_pair_checked_equal(tmp_path, shape):
    tokenizer = byte_level_directory(tmp_path / "tokenizer", LLAMA3_SPECIALS)
    records = CHAT_PAIRS if shape == "messages" else TEXT_PAIRS
    options = {"as_chat": True} if shape == "text as chat" else {}
    config, out_dir = pack_pairs(tmp_path, records, tokenizer=str(tokenizer), chat_template="llama3",
                                 preference_layout="shared-prompt", **options)
    manifest = read_manifest(out_dir)
    assert manifest.stats.pairs == manifest.stats.examples_checked == manifest.stats.examples_equal == len(records)
    eot = plan_build(config).tokenizer.backend().token_to_id("<|eot_id|>")
    for segments in read_pairs(out_dir).values():
        chosen, chosen_mask, rejected, rejected_mask = whole_sequences(segments)
        assert chosen[-1] == rejected[-1] == eot and chosen_mask[-1] == rejected_mask[-1] == 1


def test_text_pairs_as_chat_are_rendered_with_the_chat_template(tmp_path):
    config, out_dir = pack_pairs(tmp_path, TEXT_PAIRS, as_chat=True, system_prompt="Be brief.", **CHATML)
    plan = plan_build(config)
    chosen, _, rejected, _ = whole_sequences(read_pairs(out_dir)[1])
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": TEXT_PAIRS[1]["prompt"]}
    for tokens, completion in ((chosen, "chosen"), (rejected, "rejected")):
        whole = transformers_tokens(plan, [system, user, {"role": "assistant", "content": TEXT_PAIRS[1][completion]}])
        assert tokens.tolist() == whole[: len(tokens)] and len(whole) - len(tokens) <= 1  # less the final newline


BAD_PAIRS = [
    ({"prompt": "Same?", "chosen": "yes", "rejected": "yes"}, "chosen_equals_rejected"),
    ({"prompt": "Empty?", "chosen": "  ", "rejected": "no"}, "empty_completion"),
    ({"prompt": "Null?", "chosen": "yes", "rejected": None}, "empty_completion"),
    ({"prompt": "Long " * 300, "chosen": "a", "rejected": "b"}, "pair_too_long"),
    ({"prompt": None, "chosen": "a", "rejected": "b"}, "null"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_pairs_are_left_out_and_listed_with_their_reason(tmp_path, layout):
    records = [TEXT_PAIRS[0], *(record for record, _ in BAD_PAIRS), TEXT_PAIRS[1]]
    _, out_dir = pack_pairs(tmp_path, records, preference_layout=layout, on_bad_row="skip", max_bad_rows=10)
    listed = [json.loads(line) for line in (out_dir / "rejected.jsonl").read_text().splitlines()]
    assert sorted((int(entry["where"].rsplit(" ", 1)[1]), entry["reason"]) for entry in listed) == [
        (line, reason) for line, (_, reason) in enumerate(BAD_PAIRS, start=2)
    ]
    assert sorted(read_pairs(out_dir)) == [0, len(records) - 1]  # pair ids are source rows
    manifest = read_manifest(out_dir)
    assert manifest.stats.pairs == 2
    assert manifest.stats.bad_pairs == {"chosen_equals_rejected": 1, "empty_completion": 2, "null": 1, "pair_too_long": 1}


def test_message_pairs_that_are_no_pair_are_left_out(tmp_path):
    user, other = {"role": "user", "content": "Hi"}, {"role": "user", "content": "Bye"}
    answer = {"role": "assistant", "content": "Hello"}
    records = [
        CHAT_PAIRS[0],
        {"chosen": CHAT_PAIRS[0]["chosen"], "rejected": CHAT_PAIRS[0]["chosen"]},
        {"chosen": [user, answer], "rejected": [other, answer]},  # no shared prompt
        {"chosen": [user, answer], "rejected": [user, {"role": "assistant", "content": " "}]},
    ]
    _, out_dir = pack_pairs(tmp_path, records, on_bad_row="skip", max_bad_rows=10)
    reasons = [json.loads(line)["reason"] for line in (out_dir / "rejected.jsonl").read_text().splitlines()]
    assert reasons == ["chosen_equals_rejected", "not_a_pair", "empty_completion"]
    assert sorted(read_pairs(out_dir)) == [0]


def test_a_pair_is_as_long_as_its_layout_makes_it(tmp_path):
    """A long prompt with short completions fits a row once (shared-prompt), not twice (separate)."""
    record = {"prompt": "word " * 60, "chosen": "yes", "rejected": "no"}
    for layout, fits in (("separate", False), ("shared-prompt", True)):
        (tmp_path / layout).mkdir()
        _, out_dir = pack_pairs(tmp_path / layout, [record, TEXT_PAIRS[0]], preference_layout=layout, max_len=100,
                                on_bad_row="skip", max_bad_rows=10)
        assert (0 in read_pairs(out_dir)) == fits
        assert (out_dir / "rejected.jsonl").exists() != fits


def test_a_bad_pair_stops_the_build_by_default_in_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", [TEXT_PAIRS[0], BAD_PAIRS[0][0]])
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--format", "preference", "--no-progress", "--no-report"]
    assert main(args) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"varpack: error: {data} line 2: the chosen and the rejected completions are equal; fix or remove "
                     "it, or pass --on-bad-row skip to leave such rows out")
    assert main([*args, "--overflow", "error", "--max-len", "16", "--on-bad-row", "skip"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(f"varpack: error: {data} line 1: the pair is ") and "a pair is never split" in error
    assert not any((tmp_path / "out").glob("*/manifest.json"))


@pytest.mark.parametrize("overflow", ["split", "truncate"])
def test_overflow_that_would_cut_a_pair_is_refused_in_one_line(tmp_path, capsys, overflow):
    data = write_jsonl(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--format", "preference", "--overflow", overflow]
    assert main(args) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith(f"varpack: error: --overflow {overflow} would cut a pair")
    assert not (tmp_path / "out").exists()


def test_a_prompt_that_is_no_prefix_of_the_whole_tokens_is_refused_not_split_wrongly(tmp_path):
    """Joined without a separator, the prompt's last word merges with the completion's first characters."""
    records = [{"prompt": "Hello wor", "chosen": "ld", "rejected": "k"}, TEXT_PAIRS[0]]
    _, out_dir = pack_pairs(tmp_path, records, prompt_template="{prompt}{response}", on_bad_row="skip", max_bad_rows=10)
    listed = [json.loads(line) for line in (out_dir / "rejected.jsonl").read_text().splitlines()]
    assert [entry["reason"] for entry in listed] == ["prompt_not_a_prefix"]
    assert sorted(read_pairs(out_dir)) == [1]


# ChatML, but a user turn followed by an answer has its double spaces collapsed: the prompt renders differently.
COLLAPSED = "(message['content'] | replace('  ', ' ') if messages[-1]['role'] == 'assistant' else message['content'])"
RERENDERING = CHAT_TEMPLATES["chatml"].replace("message['content']", COLLAPSED)


def test_a_chat_template_that_renders_the_prompt_differently_before_a_completion_refuses_the_pair(tmp_path):
    assert RERENDERING != CHAT_TEMPLATES["chatml"]
    spaced = [{"role": "user", "content": "Two  spaces"}]
    records = [
        {"chosen": [*spaced, {"role": "assistant", "content": "a"}], "rejected": [*spaced, {"role": "assistant", "content": "b"}]},
        CHAT_PAIRS[0],
    ]
    _, out_dir = pack_pairs(tmp_path, records, on_bad_row="skip", max_bad_rows=10, chat_template=RERENDERING,
                            special_tokens=CHATML["special_tokens"])
    listed = [json.loads(line) for line in (out_dir / "rejected.jsonl").read_text().splitlines()]
    assert [entry["reason"] for entry in listed] == ["prompt_not_a_prefix"]
    assert sorted(read_pairs(out_dir)) == [1]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_token_check_compares_each_stored_prompt_and_completion_with_the_reference(tmp_path, layout):
    data = write_jsonl(tmp_path / "pairs.jsonl", CHAT_PAIRS)
    config = PackConfig(dataset=str(data), out=str(tmp_path / "out"), format="preference", preference_layout=layout)
    plan = plan_build(config)
    table = pa.Table.from_pylist(CHAT_PAIRS)
    encoder = PairEncoder(plan.tokenizer, plan.example_format, 256, Overflow.DROP, layout=layout)
    batch = encoder.encode(table, BatchRows("pairs.jsonl"))
    checker = PairTokenChecker(plan.tokenizer, plan.example_format, "error")
    everything = np.ones(batch.lengths.size, dtype=bool)
    counts = checker.check(table, BatchRows("pairs.jsonl"), batch, everything)
    assert (counts.checked, counts.equal) == (2, 2)
    # The rejected branch of the second pair, one token changed: the reference of prompt + rejected differs.
    last_rejected = int(np.flatnonzero(batch.roles == Role.REJECTED)[-1]) - 1
    batch.tokens[last_rejected] += 1
    with pytest.raises(TokenMismatchError, match=r"^pairs.jsonl row 1: its tokens differ from the tokenizer's apply_chat_template"):
        checker.check(table, BatchRows("pairs.jsonl"), batch, everything)
    counted = PairTokenChecker(plan.tokenizer, plan.example_format, "count").check(table, BatchRows("pairs.jsonl"), batch, everything)
    assert (counted.checked, counted.equal) == (2, 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_inspect_describes_a_preference_build(tmp_path, capsys, layout):
    _, out_dir = pack_pairs(tmp_path, TEXT_PAIRS, preference_layout=layout)
    assert inspect.main([str(out_dir), "--rows", "1"]) == 0
    shown = capsys.readouterr().out
    assert f"3 pairs packed whole in the {layout} layout" in shown
    assert "-- pair 0, chosen:" in shown and "-- pair 0, rejected:" in shown
    assert ("-- pair 0, prompt:" in shown) == (layout == "shared-prompt")
    assert inspect.main([str(out_dir), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["preference"] == {"layout": layout, "pairs": 3, "bad_pairs": {}}


# --- packing whole pairs: a property over lengths and capacities ------------------------------------------


def pair_tokens(lengths: list[tuple[int, int, int]], layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each pair (prompt, chosen and rejected completion lengths) laid out as the encoder lays it out: its
    length, and every token's id (pair * 1000 + place), loss mask and role."""
    sizes, tokens, masks, roles = [], [], [], []
    for pair, (p, c, r) in enumerate(lengths):
        head = p - 1 if layout == "shared-prompt" else 0
        runs = [(head, 0, Role.PROMPT), (p - head, 0, Role.CHOSEN), (c, 1, Role.CHOSEN),
                (p - head, 0, Role.REJECTED), (r, 1, Role.REJECTED)]
        sizes.append(sum(n for n, _, _ in runs))
        tokens.append(pair * 1000 + np.arange(sizes[-1]))
        masks.append(np.concatenate([np.full(n, m) for n, m, _ in runs]))
        roles.append(np.concatenate([np.full(n, role) for n, _, role in runs]))
    return np.array(sizes), np.concatenate(tokens), np.concatenate(masks).astype(np.uint8), np.concatenate(roles).astype(np.uint8)


@settings(max_examples=200, deadline=None)
@given(
    pairs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(1, 20)), min_size=1, max_size=40),
    capacity=st.integers(4, 160),
    layout=st.sampled_from(LAYOUTS),
)
def test_every_pair_lands_whole_in_exactly_one_row_its_segments_adjacent(pairs, capacity, layout):
    sizes, tokens, mask, roles = pair_tokens(pairs, layout)
    fits = np.flatnonzero(sizes <= capacity)  # the encoder leaves out longer pairs
    if not fits.size:
        return
    starts = np.cumsum(sizes) - sizes
    plan = pack(sizes[fits], capacity, overflow=Overflow.DROP)
    order = np.concatenate([np.arange(starts[fits[k]], starts[fits[k]] + sizes[fits[k]]) for k in plan.segment_example])
    segments, segment_roles = pair_segments(plan, roles[order])
    in_order = np.cumsum(segments.segment_length) - segments.segment_length
    table = build_rows(segments, in_order, tokens[order], mask[order], example_ids=fits, roles=segment_roles)
    assert table.schema.equals(PREFERENCE_ROW_SCHEMA, check_metadata=False)
    validate_table(table, capacity, "property", len(pairs), layout)
    seen = {}
    for row_number, row in enumerate(table.to_pylist()):
        cu, ids = row["cu_seqlens"], row["input_ids"]
        for j, (pair, role, offset) in enumerate(zip(row["example_ids"], row["roles"], row["example_offsets"])):
            seen.setdefault(pair, []).append((row_number, j, role, offset, ids[cu[j] : cu[j + 1]]))
    assert sorted(seen) == fits.tolist()
    for pair, parts in seen.items():
        p, c, r = pairs[pair]
        assert len({row for row, *_ in parts}) == 1
        assert [j for _, j, *_ in parts] == list(range(parts[0][1], parts[0][1] + len(parts)))
        expected_roles = [0, 1, 2] if layout == "shared-prompt" and p > 1 else [1, 2]
        assert [role for _, _, role, _, _ in parts] == expected_roles
        head = p - 1 if expected_roles[0] == 0 else 0
        assert [offset for *_, offset, _ in parts] == ([0, head, head] if head else [0, 0])
        # Every token of the pair, in its layout's order, once.
        assert [t for *_, part_ids in parts for t in part_ids] == (pair * 1000 + np.arange(sizes[pair])).tolist()
        assert [len(part_ids) for *_, part_ids in parts] == ([head, 1 + c, 1 + r] if head else [p + c, p + r])


# --- the validator's pair invariants -------------------------------------------------------------------------


def shared_prompt_row(**changes) -> pa.Table:
    """One row holding two pairs in the shared-prompt layout, with ``changes`` to its columns."""
    row = {
        "input_ids": [1, 5, 6, 7, 2, 6, 8, 2, 1, 9, 3, 2, 1, 9, 4, 2],
        "loss_mask": [0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1],
        "cu_seqlens": [0, 2, 5, 8, 12, 16],
        "max_seqlen": 4,
        "num_tokens": 16,
        "example_ids": [3, 3, 3, 4, 4],
        "example_offsets": [0, 2, 2, 0, 0],
        "roles": [0, 1, 2, 1, 2],
    }
    return pa.Table.from_pylist([{**row, **changes}], PREFERENCE_ROW_SCHEMA)


def test_a_valid_preference_row_passes():
    validate_table(shared_prompt_row(), 16, "shard", 5, "shared-prompt")


@pytest.mark.parametrize("changes, layout, message", [
    ({"roles": [0, 1, 2, 1]}, None, "roles needs one entry per segment"),
    ({"roles": [0, 2, 1, 1, 2]}, None, "a pair's roles must be"),
    ({"roles": [0, 1, 2, 1, 3]}, None, "roles holds a value other than"),
    ({"example_ids": [3, 3, 4, 4, 4]}, None, "a pair's roles must be"),
    ({"example_ids": [3, 3, 3, 3, 3]}, None, "a pair must be 2 segments"),
    ({"example_ids": [3, 3, 3, 4, 4], "roles": [0, 1, 2, 1, 2]}, "separate", "a pair of the separate layout has a prompt"),
    ({"example_offsets": [0, 1, 2, 0, 0]}, None, "example_offsets must be 0 for a prompt"),
    ({"loss_mask": [0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]}, None, "a prompt segment has trained tokens"),
    ({"loss_mask": [0, 0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]}, None, "a branch's first token"),
    ({"loss_mask": [0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]}, None, "has no trained token"),
])
def test_rows_that_break_a_pair_invariant_are_refused(changes, layout, message):
    with pytest.raises(ShardError, match=message):
        validate_table(shared_prompt_row(**changes), 16, "shard", 5, layout)


def test_a_pair_in_two_rows_is_refused():
    table = pa.concat_tables([shared_prompt_row(), shared_prompt_row()])
    with pytest.raises(ShardError, match=r"row 1: pair 3 is in more than one place \(a pair never spans rows\)"):
        validate_table(table, 16, "shard", 5)


def test_an_sft_shard_is_refused_where_the_manifest_says_preference():
    with pytest.raises(ShardError, match="does not match the preference-row schema"):
        validate_table(shared_prompt_row().drop_columns(["roles"]), 16, "shard", 5, "separate")


def test_pairs_all_longer_than_a_row_or_missing_columns_are_one_line(tmp_path, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--format", "preference", "--no-progress", "--no-report"]
    assert main([*args, "--max-len", "8"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("varpack: error: nothing to write: every pair read that is not a bad row (3) is longer than "
                            "--max-len 8 in its layout, and a pair is never split; raise --max-len")
    assert main([*args, "--chosen-column", "better"]) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (f"varpack: error: {data}: no column 'better' (columns: prompt, chosen, rejected); choose columns with "
                     "--prompt-column (none: message lists), --chosen-column and --rejected-column")
    assert not any((tmp_path / "out").glob("*/manifest.json"))


def test_the_isolation_check_runs_on_a_separate_layout_build(tmp_path, capsys):
    """``varpack check`` on a preference build: each sequence of the separate layout is a whole sequence."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from loaders.check import main as check

    _, out_dir = pack_pairs(tmp_path, TEXT_PAIRS)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    capsys.readouterr()
    args = ["--model", str(tmp_path / "model"), "--shards", str(out_dir), "--attn", "sdpa_segments", "--no-cache", "--batch-rows", "1"]
    assert check(args) == 0
    assert capsys.readouterr().out.startswith("varpack check: ok: packed examples are isolated")


def test_pairs_that_stop_the_build_say_which_row(tmp_path):
    data = write_jsonl(tmp_path / "pairs.jsonl", [TEXT_PAIRS[0], {"prompt": "p", "chosen": "a", "rejected": "a"}])
    with pytest.raises(InputError, match=r"pairs.jsonl line 2: the chosen and the rejected completions are equal"):
        build(PackConfig(dataset=str(data), out=str(tmp_path / "out"), format="preference", progress=False, report=False))


# --- what the manifest says of a preference build is what its shards hold -------------------------------


def shard_segments(out_dir: Path) -> tuple[int, dict[str, int]]:
    """The segments the build's shards hold (cu_seqlens entries), and the rows by their number of segments."""
    per_row = np.array([
        len(cu) - 1
        for info in read_manifest(out_dir).shards
        for cu in pa.ipc.open_file(str(out_dir / info.path)).read_all().column("cu_seqlens").to_pylist()
    ])
    counts = np.bincount(per_row)
    return int(per_row.sum()), {str(c): int(counts[c]) for c in np.flatnonzero(counts).tolist()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_preference_manifest_counts_the_segments_its_shards_hold_and_loads_with_fixed_shapes(tmp_path, capsys, layout):
    """A pair is one item to pack and two or three segments in its row; the fixed shapes of the loader are cut from
    the manifest's count of segments per row, so it must be the shards' count."""
    torch = pytest.importorskip("torch")
    from loaders.dataset import PackedIterableDataset

    records = [{"prompt": f"Question {i}: what is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}, I think."}
               for i in range(12)]
    _, out_dir = pack_pairs(tmp_path, records, preference_layout=layout, max_len=128)
    segments, per_row = shard_segments(out_dir)
    stats = read_manifest(out_dir).stats
    assert (stats.segments, stats.segments_per_row) == (segments, per_row)
    per_pair = 3 if layout == "shared-prompt" else 2
    assert segments == 12 * per_pair and stats.rows < 12  # rows of several pairs
    for bucket_shapes in (False, True):
        dataset = PackedIterableDataset(str(out_dir), batch_rows=1, pad_to_fixed_shape=True, bucket_shapes=bucket_shapes,
                                        shuffle=False)
        pairs = torch.cat([batch["pair_ids"] for batch in dataset])
        assert sorted(pairs.tolist()) == sorted(list(range(12)) * per_pair)
    assert inspect.main([str(out_dir)]) == 0
    assert f"segments     {segments} of the 12 pairs kept" in capsys.readouterr().out


@pytest.mark.parametrize("options, named", [
    (["--prompt-column", "chosen"], "--prompt-column and --chosen-column name the same column 'chosen'"),
    (["--chosen-column", "prompt"],
     "--prompt-column (the source's own 'prompt' column) and --chosen-column name the same column 'prompt'"),
    (["--prompt-column", "rejected", "--verify-tokens", "off"], "--prompt-column and --rejected-column name the same column 'rejected'"),
    (["--prompt-column", "none", "--rejected-column", "chosen"], "--chosen-column and --rejected-column name the same column 'chosen'"),
    (["--chosen-column", "prompt", "--rejected-column", "prompt", "--verify-tokens", "off"],
     "--prompt-column (the source's own 'prompt' column), --chosen-column and --rejected-column name the same column 'prompt'"),
])
def test_one_column_named_for_two_parts_of_a_pair_is_an_option_error(tmp_path, capsys, options, named):
    data = write_jsonl(tmp_path / "pairs.jsonl", TEXT_PAIRS)
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--format", "preference", "--no-progress", "--no-report"]
    assert main([*args, *options]) == 1
    error = capsys.readouterr().err.strip()
    assert error == f"varpack: error: {named}, but a column holds one part of a pair; name a different column with each"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["preference", "sft"])
def test_a_build_of_bad_rows_only_says_how_many_and_why_and_keeps_their_list(tmp_path, capsys, monkeypatch, gguf_cache, kind):
    if kind == "preference":
        # The byte-level Falcon vocabulary merges the default template's "\n\n" with each completion.
        monkeypatch.setenv("VARPACK_CACHE_DIR", str(gguf_cache))  # its conversion, made once for the session
        records = [{"prompt": f"What is {i} + {i}?", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}, I think."} for i in range(12)]
        options = ["--format", "preference", "--tokenizer", "tests/data/llama-cpp-vocab/ggml-vocab-falcon.gguf"]
        reasons = "prompt_not_a_prefix: 12"
    else:
        records = [{"prompt": f"What is {i} + {i}?", "response": None if i % 3 else ""} for i in range(12)]
        options = []
        reasons = "empty_text: 4, null: 8"
    data = write_jsonl(tmp_path / "rows.jsonl", records)
    args = ["--dataset", str(data), "--out", str(tmp_path / "out"), "--on-bad-row", "skip", "--max-bad-rows", "100",
            "--no-progress", "--no-report", *options]
    assert main(args) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    (build_dir,) = (tmp_path / "out").iterdir()
    assert error == (f"varpack: error: nothing to write: all 12 rows read are bad rows ({reasons}), listed with their "
                     f"reasons in {build_dir / 'rejected.jsonl'}")
    listed = [json.loads(line) for line in (build_dir / "rejected.jsonl").read_text().splitlines()]
    assert [entry["where"] for entry in listed] == [f"{data} line {i}" for i in range(1, 13)]
    assert sorted(p.name for p in build_dir.iterdir()) == ["rejected.jsonl"]  # no manifest: no build
    assert main(args) == 1  # what is left is no build to reuse: the next run reads the rows again
    assert capsys.readouterr().err.strip().splitlines()[-1] == error


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_pair_whose_chosen_and_rejected_tokens_are_the_same_is_a_bad_row(tmp_path, layout):
    """Llama 3's template trims each turn, so answers that differ only in their outer whitespace are one sequence:
    the pair carries no preference and is left out as chosen_equals_rejected, the other pair packed."""
    tokenizer = byte_level_directory(tmp_path / "tokenizer", LLAMA3_SPECIALS)
    user = {"role": "user", "content": "Hi"}
    records = [{"chosen": [user, {"role": "assistant", "content": "Hello "}],
                "rejected": [user, {"role": "assistant", "content": "\nHello"}]}, CHAT_PAIRS[0]]
    _, out_dir = pack_pairs(tmp_path, records, tokenizer=str(tokenizer), chat_template="llama3", preference_layout=layout,
                            on_bad_row="skip", max_bad_rows=10)
    listed = [json.loads(line) for line in (out_dir / "rejected.jsonl").read_text().splitlines()]
    assert [(entry["where"].rsplit(" ", 1)[1], entry["reason"]) for entry in listed] == [("1", "chosen_equals_rejected")]
    assert "not in their tokens" in listed[0]["message"]
    assert sorted(read_pairs(out_dir)) == [1]
    for segments in read_pairs(out_dir).values():
        chosen, _, rejected, _ = whole_sequences(segments)
        assert chosen.tolist() != rejected.tolist()
    assert read_manifest(out_dir).stats.bad_pairs == {"chosen_equals_rejected": 1}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("records", [CHAT_PAIRS, TEXT_PAIRS[:2]], ids=["messages", "text"])
def test_the_token_check_refuses_a_trained_prompt_token_in_either_branch(tmp_path, layout, records):
    """The reference says where the prompt ends, so equal tokens under a loss mask that trains a prompt token (the
    prompt masked in the chosen branch only) differ from it, as a wrong token does."""
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    config = PackConfig(dataset=str(data), out=str(tmp_path / "out"), format="preference", preference_layout=layout)
    plan = plan_build(config)
    table = pa.Table.from_pylist(records)
    batch = PairEncoder(plan.tokenizer, plan.example_format, 256, Overflow.DROP, layout=layout).encode(table, BatchRows("pairs.jsonl"))
    everything = np.ones(batch.lengths.size, dtype=bool)
    checker = PairTokenChecker(plan.tokenizer, plan.example_format, "error")
    assert checker.check(table, BatchRows("pairs.jsonl"), batch, everything).equal == 2
    # The rejected branch of the second pair starts with a prompt token (the prompt's last one, in shared-prompt).
    first_rejected = int(np.flatnonzero((batch.roles == Role.REJECTED) & (np.arange(batch.tokens.size) >= batch.starts[1]))[0])
    assert batch.loss_mask[first_rejected] == 0
    batch.loss_mask[first_rejected] = 1
    with pytest.raises(TokenMismatchError, match=r"^pairs.jsonl row 1: its tokens equal the .*, but its loss mask trains a "
                                                 r"prompt token at token \d+ \(the reference's prompt is its first \d+ of"):
        checker.check(table, BatchRows("pairs.jsonl"), batch, everything)
    counted = PairTokenChecker(plan.tokenizer, plan.example_format, "count").check(table, BatchRows("pairs.jsonl"), batch, everything)
    assert (counted.checked, counted.equal) == (2, 1)
    # A completion token left untrained is refused too.
    batch.loss_mask[first_rejected] = 0
    batch.loss_mask[batch.starts[1] + batch.lengths[1] - 1] = 0
    with pytest.raises(TokenMismatchError, match="leaves a completion token untrained"):
        checker.check(table, BatchRows("pairs.jsonl"), batch, everything)


def test_special_token_text_in_message_pairs_is_counted_named_and_refused_under_strict(tmp_path, capsys):
    """A message of a pair writing ``</s>`` is tokenized with the EOS inside it: counted per pair (its prompt once,
    both completions), as chat examples are, never for the template's own markers."""
    close, strike = {"role": "user", "content": "Close it"}, {"role": "user", "content": "Strike <s>old"}

    def answers(chosen: str, rejected: str) -> list[dict]:
        return [{"role": "assistant", "content": chosen}, {"role": "assistant", "content": rejected}]

    (like, no), (done, both) = answers("Like </s> this", "No."), answers("Done.", "<s>, </s>")
    records = [
        CHAT_PAIRS[0],
        {"chosen": [close, like], "rejected": [close, no]},
        {"chosen": [strike, done], "rejected": [strike, both]},
    ]
    data = write_jsonl(tmp_path / "pairs.jsonl", records)
    args = ["--dataset", str(data), "--format", "preference", "--max-len", "128", "--no-progress", "--no-report"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert f"warning: 2 examples (the first: {data} line 2): the data text holds '</s>'" in capsys.readouterr().err
    (out_dir,) = (tmp_path / "out").iterdir()
    assert read_manifest(out_dir).stats.special_token_text == {
        "</s>": {"examples": 2, "first_row": f"{data} line 2"}, "<s>": {"examples": 1, "first_row": f"{data} line 3"}
    }
    assert main([*args, "--out", str(tmp_path / "strict"), "--strict"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"varpack: error: {data} line 2: the data text holds '</s>', the text of a special token, and is tokenized as that "
        "token, not as text; remove it from the data, or leave out --strict"
    )
    assert not (tmp_path / "strict").exists() or not list((tmp_path / "strict").glob("*/manifest.json"))
