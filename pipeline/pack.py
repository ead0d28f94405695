"""``python -m pipeline.pack``: pack a dataset into reusable shards of packed rows.

    python -m pipeline.pack [--dataset NAME] [--out DIR] [--tokenizer T] [--max-len 4096]
        [--split S] [--num-examples N] [--overflow split|truncate|drop|error] [--seed S]
        [--force] [--no-report] [column options] [Apache Beam options, passed through unchanged]

With no arguments it packs the embedded GSM8K test set with the embedded Mistral-7B v0.1
tokenizer into ./shards/gsm8k-<fingerprint>/. Every option maps onto a field of PackConfig.
Errors print one line on stderr naming the file and the cause, and exit with status 1 (with
the traceback under ``--verbose``); Ctrl-C prints "interrupted" and exits with 130. Nothing is
left half-written.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import re
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

# The project's modules (pyarrow, numpy, Beam behind them) are imported inside the functions, once main()
# handles Ctrl-C: an interrupt while they load is then one line too.
if TYPE_CHECKING:
    from pipeline.build import BuildResult
    from pipeline.config import PackConfig
    from schemas import Manifest

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


def bad_row_bound(text: str) -> int | float:
    """``--max-bad-rows``: a count (``100``) or a fraction of the rows read (``0.05``, from 0.0 to 1.0)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or a fraction such as 0.05, got {text!r}") from None


PROG = "python -m pipeline.pack"


class _DanglingTurns(argparse.Action):
    """``--drop-dangling-turns`` or ``--keep-dangling-turns``; both is a ConfigError (one line), not a usage text."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from pipeline.errors import ConfigError

        if getattr(namespace, self.dest) not in (None, self.const):
            raise ConfigError("--drop-dangling-turns and --keep-dangling-turns contradict each other; pass one of them")
        setattr(namespace, self.dest, self.const)


def make_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from pipeline.config import OnTokenMismatch, PackConfig, TruncateSide, VerifyTokens
    from schemas import BadRowPolicy, BuildFormat, Overflow, PackingAlgorithm, PreferenceLayout

    parser = argparse.ArgumentParser(
        prog=prog,
        description="Pack a dataset into content-addressed shards of packed rows for FlashAttention-2 varlen training. "
        "Unknown --options are Apache Beam pipeline options (--runner, --direct_num_workers, --direct_running_mode, "
        "--temp_location, ...), passed through unchanged; the default runner is Beam's in-process FnApiRunner.",
        allow_abbrev=False,
    )
    add = parser.add_argument
    default = PackConfig()  # the one place defaults are set
    add("--dataset", default=default.dataset,
        help="gsm8k (embedded, the default), flan, orcamath, synthetic-flan, synthetic-orcamath, hf:OWNER/NAME, "
             "or local .jsonl/.json/.parquet/.arrow files, a directory or a glob")
    add("--out", default=default.out,
        help="parent directory (or gs://, s3:// URL) of DATASET-FINGERPRINT/ (default: %(default)s)")
    add("--tokenizer", default=default.tokenizer,
        help="a Hugging Face Hub id, a local directory, a tokenizer.json, a GGUF file, a SentencePiece tokenizer.model or "
             "a tiktoken ranks file (.tiktoken, or Llama 3's tokenizer.model) (default: the embedded %(default)s)")
    add("--max-len", type=int, default=default.max_len, help="row capacity in tokens (default: %(default)s)")
    add("--split", help="dataset split (default: train; gsm8k embeds only test)")
    add("--revision", help="Hub datasets: the commit, branch or tag to read (default: the main branch's "
                            "current commit, recorded in the manifest)")
    add("--num-examples", type=int,
        help="pack only the first N rows of the dataset (synthetic datasets: generate N, default 100000)")
    add("--overflow", choices=[e.value for e in Overflow], default=default.overflow,
        help="what to do with examples longer than --max-len (default: split; truncate for chat data, whose later "
             "chunks would start mid-conversation)")
    add("--truncate-side", choices=[e.value for e in TruncateSide], default=default.truncate_side,
        help="with --overflow truncate, cut a prompt/response example's tail (right) or its prompt's head (left), "
             "keeping the response (default: %(default)s)")
    add("--packing", choices=[e.value for e in PackingAlgorithm], default=default.packing,
        help="packing algorithm (default: %(default)s)")
    add("--seed", type=int, default=default.seed, help="seed of the packing's tie-breaking and row order (default: %(default)s)")
    add("--force", action="store_true",
        help="rebuild even when a build with the same fingerprint exists (in place: a loader reading it goes on)")
    add("--lock-timeout", type=float, metavar="SECONDS",
        help="how long to wait for another run building the same directory (default: until it finishes)")
    add("--verbose", action="store_true", help="print the traceback of a failure, and Beam's own error logs")
    add("--format", choices=[e.value for e in BuildFormat], default=default.format,
        help="what the rows hold: examples to fine-tune on (sft), or preference pairs of a prompt, a chosen and a "
             "rejected completion (preference; see docs/preference.md) (default: %(default)s)")
    add("--preference-layout", choices=[e.value for e in PreferenceLayout], default=default.preference_layout,
        help="--format preference: prompt + chosen and prompt + rejected as two sequences (separate), or the prompt "
             "once, each completion attending to it (shared-prompt) (default: %(default)s)")
    add("--chosen-column", default=default.chosen_column,
        help="--format preference: column of chosen completions (text, or message lists) (default: %(default)s)")
    add("--rejected-column", default=default.rejected_column,
        help="--format preference: column of rejected completions (default: %(default)s)")
    add("--prompt-column", help="column of prompts (with --response-column; with --format preference: default prompt "
                                "when the source has it, 'none' for chosen and rejected message lists)")
    add("--response-column", help="column of responses, trained on (with --prompt-column)")
    add("--messages-column", help="column of chat messages ([{role, content}, ...] or ShareGPT's [{from, value}, ...]); "
                                   "loss on assistant turns")
    add("--text-column", help="column of plain text; loss on every token")
    add("--chat-template", help="chatml, llama3, mistral or gemma, a Jinja chat template, or a file holding one "
                                "(default: the tokenizer's; Mistral-7B-Instruct-v0.1's for the embedded tokenizer)")
    add("--prompt-template",
        help="how the columns of a row are joined: {prompt} and {response}, or any column by name ({instruction}, "
             "{input}), the last one the response, trained on; {system} is --system-prompt; 'alpaca' is Stanford "
             "Alpaca's template; \\n is a newline (default: '{prompt}\\n\\n{response}')")
    add("--system-prompt", help="prompt/response data: text put at the template's {system}, else before the prompt "
                                "(followed by a blank line); a system turn with --as-chat")
    add("--as-chat", action="store_true",
        help="render prompt/response data as a user turn and an assistant turn with the chat template")
    add("--bos-token", help="token before each prompt/response or text example, or 'none' "
                            "(default: what the tokenizer adds before a sequence)")
    add("--eos-token", help="token after each prompt/response or text example (default: the tokenizer's EOS, "
                            "from its config, post-processor or special tokens)")
    add("--special-tokens", type=_token_list, default=default.special_tokens, metavar="TOKEN,TOKEN,...",
        help="special tokens to add to the tokenizer, each then one token, e.g. '<|endoftext|>,<|im_start|>,<|im_end|>' "
             "for a tiktoken ranks file, which holds none (ids follow the vocabulary; for a model's own ids put them "
             "in NAME.tiktoken.json beside the file)")
    add(
        "--drop-dangling-turns", dest="drop_dangling_turns", action=_DanglingTurns, const=True, nargs=0,
        default=default.drop_dangling_turns,
        help="chat data: drop assistant turns before the first user turn and user turns after the last assistant turn "
             "(conversations split from longer ones), as FastChat does, in {role, content} data too (ShareGPT data: the "
             "default); counted in the report and the manifest")
    add(
        "--keep-dangling-turns", dest="drop_dangling_turns", action=_DanglingTurns, const=False, nargs=0,
        help="chat data: refuse conversations that start with an assistant turn or end with a user turn, ShareGPT "
             "ones too, as bad rows")
    add("--strict", action="store_true",
        help="input present but not used (a source file or column, a chat role the template leaves out) stops the build, "
             "writing nothing, instead of a warning line")
    add("--train-on-prompt", action="store_true", help="train on prompt (or non-assistant) tokens too")
    add("--on-bad-row", choices=[e.value for e in BadRowPolicy], default=default.on_bad_row,
        help="a row that cannot make an example (null or empty text, a broken conversation): stop with an error naming "
             "it, or skip it and list it in rejected.jsonl in the build (default: %(default)s)")
    add("--max-bad-rows", type=bad_row_bound, default=default.max_bad_rows,
        help="with --on-bad-row skip, stop when more rows than this count (100) or fraction of the rows read (0.05; "
             "from 0.0 to 1.0, 1.0 accepting every bad row) are bad (default: %(default)s)")
    add("--verify-tokens", choices=[e.value for e in VerifyTokens], default=default.verify_tokens,
        help="check the built tokens against the tokenizer's own tokenization of each whole example: a seeded sample "
             "of 1,000 examples, all of them, or none (default: %(default)s)")
    add("--on-token-mismatch", choices=[e.value for e in OnTokenMismatch], default=default.on_token_mismatch,
        help="an example whose tokens differ from that reference: stop with an error showing both, or count it in the "
             "report and the manifest (default: %(default)s)")
    add("--batch-size", type=int, default=default.batch_size, help="examples per pipeline element (default: %(default)s)")
    add("--rows-per-shard", type=int, default=default.rows_per_shard, help="rows per shard file (default: about 8M tokens per shard)")
    add("--examples-per-group", type=int, default=default.examples_per_group,
        help="examples packed together as one group; more groups pack in parallel on a cluster at a small cost "
             "in fill (default: 50,000,000)")
    add("--progress", action=argparse.BooleanOptionalAction, default=default.progress, help="show progress bars (default: on)")
    add("--report", action=argparse.BooleanOptionalAction, default=default.report,
        help="write report.png beside the manifest: histograms of example length, examples per row and row fill "
             "(needs matplotlib: pip install 'varpack[plot]'; default: on)")
    return parser


# Beam warnings that say nothing to a pack user: optional GCP clients are missing (packing never
# uses them), and a local worker process has no staging directory (it needs none).
_BEAM_NOISE = ("apitools not found", "No semi_persistent_directory found", "No session file found")


class _QuietBeam(logging.Filter):
    """Drop Beam log noise: the warnings of _BEAM_NOISE, also as multi-process workers relay them,
    and, unless ``verbose``, the errors and tracebacks Beam logs for a failing step, which the
    command reports itself in one line."""

    verbose = False

    def filter(self, record: logging.LogRecord) -> bool:
        from schemas import VarpackError

        message = record.getMessage()
        if any(noise in message for noise in _BEAM_NOISE):
            return False
        if self.verbose:
            return True
        if record.exc_info and VarpackError.behind(record.exc_info[1]) is not None:
            return False
        return not (record.name.startswith("apache_beam") and (record.levelno >= logging.ERROR or "Traceback" in message))


# Runners Beam knows only by module path, with the extra that provides what they import.
_RUNNER_PATHS = {"DaskRunner": ("apache_beam.runners.dask.dask_runner.DaskRunner", "dask")}


def _resolve_runner(beam_args: list[str]) -> list[str]:
    """``beam_args`` with a short runner name Beam lacks spelled out as its module path, and a runner
    given by module path imported, so that its own options (``--dask_client_address``) are known."""
    from pipeline.errors import ConfigError

    args = list(beam_args)
    for i, arg in enumerate(args):
        if arg == "--runner" and i + 1 < len(args):
            at, name, prefix = i + 1, args[i + 1], ""
        elif arg.startswith("--runner="):
            at, name, prefix = i, arg.split("=", 1)[1], "--runner="
        else:
            continue
        path, extra = _RUNNER_PATHS.get(name, (name, None))
        if "." in path:
            try:
                importlib.import_module(path.rsplit(".", 1)[0])
            except ImportError as err:
                hint = f"pip install 'varpack[{extra}]'" if extra else "install the package that provides it"
                raise ConfigError(f"--runner {name} cannot be imported ({err}); {hint}") from err
        args[at] = prefix + path
    return args


def _check_beam_args(beam_args: list[str]) -> None:
    """Reject Beam options Beam does not know, and the multi-threading direct runner."""
    if not beam_args:
        return
    from pipeline.errors import ConfigError

    # A value may follow its option as the next word: --direct_num_workers 2.
    takes_value = [i > 0 and beam_args[i - 1].startswith("--") and "=" not in beam_args[i - 1] for i in range(len(beam_args))]
    stray = [a for a, follows_option in zip(beam_args, takes_value) if not a.startswith("-") and not follows_option]
    if stray:
        raise ConfigError(f"unexpected argument {stray[0]!r}; options start with --")
    from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions

    options = PipelineOptions(beam_args)
    beam_logger = logging.getLogger("apache_beam.options.pipeline_options")
    level = beam_logger.level
    beam_logger.setLevel(logging.ERROR)  # get_all_options warns about the unknown ones we report below
    try:
        unknown = set(options.get_all_options(retain_unknown_options=True)) - set(options.get_all_options())
    finally:
        beam_logger.setLevel(level)
    if unknown:
        names = [a.split("=", 1)[0] for a in beam_args if a.startswith("--")]
        raw = [n for n in names if n[2:].replace("-", "_") in unknown] or sorted(unknown)
        raise ConfigError(f"unknown option {raw[0]} (not a pack option nor an Apache Beam option); see --help")
    if options.view_as(DirectOptions).direct_running_mode == "multi_threading":
        raise ConfigError(
            "--direct_running_mode=multi_threading loses elements through GroupByKey; "
            "use multi_processing (with --direct_num_workers N) or the default in-process runner"
        )


def parse_args(argv: Sequence[str] | None = None, prog: str = PROG) -> PackConfig:
    """The PackConfig the command line describes; unknown --options become Beam options."""
    from pipeline.config import PackConfig

    args, beam_args = make_parser(prog).parse_known_args(argv)
    return PackConfig(**vars(args), beam_args=beam_options(beam_args))


def beam_options(beam_args: Sequence[str]) -> tuple[str, ...]:
    """Apache Beam options as pack passes them on: runners Beam knows only by module path spelled out,
    unknown options and the multi-threading direct runner refused (ConfigError)."""
    resolved = _resolve_runner(list(beam_args))
    _check_beam_args(resolved)
    return tuple(resolved)


def _token_list(value: str) -> tuple[str, ...]:
    """``--special-tokens``: comma-separated tokens."""
    tokens = tuple(token.strip() for token in value.split(",") if token.strip())
    if not tokens:
        raise argparse.ArgumentTypeError("give the tokens separated by commas, e.g. '<|im_start|>,<|im_end|>'")
    return tokens


def _one_line(err: BaseException) -> str:
    """What went wrong, in one line: the VarpackError behind ``err``, else the last line of a worker's
    traceback, else ``err`` itself. An error whose lines are its layout (``lines_kept``) keeps them."""
    from schemas import VarpackError

    found = VarpackError.behind(err)
    if found is not None:
        message = str(found)
    else:
        lines = [line for line in str(err).splitlines() if line.strip()]
        if any(line.startswith("Traceback (most recent call last)") for line in lines):
            message = [line for line in lines if not line[0].isspace()][-1]
        else:
            message = f"{type(err).__name__}: {err}"
        message += " (pass --verbose for the traceback)"
    # Beam appends the step that failed: [while running 'ReadAndEncode']
    message = re.sub(r"\s*\[while running '[^']*'\]", "", message)
    if getattr(found, "lines_kept", False):  # a message laid out in lines (two token sequences to compare)
        return "\n".join(line.rstrip() for line in message.splitlines())
    return " ".join(message.split())


_interrupted = threading.Event()


def _on_interrupt(signum, frame) -> None:
    """Remember Ctrl-C, then raise KeyboardInterrupt as Python does: Beam may wrap it in another error."""
    _interrupted.set()
    raise KeyboardInterrupt


def _is_interrupt(err: BaseException) -> bool:
    return _interrupted.is_set() or isinstance(err, KeyboardInterrupt) or "KeyboardInterrupt" in str(err)


class _HeldThreadErrors:
    """A ``threading.excepthook`` that holds the errors of background threads until the run ends.

    Ctrl-C reaches Beam's multi-process workers too, and Beam's threads that watch them then end
    with errors (a worker exited with return code -2, its control stream broke); after an interrupt
    those are expected and dropped, otherwise they are printed as Python would have.
    """

    def __init__(self) -> None:
        self.held: list[threading.ExceptHookArgs] = []
        self.original = threading.excepthook

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        if not _interrupted.is_set():
            self.held.append(args)

    def release(self) -> None:
        """Print the held errors and restore the hook; after an interrupt, stay quiet until the process exits."""
        if _interrupted.is_set():
            return
        threading.excepthook = self.original
        for args in self.held:
            self.original(args)


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet = _QuietBeam()
    for handler in logging.getLogger().handlers:
        handler.addFilter(quiet)
    _interrupted.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_interrupt)
    thread_errors = _HeldThreadErrors()
    config = None
    try:
        config = parse_args(argv, prog)
        quiet.verbose = config.verbose
        if not config.verbose:
            threading.excepthook = thread_errors
        build_and_report(config)
    except BaseException as err:
        if config is not None and config.verbose:
            traceback.print_exc()
        if _is_interrupt(err):
            print("varpack: interrupted; the next run starts the build again", file=sys.stderr)
            return EXIT_INTERRUPTED
        if isinstance(err, SystemExit):
            raise
        print(f"varpack: error: {_one_line(err)}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        thread_errors.release()
    return 0


def build_and_report(config: PackConfig) -> BuildResult:
    """Build (or reuse) what ``config`` describes and print pack's report of it."""
    from pipeline.build import build
    from pipeline.report.summary import format_report

    result = build(config, write_figure=write_report_figure if config.report else None)
    manifest = result.manifest
    verb = "reusing" if result.reused else "wrote"
    print(f"varpack: {verb} {result.out_dir} (fingerprint {manifest.fingerprint})")
    print(format_report(
        manifest.stats, manifest.capacity, len(manifest.shards), result.out_dir, result.elapsed_s, result.reused,
        result.layout, manifest.rejected, config.verify_tokens,
    ))
    if result.figure is not None:
        print(f"  {'histograms':<12}  {result.figure}")
    return result


def write_report_figure(out_dir: str, manifest: Manifest) -> str | None:
    """Write report.png beside the manifest and return its path; without matplotlib, say so once and how to get it."""
    from pipeline.report.figures import missing_matplotlib, write_report
    from pipeline.report.profile import read_profile
    from schemas import WriteError

    missing = missing_matplotlib()
    if missing:
        print(f"varpack: report figure skipped: {missing} (or pass --no-report)", file=sys.stderr)
        return None
    try:
        return write_report(read_profile(out_dir, manifest), manifest, out_dir)
    except (OSError, WriteError) as err:  # a read-only build directory, a full disk
        print(f"varpack: report figure not written ({err}); the build itself is complete", file=sys.stderr)
        return None


if __name__ == "__main__":
    code = main()
    if code == EXIT_INTERRUPTED:
        from pipeline.cli import exit_process

        exit_process(code)
    sys.exit(code)
