"""``python -m tools compare RUN [RUN ...]``: first whether the runs may be compared, then what differs
and how they went, on one HTML page.

A RUN is a run's output root, or its ``model/`` folder as RunFab archives it; two or more are given,
and every run is checked against the first. The configuration keys whose values differ are the
change (architecture, optimizer, training length, seed, other). Runs may be compared when they
started from the same initial weights, trained on the same tokens in the same order, were validated
on the same set, measured over the same scope and tokenized alike (the run record's
``comparability`` section holds a digest of each, pipeline/fingerprints.py), except where the change
explains a difference: a change of model shape or family necessarily changes the initial weights;
training longer adds updates after the same tokens. A seed change, or a difference no configuration
change explains, is not comparable. Where the training tokens differ, the per-update histories
(``history.npz``) give the first update that differs.

The page (``--out``, default ``./compare/index.html``) then shows the configuration and environment
differences, the loss curves by update and by tokens, the validation cross-entropy before and after
training (and the periodic validation losses when the run's metric lines are there), the learning
rate and gradient norm, and a table of throughput, MFU, peak memory, wall time and final validation
cross-entropy with their ratios to the first run. Runs that are not comparable get a page that says
which fingerprint differs and shows the differences, without curves or table; ``--force`` draws them
anyway, marked as not comparable. Each plot is also written as a PNG beside the page; the page
itself is self-contained (inline SVG, no script, nothing fetched), built from tools/report.py's pieces.

stdout: one JSON object (comparable, the changes, the differences, the page); stderr: the change and
the verdict in words. Exit 0 when the runs are comparable, 1 when they are not, 2 for a usage problem
or a damaged run folder (one line naming the file). Every file is written through
runfab/created_files.py: a link placed in ``--out`` is refused, never written through.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib
import numpy as np
from matplotlib.figure import Figure as MplFigure

from runfab.created_files import NotCreatedHere, open_created, write_text
from tools.report import (FIGURE_INCHES, GRID, NUMBERED_ID, STYLE, STYLE_RC, esc, figure_svg, flatten, note,
                          section, utc, value_html)

PROG = "python -m tools compare"
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
WRITTEN_BY = ".written-by-tools-compare"  # an --out folder this tool made, whose page and plots it may replace


class UsageError(ValueError):
    pass


# ----------------------------------------------------------------------------- inputs


@dataclass
class Run:
    label: str
    path: Path
    record: dict
    history: dict | None  # history.npz's columns and stride
    lines: list[dict] = field(default_factory=list)  # run/metrics.jsonl, when the output root is there

    @property
    def comparability(self) -> dict:
        return self.record.get("comparability") or {}


def read_run(path: Path, label: str) -> Run:
    """A run's record, history and metric lines; a damaged file is a ``UsageError`` that names it."""
    model = path / "model" if (path / "model" / "run_record.json").is_file() else path
    record_path = model / "run_record.json"
    if not record_path.is_file():
        raise UsageError(f"{path} holds no run_record.json (nor model/run_record.json): give a run's output root or "
                         "its model/ folder")
    record = read_record(record_path)
    history = read_history_file(model)
    return Run(label, path, record, history, read_metric_lines(model.parent / "run" / "metrics.jsonl"))


# Where the record's numbers and sections are: what the check and the page read, so a damaged value is
# refused here, naming the file, instead of failing later in a plot.
RECORD_SECTIONS = (("comparability",), ("comparability", "training_tokens"), ("comparability", "validation"),
                   ("comparability", "measurement_scope"), ("summary",), ("config",), ("environment",))
RECORD_NUMBERS = (("wall_seconds",), ("optimizer_steps",), ("comparability", "validation", "ce_before"),
                  ("comparability", "validation", "ce_after"), ("comparability", "training_tokens", "updates"),
                  *((("summary", key),) for key in ("tokens_per_second", "tokens_per_second_per_gpu", "mfu",
                                                    "peak_allocated_gib", "peak_reserved_gib")))


def read_record(record_path: Path) -> dict:
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as error:  # RecursionError: JSON nested deeper than Python's stack
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)
        raise UsageError(f"{record_path} is not a run record: not JSON ({reason})") from None
    except OSError as error:
        raise UsageError(f"{record_path} cannot be read ({error.strerror or error})") from None

    def damaged(where: tuple, expected: str, found) -> UsageError:
        return UsageError(f"{record_path} is not a run record: {'.'.join(where) or 'the top level'} should be "
                          f"{expected}, found {type(found).__name__}; give the record the trainer wrote")

    if not isinstance(record, dict):
        raise damaged((), "an object", record)
    for where in RECORD_SECTIONS:
        value = lookup(record, where)
        if value is not None and not isinstance(value, dict):
            raise damaged(where, "an object", value)
    for where in RECORD_NUMBERS:
        value = lookup(record, where)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise damaged(where, "a number", value)
    return record


def lookup(record: dict, where: tuple):
    """``record[a][b]...``, or None where a level is missing or not an object."""
    value = record
    for key in where:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def read_history_file(model: Path) -> dict | None:
    from callbacks.history import HISTORY_FILE, read_history

    path = model / HISTORY_FILE
    if not path.is_file():
        return None
    try:
        history = read_history(path)
        if len({len(column) for name, column in history.items() if name != "stride"}) != 1:
            raise ValueError("its columns have different lengths")
        return history
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, TypeError) as error:
        raise UsageError(f"{path} is not a run's history ({error}); give the history the trainer wrote, "
                         "or remove it to compare without per-update curves") from None


def read_metric_lines(path: Path) -> list[dict]:
    """The metric lines that are objects; a val_loss or step that is not a number is damage, named."""
    if not path.is_file():
        return []
    lines = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as error:
        raise UsageError(f"{path} cannot be read ({error.strerror or error})") from None
    for number, line in enumerate(text.splitlines(), 1):
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue  # stdout may hold a line that is not a metric
        if not isinstance(value, dict):
            continue
        for key in ("step", "val_loss"):
            if key in value and (isinstance(value[key], bool) or not isinstance(value[key], (int, float))):
                raise UsageError(f"{path} line {number}: {key} should be a number, found "
                                 f"{type(value[key]).__name__} {short(value[key])}")
        lines.append(value)
    return lines


# ----------------------------------------------------------------------------- the check


def first_differing_update(a: Run, b: Run) -> str:
    """Where two runs' training tokens part, from their histories' per-update digests."""
    if a.history is None or b.history is None:
        return "no per-update history to tell from which update"
    if a.history["stride"] != b.history["stride"]:
        return (f"the histories have different resolutions ({a.history['stride']} and {b.history['stride']} "
                "updates per row)")
    da, db = a.history["tokens_digest"], b.history["tokens_digest"]
    n = min(len(da), len(db))
    differs = np.flatnonzero(da[:n] != db[:n])
    if len(differs):
        row = int(differs[0])
        stride = a.history["stride"]
        first = int(a.history["update"][row]) - stride + 1 if stride > 1 else int(a.history["update"][row])
        return f"from update {first}" + (f" (within updates {first}-{first + stride - 1})" if stride > 1 else "")
    return f"the same for the first {int(a.history['update'][n - 1]) if n else 0} updates, then one run trained more"


def differences(first: Run, other: Run) -> list[dict]:
    """The fingerprints in which ``other`` differs from ``first``: one entry each."""
    a, b = first.comparability, other.comparability
    found = []

    def differ(what: str, left, right, detail: str = "") -> None:
        if left is None or right is None:
            found.append({"fingerprint": what, "run": other.label,
                          "detail": f"not recorded in {first.label if left is None else other.label}"})
        elif left != right:
            found.append({"fingerprint": what, "run": other.label,
                          "detail": detail or f"{short(left)} in {first.label}, {short(right)} in {other.label}"})

    differ("initial weights", a.get("initial_weights_sha256"), b.get("initial_weights_sha256"))
    ta, tb = a.get("training_tokens") or {}, b.get("training_tokens") or {}
    if ta.get("sha256") is None or tb.get("sha256") is None:  # a record without it
        differ("training tokens", ta.get("sha256"), tb.get("sha256"))
    elif (ta["sha256"], ta.get("updates")) != (tb["sha256"], tb.get("updates")):
        found.append({"fingerprint": "training tokens", "run": other.label,
                      "detail": f"{first_differing_update(first, other)} ({ta.get('updates')} updates in "
                                f"{first.label}, {tb.get('updates')} in {other.label})",
                      "same_prefix": same_token_prefix(first, other)})
    va, vb = a.get("validation") or {}, b.get("validation") or {}
    differ("validation set", va.get("sha256"), vb.get("sha256"),
           f"{va.get('documents')} documents ({va.get('tokens')} tokens) in {first.label}, {vb.get('documents')} "
           f"({vb.get('tokens')} tokens) in {other.label}")
    sa, sb = scope(a.get("measurement_scope")), scope(b.get("measurement_scope"))
    differ("measurement scope", sa, sb)
    differ("tokenizer", a.get("tokenizer_sha256"), b.get("tokenizer_sha256"))
    return found


def same_token_prefix(a: Run, b: Run) -> bool:
    """Whether the shorter run's training tokens are the first updates of the longer one's."""
    if a.history is None or b.history is None or a.history["stride"] != b.history["stride"]:
        return False
    da, db = a.history["tokens_digest"], b.history["tokens_digest"]
    n = min(len(da), len(db))
    return bool(n) and bool(np.array_equal(da[:n], db[:n]))


# What a configuration change is, by its key: (kind, prefixes or keys).
ARCHITECTURE, OPTIMIZER, LENGTH, SEED = "architecture", "optimizer", "training length", "seed"
CHANGE_KINDS = ((SEED, ("seed",)), (ARCHITECTURE, ("model.",)), (OPTIMIZER, ("optim.",)),
                (LENGTH, ("trainer.max_steps", "trainer.max_tokens", "trainer.max_time")))


NOT_A_CHANGE = ("output.",)  # where each run writes differs between any two runs


def kind_of(key: str) -> str:
    for kind, names in CHANGE_KINDS:
        if any(key == name or (name.endswith(".") and key.startswith(name)) for name in names):
            return kind
    return "other"


def the_change(first: Run, other: Run) -> list[dict]:
    """The configuration keys whose values differ between the two runs: the change being compared."""
    return [{"key": key, "kind": kind_of(key), first.label: values[0], other.label: values[1]}
            for key, values in differing_rows([first, other], lambda r: r.record.get("config"))
            if not key.startswith(NOT_A_CHANGE)]


def judge(first: Run, other: Run) -> tuple[list[dict], list[dict], list[dict]]:
    """The change, the fingerprint differences it explains (each with why) and those it does not, which make
    the runs not comparable. A seed change is never a change to compare: it moves the initial weights and the
    order of the tokens, which is noise, not an effect."""
    change = the_change(first, other)
    kinds = {c["kind"] for c in change}
    named = {kind: ", ".join(c["key"] for c in change if c["kind"] == kind) for kind in kinds}
    explained, unexplained = [], []
    if SEED in kinds:
        seeds = next(c for c in change if c["kind"] == SEED)
        unexplained.append({"fingerprint": "seed", "run": other.label,
                            "detail": f"seed {seeds[first.label]} in {first.label}, {seeds[other.label]} in "
                                      f"{other.label}: the initial weights and the order of the tokens change with it; "
                                      "compare runs of one seed"})
    for d in differences(first, other):
        what = d["fingerprint"]
        reason = None
        if what == "initial weights" and ARCHITECTURE in kinds and SEED not in kinds:
            reason = (f"a change of model shape or family ({named[ARCHITECTURE]}) necessarily changes the initial "
                      "weights")
        elif what == "initial weights" and SEED in kinds:
            continue  # named with the seed
        elif what == "training tokens" and LENGTH in kinds and d.get("same_prefix"):
            reason = f"one run trained longer ({named[LENGTH]}) on the same tokens in the same order"
        elif what == "tokenizer" and any(c["key"] == "data.tokenizer" for c in change):
            d = d | {"detail": d["detail"] + "; data.tokenizer changed: cross-entropies per token of different "
                                             "tokenizers do not measure the same thing"}
        elif not change:
            d = d | {"detail": d["detail"] + "; no configuration change explains it (a different input?)"}
        d = {key: value for key, value in d.items() if key != "same_prefix"}
        (explained if reason else unexplained).append(d | ({"why": reason} if reason else {}))
    return change, explained, unexplained


def scope(measurement: dict | None) -> dict | None:
    """What decides which updates a run's figures are measured over (its normal region follows from it)."""
    if measurement is None:
        return None
    return {key: measurement.get(key) for key in ("warmup_updates", "observed_updates")}


def short(value) -> str:
    return value[:12] if isinstance(value, str) and len(value) == 64 else json.dumps(value)


# ----------------------------------------------------------------------------- plots


@dataclass(frozen=True)
class Curve:
    slug: str
    title: str
    x_label: str
    y_label: str


CURVES = (
    Curve("loss-by-update", "Training loss by update", "update", "cross-entropy (nats / token)"),
    Curve("loss-by-tokens", "Training loss by target tokens", "target tokens", "cross-entropy (nats / token)"),
    Curve("validation", "Validation cross-entropy", "update", "cross-entropy (nats / token)"),
    Curve("lr", "Learning rate", "update", "learning rate"),
    Curve("grad-norm", "Gradient norm (before clipping)", "update", "gradient norm"),
)


def curve_points(curve: Curve, run: Run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The series a run contributes to ``curve``: name -> (x, y)."""
    h = run.history
    if curve.slug == "validation":
        points = {}
        validation = run.comparability.get("validation") or {}
        fixed = [(0, validation.get("ce_before")), (run.record.get("optimizer_steps"), validation.get("ce_after"))]
        fixed = [(x, y) for x, y in fixed if x is not None and y is not None]
        if fixed:
            points["fixed set"] = (np.array([x for x, _ in fixed], float), np.array([y for _, y in fixed], float))
        periodic = [(line["step"], line["val_loss"]) for line in run.lines if "val_loss" in line and "step" in line]
        if periodic:
            points["periodic"] = (np.array([x for x, _ in periodic], float), np.array([y for _, y in periodic], float))
        return points
    if h is None:
        return {}
    x = np.cumsum(h["target_tokens"]) if curve.slug == "loss-by-tokens" else h["update"]
    y = {"loss-by-update": h["loss"], "loss-by-tokens": h["loss"], "lr": h["lr"],
         "grad-norm": h["grad_norm"]}[curve.slug]
    return {"": (np.asarray(x, float), np.asarray(y, float))}


def curve_figure(curve: Curve, runs: list[Run]) -> MplFigure:
    """One plot, one colour per run; every line carries the id ``line-SLUG-RUN[-SERIES]`` in the SVG."""
    figure = MplFigure(figsize=FIGURE_INCHES, layout="constrained")
    axes = figure.add_subplot()
    drawn = 0
    for index, run in enumerate(runs):
        color = COLORS[index % len(COLORS)]
        for series, (x, y) in curve_points(curve, run).items():
            style = {"linestyle": "--", "marker": "o"} if series == "periodic" else {"marker": "o"} if series else {}
            name = mpl_literal(run.label) + (f" ({series})" if series else "")
            axes.plot(x, y, color=color, linewidth=3.5 if index == 0 else 1.8, markersize=6 if index == 0 else 4,
                      label=name,
                      gid=f"line-{curve.slug}-{index}" + (f"-{series.replace(' ', '-')}" if series else ""), **style)
            drawn += 1
    if not drawn:
        axes.set_axis_off()
        axes.text(0.5, 0.5, "no data in any run", ha="center", va="center", transform=axes.transAxes,
                  gid=f"no-data-{curve.slug}")
    else:
        axes.set_xlabel(curve.x_label)
        axes.set_ylabel(curve.y_label)
        axes.grid(color=GRID)
        axes.set_axisbelow(True)
        axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.0), ncols=min(drawn, 4), frameon=False, fontsize=9)
    axes.set_title(curve.title, loc="left", fontsize=13, fontweight="bold", pad=24 if drawn else 6)
    return figure


def mpl_literal(text: str) -> str:
    """``text`` as matplotlib shows it literally: a ``$`` would start mathtext (a folder named ``$x^$`` fails)."""
    return text.replace("$", "\\$")


def write_curve(curve: Curve, runs: list[Run], folder: Path) -> str:
    """The plot as a PNG in ``folder`` and as an ``<svg>`` element for the page."""
    with matplotlib.rc_context(STYLE_RC):
        figure = curve_figure(curve, runs)
        with open_created(folder / f"{curve.slug}.png", "wb") as png:
            figure.savefig(png, format="png", dpi=110, metadata={"Software": None})
        document = figure_svg(figure, curve.slug)
    return NUMBERED_ID.sub("", document[document.index("<svg"):])


# ----------------------------------------------------------------------------- page


def ratio_cell(value, base) -> str:
    if value is None:
        return value_html(None)
    text = value_html(round(value, 6) if isinstance(value, float) else value)
    if isinstance(base, (int, float)) and base and isinstance(value, (int, float)):
        text += f' <span class="muted">({value / base:.3f}x)</span>'
    return text


def whole_history(run: Run, what: str):
    """A figure over every update of the history, every segment of a resumed run included: its target tokens,
    the training seconds at its last update (the history counts on across resumes), or their ratio."""
    h = run.history
    if h is None or not len(h["update"]):
        return None
    tokens, seconds = int(np.sum(h["target_tokens"])), float(h["seconds"][-1])
    return {"tokens": tokens, "seconds": round(seconds, 3),
            "rate": round(tokens / seconds, 1) if seconds > 0 else None}[what]


RESULTS = (
    ("target tokens, whole history", lambda r: whole_history(r, "tokens")),
    ("training seconds, whole history", lambda r: whole_history(r, "seconds")),
    ("tokens/s, whole history", lambda r: whole_history(r, "rate")),
    ("tokens/s, run record (normal region)", lambda r: (r.record.get("summary") or {}).get("tokens_per_second")),
    ("tokens/s per GPU", lambda r: (r.record.get("summary") or {}).get("tokens_per_second_per_gpu")),
    ("MFU", lambda r: (r.record.get("summary") or {}).get("mfu")),
    ("peak allocated GiB", lambda r: (r.record.get("summary") or {}).get("peak_allocated_gib")),
    ("peak reserved GiB", lambda r: (r.record.get("summary") or {}).get("peak_reserved_gib")),
    ("wall seconds of the last segment", lambda r: r.record.get("wall_seconds")),
    ("updates", lambda r: r.record.get("optimizer_steps")),
    ("validation CE before", lambda r: (r.comparability.get("validation") or {}).get("ce_before")),
    ("validation CE after", lambda r: (r.comparability.get("validation") or {}).get("ce_after")),
)


def results_table(runs: list[Run]) -> str:
    head = "".join(f"<th>{esc(run.label)}</th>" for run in runs)
    rows = []
    for name, value_of in RESULTS:
        values = [value_of(run) for run in runs]
        cells = "".join(f"<td>{ratio_cell(v, values[0])}</td>" for v in values)
        rows.append(f"<tr><th>{esc(name)}</th>{cells}</tr>")
    return (f'<table id="results"><caption>Ratios to the first run in brackets</caption>\n<tr><th></th>{head}</tr>\n'
            + "\n".join(rows) + "\n</table>")


def differing_rows(runs: list[Run], of) -> list[tuple[str, list]]:
    """The dotted keys whose values are not the same in every run."""
    flat = [dict(flatten(of(run) or {})) for run in runs]
    keys = sorted(set().union(*flat))
    return [(key, [f.get(key) for f in flat]) for key in keys if len({json.dumps(f.get(key), default=str)
                                                                       for f in flat}) > 1]


def differences_table(anchor: str, runs: list[Run], of) -> str:
    rows = differing_rows(runs, of)
    if not rows:
        return note("The same in every run.")
    head = "".join(f"<th>{esc(run.label)}</th>" for run in runs)
    body = "\n".join(f"<tr><th>{esc(key)}</th>" + "".join(f"<td>{value_html(v)}</td>" for v in values) + "</tr>"
                     for key, values in rows)
    return f'<table id="{anchor}">\n<tr><th></th>{head}</tr>\n{body}\n</table>'


def environment_of(run: Run) -> dict:
    record = run.record
    return {"environment": record.get("environment", {}) | {"argv": None}, "git": record.get("git"),
            "world_size": record.get("world_size"), "precision": record.get("precision"), "batch": record.get("batch"),
            "sources_sha256": record.get("sources_sha256")}


def change_words(entry: dict) -> str:
    """One run's change against the first, in words: the configuration keys and the kinds of change."""
    change = entry["change"]
    if not change:
        return f"{entry['run']}: the same configuration"
    kinds = sorted({c["kind"] for c in change} - {"other"})
    keys = ", ".join(c["key"] for c in change)
    return f"{entry['run']}: {keys}" + (f" (a change of {' and '.join(kinds)})" if kinds else "")


def verdict_html(runs: list[Run], changes: list[dict], found: list[dict], forced: bool) -> str:
    change_items = "\n".join(f"<li>{esc(change_words(entry))}" + "".join(
        f"<br>{esc(d['fingerprint'])} differ: {esc(d['why'])}; the rest is the same" for d in entry["explained"])
        + "</li>" for entry in changes)
    listed = f"<p>The change against {esc(runs[0].label)}:</p>\n<ul>\n{change_items}\n</ul>\n"
    if not found:
        return (f'<div id="verdict" class="comparable"><p><strong>Comparable.</strong> {len(runs)} runs: the same '
                "initial weights, training tokens, validation set, measurement scope and tokenizer, except where the "
                f"change itself explains a difference.</p>\n{listed}</div>")
    items = "\n".join(f"<li><strong>{esc(d['fingerprint'])}</strong> differ in {esc(d['run'])}: {esc(d['detail'])}</li>"
                      for d in found)
    after = ("Drawn anyway (--force): the curves and figures below are not a like-for-like comparison."
             if forced else "Curves and figures are not drawn; --force draws them anyway, marked as here.")
    return (f'<div id="verdict" class="not-comparable"><p><strong>Not comparable.</strong></p>\n{listed}'
            f"<p>Differences the change does not explain:</p>\n<ul>\n{items}\n</ul>\n<p>{esc(after)}</p></div>")


PAGE_STYLE = STYLE + """
.comparable { border-left: 4px solid #2ca02c; padding: 6px 12px; background: #eef8ee; }
.not-comparable { border-left: 4px solid #d62728; padding: 6px 12px; background: #fcecec; }
#results td, #config td, #environment td { white-space: nowrap; }
"""


def render(runs: list[Run], changes: list[dict], found: list[dict], forced: bool, plots: dict[str, str]) -> str:
    listed = "\n".join(f"<li><code>{esc(run.label)}</code>: <code>{esc(str(run.path))}</code>, "
                       f"{esc(str(run.record.get('status', 'status unknown')))}</li>" for run in runs)
    parts = [f"<h1>Comparison of {len(runs)} runs</h1>\n<ul>\n{listed}\n</ul>",
             verdict_html(runs, changes, found, forced),
             section("config", "Configuration differences", differences_table("config", runs,
                                                                               lambda r: r.record.get("config"))),
             section("environment-differences", "Environment differences",
                     differences_table("environment", runs, environment_of))]
    if plots:
        figures = "\n".join(f'<figure class="plot" id="plot-{slug}">{svg}</figure>' for slug, svg in plots.items())
        parts += [section("results", "Results", results_table(runs)), section("curves", "Curves", figures)]
    title = "comparable" if not found else "NOT comparable"
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>Run comparison: {title}</title>\n<style>{PAGE_STYLE}</style>\n</head>\n<body>\n<main>\n"
            + "\n".join(parts) + f'\n<p class="note footer">Written by {PROG} on {utc(time.time())}.</p>\n'
            "</main>\n</body>\n</html>\n")


def claim_folder(folder: Path) -> None:
    """Write only into a new or empty folder, or one this tool wrote before: never over someone's files."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is a file; give a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / WRITTEN_BY).exists():
        raise UsageError(f"--out {folder} holds files that {PROG} did not write; give a new or empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    open_created(folder / WRITTEN_BY, "a").close()


def compare(paths: list[Path], out: Path, force: bool = False) -> dict:
    if len(paths) < 2:
        raise UsageError(f"give two runs or more (a baseline and the change); {len(paths)} given, nothing written")
    labels = [path.name if path.name != "model" else path.parent.name for path in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{index + 1}:{label}" for index, label in enumerate(labels)]
    runs = [read_run(path, label) for path, label in zip(paths, labels)]
    judged = [judge(runs[0], other) for other in runs[1:]]
    changes = [{"run": other.label, "change": change, "explained": explained}
               for other, (change, explained, _) in zip(runs[1:], judged)]
    found = [d for _, _, unexplained in judged for d in unexplained]
    page = out / "index.html"
    try:  # every file through open_created: a link planted in --out is refused, never written through
        claim_folder(out)
        plots = {}
        if not found or force:
            plots = {curve.slug: write_curve(curve, runs, out) for curve in CURVES}
        else:
            for curve in CURVES:  # none from an earlier comparison may pass for this one's
                (out / f"{curve.slug}.png").unlink(missing_ok=True)
        write_text(page, render(runs, changes, found, force, plots))
    except NotCreatedHere as error:
        raise UsageError(str(error)) from None
    return {"comparable": not found, "changes": changes, "differences": found, "page": str(page),
            "plots": [str(out / f"{slug}.png") for slug in plots]}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Name the change between runs (the configuration "
                                     "keys that differ), say whether they are comparable (initial weights, training "
                                     "tokens, validation set, measurement scope, tokenizer; what the change explains "
                                     "aside), then write one HTML page of their differences, curves and figures.")
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                        help="a run's output root, or its model/ folder: the baseline first, then one or more changes")
    parser.add_argument("--out", type=Path, default=Path("compare"), metavar="DIR",
                        help="folder of the page (index.html) and its PNG plots (default ./compare)")
    parser.add_argument("--force", action="store_true", help="draw runs that are not comparable, marked as such")
    args = parser.parse_args(argv)
    try:
        result = compare(args.runs, args.out, args.force)
    except UsageError as error:
        print(f"{PROG}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    for entry in result["changes"]:
        print(f"{PROG}: change: {change_words(entry)}", file=sys.stderr)
        for d in entry["explained"]:
            print(f"{PROG}:   {d['fingerprint']} differ: {d['why']}; the rest is the same", file=sys.stderr)
    if result["comparable"]:
        print(f"{PROG}: the runs are comparable; page {result['page']}", file=sys.stderr)
        return 0
    for d in result["differences"]:
        print(f"{PROG}: not comparable: {d['fingerprint']} differ in {d['run']}: {d['detail']}", file=sys.stderr)
    print(f"{PROG}: page {result['page']}" + ("" if args.force else " (no curves: --force draws them)"),
          file=sys.stderr)
    return 1
