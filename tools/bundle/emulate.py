"""``python -m tools emulate [BUNDLE] < records.jsonl``: RunFab's procedure, run on this machine.

1. Unpack the bundle read-only, as RunFab's /workspace (sandbox.Sandbox).
2. Probe each candidate microbatch (the divisors of EFFECTIVE_BATCH_SIZE / GPUs, smallest first)
   in a fresh process with RunFab's 120 s limit; stop at the first failure; take the largest fit.
3. Call ``train(microbatch, accumulation)`` in a fresh process with this process's stdin streamed
   into a pipe by a thread (as RunFab's worker streams the dataset), ``RUNFABRIC_OUTPUT`` set and
   TMPDIR in the sandbox, while a watchdog samples host memory of the whole process tree (PSS, as
   a memory cgroup charges it; RSS beside it), the size of TMPDIR and of the output, and stops the
   run (as the platform would) when one goes over RunFab's budget: 8 GiB RAM, 256 MiB /tmp, 3 GiB
   output.
4. Write a summary, SVG plots of loss and throughput over ``elapsed_seconds`` from the metric
   lines, as the platform's graphs show them, and ``report.html``: tools/report.py's page of the
   emulated run's output root, written before the sandbox is removed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from runfab import created_files, limits as runfab_limits
from runfab.limits import GIB, MIB
from runfab.shipping import folder_bytes
from tools import processes
from tools import report as run_report
from tools.bundle import check
from tools.bundle.sandbox import BundleSource, Sandbox, UsageError, feed
from tools.bundle.static_checks import batch_literal, parse_train

RAM_BUDGET = runfab_limits.RAM_BYTES
TMP_BUDGET = runfab_limits.TMP_BYTES
OUTPUT_BUDGET = runfab_limits.OUTPUT_BYTES
PROBE_LIMIT = runfab_limits.PROBE_SECONDS


@dataclass
class Usage:
    """Peaks seen by the watchdog, and the budget that stopped the run, if any."""

    peak_pss_bytes: int = 0  # what the RAM budget is checked against
    peak_rss_bytes: int = 0  # shared libraries counted once per process: reported, not budgeted
    peak_tmp_bytes: int = 0
    peak_output_bytes: int = 0
    exceeded: str | None = None


@dataclass
class Emulation:
    gpus: int
    effective_batch_size: int
    probes: list[dict] = field(default_factory=list)
    microbatch: int | None = None
    accumulation: int | None = None
    train_exit_code: int | None = None
    train_seconds: float | None = None
    usage: Usage = field(default_factory=Usage)
    metric_lines: int = 0


def candidates(effective_batch_size: int, gpus: int) -> list[int]:
    per_gpu = effective_batch_size // gpus
    return [k for k in range(1, per_gpu + 1) if per_gpu % k == 0]


def probe(sandbox: Sandbox, microbatch: int, cuda: bool, limit: float) -> dict:
    """One candidate in a fresh process, as RunFab runs it; host memory of its tree sampled meanwhile."""
    command = [sys.executable, "-c", f"import train; train.probe_batch({microbatch})"]
    start = time.monotonic()
    measured: dict = {}
    process = processes.start(command, cwd=sandbox.bundle, env=sandbox.env(cuda), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    sampler = processes.MemorySampler(process)  # no budget: a probe is short, and RunFab's own
    sampler.start()
    try:
        _, err = process.communicate(timeout=limit)
        stderr = err.decode("utf-8", "replace").strip().splitlines()
        ok, reason = process.returncode == 0, stderr[-1:]
        measured = probe_figures(stderr)
    except subprocess.TimeoutExpired:
        processes.kill_group(process.pid)
        process.communicate()
        ok, reason = False, [f"over the {limit:.0f} s limit"]
    sampler.join()
    return {"microbatch": microbatch, "fits": ok, "seconds": round(time.monotonic() - start, 1),
            "reason": None if ok else (reason[0] if reason else "failed"),
            "peak_host_pss_gib": round(sampler.peak_pss / GIB, 2),
            "peak_host_rss_gib": round(sampler.peak_rss / GIB, 2), **measured}


def probe_figures(stderr: list[str]) -> dict:
    """Peak GPU memory from the trainer's ``probe figures: {...}`` log line (JSON), when it wrote one."""
    for line in reversed(stderr):
        _, marker, rest = line.partition(" probe figures: ")
        if marker:
            try:
                figures = json.loads(rest)
            except ValueError:
                return {}
            return {k: v for k, v in figures.items() if k.startswith("peak_")} if isinstance(figures, dict) else {}
    return {}


def enforce_budgets(process: subprocess.Popen, sandbox: Sandbox, usage: Usage) -> Callable[[dict], None]:
    """What the watchdog does after each sample of the tree's memory: keep the peaks of RAM (PSS),
    TMPDIR and the output, and past a budget, record which and stop the run."""
    def size(folder: Path) -> int:
        try:
            return folder_bytes(folder)
        except OSError:  # a file removed while it was measured
            return 0

    def check_sample(totals: dict) -> None:
        usage.peak_rss_bytes = max(usage.peak_rss_bytes, totals["Rss"])
        for name, limit, attribute, value in (
                ("RAM (PSS)", RAM_BUDGET, "peak_pss_bytes", totals["Pss"]),
                ("/tmp", TMP_BUDGET, "peak_tmp_bytes", size(sandbox.tmp)),
                ("output", OUTPUT_BUDGET, "peak_output_bytes", size(sandbox.output))):
            setattr(usage, attribute, max(getattr(usage, attribute), value))
            if value > limit and usage.exceeded is None:
                usage.exceeded = f"{name}: {value / MIB:.0f} MiB > {limit / MIB:.0f} MiB"
                processes.kill_group(process.pid)

    return check_sample


def run_training(sandbox: Sandbox, microbatch: int, accumulation: int, cuda: bool,
                 metrics_path: Path, out: TextIO, usage: Usage, stdin) -> tuple[int, float, int]:
    """train() with the records on ``stdin``; metric lines go to ``out`` and a file, as RunFab collects them."""
    command = [sys.executable, "-c", f"import train; train.train({microbatch}, {accumulation})"]
    start = time.monotonic()
    # No records given (a terminal, or stdin closed): the child gets the same and says what it does then.
    terminal = stdin is None or stdin.isatty()
    process = processes.start(command, cwd=sandbox.bundle, env=sandbox.env(cuda),
                              stdin=stdin if terminal else subprocess.PIPE, stdout=subprocess.PIPE,
                              start_new_session=True)
    streaming = None if terminal else stream_into(stdin, process.stdin)
    watchdog = processes.MemorySampler(process, check=enforce_budgets(process, sandbox, usage))
    watchdog.start()
    lines = 0
    with created_files.open_created(metrics_path) as saved:
        for raw in process.stdout:
            line = raw.decode("utf-8", "replace")
            saved.write(line)
            out.write(line)
            out.flush()
            lines += 1
    code = process.wait()
    watchdog.join()
    if streaming is not None:
        streaming.join(timeout=5)
    return code, time.monotonic() - start, lines


STREAM_CHUNK_BYTES = 1 << 16


def stream_into(source, pipe) -> threading.Thread:
    """Copy ``source`` (this process's stdin) into ``pipe`` (the child's) from a thread, then close it.

    RunFab's worker writes the dataset into a pipe while training reads it. A file handed over as
    stdin would be there whole for every read, which RunFab's stdin never is, so the emulation
    streams it. The copy ends at the end of ``source`` (the child then sees the end of
    input) or when the child stops reading."""
    chunks = iter(functools.partial(os.read, source.fileno(), STREAM_CHUNK_BYTES), b"")
    thread = threading.Thread(target=feed, args=(pipe, chunks), name="emulate-stdin", daemon=True)
    thread.start()
    return thread


# ----------------------------------------------------------------------------- report

PLOT_FILES = ("loss", "throughput")  # the platform's two graphs, as SVG files of their own


def write_report(output_root: Path, folder: Path) -> Path:
    """report.html of the emulated run, and its loss and throughput plots as SVG files.

    The metric lines are the trainer's own ``run/metrics.jsonl`` when it wrote one, else the
    stdout lines this emulation saved in ``folder``.
    """
    written = output_root / run_report.METRICS_FILE
    metrics = written if written.is_file() else folder / "metrics.jsonl"
    lines = run_report.read_metrics(metrics)
    for plot in run_report.PLOTS:
        if plot.slug in PLOT_FILES:
            run_report.write_plot_svg(plot, lines, folder / f"{plot.slug}.svg")
    record = output_root / "model" / "run_record.json"
    if record.is_file():  # the sandbox goes away; the record (summary, input counts) stays with the report
        created_files.write_bytes(folder / "run_record.json", record.read_bytes())
    return run_report.write_report(output_root, folder / "report.html", metrics)


# ----------------------------------------------------------------------------- command


def emulate(bundle: Path, report: Path, cuda: bool, gpus: int | None, microbatches: list[int] | None,
            out: TextIO, log: TextIO, stdin=None) -> Emulation:
    visible = check.cuda_gpus() if cuda else 1
    if gpus is not None and gpus > visible:  # the trainer would refuse the split only after every probe
        raise UsageError(f"--gpus {gpus}, but the children see {visible} device(s)"
                               + ("" if cuda else ": without --cuda they train on the CPU, as one process"))
    source = BundleSource.open(bundle)
    with Sandbox(source, keep=False) as sandbox:
        tree, error = parse_train(sandbox.bundle)
        effective, why = batch_literal(tree) if tree is not None else (None, error)
        if effective is None:
            raise UsageError(f"cannot read EFFECTIVE_BATCH_SIZE: {why}")
        gpus = gpus or visible
        planned = candidates(effective, gpus)
        if unusable := [k for k in microbatches or [] if k not in planned]:
            raise UsageError(f"--microbatches {' '.join(map(str, unusable))}: RunFab probes only microbatches that "
                                   f"divide EFFECTIVE_BATCH_SIZE ({effective}) / {gpus} GPU(s): "
                                   f"{', '.join(map(str, planned))}")
        report.mkdir(parents=True, exist_ok=True)
        result = Emulation(gpus=gpus, effective_batch_size=effective)
        where = "the GPUs" if cuda else "the CPU (no --cuda; a CPU-sized config, e.g. RUNFAB_CONFIG=conf/smoke.yaml, is quick)"
        print(f"emulate: probing microbatch {', '.join(map(str, microbatches or planned))} in fresh processes, "
              f"at most {PROBE_LIMIT:.0f} s each, on {where}", file=log, flush=True)
        for k in microbatches or planned:
            outcome = probe(sandbox, k, cuda, PROBE_LIMIT)
            result.probes.append(outcome)
            print(f"emulate: probe microbatch {k}: {'fits' if outcome['fits'] else 'fails'} "
                  f"({outcome['seconds']} s, host PSS {outcome['peak_host_pss_gib']:.2f} GiB, RSS "
                  f"{outcome['peak_host_rss_gib']:.2f} GiB){'' if outcome['fits'] else ': ' + outcome['reason']}",
                  file=log)
            if not outcome["fits"]:
                break
        fitting = [p["microbatch"] for p in result.probes if p["fits"]]
        if not fitting:
            raise UsageError("no candidate microbatch fits: RunFab would reject this bundle")
        result.microbatch = max(fitting)
        result.accumulation = effective // (result.microbatch * gpus)
        print(f"emulate: train({result.microbatch}, {result.accumulation}) on {gpus} GPU(s)", file=log)
        code, seconds, lines = run_training(sandbox, result.microbatch, result.accumulation, cuda,
                                            report / "metrics.jsonl", out, result.usage, stdin or sys.stdin)
        result.train_exit_code, result.train_seconds, result.metric_lines = code, round(seconds, 1), lines
        model = sandbox.output / "model"
        result_files = sorted(p.name for p in model.iterdir()) if model.is_dir() else []
        page = write_report(sandbox.output, report)
    summary = asdict(result) | {"model_files": result_files}
    created_files.write_text(report / "summary.json", json.dumps(summary, indent=2) + "\n")
    u = result.usage
    print(f"emulate: exit {code} after {result.train_seconds} s, {lines} metric lines; peaks: RAM "
          f"{u.peak_pss_bytes / GIB:.2f} GiB PSS ({u.peak_rss_bytes / GIB:.2f} GiB RSS), "
          f"/tmp {u.peak_tmp_bytes / MIB:.1f} MiB, output "
          f"{u.peak_output_bytes / MIB:.1f} MiB{'; STOPPED: ' + u.exceeded if u.exceeded else ''}; "
          f"report {page}, summary and plots in {report}", file=log)
    return result


def microbatch_value(text: str) -> int:
    """One value of ``--microbatches``. The list takes every word up to the next option, so a word that is
    not a count is most likely the bundle, and the message says how to place it."""
    try:
        return check.positive_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a microbatch (a whole number); name the bundle before "
                                         "--microbatches, or end the list with --") from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools emulate", description=__doc__.splitlines()[0])
    parser.add_argument("bundle", nargs="?", default=str(check.PROJECT_ROOT), help="ZIP or folder")
    parser.add_argument("--report", type=Path, default=Path("emulate-report"), help="where summary and plots go")
    parser.add_argument("--cuda", action="store_true", help="let the children see the GPUs (default: CPU only)")
    parser.add_argument("--gpus", type=check.positive_int,
                        help="GPU count to plan for (default: visible GPUs with --cuda, else 1)")
    parser.add_argument("--microbatches", type=microbatch_value, nargs="+", metavar="K",
                        help="candidates to probe instead of every divisor (bundle first, or after --)")
    args = parser.parse_args(argv)
    try:
        result = emulate(Path(args.bundle), args.report, args.cuda, args.gpus, args.microbatches, sys.stdout, sys.stderr)
    except UsageError as error:
        print(f"emulate: {error}", file=sys.stderr)
        return 2
    return 0 if result.train_exit_code == 0 and result.usage.exceeded is None else 1
