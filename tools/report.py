"""``python -m tools report OUTPUT_DIR``: one HTML page that tells how a run went.

A run leaves its story in pieces meant for machines: the metric lines RunFab graphs
(``run/metrics.jsonl``), the run record beside the model (``model/run_record.json``) and, when
observation was on, profiler traces and memory snapshots. This page puts the curves, the headline
figures, the configuration, the environment and the input summary into one file that opens
anywhere, offline and years later, and can be attached to a ticket: matplotlib's figures as inline
SVG, CSS, no script, nothing fetched. What is missing is said, never guessed.

Intervals whose updates were warmup or were observed (profiler, memory snapshot) do not run at the
run's normal pace: the plots shade them and draw their points hollow, and the headline throughput
leaves them out.
"""

from __future__ import annotations

import argparse
import html
import io
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure as MplFigure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter

from runfab import created_files
from runfab.limits import GIB, MIB

METRICS_FILE = Path("run/metrics.jsonl")
RUN_RECORD_FILE = Path("model/run_record.json")
DEFAULT_PAGE = Path("run/report.html")

esc = html.escape


# ----------------------------------------------------------------------------- inputs


def is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or isinstance(value, float) and math.isfinite(value)


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The metric lines in file order, numeric values only; a blank or cut-short line is skipped."""
    lines = []
    for text in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            parsed = json.loads(text)
        except ValueError:
            continue  # blank, or the last line of a run that was stopped mid-write
        if isinstance(parsed, dict):
            lines.append({key: value for key, value in parsed.items() if is_number(value)})
    return lines


def read_run_record(path: Path, output_dir: Path) -> tuple[dict, str | None]:
    """The run record and, when there is none to show, why. A record that is a link out of the run folder
    is not read: the page would show whatever file it points to."""
    if not path.is_file():
        return {}, f"{RUN_RECORD_FILE} not found: the run ended before writing it, or this is not a run's output root"
    if not path.resolve().is_relative_to(output_dir.resolve()):
        return {}, (f"{RUN_RECORD_FILE} is a link out of the run folder (to {path.resolve()}); it was not read: "
                    "give the output root the run wrote")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        return {}, f"{RUN_RECORD_FILE} is unreadable: {error}"
    if not isinstance(record, dict):
        return {}, f"{RUN_RECORD_FILE} is not a JSON object"
    return record, None


@dataclass(frozen=True)
class ObservationKind:
    """A kind of file that profiling or memory observation leaves, and how a person opens it."""

    folder: str
    patterns: tuple[str, ...]
    what: str
    how_html: str  # written here, not read from the run: safe markup


OBSERVATION_KINDS = (
    ObservationKind("run/profile", ("*.json", "*.json.gz"), "profiler trace",
                    'open it in <a href="https://ui.perfetto.dev">ui.perfetto.dev</a> or at chrome://tracing'),
    ObservationKind("run/memory", ("*.pickle",), "CUDA memory snapshot",
                    'drop it on <a href="https://pytorch.org/memory_viz">pytorch.org/memory_viz</a>'),
)


@dataclass(frozen=True)
class ObservationFile:
    path: str  # relative to the output root
    size: int
    kind: ObservationKind


def find_observation_files(output_dir: Path) -> list[ObservationFile]:
    """Traces and snapshots, listed by name and size only: they can be large, and are not loaded."""
    found = []
    for kind in OBSERVATION_KINDS:
        folder = output_dir / kind.folder
        paths = sorted({p for pattern in kind.patterns for p in folder.glob(pattern) if p.is_file()})
        found += [ObservationFile(p.relative_to(output_dir).as_posix(), p.stat().st_size, kind) for p in paths]
    return found


@dataclass(frozen=True)
class Run:
    """Everything the page shows, read once."""

    output_dir: Path
    metrics_path: Path
    lines: list[dict[str, float]]
    record: dict
    record_problem: str | None
    observation_files: list[ObservationFile]


def read_run(output_dir: Path, metrics_path: Path) -> Run:
    record, problem = read_run_record(output_dir / RUN_RECORD_FILE, output_dir)
    return Run(output_dir, metrics_path, read_metrics(metrics_path), record, problem,
               find_observation_files(output_dir))


# ----------------------------------------------------------------------------- numbers for people


def plain_number(value: float, group_digits: bool = False) -> str:
    """A value as a table shows it: integers whole, other numbers to six significant digits.

    ``group_digits`` writes counts and rates as 31,457,280 and 209,876.5; settings (a seed, a
    vocabulary size, a learning rate) stay as typed.
    """
    if isinstance(value, int):
        return f"{value:,}" if group_digits else str(value)
    if group_digits and abs(value) >= 1000:
        return f"{value:,.1f}"
    return f"{value:.6g}"


def with_prefix(value: float, digits: int = 3) -> str:
    """12345678 -> '12.3 M': large counts at a glance."""
    for prefix, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.{digits}g} {prefix}"
    return f"{value:.{digits}g}"


def file_size(size: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def utc(unix_seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix_seconds))


# ----------------------------------------------------------------------------- plots: what is drawn


def time_unit(seconds: float) -> tuple[float, str]:
    """Seconds for short runs, then minutes, then hours, so the time ticks stay readable."""
    if seconds <= 300:
        return 1.0, "s"
    if seconds <= 5 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


@dataclass(frozen=True)
class Series:
    key: str  # the metric lines' key
    color: str
    scale: float = 1.0  # drawn value = stored value x scale (MFU: fraction to %)


@dataclass(frozen=True)
class Plot:
    slug: str
    title: str
    y_label: str
    series: tuple[Series, ...]
    from_zero: bool = False
    absent_hint: str = ""  # when the keys are expected to be missing


PLOTS = (
    Plot("loss", "Loss", "cross-entropy (nats / token)", (Series("loss", "#1f77b4"), Series("val_loss", "#d62728"))),
    Plot("throughput", "Throughput", "target tokens / s", (Series("tokens_per_second", "#2ca02c"),), from_zero=True),
    Plot("mfu", "Model FLOPs utilization", "MFU (%)", (Series("mfu", "#9467bd", scale=100.0),), from_zero=True,
         absent_hint="GPU runs only"),
    Plot("memory", "Peak GPU memory", "GiB",
         (Series("peak_allocated_gib", "#17becf"), Series("peak_reserved_gib", "#8c564b")), from_zero=True,
         absent_hint="GPU runs only"),
    Plot("lr", "Learning rate", "learning rate", (Series("lr", "#e377c2"),), from_zero=True),
)


@dataclass(frozen=True)
class Flag:
    """A metric-line flag that marks an interval as outside the run's normal pace."""

    key: str
    color: str
    label: str


FLAGS = (
    Flag("warmup", "#fbe6b8", "warmup updates"),
    Flag("observed", "#d9dff0", "observed (profiler / memory snapshot)"),
)


@dataclass(frozen=True)
class Point:
    seconds: float
    value: float  # as drawn (scaled)
    step: float | None
    flagged: bool


def is_flagged(line: dict) -> bool:
    return any(line.get(flag.key) for flag in FLAGS)


def points_of(lines: list[dict], series: Series) -> list[Point]:
    return [Point(r["elapsed_seconds"], r[series.key] * series.scale, r.get("step"), is_flagged(r))
            for r in lines if series.key in r and "elapsed_seconds" in r]


def flagged_spans(lines: list[dict], flag: Flag) -> list[tuple[float, float]]:
    """The time spans of the intervals carrying ``flag``: a line's interval starts where the previous line's ended."""
    spans: list[tuple[float, float]] = []
    previous = 0.0
    for line in lines:
        if "elapsed_seconds" not in line:
            continue
        end = line["elapsed_seconds"]
        if line.get(flag.key):
            if spans and spans[-1][1] == previous:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((previous, end))
        previous = end
    return spans


# ----------------------------------------------------------------------------- plots: matplotlib

FIGURE_INCHES = (8.8, 3.2)
PLACEHOLDER_INCHES = (8.8, 1.1)
MAX_MARKERS = 300  # beyond this many points a series is a line only; the bands still mark flagged intervals
INK, MUTED, GRID = "#1d232a", "#5b6570", "#e6e8eb"
STYLE_RC = {"font.family": "DejaVu Sans", "font.size": 10, "text.color": INK, "axes.labelcolor": INK,
            "axes.edgecolor": "#9aa3ad", "xtick.color": MUTED, "ytick.color": MUTED}
# matplotlib numbers the groups of each figure from 1; several figures on one page would repeat those
# ids. Nothing refers to them (references go to the hashed ids of markers and clip paths), so they go.
NUMBERED_ID = re.compile(r' id="(?:figure|axes|patch|line2d|text|legend|xtick|ytick|matplotlib\.axis)_\d+"')


def plot_figure(plot: Plot, lines: list[dict]) -> MplFigure:
    """One plot over elapsed time: each series' line, hollow markers for flagged intervals, shaded bands
    for those intervals. Artists carry ids (``line-KEY``, ``points-KEY``, ``flagged-KEY``,
    ``band-SLUG-FLAG-N``) that the SVG keeps, so the page can be checked by what it holds."""
    points = {series.key: points_of(lines, series) for series in plot.series}
    if not any(points.values()):
        return placeholder_figure(plot)
    figure = MplFigure(figsize=FIGURE_INCHES, layout="constrained")
    axes = figure.add_subplot()
    longest = max(r["elapsed_seconds"] for r in lines if "elapsed_seconds" in r)
    unit, unit_name = time_unit(longest)
    handles = []
    for flag in FLAGS:
        spans = flagged_spans(lines, flag)
        for number, (start, end) in enumerate(spans):
            axes.axvspan(start / unit, end / unit, color=flag.color, linewidth=0, zorder=0,
                         gid=f"band-{plot.slug}-{flag.key}-{number}")
        if spans:
            handles.append(Patch(facecolor=flag.color, edgecolor="#b8bfc7", label=flag.label))
    for series in plot.series:
        handles.append(draw_series(axes, series, points[series.key], unit))
    axes.set_xlim(0, (longest / unit or 1) * 1.02)  # room for the last marker
    values = [p.value for series_points in points.values() for p in series_points]
    if plot.from_zero:
        axes.set_ylim(min(0.0, min(values)), max(values) * 1.08 or 1.0)
    if max(abs(v) for v in values) >= 10_000:
        axes.yaxis.set_major_formatter(EngFormatter(sep=""))  # 250k, 1.5M
    axes.set_xlabel(f"elapsed time ({unit_name})")
    axes.set_ylabel(plot.y_label)
    axes.grid(color=GRID)
    axes.set_axisbelow(True)
    axes.set_title(plot.title, loc="left", fontsize=13, fontweight="bold", pad=24)  # the legend's row goes under it
    axes.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=len(handles), frameon=False,
                fontsize=9, borderaxespad=0.2, borderpad=0.2, handlelength=1.6, columnspacing=1.4)
    return figure


def draw_series(axes, series: Series, points: list[Point], unit: float) -> Line2D:
    """The line, then a marker per point (hollow for flagged intervals); returns the legend's handle."""
    if not points:
        return Line2D([], [], linestyle="none", label=f"{series.key}: no data")
    if len(points) > 1:
        axes.plot([p.seconds / unit for p in points], [p.value for p in points], color=series.color, linewidth=2,
                  gid=f"line-{series.key}")
    if len(points) <= MAX_MARKERS:
        for flagged, gid, face in ((False, "points", series.color), (True, "flagged", "#ffffff")):
            chosen = [p for p in points if p.flagged is flagged]
            if chosen:
                axes.plot([p.seconds / unit for p in chosen], [p.value for p in chosen], linestyle="none", marker="o",
                          markersize=5, markerfacecolor=face, markeredgecolor=series.color, markeredgewidth=1.4,
                          gid=f"{gid}-{series.key}")
    return Line2D([], [], color=series.color, linewidth=2, marker="o", markersize=5, label=series.key)


def placeholder_figure(plot: Plot) -> MplFigure:
    """What a plot shows when no metric line has any of its keys; the message names them."""
    keys = " or ".join(f'"{s.key}"' for s in plot.series)
    hint = f" ({plot.absent_hint})" if plot.absent_hint else ""
    figure = MplFigure(figsize=PLACEHOLDER_INCHES, layout="constrained")
    axes = figure.add_subplot()
    axes.set_axis_off()
    axes.set_title(plot.title, loc="left", fontsize=13, fontweight="bold")
    axes.text(0.5, 0.5, f"no data: no metric line has {keys}{hint}", ha="center", va="center", color=MUTED,
              fontsize=11, transform=axes.transAxes, gid=f"no-data-{plot.slug}")
    return figure


def figure_svg(figure: MplFigure, salt: str) -> str:
    """The figure as an SVG document; ``salt`` makes its marker and clip-path ids its own and repeatable."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        figure.savefig(buffer, format="svg", metadata={"Creator": None, "Date": None, "Format": None, "Type": None})
    return buffer.getvalue()


def plot_svg(plot: Plot, lines: list[dict]) -> str:
    """The plot as an ``<svg>`` element to place in a page (no XML prologue, no numbered group ids)."""
    with matplotlib.rc_context(STYLE_RC):
        document = figure_svg(plot_figure(plot, lines), plot.slug)
    return NUMBERED_ID.sub("", document[document.index("<svg"):])


def write_plot_svg(plot: Plot, lines: list[dict], path: Path) -> Path:
    """The plot as an SVG file of its own."""
    with matplotlib.rc_context(STYLE_RC):
        created_files.write_text(path, figure_svg(plot_figure(plot, lines), plot.slug))
    return path


# ----------------------------------------------------------------------------- page: building blocks


def value_html(value: object, group_digits: bool = False) -> str:
    if value is None:
        return '<span class="muted">none</span>'
    if isinstance(value, bool):
        return "true" if value else "false"
    if is_number(value):
        return plain_number(value, group_digits)
    if isinstance(value, str):
        return esc(value) if value else '<span class="muted">(empty)</span>'
    if value == []:
        return '<span class="muted">none</span>'
    return esc(json.dumps(value, default=str))


def flatten(mapping: dict, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dicts as dotted keys: {'a': {'b': 1}} -> [('a.b', 1)]; an empty dict stays a value."""
    rows = []
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            rows += flatten(value, f"{name}.")
        else:
            rows.append((name, value))
    return rows


def table(mapping: dict, caption: str = "", group_digits: bool = False) -> str:
    rows = "\n".join(f"<tr><th>{esc(key)}</th><td>{value_html(value, group_digits)}</td></tr>"
                     for key, value in flatten(mapping))
    head = f"<caption>{esc(caption)}</caption>" if caption else ""
    return f"<table>{head}\n{rows}\n</table>"


def tables(mapping: dict, caption: str, group_digits: bool = False) -> list[str]:
    """Plain values in one table under ``caption``, each nested dict in a table of its own."""
    plain = {k: v for k, v in mapping.items() if not (isinstance(v, dict) and v)}
    nested = [(k, v) for k, v in mapping.items() if isinstance(v, dict) and v]
    blocks = [table(plain, caption or "top level", group_digits)] if plain else []
    return blocks + [table(v, f"{caption}.{k}" if caption else k, group_digits) for k, v in nested]


def columns(blocks: list[str]) -> str:
    """Tables flowed into two balanced columns (one on a narrow window)."""
    return '<div class="tables">\n' + "\n".join(blocks) + "\n</div>"


def section(anchor: str, heading: str, *content: str) -> str:
    return f'<section id="{anchor}">\n<h2>{esc(heading)}</h2>\n' + "\n".join(content) + "\n</section>"


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


# ----------------------------------------------------------------------------- page: sections


@dataclass(frozen=True)
class Figure:
    label: str
    value: str
    detail: str = ""


def last_value(lines: list[dict], key: str) -> tuple[float, float | None] | None:
    """The latest value of ``key`` and the step it was reported at."""
    found = [r for r in lines if key in r]
    return (found[-1][key], found[-1].get("step")) if found else None


def normal_values(lines: list[dict], key: str) -> tuple[list[float], str]:
    """Values of ``key`` from intervals outside warmup and observation, and which intervals they are."""
    normal = [r[key] for r in lines if key in r and not is_flagged(r)]
    if normal:
        return normal, f"median of {len(normal)} normal intervals"
    return [r[key] for r in lines if key in r], "median of all intervals (none outside warmup/observation)"


def at_step(step: float | None) -> str:
    return f"at step {step:g}" if step is not None else ""


def headline_figures(run: Run) -> list[Figure]:
    record, lines = run.record, run.lines
    summary = record.get("summary") if isinstance(record.get("summary"), dict) else {}
    figures = []
    if "status" in record:
        figures.append(Figure("status", str(record["status"])))
    if is_number(record.get("optimizer_steps")):
        figures.append(Figure("optimizer steps", f"{record['optimizer_steps']:,}"))
    elif last_value(lines, "step"):
        figures.append(Figure("optimizer steps", f"{last_value(lines, 'step')[0]:,}", "last metric line"))
    wall = record.get("wall_seconds")
    if is_number(wall):
        figures.append(Figure("wall time", duration(wall), "whole run"))
    elif last_value(lines, "elapsed_seconds"):
        figures.append(Figure("training time", duration(last_value(lines, "elapsed_seconds")[0]), "last metric line"))
    if is_number(record.get("parameters")):
        figures.append(Figure("parameters", with_prefix(record["parameters"], 4), f"{record['parameters']:,}"))
    latest = last_value(lines, "loss")
    if latest:
        where = ", ".join(filter(None, ("training", at_step(latest[1]))))
        figures.append(Figure("final loss", f"{latest[0]:.4f}", where))
    comparability = record.get("comparability") if isinstance(record.get("comparability"), dict) else {}
    validation = comparability.get("validation") if isinstance(comparability.get("validation"), dict) else {}
    if is_number(validation.get("ce_after")):
        figures.append(Figure("final validation CE", f"{validation['ce_after']:.4f}",
                              "fixed validation set, after training, run record"))
    latest = last_value(lines, "val_loss")
    if latest:
        figures.append(Figure("last periodic val_loss", f"{latest[0]:.4f}", at_step(latest[1])))
    figures += throughput_figures(lines, summary)
    figures += device_figures(record, lines, summary)
    return figures


def throughput_figures(lines: list[dict], summary: dict) -> list[Figure]:
    """The run record's normal-region figures; without them, the median of the normal metric lines."""
    figures = []
    total, per_gpu = summary.get("tokens_per_second"), summary.get("tokens_per_second_per_gpu")
    if is_number(total):
        figures.append(Figure("tokens / s", f"{total:,.0f}", "normal region, run record"))
    else:
        rates, which = normal_values(lines, "tokens_per_second")
        if rates:
            figures.append(Figure("tokens / s", f"{statistics.median(rates):,.0f}", which))
    if is_number(per_gpu) and per_gpu != total:
        figures.append(Figure("tokens / s per GPU", f"{per_gpu:,.0f}", "normal region, run record"))
    computing = summary.get("tokens_per_compute_second")
    if is_number(computing) and is_number(total) and computing > 1.01 * total:  # training waited for input
        figures.append(Figure("tokens / s computing", f"{computing:,.0f}", "normal region, input waits left out"))
    if is_number(summary.get("mfu")):
        figures.append(Figure("MFU", f"{summary['mfu'] * 100:.1f} %", "normal region, run record"))
    else:
        utilization, which = normal_values(lines, "mfu")
        if utilization:
            figures.append(Figure("MFU", f"{statistics.median(utilization) * 100:.1f} %", which))
    return figures


def peak(lines: list[dict], summary: dict, key: str) -> float | None:
    """The run record summary's figure, else the largest value the metric lines reported."""
    if is_number(summary.get(key)):
        return summary[key]
    return max((line[key] for line in lines if key in line), default=None)


def device_figures(record: dict, lines: list[dict], summary: dict) -> list[Figure]:
    figures = []
    allocated, reserved = peak(lines, summary, "peak_allocated_gib"), peak(lines, summary, "peak_reserved_gib")
    if allocated is not None:
        figures.append(Figure("peak GPU memory", f"{allocated:.2f} GiB",
                              f"allocated; {reserved:.2f} GiB reserved" if reserved is not None else "allocated"))
    environment = record.get("environment") if isinstance(record.get("environment"), dict) else {}
    if "world_size" in record:
        device = environment.get("gpu") or "CPU"
        figures.append(Figure("devices", f"{record['world_size']} × {device}"))
    if "precision" in record:
        figures.append(Figure("precision", str(record["precision"])))
    return figures


def figures_html(figures: list[Figure]) -> str:
    cards = "\n".join(f'<div class="figure"><div class="label">{esc(f.label)}</div>'
                      f'<div class="value">{esc(f.value)}</div><div class="detail">{esc(f.detail)}</div></div>'
                      for f in figures)
    return f'<div class="figures">\n{cards}\n</div>'


def summary_section(run: Run) -> str:
    content = [figures_html(headline_figures(run))]
    if run.record_problem:
        content.append(note(run.record_problem))
    blocks = [block for key, caption in (("summary", "summary"), ("final_metrics", "final metric line"))
              for block in record_tables(run.record, key, caption, "", group_digits=True)]
    if blocks:
        content.append(columns(blocks))
    return section("summary", "Run summary", *content)


def plots_section(lines: list[dict]) -> str:
    legend = ("Metric lines over elapsed training time. Shaded bands mark intervals whose updates were warmup or "
              "were observed by the profiler or a memory snapshot; their points are hollow: their throughput and "
              "MFU are not the run's normal pace.")
    if not lines:
        legend = "The metrics file holds no complete metric line yet."
    figures = "\n".join(f'<figure class="plot" id="plot-{plot.slug}">{plot_svg(plot, lines)}</figure>'
                        for plot in PLOTS)
    return section("plots", "Metrics", note(legend), figures)


def record_tables(record: dict, key: str, caption: str, absent: str, group_digits: bool = False) -> list[str]:
    """The tables of one run record field, or a note saying what is ``absent`` (nothing when that is empty)."""
    value = record.get(key)
    if isinstance(value, dict) and value:
        return tables(value, caption, group_digits)
    if value not in (None, {}):
        return [table({caption or key: value})]
    return [note(absent)] if absent else []


def configuration_section(record: dict) -> str:
    if not record:
        return section("configuration", "Configuration", note("No run record: the configuration is unknown."))
    config = record.get("config") if isinstance(record.get("config"), dict) else {}
    seed = note(f"Seed {record['seed']}.") if "seed" in record and record["seed"] != config.get("seed") else ""
    return section("configuration", "Configuration", seed, columns(
        record_tables(record, "config", "", "The run record holds no configuration.")
        + record_tables(record, "batch", "batch", "No batch settings recorded.")
        + record_tables(record, "tokenizer", "tokenizer", "No tokenizer recorded.")))


def environment_section(record: dict) -> str:
    if not record:
        return section("environment", "Environment", note("No run record: the environment is unknown."))
    content = [columns(record_tables(record, "environment", "environment", "No environment recorded."))]
    hashes = record.get("sources_sha256")
    if isinstance(hashes, dict):
        content.append(f"<details><summary>{len(hashes)} source files hashed (SHA-256)</summary>\n"
                       f"{table(hashes)}\n</details>")
    return section("environment", "Environment", *content)


def data_section(record: dict) -> str:
    if not record:
        return section("data", "Data", note("No run record: the input summary is unknown."))
    return section("data", "Data", columns(
        record_tables(record, "input", "input", "No input summary recorded.", group_digits=True)
        + record_tables(record, "dataset", "dataset", "No dataset descriptor (runfabric.dataset.json).")))


def missing_observations(run: Run) -> list[str]:
    """Files the run record says were written (relative to run/) that are not in the output root."""
    listed = run.record.get("observations")
    found = {f.path for f in run.observation_files}
    return [name for name in listed if f"run/{name}" not in found] if isinstance(listed, list) else []


def observations_section(run: Run) -> str:
    missing = missing_observations(run)
    gone = [note(f"Listed in the run record but not found: {', '.join(map(str, missing))}.")] if missing else []
    if not run.observation_files:
        folders = " or ".join(kind.folder for kind in OBSERVATION_KINDS)
        return section("observation", "Observation files", note(f"None: nothing in {folders}."), *gone)
    rows = "\n".join(f"<tr><th>{esc(f.path)}</th><td>{file_size(f.size)}</td>"
                     f"<td>{esc(f.kind.what)}: {f.kind.how_html}</td></tr>" for f in run.observation_files)
    return section("observation", "Observation files",
                   note("Listed, not loaded. Both viewers open the file inside the browser, without uploading it."),
                   f'<table class="files">\n{rows}\n</table>', *gone)


SHOWN_ELSEWHERE = {"status", "started_unix", "wall_seconds", "seed", "config", "batch", "tokenizer", "precision",
                   "world_size", "optimizer_steps", "parameters", "final_metrics", "input", "dataset",
                   "environment", "sources_sha256", "summary", "observations"}


def other_fields_section(record: dict) -> str:
    """Run record fields this page does not know yet, so that nothing recorded goes unseen."""
    others = {k: v for k, v in record.items() if k not in SHOWN_ELSEWHERE}
    return section("other", "Other run record fields", columns(tables(others, ""))) if others else ""


STYLE = """
body { margin: 0; background: #eef0f3; color: #1d232a;
       font: 14px/1.45 "DejaVu Sans", system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
main { max-width: 920px; margin: 0 auto; padding: 24px 28px 48px; background: #ffffff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 34px 0 12px; padding-bottom: 4px; border-bottom: 1px solid #dde1e6; }
.sub, .note { color: #5b6570; margin: 4px 0 10px; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(165px, 1fr)); gap: 10px; }
.figure { border: 1px solid #dde1e6; border-radius: 6px; padding: 8px 12px; }
.figure .label { color: #5b6570; font-size: 11px; text-transform: uppercase; letter-spacing: .05em; }
.figure .value { font-size: 19px; font-weight: bold; overflow-wrap: anywhere; }
.figure .detail { color: #7b858f; font-size: 12px; min-height: 1em; }
figure.plot { margin: 0 0 16px; }
figure.plot svg { display: block; max-width: 100%; height: auto; }
.tables { columns: 2 380px; column-gap: 28px; margin-bottom: 12px; }
.tables table { break-inside: avoid; margin-bottom: 14px; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
caption { text-align: left; font-weight: bold; padding: 4px 0; }
th, td { text-align: left; vertical-align: top; padding: 3px 8px; border-bottom: 1px solid #eef0f2; }
th { font-weight: normal; color: #4a5561; width: 1%; white-space: nowrap; }
td { font-family: "DejaVu Sans Mono", ui-monospace, Menlo, Consolas, monospace; overflow-wrap: anywhere; }
table.files td { font-family: inherit; }
.muted { color: #8a939c; }
code { font-family: "DejaVu Sans Mono", ui-monospace, Menlo, Consolas, monospace; font-size: 13px;
       overflow-wrap: anywhere; }
details { margin: 8px 0; }
.footer { margin-top: 32px; font-size: 12px; }
summary { cursor: pointer; color: #4a5561; }
"""


def shown_path(path: Path, output_dir: Path) -> str:
    return path.relative_to(output_dir).as_posix() if path.is_relative_to(output_dir) else str(path)


def header_html(run: Run, status: str) -> str:
    started = [f"started {utc(run.record['started_unix'])}"] if is_number(run.record.get("started_unix")) else []
    facts = " · ".join([f"<strong>{esc(status)}</strong>", *map(esc, started), f"{len(run.lines)} metric lines"])
    where = (f"output root <code>{esc(str(run.output_dir))}</code> · metrics "
             f"<code>{esc(shown_path(run.metrics_path, run.output_dir))}</code>")
    return f'<h1>Training run report</h1>\n<p class="sub">{facts}</p>\n<p class="sub">{where}</p>'


def render(run: Run) -> str:
    """The whole page, as one string: every value from the run goes through html.escape."""
    status = str(run.record.get("status", "no run record" if run.record_problem else "status unknown"))
    body = "\n".join(part for part in (
        header_html(run, status), summary_section(run), plots_section(run.lines), configuration_section(run.record),
        environment_section(run.record), data_section(run.record), observations_section(run),
        other_fields_section(run.record)) if part)
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>Run report: {esc(str(status))}</title>\n<style>{STYLE}</style>\n</head>\n"
            f"<body>\n<main>\n{body}\n<p class=\"note footer\">Written by python -m tools report on {utc(time.time())}.</p>\n"
            f"</main>\n</body>\n</html>\n")


# ----------------------------------------------------------------------------- command


def write_report(output_dir: Path, page: Path, metrics_path: Path | None = None) -> Path:
    """Write the page for the run in ``output_dir`` (metric lines from ``metrics_path`` when given)."""
    run = read_run(output_dir, metrics_path or output_dir / METRICS_FILE)
    page.parent.mkdir(parents=True, exist_ok=True)
    created_files.write_text(page, render(run))
    return page


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools report",
                                     description="Write one self-contained HTML page about a run.")
    parser.add_argument("output_dir", type=Path, metavar="OUTPUT_DIR",
                        help="the run's output root ($RUNFABRIC_OUTPUT; ./output by default when training)")
    parser.add_argument("--out", type=Path, metavar="FILE",
                        help="the page to write (default: OUTPUT_DIR/run/report.html)")
    parser.add_argument("--metrics", type=Path, metavar="FILE",
                        help="read the metric lines from FILE instead of OUTPUT_DIR/run/metrics.jsonl "
                             "(for example the stdout lines saved by emulate)")
    args = parser.parse_args(argv)
    metrics = args.metrics or args.output_dir / METRICS_FILE
    if not metrics.is_file():
        print(f"report: no metric lines: {metrics} does not exist (is {args.output_dir} a run's output root? "
              "--metrics FILE reads them from elsewhere)", file=sys.stderr)
        return 2
    page = write_report(args.output_dir, args.out or args.output_dir / DEFAULT_PAGE, metrics)
    print(f"report: wrote {page}", file=sys.stderr)
    return 0
