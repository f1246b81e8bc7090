"""``python -m tools check [BUNDLE.zip | DIR]``: check a bundle against the RunFab contract before uploading.

RunFab imports ``train.py`` from a read-only ``/workspace`` and runs each memory probe in a fresh
subprocess with a 120-second limit; a bundle that reads stdin, prints, writes files or leaves
processes at those moments breaks a run in ways that are hard to diagnose from the platform's side.
This command reproduces those moments locally, each in a fresh interpreter (``sys.executable``)
whose every possible side effect lands somewhere it can be inspected afterwards:

- the bundle is unpacked (a ZIP) or copied (a directory) into a temporary folder and made read-only;
- the working directory, ``RUNFABRIC_OUTPUT``, ``HOME`` and ``TMPDIR`` are empty temporary folders;
- stdin is a pipe carrying NDJSON records, which the child reads back from fd 0 afterwards: any
  byte missing was consumed (Python's buffered ``sys.stdin`` takes a whole chunk for one line);
- stdout goes to a file that must stay empty (RunFab reads metric lines from it);
- ``CUDA_VISIBLE_DEVICES=""`` hides GPUs unless ``--cuda`` is given, and ``PYTHONDONTWRITEBYTECODE=1``
  keeps the interpreter's own byte-code cache from counting as a write into the bundle (running as
  root, a read-only folder still accepts writes, so writes are found by comparing snapshots).

Checks, in order: ``layout``, ``archive``, ``batch`` and ``hooks`` read the bundle
(static_checks.py); ``import`` and ``probe`` run it (sandbox.py, child.py) and are judged on what
the children did (judge.py). Exit status 0 when every check passes, 1 otherwise, 2 for a usage error.

Environment variables other than the ones above pass through to the children, so a project's
own switches work: this project reads ``RUNFAB_CONFIG``. On a machine without a GPU, check with the
small config, ``RUNFAB_CONFIG=conf/smoke.yaml python -m tools check``; the reference model of
``conf/config.yaml`` probed on a CPU can take longer than RunFab's 120 s although it fits a GPU easily.

A directory is checked as the files ``python -m tools package`` would ship from it
(``shipping.shipped_files``), so checking the project checks what the ZIP would hold. The bundle's
code runs in the child processes only; this process imports torch only to count the visible GPUs.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

from runfab.limits import PROBE_SECONDS
from tools.bundle.judge import IMPORT_GRACE, judge_import, judge_probe
from tools.bundle.sandbox import BundleSource, Sandbox, UsageError, run_child
from tools.bundle.static_checks import (
    FAIL, SKIP, Result, batch_literal, check_archive, check_batch, check_hooks, check_layout, parse_train,
)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_IMPORT_LIMIT = 60.0


@dataclass
class Options:
    gpus: int | None = None  # None: the GPUs visible on this machine (1 when none)
    microbatch: int | None = None  # None: 1, which divides every effective batch
    import_limit: float = DEFAULT_IMPORT_LIMIT
    probe_limit: float | None = None  # None: RunFab's (runfab_limits.PROBE_SECONDS)
    cuda: bool = False  # keep the caller's CUDA_VISIBLE_DEVICES in the children
    keep: bool = False  # leave the temporary folders for inspection


# ----------------------------------------------------------------------------- driver


def check_bundle(path: str | Path, options: Options | None = None, out: TextIO | None = None) -> list[Result]:
    """Run every check on the bundle at ``path`` (a ZIP or a directory) and return the verdicts.

    Verdicts are printed on ``out`` as they are reached; a check whose prerequisite failed is
    SKIPped rather than failed again, so the first FAIL is the one to fix.
    """
    options = options or Options()
    if options.probe_limit is None:
        options = replace(options, probe_limit=PROBE_SECONDS)
    out = out or sys.stdout
    visible = cuda_gpus() if options.cuda else None  # refused before anything runs when there are none
    source = BundleSource.open(Path(path).resolve())
    gpus, gpus_from = ((options.gpus, "--gpus") if options.gpus
                       else (visible or max(1, visible_gpus()), "visible on this machine"))
    emit(out, f"RunFab contract check of {source.path} ({source.kind}, {len(source.files)} files"
              + (f"; {source.selection}" if source.selection else "") + ")")
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)") if options.cuda else '""'
    config = os.environ.get("RUNFAB_CONFIG")
    emit(out, f"  children: fresh {sys.executable}, read-only copy, empty cwd, HOME, TMPDIR and RUNFABRIC_OUTPUT, "
              f"CUDA_VISIBLE_DEVICES={devices}" + (f", RUNFAB_CONFIG={config}" if config else ""))
    results: list[Result] = []

    def record(result: Result) -> Result:
        results.append(result)
        show(out, result, len(results))
        return result

    layout = record(check_layout(source))
    record(check_archive(source))
    if not layout.passed:
        for key in ("batch", "hooks", "import", "probe"):
            record(Result(key, SKIP, "not run: no train.py at the bundle root"))
        return results

    with Sandbox(source, options.keep) as sandbox:
        tree, parse_error = parse_train(sandbox.bundle)
        progress(out, f"importing train.py in a fresh process (limit {options.import_limit:g} s) ...")
        import_run = run_child(sandbox, "import", options.cuda, 0, options.import_limit + IMPORT_GRACE)
        kept = [sandbox.base]
    batch = record(check_batch(tree, parse_error, gpus, gpus_from, import_run))
    record(check_hooks(tree, parse_error, import_run))
    import_result = record(judge_import(import_run, options.import_limit))

    value, _ = batch_literal(tree) if tree is not None else (None, "")
    microbatch = options.microbatch or 1
    if options.microbatch and value and batch.passed and (value // gpus) % options.microbatch:
        record(Result("probe", SKIP, f"not run: --microbatch {options.microbatch} is not a split RunFab would try; "
                                     f"microbatch x accumulation x {gpus} GPU(s) must equal {value}"))
    elif import_run.report is None or "import_error" in import_run.report:
        record(Result("probe", SKIP, "not run: train.py did not import (see import)"))
    elif not import_run.report["hooks"]["probe_batch"].get("callable"):
        record(Result("probe", SKIP, "not run: train.py has no probe_batch function to call (see hooks)"))
    else:
        with Sandbox(source, options.keep) as sandbox:
            progress(out, f"calling probe_batch({microbatch}) in a fresh process (limit {options.probe_limit:g} s) ...")
            probe_run = run_child(sandbox, "probe", options.cuda, microbatch, options.probe_limit)
            kept.append(sandbox.base)
        record(judge_probe(probe_run, options.cuda, microbatch, import_result))
    if options.keep:
        emit(out, f"  kept for inspection: {', '.join(map(str, kept))}")
    return results


def visible_gpus() -> int:
    """GPUs CUDA shows this process (CUDA_VISIBLE_DEVICES honoured); 0 without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count()
    except Exception:  # a broken driver counts as no GPU here; the probe would tell the rest
        return 0


def cuda_gpus() -> int:
    """The GPUs ``--cuda`` hands to the children. None is a usage error: the children would run on
    the CPU, and their pass would be taken for the GPU run that was asked for."""
    gpus = visible_gpus()
    if not gpus:
        devices = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if devices is None else f" (CUDA_VISIBLE_DEVICES={devices!r})"
        raise UsageError(f"--cuda: no CUDA GPU is visible on this machine{shown}; leave out --cuda to run on the CPU")
    return gpus


def show(out: TextIO, result: Result, index: int) -> None:
    emit(out, f"{result.verdict}  [{index}] {result.key}: {result.reason}")
    for note in result.notes:
        emit(out, f"        note: {note}")


def progress(out: TextIO, message: str) -> None:
    emit(out, f"  ... {message}")


def emit(out: TextIO, line: str) -> None:
    print(line, file=out, flush=True)


def summary(results: list[Result]) -> str:
    width = 100
    rows = [f"{'#':>2}  {'check':<8} {'verdict':<7} {'seconds':>7}  reason"]
    for index, result in enumerate(results, start=1):
        seconds = f"{result.seconds:7.1f}" if result.seconds is not None else f"{'-':>7}"
        reason = result.reason if len(result.reason) <= width else result.reason[:width - 3] + "..."
        rows.append(f"{index:>2}  {result.key:<8} {result.verdict:<7} {seconds}  {reason}")
    failed = [r.key for r in results if r.verdict == FAIL]
    skipped = [r.key for r in results if r.verdict == SKIP]
    if not failed and not skipped:
        rows.append(f"All {len(results)} checks passed.")
    else:
        rows.append(f"{len(results) - len(failed) - len(skipped)} of {len(results)} checks passed"
                    + (f"; failed: {', '.join(failed)}" if failed else "")
                    + (f"; skipped: {', '.join(skipped)}" if skipped else "") + ".")
    return "\n".join(rows)


def parse_args(argv: list[str]) -> tuple[Path, Options]:
    parser = argparse.ArgumentParser(
        prog="python -m tools check",
        description="Check a bundle the way RunFab runs it: layout, sizes, the literal EFFECTIVE_BATCH_SIZE, the "
                    "hooks, a side-effect-free import and one probe, each in a fresh process from a read-only copy.",
        epilog="On a machine without a GPU use a small config so the probe fits the limit: "
               "RUNFAB_CONFIG=conf/smoke.yaml python -m tools check. Other environment variables pass through.",
    )
    parser.add_argument("bundle", nargs="?", default=str(PROJECT_ROOT),
                        help="a ZIP to upload or a directory (default: this project's root)")
    parser.add_argument("--gpus", type=positive_int,
                        help="GPU count the batch must divide by (default: the visible GPUs, 1 if none)")
    parser.add_argument("--microbatch", type=positive_int, help="microbatch to probe (default: 1)")
    parser.add_argument("--import-limit", type=positive_float, default=DEFAULT_IMPORT_LIMIT, metavar="SECONDS",
                        help=f"longest acceptable `import train` (default: {DEFAULT_IMPORT_LIMIT:g})")
    parser.add_argument("--probe-limit", type=positive_float, metavar="SECONDS",
                        help="limit for the whole probe process, import included "
                             f"(default: RunFab's {PROBE_SECONDS:g})")
    parser.add_argument("--cuda", action="store_true",
                        help="let the children see this machine's GPUs (default: CUDA_VISIBLE_DEVICES=\"\")")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folders and print where they are")
    args = parser.parse_args(argv)
    return Path(args.bundle), Options(gpus=args.gpus, microbatch=args.microbatch, import_limit=args.import_limit,
                                      probe_limit=args.probe_limit, cuda=args.cuda, keep=args.keep)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text}")
    return value


def main(argv: list[str]) -> int:
    """``python -m tools check``: 0 when every check passes, 1 when any does not, 2 for usage."""
    bundle, options = parse_args(argv)
    try:
        results = check_bundle(bundle, options)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("\n" + summary(results), file=sys.stdout, flush=True)
    return 0 if all(result.passed for result in results) else 1
