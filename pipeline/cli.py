"""``varpack COMMAND ...``: one entry point for the commands, each also a ``python -m`` module.

    varpack pack ...      python -m pipeline.pack: pack a dataset into shards
    varpack inspect ...   python -m pipeline.inspect: what a build holds (of a mixture file, its plan:
                          python -m loaders.mixture)
    varpack check ...     python -m loaders.check: the isolation self-check (read side only); with --ranks K
                          --grad-accum G, data-parallel gradients against one process's

Commands are imported by module name only when run, so ``varpack check`` works on a training
box that has the read side (torch, pyarrow, numpy) but no Apache Beam, datasets or tokenizers.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130

COMMANDS = {
    "pack": ("pipeline.pack", "pack a dataset into content-addressed shards of packed rows"),
    "inspect": ("pipeline.inspect", "show what a build holds: summary, decoded rows, histograms"),
    "check": ("loaders.check", "check that a model, attention backend and settings keep packed examples apart; with "
                               "--ranks K --grad-accum G, that K ranks' gradients equal one process's"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "usage: varpack COMMAND [options]  (varpack COMMAND --help for its options)\n\ncommands:\n" + "\n".join(lines)


# The options of ``inspect`` (of a build or of a mixture file) that take a value, so that it is not the file.
_INSPECT_VALUE_OPTIONS = ("--steps", "--batch-rows", "--seed", "--plot", "--rows", "--tokenizer")


def _module_name(command: str, rest: list[str]) -> str:
    """The module that runs ``command``: ``inspect`` of a mixture file (a file that is not a manifest, whatever
    the options before it) shows the mixture's plan, which the read side computes (``loaders.mixture``)."""
    if command == "inspect":
        target = _first_positional(rest)
        if target is not None and os.path.isfile(target) and not _is_manifest(target):
            return "loaders.mixture"
    return COMMANDS[command][0]


def _first_positional(args: list[str]) -> str | None:
    """The first argument that is neither an option nor an option's value (``--`` ends the options)."""
    remaining = iter(args)
    for arg in remaining:
        if arg == "--":
            return next(remaining, None)
        if arg.startswith("-") and arg != "-":
            # argparse takes any unambiguous prefix of an option: --step is --steps.
            if arg.startswith("--") and "=" not in arg and any(o.startswith(arg) for o in _INSPECT_VALUE_OPTIONS):
                next(remaining, None)
            continue
        return arg
    return None


def _is_manifest(path: str) -> bool:
    """Whether the file at ``path`` is a build's manifest (by its content, not its name)."""
    from schemas.manifest import FORMAT_NAME

    try:
        with open(path, "rb") as file:
            data = json.loads(file.read())
    except (OSError, ValueError, RecursionError):  # unreadable, not UTF-8 or not JSON: not a manifest
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT_NAME


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_USAGE
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"varpack: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    module_name = _module_name(command, rest)
    try:
        code = _run(command, module_name, rest)
    except KeyboardInterrupt:
        print("varpack: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    if argv is None and code == EXIT_INTERRUPTED:
        exit_process(code)
    return code


def _run(command: str, module_name: str, rest: list[str]) -> int:
    """Import the command's module and run it (its own main handles Ctrl-C once it runs)."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            print(f"varpack: error: varpack {command} needs {err.name}, which is not installed ({err})", file=sys.stderr)
        else:
            print(f"varpack: error: varpack {command} is not in this installation (no module {module_name}); "
                  "install a varpack that has it", file=sys.stderr)
        return EXIT_ERROR
    return module.main(rest, prog=f"varpack {command}")


def exit_process(code: int) -> NoReturn:
    """End the process now with ``code``, its output flushed.

    After Ctrl-C, ``sys.exit(130)`` is not enough: CPython ends the process by SIGINT instead
    when the KeyboardInterrupt, though caught, passed through code it ran with ``PyRun_*`` (some
    extension modules' imports do).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
