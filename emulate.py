"""``python train.py emulate [BUNDLE] < records.jsonl``: RunFab's procedure, run on this machine.

1. Unpack the bundle read-only, as RunFab's /workspace (contract_check.Sandbox).
2. Probe each candidate microbatch (the divisors of EFFECTIVE_BATCH_SIZE / GPUs, smallest first)
   in a fresh process with RunFab's 120 s limit; stop at the first failure; take the largest fit.
3. Call ``train(microbatch, accumulation)`` in a fresh process with this process's stdin,
   ``RUNFABRIC_OUTPUT`` set and TMPDIR in the sandbox, while a watchdog samples host memory of
   the whole process tree, the size of TMPDIR and of the output, and stops the run (as the
   platform would) when one goes over RunFab's budget: 8 GiB RAM, 256 MiB /tmp, 3 GiB output.
4. Write a summary and SVG plots of loss and throughput over ``elapsed_seconds`` from the metric
   lines, as the platform's graphs show them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

import contract_check

RAM_BUDGET = 8 << 30
TMP_BUDGET = 256 << 20
OUTPUT_BUDGET = 3 << 30
PROBE_LIMIT = 120.0
SAMPLE_SECONDS = 0.5


@dataclass
class Usage:
    """Peaks seen by the watchdog, and the budget that stopped the run, if any."""

    peak_rss_bytes: int = 0
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


def probe(sandbox: contract_check.Sandbox, microbatch: int, cuda: bool, limit: float) -> dict:
    command = [sys.executable, "-c", f"import train; train.probe_batch({microbatch})"]
    start = time.monotonic()
    try:
        result = subprocess.run(command, cwd=sandbox.bundle, env=sandbox.env(cuda), stdin=subprocess.DEVNULL,
                                capture_output=True, timeout=limit)
        ok, reason = result.returncode == 0, result.stderr.decode("utf-8", "replace").strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        ok, reason = False, [f"over the {limit:.0f} s limit"]
    return {"microbatch": microbatch, "fits": ok, "seconds": round(time.monotonic() - start, 1),
            "reason": None if ok else (reason[0] if reason else "failed")}


def tree_rss(pid: int) -> int:
    """Resident memory of a process and all its descendants (from /proc, no psutil needed)."""
    table = contract_check.process_table()
    family, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, *_rest) in table.items():
            if ppid == parent and child not in family:
                family.add(child)
                frontier.append(child)
    total = 0
    for member in family:
        try:
            fields = Path(f"/proc/{member}/statm").read_text().split()
            total += int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def watch(process: subprocess.Popen, sandbox: contract_check.Sandbox, usage: Usage) -> None:
    """Sample until the process ends; past a budget, record which and stop the run."""
    budgets = (("RAM", RAM_BUDGET, "peak_rss_bytes", lambda: tree_rss(process.pid)),
               ("/tmp", TMP_BUDGET, "peak_tmp_bytes", lambda: folder_bytes(sandbox.tmp)),
               ("output", OUTPUT_BUDGET, "peak_output_bytes", lambda: folder_bytes(sandbox.output)))
    while process.poll() is None:
        for name, limit, attribute, measure in budgets:
            try:
                value = measure()
            except OSError:
                continue
            setattr(usage, attribute, max(getattr(usage, attribute), value))
            if value > limit and usage.exceeded is None:
                usage.exceeded = f"{name}: {value / 2**20:.0f} MiB > {limit / 2**20:.0f} MiB"
                contract_check.kill_group(process.pid)
        time.sleep(SAMPLE_SECONDS)


def run_training(sandbox: contract_check.Sandbox, microbatch: int, accumulation: int, cuda: bool,
                 metrics_path: Path, out: TextIO, usage: Usage, stdin) -> tuple[int, float, int]:
    """train() with the records on ``stdin``; metric lines go to ``out`` and a file, as RunFab collects them."""
    command = [sys.executable, "-c", f"import train; train.train({microbatch}, {accumulation})"]
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=sandbox.bundle, env=sandbox.env(cuda), stdin=stdin,
                               stdout=subprocess.PIPE, start_new_session=True)
    watchdog = threading.Thread(target=watch, args=(process, sandbox, usage), daemon=True)
    watchdog.start()
    lines = 0
    with metrics_path.open("w") as saved:
        for raw in process.stdout:
            line = raw.decode("utf-8", "replace")
            saved.write(line)
            out.write(line)
            out.flush()
            lines += 1
    code = process.wait()
    watchdog.join()
    return code, time.monotonic() - start, lines


# ----------------------------------------------------------------------------- plots


def svg_chart(series: dict[str, list[tuple[float, float]]], title: str, y_label: str, from_zero: bool = False) -> str:
    """A self-contained line chart (no plotting library, opens in any browser)."""
    width, height, left, bottom, top, right = 720, 360, 70, 40, 30, 20
    points = [p for values in series.values() for p in values]
    if not points:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60"><text x="10" y="30">{title}: no data</text></svg>'
    x_max = max(x for x, _ in points) or 1.0
    y_min, y_max = min(y for _, y in points), max(y for _, y in points)
    if from_zero:
        y_min = min(0.0, y_min)
    if y_max == y_min:
        y_min, y_max = y_min - 1, y_max + 1

    def place(x: float, y: float) -> str:
        px = left + (width - left - right) * x / x_max
        py = height - bottom - (height - top - bottom) * (y - y_min) / (y_max - y_min)
        return f"{px:.1f},{py:.1f}"

    colors = ["#1f77b4", "#d62728", "#2ca02c"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
             f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">{title}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">elapsed_seconds (0 to {x_max:.0f})</text>',
             f'<text x="12" y="{height / 2}" transform="rotate(-90 12 {height / 2})" text-anchor="middle">{y_label}</text>',
             f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{y_max:.4g}</text>',
             f'<text x="{left - 4}" y="{height - bottom}" text-anchor="end">{y_min:.4g}</text>']
    for i, (name, values) in enumerate(series.items()):
        color = colors[i % len(colors)]
        if len(values) > 1:
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{" ".join(place(*p) for p in values)}"/>')
        parts.extend(f'<circle cx="{place(*p).split(",")[0]}" cy="{place(*p).split(",")[1]}" r="2.5" fill="{color}"/>' for p in values)
        parts.append(f'<text x="{width - right - 4}" y="{top + 14 * (i + 1)}" text-anchor="end" fill="{color}">{name}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


def write_plots(metrics_path: Path, report: Path) -> None:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]

    def series(key: str) -> list[tuple[float, float]]:
        return [(r["elapsed_seconds"], r[key]) for r in records if key in r and "elapsed_seconds" in r]

    (report / "loss.svg").write_text(svg_chart({"loss": series("loss"), "val_loss": series("val_loss")}, "Loss", "loss"))
    (report / "throughput.svg").write_text(
        svg_chart({"tokens_per_second": series("tokens_per_second")}, "Throughput", "target tokens / s", from_zero=True))


# ----------------------------------------------------------------------------- command


def emulate(bundle: Path, report: Path, cuda: bool, gpus: int | None, microbatches: list[int] | None,
            out: TextIO, log: TextIO, stdin=None) -> Emulation:
    source = contract_check.BundleSource.open(bundle)
    report.mkdir(parents=True, exist_ok=True)
    with contract_check.Sandbox(source, keep=False) as sandbox:
        tree, error = contract_check.parse_train(sandbox.bundle)
        effective, why = contract_check.batch_literal(tree) if tree is not None else (None, error)
        if effective is None:
            raise contract_check.UsageError(f"cannot read EFFECTIVE_BATCH_SIZE: {why}")
        gpus = gpus or (contract_check.visible_gpus() if cuda else 1)
        result = Emulation(gpus=gpus, effective_batch_size=effective)
        for k in microbatches or candidates(effective, gpus):
            outcome = probe(sandbox, k, cuda, PROBE_LIMIT)
            result.probes.append(outcome)
            print(f"emulate: probe microbatch {k}: {'fits' if outcome['fits'] else 'fails'} "
                  f"({outcome['seconds']} s){'' if outcome['fits'] else ': ' + outcome['reason']}", file=log)
            if not outcome["fits"]:
                break
        fitting = [p["microbatch"] for p in result.probes if p["fits"]]
        if not fitting:
            raise contract_check.UsageError("no candidate microbatch fits: RunFab would reject this bundle")
        result.microbatch = max(fitting)
        result.accumulation = effective // (result.microbatch * gpus)
        print(f"emulate: train({result.microbatch}, {result.accumulation}) on {gpus} GPU(s)", file=log)
        code, seconds, lines = run_training(sandbox, result.microbatch, result.accumulation, cuda,
                                            report / "metrics.jsonl", out, result.usage, stdin or sys.stdin)
        result.train_exit_code, result.train_seconds, result.metric_lines = code, round(seconds, 1), lines
        model = sandbox.output / "model"
        result_files = sorted(p.name for p in model.iterdir()) if model.is_dir() else []
    write_plots(report / "metrics.jsonl", report)
    summary = asdict(result) | {"model_files": result_files}
    (report / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    u = result.usage
    print(f"emulate: exit {code} after {result.train_seconds} s, {lines} metric lines; peaks: RAM "
          f"{u.peak_rss_bytes / 2**30:.2f} GiB, /tmp {u.peak_tmp_bytes / 2**20:.1f} MiB, output "
          f"{u.peak_output_bytes / 2**20:.1f} MiB{'; STOPPED: ' + u.exceeded if u.exceeded else ''}; report in {report}",
          file=log)
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train.py emulate", description=__doc__.splitlines()[0])
    parser.add_argument("bundle", nargs="?", default=str(contract_check.PROJECT_ROOT), help="ZIP or folder")
    parser.add_argument("--report", type=Path, default=Path("emulate-report"), help="where summary and plots go")
    parser.add_argument("--cuda", action="store_true", help="let the children see the GPUs (default: CPU only)")
    parser.add_argument("--gpus", type=int, help="GPU count to plan for (default: visible GPUs with --cuda, else 1)")
    parser.add_argument("--microbatches", type=int, nargs="+", help="candidates to probe instead of every divisor")
    args = parser.parse_args(argv)
    try:
        result = emulate(Path(args.bundle), args.report, args.cuda, args.gpus, args.microbatches, sys.stdout, sys.stderr)
    except contract_check.UsageError as error:
        print(f"emulate: {error}", file=sys.stderr)
        return 2
    return 0 if result.train_exit_code == 0 and result.usage.exceeded is None else 1
