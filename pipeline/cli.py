"""``varpack COMMAND ...``: one entry point for the commands, each also a ``python -m`` module.

    varpack pack ...      python -m pipeline.pack: pack a dataset into shards
    varpack inspect ...   python -m pipeline.inspect: what a build holds
    varpack check ...     python -m loaders.check: the isolation self-check (read side only)

Commands are imported by module name only when run, so ``varpack check`` works on a training
box that has the read side (torch, pyarrow, numpy) but no Apache Beam, datasets or tokenizers.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

EXIT_ERROR, EXIT_USAGE = 1, 2

COMMANDS = {
    "pack": ("pipeline.pack", "pack a dataset into content-addressed shards of packed rows"),
    "inspect": ("pipeline.inspect", "show what a build holds: summary, decoded rows, histograms"),
    "check": ("loaders.check", "check that a model, attention backend and settings keep packed examples apart"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "usage: varpack COMMAND [options]  (varpack COMMAND --help for its options)\n\ncommands:\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else EXIT_USAGE
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"varpack: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return EXIT_USAGE
    module_name = COMMANDS[command][0]
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


if __name__ == "__main__":
    sys.exit(main())
