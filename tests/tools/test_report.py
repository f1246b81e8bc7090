"""``python -m tools report``: one self-contained HTML page from a run's output root.

The page is built from a realistic fake output root (metric lines with warmup and observation
flags, validation lines, GPU keys, a cut-short last line; a full run record; observation files)
and checked as text (matplotlib's figures keep the ids the report gives their lines, markers and
bands), then rendered by a real headless Chromium: the DOM must hold every plot and the screenshot
must show the series' colours.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
import struct
import zlib
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

import pytest

from tests.helpers import CHROMIUM, run_chromium

from runfab.limits import MIB
from tools import report

WARMUP_LINES, OBSERVED_LINES, VALIDATION_EVERY = 5, (18, 19), 10
MARKUP_IN_CONFIG = "<script>alert('x')</script>"

# ----------------------------------------------------------------------------- a fake run


def metric_lines(count: int = 40, gpu: bool = True) -> list[dict]:
    """What RunFabMetrics writes: an interval line every ~5 s, a validation line every few."""
    lines, step, elapsed = [], 0, 0.0
    for i in range(count):
        step += 6
        elapsed += 5.0 + 0.01 * i
        warmup, observed = i < WARMUP_LINES, i in OBSERVED_LINES
        speed = 0.4 if warmup else 0.7 if observed else 1.0
        line = {"step": step, "elapsed_seconds": round(elapsed, 3), "loss": 3.0 + 7.5 * math.exp(-i / 8),
                "tokens_per_second": 210_000 * speed, "samples_per_second": 102.5 * speed,
                "lr": 6e-4 * min(1.0, (i + 1) / WARMUP_LINES) * (0.55 + 0.45 * math.cos(math.pi * i / count)),
                "grad_norm": 1.0 + 2.0 * math.exp(-i / 5)}
        if gpu:
            line |= {"mfu": 0.41 * speed, "peak_allocated_gib": 38.5 + 0.01 * i, "peak_reserved_gib": 44.0}
        if warmup:
            line["warmup"] = 1
        if observed:
            line["observed"] = 1
        lines.append(line)
        if (i + 1) % VALIDATION_EVERY == 0:
            elapsed += 1.5
            lines.append({"step": step, "elapsed_seconds": round(elapsed, 3), "val_loss": line["loss"] + 0.08})
    return lines


RUN_RECORD = {
    "status": "completed",
    "started_unix": 1764410000.0,
    "wall_seconds": 262.4,
    "seed": 1337,
    "config": {
        "seed": 1337,
        "model": {"vocab_size": 50257, "n_layer": 12, "n_head": 12, "n_embd": 768, "max_seq_len": 4096},
        "optim": {"lr": 0.0006, "warmup_steps": 30, "schedule": "cosine", "betas": [0.9, 0.95]},
        "trainer": {"max_steps": 240, "val_every_steps": 60, "compile": None, "run_name": MARKUP_IN_CONFIG},
        "data": {"tokenizer": "conf/tokenizer.json", "val_fraction": 0.01},
    },
    "batch": {"effective": 32, "microbatch": 8, "accumulation": 4, "world_size": 1, "tokens_per_update": 131072},
    "tokenizer": {"path": "conf/tokenizer.json", "sha256": "ab" * 32, "vocab_size": 8192, "eos_id": 0,
                  "backend": "tiktoken"},
    "precision": "bf16-mixed",
    "world_size": 1,
    "optimizer_steps": 240,
    "parameters": 126716160,
    "final_metrics": {"step": 240, "loss": 3.0412, "tokens_per_second": 209876.5},
    "input": {"source": "stdin", "records": 10412, "accepted": 10400,
              "rejected": {"invalid_json": 7, "empty_text": 5}, "tokens": 31457280, "tail_tokens_dropped": 1873,
              "input_sha256": "cd" * 32},
    "dataset": None,
    "environment": {"libraries": {"python": "3.11.7", "torch": "2.13.0", "lightning": "2.5.1", "cuda": "12.8"},
                    "platform": "Linux-6.8.0-x86_64-with-glibc2.36", "gpu": "NVIDIA H200",
                    "argv": ["train.py", "--config", "conf/config.yaml"]},
    "sources_sha256": {"train.py": "01" * 32, "model.py": "02" * 32, "conf/config.yaml": "03" * 32},
    "summary": {"tokens_per_second_per_gpu": 209512.5, "tokens_per_second": 209512.5, "mfu": 0.41,
                "normal_region": {"first_update": 31, "last_update": 240, "updates": 198, "seconds": 148.7,
                                  "target_tokens": 31153408},
                "excluded_updates": {"warmup": 30, "observed": [121, 122]}, "total_target_tokens": 31457280,
                "world_size": 1, "peak_allocated_gib": 38.89, "peak_reserved_gib": 44.0},
    "observations": ["profile/trace-updates-121-122.json", "memory/snapshot-update-123.pickle"],
}


def write_output_root(root: Path, lines: list[dict], record: dict | None = RUN_RECORD) -> Path:
    """An output root as training leaves it; the last metric line is cut short, as by a kill mid-write."""
    (root / "run").mkdir(parents=True)
    text = "".join(json.dumps(line) + "\n" for line in lines)
    (root / "run/metrics.jsonl").write_text(text + '{"step": 241, "elapsed_sec')
    if record is not None:
        (root / "model").mkdir()
        (root / "model/run_record.json").write_text(json.dumps(record, indent=2))
    return root


@pytest.fixture
def gpu_run(tmp_path) -> Path:
    root = write_output_root(tmp_path / "output", metric_lines())
    (root / "run/profile").mkdir()
    (root / "run/profile/trace-updates-121-122.json").write_bytes(b"{" * 3 * MIB)
    (root / "run/memory").mkdir()
    (root / "run/memory/snapshot-update-123.pickle").write_bytes(b"not a pickle: must never be loaded")
    return root


def render(root: Path, *extra: str) -> str:
    page = root / "page.html"
    assert report.main([str(root), "--out", str(page), *extra]) == 0
    return page.read_text(encoding="utf-8")


def table_rows(page: str, caption: str) -> dict[str, str]:
    """The rows of the first table with this caption."""
    match = re.search(rf"<table><caption>{re.escape(caption)}</caption>\n(.*?)</table>", page, re.S)
    assert match, f"no table captioned {caption!r}"
    return dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", match.group(1)))


def svg_of(page: str, slug: str) -> str:
    match = re.search(rf'<figure class="plot" id="plot-{slug}">(.*?)</figure>', page, re.S)
    assert match, f"no figure for plot {slug}"
    return match.group(1)


def markers(svg: str, group: str) -> int:
    """How many markers the figure's group ``group`` (a series' points) draws."""
    match = re.search(rf'<g id="{re.escape(group)}">(.*?)</g>', svg, re.S)
    return match.group(1).count("<use ") if match else 0


# ----------------------------------------------------------------------------- the page as text


def test_every_plot_has_its_series_and_the_flagged_intervals_are_marked(gpu_run):
    page = render(gpu_run)
    assert page.count("<svg") == len(report.PLOTS)
    for plot in report.PLOTS:
        svg = svg_of(page, plot.slug)
        assert svg.count("<svg") == 1
        for series in plot.series:
            assert f'id="line-{series.key}"' in svg and markers(svg, f"points-{series.key}"), (plot.slug, series.key)
            assert series.color in svg
        assert "no data" not in svg
        assert len(re.findall(rf'id="band-{plot.slug}-warmup-\d+"', svg)) == 1  # five consecutive warmup lines
        assert len(re.findall(rf'id="band-{plot.slug}-observed-\d+"', svg)) == 1
        assert "warmup updates" in svg and "observed (profiler / memory snapshot)" in svg
    loss = svg_of(page, "loss")
    validation_lines = sum("val_loss" in line for line in metric_lines())
    assert markers(loss, "points-val_loss") == validation_lines and markers(loss, "flagged-val_loss") == 0
    assert markers(loss, "flagged-loss") == WARMUP_LINES + len(OBSERVED_LINES)  # hollow: not the normal pace
    assert markers(loss, "points-loss") == len(metric_lines()) - validation_lines - markers(loss, "flagged-loss")
    assert ">200k<" in svg_of(page, "throughput")  # large values get short tick labels
    assert "elapsed time (s)" in loss


def test_a_long_run_is_plotted_in_minutes(tmp_path):
    lines = [{"elapsed_seconds": 60.0 * minute, "loss": 5.0 - minute / 100} for minute in range(1, 90)]
    page = render(write_output_root(tmp_path / "output", lines))
    assert "elapsed time (min)" in svg_of(page, "loss")


def test_the_page_holds_the_run_record_and_fetches_nothing(gpu_run):
    page = render(gpu_run)
    for expected in ("126.7 M", "126,716,160", "completed", "bf16-mixed", "1 × NVIDIA H200", "41.0 %",
                     "209,512", "38.89 GiB", "4 min 22 s"):
        assert expected in page, expected
    for caption, key, value in (("model", "n_embd", "768"), ("optim", "betas", "[0.9, 0.95]"),
                                ("trainer", "compile", '<span class="muted">none</span>'),
                                ("top level", "seed", "1337"), ("batch", "microbatch", "8"),
                                ("tokenizer", "backend", "tiktoken"),
                                ("environment.libraries", "torch", "2.13.0"),
                                ("environment", "platform", "Linux-6.8.0-x86_64-with-glibc2.36"),
                                ("input.rejected", "invalid_json", "7"), ("input", "tokens", "31,457,280"),
                                ("summary.normal_region", "target_tokens", "31,153,408"),
                                ("summary.excluded_updates", "observed", "[121, 122]")):
        assert value in table_rows(page, caption).get(key, ""), (caption, key)
    assert "3 source files hashed" in page and "<details>" in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page and MARKUP_IN_CONFIG not in page
    assert "run/profile/trace-updates-121-122.json" in page and "3.0 MiB" in page and "34 B" in page
    assert "run/memory/snapshot-update-123.pickle" in page and "pytorch.org/memory_viz" in page
    assert "not found" not in page and "Other run record fields" not in page
    assert_fetches_nothing(page)


def test_a_run_that_waited_for_input_shows_its_time_computing_beside_the_throughput(tmp_path):
    """tokens / s is over the wall clock, as the contract counts it; a run slowed by its input also
    shows how fast it trained while it had rows."""
    summary = RUN_RECORD["summary"] | {"tokens_per_second": 52_378.0, "tokens_per_compute_second": 209_512.5}
    page = render(write_output_root(tmp_path / "output", metric_lines(), RUN_RECORD | {"summary": summary}))
    assert "52,378" in page and "tokens / s computing" in page and "209,512" in page
    assert "tokens / s computing" not in render(write_output_root(tmp_path / "other", metric_lines()))


def assert_fetches_nothing(page: str) -> None:
    """No element or rule that makes a browser load anything: references inside the page (a figure's
    markers and clip paths) and links for a person to click are fine."""
    for fetching in ("<script", "<link", "<img", "<iframe", "<object", "<embed", "<image", "@import"):
        assert fetching not in page.lower(), fetching
    assert not re.search(r"url\((?!#)", page), "a CSS url() that leaves the page"
    assert not re.search(r"\s(src|srcset|poster|data|action)\s*=", page, re.I)
    for match in re.finditer(r'<(\w+)[^>]*\s(?:xlink:)?href="([^"]*)"', page):
        element, target = match.groups()
        assert target.startswith("#") or element == "a", f"<{element}> loads {target}"
    namespaces = ("http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink")  # names, never fetched
    for match in re.finditer(r"https?://[^\s\"'<>]*", page):
        before = page[max(0, match.start() - 9):match.start()]
        assert before == '<a href="' or match.group() in namespaces, \
            f"a network address outside a link: {page[match.start() - 40:match.end() + 40]}"


def test_missing_keys_and_record_get_placeholders_that_name_them(tmp_path):
    cpu_lines = [{k: v for k, v in line.items() if k not in {"lr"}} for line in metric_lines(12, gpu=False)]
    cpu_lines = [line for line in cpu_lines if "val_loss" not in line]
    root = write_output_root(tmp_path / "output", cpu_lines, record=None)
    page = render(root)
    assert page.count("<svg") == len(report.PLOTS)
    assert 'no data: no metric line has "mfu" (GPU runs only)' in svg_of(page, "mfu")
    assert 'no data: no metric line has "peak_allocated_gib" or "peak_reserved_gib"' in svg_of(page, "memory")
    assert 'no data: no metric line has "lr"' in svg_of(page, "lr")
    loss = svg_of(page, "loss")
    assert 'id="line-loss"' in loss and "val_loss: no data" in loss
    assert "model/run_record.json not found" in page and "<title>Run report: no run record</title>" in page
    assert "210,000" in page and "median of 7 normal intervals" in page  # no run record summary: the metric lines
    assert "No run record: the configuration is unknown." in page
    assert "None: nothing in run/profile or run/memory." in page


def test_run_record_fields_it_does_not_know_are_shown_too(tmp_path):
    record = RUN_RECORD | {"resumed_from": {"path": "checkpoints/last.ckpt", "step": 120}}
    page = render(write_output_root(tmp_path / "output", metric_lines(4), record))
    assert "Other run record fields" in page
    assert table_rows(page, "resumed_from") == {"path": "checkpoints/last.ckpt", "step": "120"}


def test_an_empty_metrics_file_still_gives_a_page(tmp_path):
    root = write_output_root(tmp_path / "output", [], record=None)
    page = render(root)
    assert page.count("no data: no metric line has") == len(report.PLOTS)


def test_without_metrics_it_exits_2_with_one_line_on_stderr(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("report: ") and captured.err.count("\n") == 1
    assert "run/metrics.jsonl" in captured.err
    assert report.main([str(tmp_path), "--metrics", str(tmp_path / "missing.jsonl")]) == 2


def test_default_page_path_and_stdout_stays_empty(gpu_run, capsys):
    assert report.main([str(gpu_run)]) == 0
    captured = capsys.readouterr()
    page = gpu_run / "run/report.html"
    assert captured.out == "" and str(page) in captured.err
    assert page.read_text().startswith("<!DOCTYPE html>")


def test_metrics_from_another_file(tmp_path, capsys):
    root = tmp_path / "output"
    (root / "model").mkdir(parents=True)
    (root / "model/run_record.json").write_text(json.dumps(RUN_RECORD))
    saved = tmp_path / "emulate-report/metrics.jsonl"
    saved.parent.mkdir()
    saved.write_text("".join(json.dumps(line) + "\n" for line in metric_lines(8)))
    page = render(root, "--metrics", str(saved))
    assert 'id="line-tokens_per_second"' in page and "8 metric lines" in page
    assert "Listed in the run record but not found: profile/trace-updates-121-122.json, " in page


def test_a_plot_of_its_own_is_a_well_formed_svg_file(tmp_path):
    for plot in report.PLOTS:
        for lines in (metric_lines(), []):
            path = report.write_plot_svg(plot, lines, tmp_path / f"{plot.slug}.svg")
            assert ElementTree.parse(path).getroot().tag == "{http://www.w3.org/2000/svg}svg"


# ----------------------------------------------------------------------------- in a real browser


def png_pixels(data: bytes) -> tuple[int, int, Counter]:
    """Width, height and a count of each RGB colour of an 8-bit, non-interlaced PNG, decoded with the stdlib."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    position, compressed = 8, []
    while position < len(data):
        length, kind = struct.unpack(">I4s", data[position:position + 8])
        body = data[position + 8:position + 8 + length]
        position += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour_type in (2, 6) and interlace == 0, (depth, colour_type, interlace)
        elif kind == b"IDAT":
            compressed.append(body)
    channels = 3 if colour_type == 2 else 4
    raw, stride = zlib.decompress(b"".join(compressed)), width * channels
    colours, previous = Counter(), bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        row = unfilter(raw[start], bytearray(raw[start + 1:start + 1 + stride]), previous, channels)
        colours.update(zip(row[0::channels], row[1::channels], row[2::channels]))
        previous = row
    return width, height, colours


def unfilter(kind: int, row: bytearray, previous: bytearray, bpp: int) -> bytearray:
    """Undo one PNG row filter (None, Sub, Up, Average, Paeth); ``previous`` is the row above, unfiltered."""
    if kind == 0:
        return row
    if kind == 2:
        return bytearray((a + b) & 255 for a, b in zip(row, previous))
    left_of = bytearray(bpp) + row  # left_of[i] is the unfiltered byte bpp to the left of row[i], once written
    up_left_of = bytearray(bpp) + previous
    for i, up in enumerate(previous):
        left, up_left = left_of[i], up_left_of[i]
        if kind == 1:
            predictor = left
        elif kind == 3:
            predictor = (left + up) // 2
        else:  # Paeth: whichever of left, up, up-left is nearest to left + up - up_left
            to_left, to_up, to_up_left = abs(up - up_left), abs(left - up_left), abs(left + up - 2 * up_left)
            predictor = left if to_left <= to_up and to_left <= to_up_left else up if to_up <= to_up_left else up_left
        left_of[i + bpp] = row[i] = (row[i] + predictor) & 255
    return row


def count_near(colours: Counter, hex_colour: str, tolerance: int = 24) -> int:
    target = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return sum(n for rgb, n in colours.items() if max(abs(a - b) for a, b in zip(rgb, target)) <= tolerance)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                  "(apt-get install -y chromium; .ci/run installs it)")
def test_chromium_renders_every_plot_and_the_screenshot_shows_the_series(gpu_run, tmp_path):
    page = gpu_run / "run/report.html"
    assert report.main([str(gpu_run)]) == 0
    dom = run_chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-dom").decode("utf-8")
    for plot in report.PLOTS:
        assert f'id="plot-{plot.slug}"' in dom, plot.slug
        for series in plot.series:
            assert f'id="line-{series.key}"' in dom, series.key
    assert "Configuration" in dom and "NVIDIA H200" in dom

    screenshot = tmp_path / "report.png"
    run_chromium(f"--screenshot={screenshot}", "--window-size=1280,4000", page.as_uri(),
                 profile=tmp_path / "profile-shot")
    assert screenshot.is_file(), "chromium wrote no screenshot"
    if os.environ.get("REPORT_SCREENSHOT"):  # to look at it: REPORT_SCREENSHOT=/tmp/report-screenshot.png
        shutil.copyfile(screenshot, os.environ["REPORT_SCREENSHOT"])
    width, height, colours = png_pixels(screenshot.read_bytes())
    assert (width, height) == (1280, 4000)
    inked = sum(n for rgb, n in colours.items() if min(rgb) < 200)
    assert inked > 0.02 * width * height, f"only {inked} inked pixels: is the page blank?"
    for plot in report.PLOTS:
        for series in plot.series:
            assert count_near(colours, series.color) > 150, f"{series.key} ({series.color}) is not on the screenshot"
    for flag in report.FLAGS:
        assert count_near(colours, flag.color, tolerance=6) > 2000, f"no {flag.key} band on the screenshot"


def test_a_run_record_linked_out_of_the_run_folder_is_not_read(tmp_path):
    secret = tmp_path / "credentials.json"
    secret.write_text(json.dumps({"token": "hunter2-secret"}))
    root = write_output_root(tmp_path / "output", metric_lines(4), record=None)
    (root / "model").mkdir()
    (root / "model/run_record.json").symlink_to(secret)
    page = render(root)
    assert "hunter2-secret" not in page
    assert "link out of the run folder" in page


def test_the_headline_validation_is_the_final_fixed_validation(tmp_path):
    record = copy.deepcopy(RUN_RECORD)
    record["comparability"] = {"validation": {"sha256": "c" * 64, "ce_before": 10.9, "ce_after": 3.2109}}
    page = render(write_output_root(tmp_path / "output", metric_lines(), record))
    assert re.search(r"final validation CE.{0,300}3\.2109.{0,300}fixed validation set, after training", page, re.S)
    assert "final val_loss" not in page
