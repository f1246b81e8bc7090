"""``python -m tools COMMAND [ARGS]``: the bundle tools under one entry point."""

from __future__ import annotations

import importlib
import sys

# command -> module whose main(argv) runs it
COMMANDS = {
    "package": "tools.package",  # write the upload ZIP (--dry-run lists it)
    "check": "tools.check",  # check a ZIP or folder against the contract, as RunFab runs it
    "emulate": "tools.emulate",  # RunFab's probe-then-train procedure on this machine
    "report": "tools.report",  # one HTML page of a run's output
    "tokenizer": "tokenizer",  # train a byte-level BPE tokenizer.json from NDJSON
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        found = f"got {argv[0]!r}" if argv else "got none"
        print(f"usage: python -m tools {{{','.join(COMMANDS)}}} [ARGS]: expected a command, {found}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
