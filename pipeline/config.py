"""The settings of one pack run, from the command line down to the manifest.

The command line (``pipeline/pack.py``) maps onto PackConfig one to one and takes its defaults
from it. Every other stage reads the same object: the build plan holds it, the Beam steps read
their settings from it, and ``build_inputs`` turns it into the inputs the manifest records and
the fingerprint covers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pipeline.errors import ConfigError
from pipeline.storage import local_path
from schemas import (
    BadRowPolicy,
    BuildFormat,
    BuildInputs,
    DatasetInputs,
    GroupCut,
    Overflow,
    PackingAlgorithm,
    PreferenceLayout,
    TokenizerInputs,
    one_of,
    positive_int,
)
from schemas.row import MAX_ROW_TOKENS

# The Mistral-7B v0.1 tokenizer that ships inside mistral-common (see pipeline/encode/tokenizer.py).
DEFAULT_TOKENIZER = "mistral-7b-v0.1"

# --prompt-column none: a preference dataset's chosen and rejected columns are message lists whose shared
# leading turns are the prompt, even where the source has a prompt column too (UltraFeedback's).
NO_PROMPT_COLUMN = "none"

# Examples per packing group: above it a dataset is packed in groups of consecutive examples.
EXAMPLES_PER_GROUP = 50_000_000
# Example ids and group bounds are int64.
MAX_EXAMPLES_PER_GROUP = 2**63 - 1
# About 8M tokens (about 40 MB) per shard: large enough for sequential reads, small enough to spread.
TARGET_SHARD_TOKENS = 1 << 23


class VerifyTokens(StrEnum):
    """Which examples a build checks against the reference tokenization (``--verify-tokens``)."""

    SAMPLE = "sample"
    ALL = "all"
    OFF = "off"


class OnTokenMismatch(StrEnum):
    """What an example whose tokens differ from the reference does (``--on-token-mismatch``)."""

    ERROR = "error"
    COUNT = "count"


def default_rows_per_shard(capacity: int) -> int:
    """Rows per shard so that a full shard holds about TARGET_SHARD_TOKENS tokens."""
    return max(1, TARGET_SHARD_TOKENS // capacity)


class TruncateSide(StrEnum):
    """Which end of a too-long prompt/response example ``--overflow truncate`` cuts."""

    RIGHT = "right"  # the tail, as packing cuts any example
    LEFT = "left"  # the prompt's head after BOS, keeping the response


@dataclass(frozen=True)
class PackConfig:
    """What to pack, with which tokenizer, into which directory, and how.

    ``beam_args`` are Apache Beam pipeline options passed through unchanged (``--runner``,
    ``--direct_num_workers``, ``--temp_location``, ...).
    """

    dataset: str = "gsm8k"
    out: str = "shards"
    # What the rows hold: examples to fine-tune on ("sft"), or preference pairs ("preference").
    format: str = BuildFormat.SFT
    # Preference pairs: both sequences whole ("separate"), or the prompt once ("shared-prompt").
    preference_layout: str = PreferenceLayout.SEPARATE
    tokenizer: str = DEFAULT_TOKENIZER
    max_len: int = 4096
    # None: the dataset's usual split ("train"; "test" for gsm8k, which embeds only that split).
    split: str | None = None
    # Hub datasets: the commit (or branch or tag) to read; None: the main branch's commit now.
    revision: str | None = None
    # The first N source rows; None: every row (synthetic datasets: 100,000).
    num_examples: int | None = None
    # None: split, but truncate chat data, whose later chunks would start mid-conversation (see resolved_overflow).
    overflow: str | None = None
    packing: str = PackingAlgorithm.BEST_FIT_DECREASING
    seed: int = 0
    force: bool = False
    # Seconds to wait for another run building the same directory; None: as long as it takes.
    lock_timeout: float | None = None
    prompt_column: str | None = None
    response_column: str | None = None
    messages_column: str | None = None
    text_column: str | None = None
    # Preference pairs: the completions' columns (text, or message lists with --prompt-column none).
    chosen_column: str = "chosen"
    rejected_column: str = "rejected"
    # A Jinja chat template, or a file holding one; None: the tokenizer's own.
    chat_template: str | None = None
    # Prompt/response: how they are joined (None: formats.DEFAULT_PROMPT_TEMPLATE), or --as-chat.
    prompt_template: str | None = None
    as_chat: bool = False
    # Prompt/response: a system prompt, the template's {system} field (placed before the prompt when the
    # template has none), or a system turn under --as-chat.
    system_prompt: str | None = None
    # Under --overflow truncate: "right" cuts an example's tail, "left" the prompt's head (after BOS), keeping the response.
    truncate_side: str = TruncateSide.RIGHT
    # Special tokens around each prompt/response or text example; None: the tokenizer's own.
    bos_token: str | None = None
    eos_token: str | None = None
    # Chat data: drop assistant turns before the first user turn and user turns after the last assistant turn
    # (True), refuse such rows (False), or drop them in ShareGPT data and refuse them in messages data (None).
    drop_dangling_turns: bool | None = None
    # Special tokens to add to the tokenizer (a tiktoken ranks file has none), each one token.
    special_tokens: tuple[str, ...] = ()
    train_on_prompt: bool = False
    on_bad_row: str = BadRowPolicy.ERROR
    # Under --on-bad-row skip: a count of bad rows (an int), or a fraction of the rows read (a float from
    # 0.0 to 1.0, 1.0 accepting every bad row), over which the build stops, its data then mostly garbage.
    max_bad_rows: int | float = 0.1
    # Which examples are checked against the reference tokenization, and what a difference does.
    verify_tokens: str = VerifyTokens.SAMPLE
    on_token_mismatch: str = OnTokenMismatch.ERROR
    # Examples per Beam element: one tokenizer call and one shuffle record each.
    batch_size: int = 4096
    # Rows per shard file; None: about 8M tokens per shard.
    rows_per_shard: int | None = None
    # Examples packed together as one group (see pipeline/packing/groups.py); None: 50M.
    examples_per_group: int | None = None
    progress: bool = True
    # Write report.png (the build's histograms) beside the manifest; needs matplotlib.
    report: bool = True
    verbose: bool = False
    # Input present but not used (a source file or column, a chat turn the template leaves out) is an error, not a warning.
    strict: bool = False
    beam_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # file:///abs/path names the local path /abs/path: Beam's filesystems know no file:// scheme.
        for name in ("dataset", "out"):
            object.__setattr__(self, name, local_path(getattr(self, name)))
        if isinstance(self.max_bad_rows, float):
            object.__setattr__(self, "max_bad_rows", self.max_bad_rows + 0.0)  # -0.0 is 0.0, and says so in messages

    @property
    def resolved_rows_per_shard(self) -> int:
        """Rows per shard file: ``rows_per_shard``, else about 8M tokens' worth."""
        return self.rows_per_shard or default_rows_per_shard(self.max_len)

    @property
    def resolved_examples_per_group(self) -> int:
        """Examples packed together as one group: ``examples_per_group``, else 50M."""
        return self.examples_per_group or EXAMPLES_PER_GROUP

    def may_pack_in_groups(self, known_rows: int | None) -> bool:
        """Whether a build of ``known_rows`` source rows (None: not counted before reading) may be packed in more
        than one group; bounded by ``--num-examples`` when the rows are not counted."""
        rows = known_rows if known_rows is not None else self.num_examples
        return rows is None or rows > self.resolved_examples_per_group

    def resolved_overflow(self, chat: bool) -> str:
        """``--overflow``, else split, or for chat data truncate: a conversation keeps its start and is never cut
        into chunks that start mid-conversation (examples truncation leaves untrained are dropped and counted)."""
        if self.overflow is not None:
            return self.overflow
        if self.is_preference:  # a pair longer than a row is left out, listed in rejected.jsonl
            return Overflow.DROP
        return Overflow.TRUNCATE if chat else Overflow.SPLIT

    @property
    def is_preference(self) -> bool:
        """Whether the build packs preference pairs (``--format preference``)."""
        return self.format == BuildFormat.PREFERENCE

    def build_inputs(
        self, dataset: DatasetInputs, tokenizer: TokenizerInputs, template: str, loss_masking: str, package_version: str,
        *, known_rows: int | None,
    ) -> BuildInputs:
        """What the manifest records of this run and the fingerprint covers.

        The dataset, tokenizer and template come resolved (by content, not by name); the
        settings that shape the rows come from here. Settings in RUN_SETTINGS are left out:
        they change how a build runs, never the bytes it writes. ``overflow`` must be resolved
        (``resolved_overflow``), as ``plan_build`` does. A build of ``known_rows`` source rows
        (None: not counted) that may be packed in more than one group records how its groups
        are cut (``inputs.group_cut``).
        """
        if self.overflow is None:
            raise ValueError("build_inputs needs the resolved --overflow (PackConfig.resolved_overflow)")
        return BuildInputs(
            dataset=dataset,
            tokenizer=tokenizer,
            template=template,
            loss_masking=loss_masking,
            max_len=self.max_len,
            overflow=self.overflow,
            packing=self.packing,
            seed=self.seed,
            package_version=package_version,
            on_bad_row=self.on_bad_row,
            rows_per_shard=self.rows_per_shard,
            examples_per_group=self.examples_per_group,
            format=BuildFormat.PREFERENCE if self.is_preference else None,
            preference_layout=self.preference_layout if self.is_preference else None,
            group_cut=GroupCut.EXAMPLE if self.may_pack_in_groups(known_rows) else None,
        )

    def validate(self) -> None:
        """Raise ConfigError for a setting, or a mix of settings, that cannot work."""
        positive_int("--max-len", self.max_len, ConfigError)
        if self.max_len > MAX_ROW_TOKENS:
            raise ConfigError(
                f"--max-len must be at most {MAX_ROW_TOKENS:,} (a row's token counts are int32), got {self.max_len:,}"
            )
        positive_int("--batch-size", self.batch_size, ConfigError)
        for name in ("num_examples", "rows_per_shard", "examples_per_group"):
            value = getattr(self, name)
            if value is not None:
                positive_int(f"--{name.replace('_', '-')}", value, ConfigError)
        if self.examples_per_group is not None and self.examples_per_group > MAX_EXAMPLES_PER_GROUP:
            raise ConfigError(
                f"--examples-per-group must be between 1 and {MAX_EXAMPLES_PER_GROUP:,}, got {self.examples_per_group:,}"
            )
        if self.overflow is not None:
            one_of("--overflow", self.overflow, Overflow, ConfigError)
        one_of("--packing", self.packing, PackingAlgorithm, ConfigError)
        one_of("--format", self.format, BuildFormat, ConfigError)
        one_of("--preference-layout", self.preference_layout, PreferenceLayout, ConfigError)
        self._check_preference()
        one_of("--on-bad-row", self.on_bad_row, BadRowPolicy, ConfigError)
        one_of("--truncate-side", self.truncate_side, TruncateSide, ConfigError)
        one_of("--verify-tokens", self.verify_tokens, VerifyTokens, ConfigError)
        one_of("--on-token-mismatch", self.on_token_mismatch, OnTokenMismatch, ConfigError)
        bound = self.max_bad_rows
        if isinstance(bound, bool) or not (
            (isinstance(bound, int) and bound >= 0) or (isinstance(bound, float) and 0 <= bound <= 1)
        ):
            raise ConfigError("--max-bad-rows must be a count (0, 1, 2, ...) or a fraction of the rows read from 0.0 to 1.0 "
                              f"(1.0: every row may be bad), got {bound!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"--seed must be a non-negative integer, got {self.seed!r}")
        if not self.is_preference and (self.prompt_column is None) != (self.response_column is None):
            raise ConfigError("--prompt-column and --response-column go together: pass both")
        formats = [self.prompt_column is not None, self.messages_column is not None, self.text_column is not None]
        if sum(formats) > 1:
            raise ConfigError(
                "choose one example format: --prompt-column/--response-column, --messages-column or --text-column"
            )
        if self.lock_timeout is not None and not self.lock_timeout >= 0:
            raise ConfigError(f"--lock-timeout must be a number of seconds (0 or more), got {self.lock_timeout!r}")
        if not self.dataset:
            raise ConfigError("--dataset must not be empty")

    def _check_preference(self) -> None:
        """Raise ConfigError for an option that does not go with ``--format``."""
        if not self.is_preference:
            if self.preference_layout != PreferenceLayout.SEPARATE:
                raise ConfigError("--preference-layout lays out preference pairs: pass it with --format preference")
            return
        if self.overflow in (Overflow.SPLIT, Overflow.TRUNCATE):
            raise ConfigError(
                f"--overflow {self.overflow} would cut a pair, which is never split: with --format preference a pair "
                "longer than --max-len is left out (--overflow drop, the default) or stops the build (--overflow error)"
            )
        for option, given in (("--messages-column", self.messages_column), ("--text-column", self.text_column),
                              ("--response-column", self.response_column), ("--train-on-prompt", self.train_on_prompt)):
            if given:
                raise ConfigError(
                    f"{option} does not go with --format preference, which reads --prompt-column, --chosen-column and "
                    "--rejected-column and trains on the completions"
                )
        if not self.out:
            raise ConfigError("--out must not be empty")


# Settings that change how a build runs (where it goes, how it reports, how it is split into
# Beam elements, when it gives up) but never the bytes of its shards: not in the fingerprint.
# Every other setting is, directly or through the dataset, tokenizer or template it resolves.
RUN_SETTINGS = frozenset(
    {"out", "force", "lock_timeout", "max_bad_rows", "batch_size", "progress", "report", "verbose", "strict", "beam_args"}
    | {"verify_tokens", "on_token_mismatch"}
)
