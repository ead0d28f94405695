"""``python -m pipeline.inspect DIR``: what a build holds, to look at before training on it.

    python -m pipeline.inspect DIR                 # summary: inputs, fill, examples, overflow, bad rows
    python -m pipeline.inspect DIR --json          # the same, as one JSON object
    python -m pipeline.inspect DIR --rows 3        # the first rows decoded, examples and trained spans marked
    python -m pipeline.inspect DIR --plot FIGDIR   # FIGDIR/report.png: length, examples-per-row and fill histograms

``DIR`` is a build directory (holding ``manifest.json``), or a directory holding exactly one
build. Rows are decoded with the tokenizer the manifest names (``--tokenizer`` to use another,
``--ids`` to print token ids). In a terminal, trained tokens are green and each example's
header is bold; piped, trained spans are wrapped in ``«`` and ``»``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from pipeline import storage
from pipeline.errors import InputError
from pipeline.report.profile import read_profile, read_shard_table
from pipeline.report.summary import (
    aligned,
    describe_examples,
    describe_overflow,
    describe_pairs,
    describe_rejected,
    describe_trimmed,
    examples_dropped,
    examples_per_row,
    plural,
)
from pipeline.write.build_dir import read_build_manifest
from schemas import MANIFEST_NAME, Manifest, ManifestError, Role, VarpackError

EXIT_ERROR = 1
TRAINED_OPEN, TRAINED_CLOSE = "«", "»"
_GREEN, _BOLD, _DIM, _RESET = "\033[32m", "\033[1m", "\033[2m", "\033[0m"


def printable(text: str, keep: str = "") -> str:
    r"""``text`` with its control characters (C0 but those in ``keep``, DEL, C1) escaped as ``\xNN``, so that a
    manifest's strings cannot start a line or colour the terminal.

    >>> print(printable("2026-01-01\n\x1b[31m"))
    2026-01-01\x0a\x1b[31m
    """
    return _CONTROL.sub(lambda found: found[0] if found[0] in keep else f"\\x{ord(found[0]):02x}", text)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def locate_build(path: str) -> str:
    """The build directory ``path`` names: itself when it holds a manifest, else its one build subdirectory
    (``path`` may also name the manifest itself)."""
    if storage.basename(path) == MANIFEST_NAME and storage.exists(path) and not storage.is_dir(path):
        return path.rstrip("/").rsplit("/", 1)[0] if storage.is_url(path) else os.path.dirname(os.path.abspath(path))
    if storage.exists(storage.join(path, MANIFEST_NAME)):
        return path
    builds = [d for d in storage.list_subdirs(path) if storage.exists(storage.join(path, d, MANIFEST_NAME))]
    if len(builds) == 1:
        return storage.join(path, builds[0])
    if builds:
        raise InputError(f"{path} holds {len(builds)} builds ({', '.join(builds[:3])}); pass one of them")
    if not storage.exists(path):
        raise InputError(f"{path}: no such directory")
    raise ManifestError(f"{path}: no {MANIFEST_NAME}; the build is missing or was interrupted, run the pipeline again")


def summarize(build_dir: str, manifest: Manifest) -> dict[str, Any]:
    """The summary of a build, JSON-ready: its inputs, what packing did, what was left out, and its size."""
    mean, low, high = examples_per_row(manifest.stats)
    rejected = manifest.rejected
    return {
        "build": build_dir,
        "fingerprint": manifest.fingerprint,
        "format_version": manifest.format_version,
        "created_at": manifest.created_at,
        "inputs": manifest.inputs.to_dict(),
        "capacity": manifest.capacity,
        "shards": len(manifest.shards),
        "bytes": sum(s.bytes for s in manifest.shards),
        "stats": manifest.stats.to_dict(),
        "examples": {
            "read": manifest.stats.examples_read,
            "kept": manifest.stats.examples_kept,
            "dropped": examples_dropped(manifest.stats),
        },
        "examples_per_row": {"mean": mean, "min": low, "max": high},
        "rejected": None if rejected is None else {"rows": rejected.rows, "by_reason": rejected.by_reason},
        "preference": None if manifest.preference_layout is None else {
            "layout": manifest.preference_layout, "pairs": manifest.stats.pairs, "bad_pairs": manifest.stats.bad_pairs,
        },
    }


def _size(num_bytes: int) -> str:
    """``812 bytes``, ``1.2 MB``, ``40.3 GB``."""
    if num_bytes < 1000:
        return f"{num_bytes:,} bytes"
    exponent = min((len(str(num_bytes)) - 1) // 3, 3)  # exact for any integer; bytes are at most 2**63 - 1
    return f"{num_bytes / 1000**exponent:,.1f} {('KB', 'MB', 'GB')[exponent - 1]}"


def format_summary(build_dir: str, manifest: Manifest) -> str:
    """The summary as aligned lines."""
    inputs, stats, dataset, tokenizer = manifest.inputs, manifest.stats, manifest.inputs.dataset, manifest.inputs.tokenizer
    mean, low, high = examples_per_row(stats)
    special = ", ".join(
        f"{name} {'none' if token is None else token}"
        for name, token in (("BOS", tokenizer.bos_token_id), ("EOS", tokenizer.eos_token_id))
    )
    rejected = manifest.rejected
    if rejected is None:
        bad_rows = "not recorded (format 1 manifest)"
    elif rejected.rows:
        bad_rows = f"{describe_rejected(rejected)} (--on-bad-row {inputs.on_bad_row})"
    else:
        bad_rows = f"none (--on-bad-row {inputs.on_bad_row})"
    # A preference build's segments are its pairs' sequences (2 or 3 a pair); an SFT build's, its examples' chunks.
    kept = plural(stats.pairs, 'pair') if manifest.preference_layout is not None else plural(stats.examples_kept, 'example')
    lines = [
        ("build", build_dir),
        ("fingerprint", f"{manifest.fingerprint} (format {manifest.format_version}, varpack {inputs.package_version}, "
                        f"written {manifest.created_at})"),
        ("dataset", ", ".join([dataset.id, f"split {dataset.split}"]
                              + ([f"revision {dataset.revision}"] if dataset.revision else [])
                              + ([f"first {dataset.num_examples:,} rows"] if dataset.num_examples else [])
                              + [f"content {dataset.content_hash[:12]}"])),
        ("tokenizer", f"{tokenizer.name} (vocabulary {tokenizer.vocab_size:,}, content {tokenizer.content_hash[:12]})"),
        ("template", inputs.template),
        ("loss on", inputs.loss_masking),
        ("special ids", special),
        ("capacity", f"{manifest.capacity:,} tokens per row; --overflow {inputs.overflow}, --packing {inputs.packing}, "
                     f"--seed {inputs.seed}"),
        ("rows", f"{plural(stats.rows, 'row')} in {plural(len(manifest.shards), 'shard')} "
                 f"({_size(sum(s.bytes for s in manifest.shards))})"),
        ("tokens", f"{stats.tokens:,} packed"),
        ("fill", f"{100 * stats.fill:.3f}%"),
        ("examples", describe_examples(stats, manifest.capacity)),
        ("segments", f"{stats.segments:,} of the {kept} kept; {mean:.2f} per row, "
                     f"{low} to {high}; example ids below {manifest.num_example_ids:,} (source rows)"),
        ("overflow", describe_overflow(stats)),
        ("bad rows", bad_rows),
        *([("trimmed", describe_trimmed(stats))] if stats.conversations_trimmed else []),
        *([("pairs", describe_pairs(stats, manifest.preference_layout))] if manifest.preference_layout is not None else []),
    ]
    return aligned([(label, printable(value)) for label, value in lines])


Decoder = Callable[[np.ndarray], str]


def _spans(mask: np.ndarray) -> Iterator[tuple[int, int, bool]]:
    """``(start, end, trained)`` runs of equal loss mask."""
    cuts = np.flatnonzero(np.diff(mask)) + 1
    bounds = np.concatenate(([0], cuts, [mask.size])).tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        yield start, end, bool(mask[start])


def _segment_text(ids: np.ndarray, mask: np.ndarray, decode: Decoder | None, color: bool) -> str:
    """A segment's tokens, decoded (or as ids), its trained spans marked."""
    pieces = []
    for start, end, trained in _spans(mask):
        if decode is None:
            text = " ".join(map(str, ids[start:end].tolist()))
            text = (" " if start else "") + text
        else:
            # Decode prefixes and take the difference: a span decoded alone loses its leading space.
            text = decode(ids[:end])[len(decode(ids[:start])) :] if start else decode(ids[:end])
            text = printable(text, keep="\n\t")
        if trained:
            text = f"{_GREEN}{text}{_RESET}" if color else f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}"
        pieces.append(text)
    return "".join(pieces)


def format_rows(build_dir: str, manifest: Manifest, num_rows: int, decode: Decoder | None, color: bool) -> Iterator[str]:
    """The first ``num_rows`` rows of the build, each example on its own lines under a header."""
    bold = (lambda s: f"{_BOLD}{s}{_RESET}") if color else (lambda s: s)
    dim = (lambda s: f"{_DIM}{s}{_RESET}") if color else (lambda s: s)
    shown = 0
    for info in manifest.shards:
        if shown == num_rows:
            return
        table = read_shard_table(build_dir, info, manifest.capacity).slice(0, num_rows - shown)
        for i, row in enumerate(table.to_pylist()):
            cu, tokens = row["cu_seqlens"], row["num_tokens"]
            segment = "segment" if "roles" in row else "example"
            yield bold(
                f"row {shown} ({printable(info.path)} row {i}): {plural(len(cu) - 1, segment)}, {tokens:,} of "
                f"{manifest.capacity:,} tokens ({100 * tokens / manifest.capacity:.1f}%)"
            )
            ids, mask = np.asarray(row["input_ids"]), np.asarray(row["loss_mask"])
            roles = row.get("roles") or [None] * len(row["example_ids"])
            for j, (example, offset, role) in enumerate(zip(row["example_ids"], row["example_offsets"], roles)):
                a, b = cu[j], cu[j + 1]
                if role is None:
                    chunk = f", from token {offset:,} (a later chunk of a split example)" if offset else ""
                    yield dim(f"  -- example {example}: {plural(b - a, 'token')}{chunk}, positions {a} to {b - 1}")
                else:
                    after = f", position ids from {offset:,} (after the prompt)" if offset else ""
                    yield dim(f"  -- pair {example}, {Role(role).name.lower()}: {plural(b - a, 'token')}{after}, positions {a} to {b - 1}")
                text = _segment_text(ids[a:b], mask[a:b], decode, color)  # escapes the text's own controls
                yield "    " + text.replace("\n", "\n    ")
            shown += 1


def load_decoder(manifest: Manifest, tokenizer: str | None) -> tuple[Decoder, str | None]:
    """A decoder of token ids, from ``tokenizer`` or the one the manifest names, and a note when its
    content differs from the build's."""
    from pipeline.encode.tokenizer import load_tokenizer

    recorded = manifest.inputs.tokenizer
    name = tokenizer or recorded.name
    try:
        loaded = load_tokenizer(name)
    except (VarpackError, OSError) as err:
        raise InputError(
            f"cannot load tokenizer {name} to decode the rows ({err}); pass --tokenizer PATH, or --ids to print token ids"
        ) from err
    note = None
    if loaded.content_hash != recorded.content_hash:
        note = (f"tokenizer {name} differs from the one the build recorded ({recorded.name}, content "
                f"{recorded.content_hash[:12]}): another version, or --bos-token/--eos-token; the text may be off")
    backend = loaded.backend()
    return (lambda ids: backend.decode(ids.tolist(), skip_special_tokens=False)), note


def make_parser(prog: str = "python -m pipeline.inspect") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Show what a build holds: a summary (inputs, fill, examples, overflow, bad rows), decoded rows, "
        "and histograms.",
    )
    parser.add_argument("build", help="build directory (holding manifest.json), or a directory holding one build")
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    shown.add_argument("--rows", type=int, default=0, metavar="N", help="after the summary, print the first N rows, "
                       "decoded, with example boundaries and trained (loss) spans marked")
    parser.add_argument("--tokenizer", help="tokenizer to decode with (default: the one the manifest names)")
    parser.add_argument("--ids", action="store_true", help="with --rows, print token ids instead of text")
    parser.add_argument("--plot", metavar="DIR", help="write DIR/report.png: histograms of example length "
                        "(before and after overflow handling), examples per row and row fill (needs matplotlib)")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m pipeline.inspect") -> int:
    args = make_parser(prog).parse_args(argv)
    try:
        if args.rows < 0:
            raise InputError(f"--rows must be 0 or more, got {args.rows}")
        build_dir = locate_build(storage.local_path(args.build))
        manifest = read_build_manifest(build_dir)
        if args.json:
            print(json.dumps(summarize(build_dir, manifest), indent=2))
        else:
            print(format_summary(build_dir, manifest))
        if args.rows:
            decode, note = (None, None) if args.ids else load_decoder(manifest, args.tokenizer)
            if note:
                print(f"varpack: note: {note}", file=sys.stderr)
            color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
            print()
            for line in format_rows(build_dir, manifest, args.rows, decode, color):
                print(line)
        if args.plot:
            from pipeline.report.figures import missing_matplotlib, write_report

            if missing_matplotlib():
                raise InputError(f"--plot needs matplotlib: {missing_matplotlib()}")
            path = write_report(read_profile(build_dir, manifest), manifest, args.plot)
            print(f"varpack: wrote {path}", file=sys.stderr)
    except BrokenPipeError:
        # The reader went away (| head): stop quietly, and keep Python from failing to flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (VarpackError, OSError) as err:
        print(f"varpack: error: {printable(' '.join(str(err).split()))}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
