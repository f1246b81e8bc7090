"""``python -m tools COMMAND [ARGS]``: the bundle tools under one entry point."""

from __future__ import annotations

import importlib
import signal
import sys

# command -> (module whose main(argv) runs it, the line --help shows for it)
COMMANDS = {
    "package": ("tools.package", "write the upload ZIP (--dry-run lists it)"),
    "check": ("tools.check", "check a ZIP or folder against the contract, as RunFab runs it"),
    "emulate": ("tools.emulate", "RunFab's probe-then-train procedure on this machine"),
    "report": ("tools.report", "one HTML page of a run's output"),
    "tokenizer": ("tokenizer", "train a byte-level BPE tokenizer.json from NDJSON"),
    "prepare": ("tools.prepare", "tokenize NDJSON files into packed rows for data.source litdata (LitData chunks)"),
}
USAGE = f"usage: python -m tools {{{','.join(COMMANDS)}}} [ARGS]"


def help_text() -> str:
    """The commands, one line each; modules are not imported, so help is instant."""
    width = max(map(len, COMMANDS))
    rows = [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join([USAGE, "", "commands:", *rows, "", "python -m tools COMMAND --help describes one command."])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(help_text())
        return 0
    if not argv or argv[0] not in COMMANDS:
        found = f"got {argv[0]!r}" if argv else "got none"
        print(f"{USAGE}: expected a command, {found} (--help lists them)", file=sys.stderr)
        return 2
    name = argv[0]
    # SIGTERM unwinds like Ctrl-C, so a sandbox, staging folder or child process is cleaned up either way.
    signal.signal(signal.SIGTERM, lambda signum, frame: _raise_interrupt())
    try:
        return importlib.import_module(COMMANDS[name][0]).main(argv[1:])
    except KeyboardInterrupt:
        print(f"python -m tools {name}: interrupted; what it had started was stopped and removed", file=sys.stderr)
        return 130
    except OSError as error:
        if error.filename is None:  # not about a path the user gave: a defect, with its traceback
            raise
        print(f"python -m tools {name}: {error}", file=sys.stderr)
        return 2


def _raise_interrupt() -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
