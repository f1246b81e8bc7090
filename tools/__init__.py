"""Developer tools beside the bundle, never shipped in it (runfab/shipping.py leaves tools/ out).

    bundle/       what proves a bundle before upload: package, check, emulate
    bench/        measurements: the trainer's experiments, the host pipeline, all-reduce, traces, rank balance, shards
    data/         what builds the bundled data: the sample, GPT-2's tokenizer.json
    report.py     one HTML page of a run's output
    compare.py    whether runs are comparable, then one HTML page of their differences and curves
    evaluate.py   an exported model's exact cross-entropy on NDJSON records, as training validates
    sample.py     text sampled from an exported model
    processes.py  the processes a tool starts: they die with it, and their memory is read as RunFab counts it

The tools may import the training modules (train, config, model, pipeline, runtime, callbacks);
training never imports a tool. One way to run one, from the project root: ``python -m tools NAME
[ARGS]``; ``python -m tools --help`` lists them.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Run ``argv[0]``'s entry of ``commands`` (name -> ("module:function", help line)) on the rest of ``argv``.

    A module is imported only when its command runs, so ``--help`` is instant; the function defaults
    to ``main``. A missing or unknown name, or a tool's dependency that is not installed (the pyproject
    extra "tools"), is one line on stderr and exit status 2.
    """
    usage = f"usage: {prog} {{{','.join(commands)}}} [ARGS]"
    if argv[:1] in (["-h"], ["--help"]):
        width = max(map(len, commands))
        rows = [f"  {name:<{width}}  {summary}" for name, (_, summary) in commands.items()]
        print("\n".join([usage, "", "commands:", *rows, "", f"{prog} COMMAND --help describes one command."]))
        return 0
    if not argv or argv[0] not in commands:
        found = f"got {argv[0]!r}" if argv else "got none"
        print(f"{usage}: expected a command, {found} (--help lists them)", file=sys.stderr)
        return 2
    module, _, function = commands[argv[0]][0].partition(":")
    try:
        entry = getattr(importlib.import_module(module), function or "main")
    except ModuleNotFoundError as e:
        package = (e.name or "").partition(".")[0]
        if not package or (PROJECT_ROOT / package).exists() or (PROJECT_ROOT / f"{package}.py").exists():
            raise  # the project's own module: a bug, not an installation to complete
        print(f"{prog} {argv[0]}: needs the package {package!r}, which is not installed; the tools' dependencies: "
              "pip install -r requirements-dev.txt (or the pyproject extra \"tools\")", file=sys.stderr)
        return 2
    return entry(argv[1:])
