"""``python -m tools NAME [ARGS]``: every tool under one entry point."""

from __future__ import annotations

import sys

from runfab.lifetime import on_stop_signals
from tools import dispatch

# name -> ("module:function" run with the remaining arguments, the line --help shows for it)
COMMANDS = {
    "package": ("tools.bundle.package", "write the upload ZIP (--dry-run lists it)"),
    "check": ("tools.bundle.check", "check a ZIP or folder against the contract, as RunFab runs it"),
    "emulate": ("tools.bundle.emulate", "RunFab's probe-then-train procedure on this machine"),
    "report": ("tools.report", "one HTML page of a run's output"),
    "bench": ("tools.bench", "measure the trainer, its input and its ranks (bench --help lists the experiments)"),
    "tokenizer": ("tools.data.train_tokenizer", "train a byte-level BPE tokenizer.json from NDJSON"),
    "gpt2-tokenizer": ("tools.data.build_gpt2_tokenizer", "rebuild conf/gpt2/tokenizer.json from OpenAI's GPT-2 files"),
    "sample-data": ("tools.data.make_sample_data", "rebuild data/sample.jsonl from the standard library's docstrings"),
    "prepare": ("tools.data.prepare", "tokenize NDJSON files into packed rows for data.source litdata (LitData chunks)"),
    "compare": ("tools.compare", "say whether runs are comparable, then one HTML page of their differences and curves"),
    "evaluate": ("tools.evaluate", "an exported model's exact cross-entropy on NDJSON records, as training validates"),
    "sample": ("tools.sample", "text from an exported model (transformers), on stdout"),
}
PROG = "python -m tools"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C, so a sandbox, staging folder or child process is cleaned up either way.
    restore = on_stop_signals(raise_interrupt)
    try:
        return dispatch(PROG, COMMANDS, argv)
    except KeyboardInterrupt:
        print(f"{PROG} {argv[0]}: interrupted; what it had started was stopped and removed", file=sys.stderr)
        return 130
    except OSError as error:
        if error.filename is None:  # not about a path the user gave: a defect, with its traceback
            raise
        print(f"{PROG} {argv[0]}: {error}", file=sys.stderr)
        return 2
    finally:
        restore()


def raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
