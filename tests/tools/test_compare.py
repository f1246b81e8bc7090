"""``tools compare`` on runs written here (a record and a history each, no training): the check that
names what differs, the page's plots holding the runs' own numbers, and the page in a real browser."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import CHROMIUM, run_chromium

from callbacks.history import COLUMNS
from tools import compare

UPDATES = 40


def record(seed: int = 1) -> dict:
    return {"status": "completed", "wall_seconds": 100.0, "optimizer_steps": UPDATES, "seed": seed,
            "config": {"seed": seed, "model": {"n_layer": 12}}, "world_size": 1, "precision": "bf16-mixed",
            "environment": {"libraries": {"torch": "2.13"}, "gpu": "NVIDIA H200"},
            "summary": {"tokens_per_second": 500_000.0, "mfu": 0.5, "peak_allocated_gib": 30.0},
            "comparability": {
                "initial_weights_sha256": "a" * 64,
                "training_tokens": {"sha256": "b" * 64, "updates": UPDATES},
                "validation": {"sha256": "c" * 64, "documents": 10, "tokens": 1000, "ce_before": 10.9,
                               "ce_after": 6.8},
                "tokenizer_sha256": "d" * 64,
                "measurement_scope": {"warmup_updates": 10, "observed_updates": []}}}


def history(loss_scale: float = 1.0, digests: np.ndarray | None = None) -> dict:
    updates = np.arange(1, UPDATES + 1)
    rng = np.random.default_rng(5)
    return {"update": updates, "loss": (10.0 / np.sqrt(updates) + rng.uniform(0, 0.2, UPDATES)) * loss_scale,
            "lr": np.minimum(updates / 10, 1.0) * 6e-4, "grad_norm": rng.uniform(0.5, 2.0, UPDATES),
            "target_tokens": rng.integers(100_000, 130_000, UPDATES), "seconds": updates * 0.25,
            "tokens_digest": digests if digests is not None else np.arange(UPDATES) * 7 + 3}


def write_run(folder: Path, rec: dict, columns: dict) -> Path:
    model = folder / "model"
    model.mkdir(parents=True)
    (model / "run_record.json").write_text(json.dumps(rec))
    np.savez_compressed(model / "history.npz", stride=np.int64(1),
                        **{name: np.asarray(columns[name], dtype=dtype) for name, dtype in COLUMNS.items()})
    return folder


@pytest.fixture
def two_runs(tmp_path) -> tuple[Path, Path, dict, dict]:
    first, second = history(), history(loss_scale=0.9)
    faster = record()
    faster["summary"]["tokens_per_second"] = 600_000.0
    return (write_run(tmp_path / "baseline", record(), first), write_run(tmp_path / "change", faster, second),
            first, second)


def path_vertices(page: str, gid: str) -> np.ndarray:
    """The (x, y) vertices of the line drawn with id ``gid``, as matplotlib wrote them into the SVG."""
    found = re.search(rf'id="{re.escape(gid)}".*?\sd="([^"]+)"', page, re.S)
    assert found, f"no line {gid} on the page"
    numbers = [float(v) for v in re.findall(r"-?\d+(?:\.\d+)?", found.group(1))]
    return np.array(numbers).reshape(-1, 2)


def assert_drawn_from(vertices: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    """Every point drawn, at a position linear in the data (SVG's y axis points down)."""
    assert len(vertices) == len(x)
    assert np.corrcoef(vertices[:, 0], x)[0, 1] == pytest.approx(1.0, abs=1e-6)
    assert np.corrcoef(vertices[:, 1], y)[0, 1] == pytest.approx(-1.0, abs=1e-6)


def test_the_plots_hold_each_runs_numbers_and_the_table_its_ratios(two_runs, tmp_path, capsys):
    a, b, first, second = two_runs
    assert compare.main([str(a), str(b / "model"), "--out", str(tmp_path / "page")]) == 0
    assert json.loads(capsys.readouterr().out)["comparable"] is True
    page = (tmp_path / "page" / "index.html").read_text()
    for index, columns in enumerate((first, second)):
        assert_drawn_from(path_vertices(page, f"line-loss-by-update-{index}"), columns["update"], columns["loss"])
        assert_drawn_from(path_vertices(page, f"line-loss-by-tokens-{index}"), np.cumsum(columns["target_tokens"]),
                          columns["loss"])
        assert_drawn_from(path_vertices(page, f"line-grad-norm-{index}"), columns["update"], columns["grad_norm"])
        assert len(path_vertices(page, f"line-validation-{index}-fixed-set")) == 2  # before and after
    results = page[page.index('<table id="results">'):]
    assert "(1.200x)" in results[:results.index("</tr>", results.index("tokens/s, run record"))]
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org", "")


@pytest.mark.parametrize("change, named", [
    (lambda c: c.update(initial_weights_sha256="e" * 64), "initial weights"),
    (lambda c: c["validation"].update(sha256="f" * 64), "validation set"),
    (lambda c: c["measurement_scope"].update(warmup_updates=5), "measurement scope"),
    (lambda c: c.update(tokenizer_sha256="0" * 64), "tokenizer"),
])
def test_each_fingerprint_that_differs_is_named(tmp_path, capsys, change, named):
    other = record()
    change(other["comparability"])
    a = write_run(tmp_path / "a", record(), history())
    b = write_run(tmp_path / "b", other, history())
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "page")]) == 1
    assert [d["fingerprint"] for d in json.loads(capsys.readouterr().out)["differences"]] == [named]


def test_the_first_update_whose_tokens_differ_is_found(tmp_path, capsys):
    digests = history()["tokens_digest"].copy()
    digests[16] += 1  # update 17
    other = copy.deepcopy(record())
    other["comparability"]["training_tokens"]["sha256"] = "9" * 64
    a = write_run(tmp_path / "a", record(), history())
    b = write_run(tmp_path / "b", other, history(digests=digests))
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "page")]) == 1
    captured = capsys.readouterr()
    assert "training tokens differ in b: from update 17" in captured.err


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                  "(apt-get install -y chromium; .ci/run installs it)")
def test_chromium_renders_the_page_with_every_runs_curves(two_runs, tmp_path, capsys):
    import matplotlib.image

    a, b, _, _ = two_runs
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "page")]) == 0
    page = tmp_path / "page" / "index.html"
    dom = run_chromium("--dump-dom", page.as_uri(), profile=tmp_path / "profile-dom").decode("utf-8")
    for curve in compare.CURVES:
        assert f'id="plot-{curve.slug}"' in dom
        for index in (0, 1):
            assert f'id="line-{curve.slug}-{index}' in dom, (curve.slug, index)
    assert "Comparable." in dom
    screenshot = tmp_path / "compare.png"
    run_chromium(f"--screenshot={screenshot}", "--window-size=1280,3000", page.as_uri(), profile=tmp_path / "shot")
    pixels = (matplotlib.image.imread(screenshot)[:, :, :3] * 255).astype(int)
    for color in compare.COLORS[:2]:
        rgb = np.array([int(color[i:i + 2], 16) for i in (1, 3, 5)])
        near = (np.abs(pixels - rgb).max(axis=2) <= 24).sum()
        assert near > 500, f"the run drawn in {color} is not on the screenshot"


@pytest.mark.parametrize("planted", ["index.html", "loss-by-update.png", compare.WRITTEN_BY])
def test_a_link_planted_in_out_is_refused_and_its_target_kept(two_runs, tmp_path, capsys, planted):
    a, b, _, _ = two_runs
    out = tmp_path / "page"
    out.mkdir()
    (out / compare.WRITTEN_BY).touch()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (out / planted).unlink(missing_ok=True)
    (out / planted).symlink_to(victim)
    assert compare.main([str(a), str(b), "--out", str(out)]) == 2
    assert victim.read_text() == "keep me"
    err = capsys.readouterr().err
    assert "symbolic link" in err and planted in err and len(err.strip().splitlines()) == 1


def damage_record_list(model: Path) -> Path:
    (model / "run_record.json").write_text("[1, 2]")
    return model / "run_record.json"


def damage_deep_json(model: Path) -> Path:
    (model / "run_record.json").write_text("[" * 100_000 + "]" * 100_000)
    return model / "run_record.json"


def damage_string_number(model: Path) -> Path:
    rec = json.loads((model / "run_record.json").read_text())
    rec["comparability"]["validation"]["ce_after"] = "low"
    (model / "run_record.json").write_text(json.dumps(rec))
    return model / "run_record.json"


def damage_history_cut(model: Path) -> Path:
    data = (model / "history.npz").read_bytes()
    (model / "history.npz").write_bytes(data[:len(data) // 2])
    return model / "history.npz"


def damage_metric_line(model: Path) -> Path:
    run = model.parent / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 5, "val_loss": 7.1}\n{"step": 10, "val_loss": "NaN?"}\n')
    return run / "metrics.jsonl"


@pytest.mark.parametrize("damage", [damage_record_list, damage_deep_json, damage_string_number, damage_history_cut,
                                    damage_metric_line])
def test_a_damaged_run_folder_is_exit_2_and_one_line_naming_the_file(two_runs, tmp_path, capsys, damage):
    a, b, _, _ = two_runs
    named = damage(b / "model")
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "page")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(named) in err
    assert "Traceback" not in err


def test_a_folder_name_that_matplotlib_would_read_as_math_is_drawn_as_written(tmp_path, capsys):
    columns = history()
    a = write_run(tmp_path / "$x^$", record(), columns)
    b = write_run(tmp_path / "b$_{", record(), columns)
    assert compare.main([str(a), str(b), "--out", str(tmp_path / "page")]) == 0
    assert (tmp_path / "page" / "loss-by-update.png").stat().st_size > 0


def changed(rec: dict, **config) -> dict:
    """``rec`` with dotted config keys set (``model__n_layer`` for model.n_layer)."""
    rec = copy.deepcopy(rec)
    for key, value in config.items():
        *sections, last = key.split("__")
        target = rec["config"]
        for section in sections:
            target = target.setdefault(section, {})
        target[last] = value
    return rec


def verdict(tmp_path, capsys, a: Path, b: Path) -> tuple[int, dict, str]:
    code = compare.main([str(a), str(b), "--out", str(tmp_path / "page")])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def test_an_architecture_change_is_comparable_and_named_with_its_new_initial_weights(tmp_path, capsys):
    deeper = changed(record(), model__n_layer=24)
    deeper["comparability"]["initial_weights_sha256"] = "e" * 64
    code, result, err = verdict(tmp_path, capsys, write_run(tmp_path / "a", record(), history()),
                                write_run(tmp_path / "b", deeper, history()))
    assert code == 0 and result["comparable"]
    [entry] = result["changes"]
    assert [(c["key"], c["kind"]) for c in entry["change"]] == [("model.n_layer", "architecture")]
    assert [d["fingerprint"] for d in entry["explained"]] == ["initial weights"]
    assert "change: b: model.n_layer (a change of architecture)" in err
    assert "necessarily changes the initial weights" in err
    assert "necessarily changes the initial weights" in (tmp_path / "page" / "index.html").read_text()


def test_an_optimizer_change_keeps_the_initial_weights_and_is_comparable(tmp_path, capsys):
    muon = changed(record(), optim__name="muon", optim__lr=0.02)
    base = changed(record(), optim__name="adamw", optim__lr=6e-4)
    code, result, err = verdict(tmp_path, capsys, write_run(tmp_path / "a", base, history()),
                                write_run(tmp_path / "b", muon, history()))
    assert code == 0
    assert {c["kind"] for c in result["changes"][0]["change"]} == {"optimizer"}
    assert "optim.lr, optim.name (a change of optimizer)" in err


def test_a_seed_change_is_not_comparable_and_named(tmp_path, capsys):
    other = record(seed=7)
    other["comparability"]["initial_weights_sha256"] = "e" * 64
    code, result, err = verdict(tmp_path, capsys, write_run(tmp_path / "a", record(), history()),
                                write_run(tmp_path / "b", other, history()))
    assert code == 1
    assert [d["fingerprint"] for d in result["differences"]] == ["seed"]
    assert "not comparable: seed differ in b: seed 1 in a, 7 in b" in err


def test_another_validation_set_without_a_configuration_change_is_not_comparable(tmp_path, capsys):
    other = record()
    other["comparability"]["validation"]["sha256"] = "f" * 64
    code, result, err = verdict(tmp_path, capsys, write_run(tmp_path / "a", record(), history()),
                                write_run(tmp_path / "b", other, history()))
    assert code == 1 and result["changes"][0]["change"] == []
    assert "validation set differ in b" in err and "no configuration change explains it" in err


def test_train_longer_on_the_same_tokens_is_comparable(tmp_path, capsys):
    longer_columns = {name: np.concatenate([column, column[-10:]]) for name, column in history().items()}
    longer_columns["update"] = np.arange(1, UPDATES + 11)
    longer_columns["tokens_digest"] = np.arange(UPDATES + 10) * 7 + 3  # the same first 40 updates, 10 more
    longer = changed(record(), trainer__max_steps=UPDATES + 10)
    longer["optimizer_steps"] = UPDATES + 10
    longer["comparability"]["training_tokens"] = {"sha256": "9" * 64, "updates": UPDATES + 10}
    base = changed(record(), trainer__max_steps=UPDATES)
    code, result, err = verdict(tmp_path, capsys, write_run(tmp_path / "a", base, history()),
                                write_run(tmp_path / "b", longer, longer_columns))
    assert code == 0, err
    assert [d["fingerprint"] for d in result["changes"][0]["explained"]] == ["training tokens"]
    assert "trained longer (trainer.max_steps) on the same tokens in the same order" in err


def test_train_longer_on_other_tokens_is_not_comparable(tmp_path, capsys):
    digests = history()["tokens_digest"].copy()
    digests[3] += 1
    longer = changed(record(), trainer__max_steps=UPDATES + 10)
    longer["comparability"]["training_tokens"]["sha256"] = "9" * 64
    code, result, _ = verdict(tmp_path, capsys, write_run(tmp_path / "a", record(), history()),
                              write_run(tmp_path / "b", longer, history(digests=digests)))
    assert code == 1 and [d["fingerprint"] for d in result["differences"]] == ["training tokens"]


def test_a_resumed_run_is_measured_over_its_whole_history(tmp_path, capsys):
    resumed = record()
    resumed["wall_seconds"] = 3.0  # the last segment alone; the history counts every segment's seconds
    columns = history()
    code, _, _ = verdict(tmp_path, capsys, write_run(tmp_path / "a", record(), history()),
                         write_run(tmp_path / "b", resumed, columns))
    assert code == 0
    page = (tmp_path / "page" / "index.html").read_text()
    row = page[page.index("<th>training seconds, whole history</th>"):]
    row = row[:row.index("</tr>")]
    assert f"{columns['seconds'][-1]:g}" in row.replace(",", "")
    row = page[page.index("<th>target tokens, whole history</th>"):]
    assert f"<td>{int(np.sum(columns['target_tokens']))} " in row[:row.index("</tr>")]


def test_a_single_run_is_a_usage_error_and_nothing_is_written(two_runs, tmp_path, capsys):
    a, _, _, _ = two_runs
    assert compare.main([str(a), "--out", str(tmp_path / "page")]) == 2
    assert "two runs or more" in capsys.readouterr().err
    assert not (tmp_path / "page").exists()
