"""Experiments as the training lab runs them, end to end on a CPU: the run record's fingerprints, the
per-update history, the fixed validation before and after, ``tools compare``, ``tools evaluate`` and
``tools sample``, on the stdin path and from prepared shards (LitData; CI installs it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from callbacks.history import read_history

from tests.helpers import ROOT, as_args, as_dotlist, records, tiny

TIMEOUT = 300
STDIN_RUN = ["--config", "conf/smoke.yaml", *as_args(tiny({
    "trainer.max_steps": 6, "trainer.val_every_steps": 3, "optim.warmup_steps": 1, "metrics.interval_seconds": 0,
    "data.val_fraction": 0.05,
}))]
SHARD_VALUES = tiny({"model.vocab_size": 8192, "model.max_seq_len": 32, "data.tokenizer": "conf/tokenizer.json",
                     "data.val_fraction": 0.05, "data.val_max_tokens": 4096, "data.shuffle_buffer_docs": 16,
                     "data.loader_workers": 0, "optim.warmup_steps": 1, "optim.schedule": "constant",
                     "trainer.global_batch_size": 6, "data.microbatch": 2, "metrics.interval_seconds": 0,
                     "trainer.val_every_steps": 0})


def run(args: list[str], output: Path, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(output), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, *args], input=stdin, env=env, capture_output=True, timeout=TIMEOUT,
                            cwd=cwd or ROOT)
    return result


def train(output: Path, *extra: str) -> Path:
    result = run([str(ROOT / "train.py"), *STDIN_RUN, *extra], output, records(500))
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return output


def tool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools", *map(str, args)], capture_output=True, text=True,
                          timeout=TIMEOUT, cwd=cwd or ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))


def record_of(output: Path) -> dict:
    return json.loads((output / "model" / "run_record.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A baseline, the same command again, the same with another seed, and a deeper model."""
    root = tmp_path_factory.mktemp("runs")
    return {"baseline": train(root / "baseline"), "rerun": train(root / "rerun"),
            "seed": train(root / "seed", "--seed", "7"), "layers": train(root / "layers", "--model.n_layer", "4")}


# ----------------------------------------------------------------------------- the record and the history


def test_the_record_has_the_fingerprints_and_the_history_every_update(runs):
    out = runs["baseline"]
    record = record_of(out)
    comparability = record["comparability"]
    assert len(comparability["initial_weights_sha256"]) == 64
    assert comparability["training_tokens"]["updates"] == 6
    assert comparability["tokenizer_sha256"] == record["tokenizer"]["sha256"]
    assert comparability["measurement_scope"]["warmup_updates"] == record["config"]["observe"]["warmup_updates"]
    validation = comparability["validation"]
    assert validation["documents"] > 0 and validation["ce_before"] > validation["ce_after"]
    history = read_history(out / "model" / "history.npz")
    assert history["stride"] == 1 and history["update"].tolist() == [1, 2, 3, 4, 5, 6]
    lines = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]  # one line per update (interval 0)
    assert history["loss"] == pytest.approx([line["loss"] for line in lines], abs=1e-6)
    assert history["grad_norm"] == pytest.approx([line["grad_norm"] for line in lines], abs=1e-5)
    # A line's lr is the one the next update trains with; the history keeps each update's own.
    assert history["lr"][1:] == pytest.approx([line["lr"] for line in lines[:-1]], abs=1e-6)  # lines: 6 decimals
    assert (history["target_tokens"] > 0).all() and np.all(np.diff(history["seconds"]) >= 0)
    # The pool was complete by then; validation_step averages in float32.
    assert lines[-1]["val_loss"] == pytest.approx(validation["ce_after"], abs=1e-5)


# ----------------------------------------------------------------------------- compare


def test_a_seed_identical_rerun_is_comparable(runs, tmp_path):
    result = tool("compare", runs["baseline"], runs["rerun"] / "model", "--out", tmp_path / "page")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["comparable"] and verdict["differences"] == []
    page = (tmp_path / "page" / "index.html").read_text()
    assert "<strong>Comparable.</strong>" in page and 'id="results"' in page
    for slug in ("loss-by-update", "loss-by-tokens", "validation", "lr", "grad-norm"):
        assert (tmp_path / "page" / f"{slug}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'id="line-{slug}-0' in page and f'id="line-{slug}-1' in page


def test_runs_differing_only_in_seed_are_refused_and_the_message_names_the_seed(runs, tmp_path):
    result = tool("compare", runs["baseline"], runs["seed"], "--out", tmp_path / "page")
    assert result.returncode == 1
    assert "not comparable: seed differ in seed: seed " in result.stderr
    found = {d["fingerprint"]: d["detail"] for d in json.loads(result.stdout)["differences"]}
    assert set(found) == {"seed", "training tokens"}  # the seed also shuffles the input
    assert "initial weights" in found["seed"] and found["training tokens"].startswith("from update ")
    page = (tmp_path / "page" / "index.html").read_text()
    assert "<strong>Not comparable.</strong>" in page and "<strong>seed</strong>" in page
    assert 'id="line-' not in page and not list((tmp_path / "page").glob("*.png"))  # nothing drawn
    assert '<table id="config">' in page and "seed" in page  # but what differs is shown

    forced = tool("compare", runs["baseline"], runs["seed"], "--out", tmp_path / "page", "--force")
    assert forced.returncode == 1
    page = (tmp_path / "page" / "index.html").read_text()
    assert "Drawn anyway (--force)" in page and 'id="line-loss-by-update-1' in page


def test_a_deeper_model_is_an_architecture_comparison_and_the_page_says_so(runs, tmp_path):
    result = tool("compare", runs["baseline"], runs["layers"], "--out", tmp_path / "page")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["differences"] == []  # the same tokens, validation set, scope and tokenizer
    [entry] = verdict["changes"]
    assert [c["key"] for c in entry["change"]] == ["model.n_layer"]
    assert [d["fingerprint"] for d in entry["explained"]] == ["initial weights"]
    page = (tmp_path / "page" / "index.html").read_text()
    assert "model.n_layer (a change of architecture)" in page
    assert "necessarily changes the initial weights" in page


def test_compare_never_writes_into_a_folder_of_someone_elses(runs, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    result = tool("compare", runs["baseline"], runs["rerun"], "--out", tmp_path / "mine")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep" and len(list((tmp_path / "mine").iterdir())) == 1
    assert tool("compare", tmp_path, "--out", tmp_path / "x").returncode == 2


# ----------------------------------------------------------------------------- evaluate, sample


def test_evaluate_on_the_runs_validation_set_gives_its_final_validation_ce(runs):
    out = runs["baseline"]
    result = tool("evaluate", out / "model", "--data", out / "run" / "validation.jsonl")
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout)
    validation = record_of(out)["comparability"]["validation"]
    assert scored["cross_entropy"] == pytest.approx(validation["ce_after"], rel=1e-6)
    assert scored["documents"] == {k: validation[k] for k in ("sha256", "documents", "tokens")}
    assert scored["perplexity"] == pytest.approx(np.exp(scored["cross_entropy"]))
    # Another model on the same file: a number of its own, on the same documents.
    other = json.loads(tool("evaluate", runs["layers"] / "model", "--data", out / "run" / "validation.jsonl").stdout)
    assert other["documents"] == scored["documents"] and other["cross_entropy"] != scored["cross_entropy"]
    assert other["cross_entropy"] == pytest.approx(record_of(runs["layers"])["comparability"]["validation"]["ce_after"],
                                                   rel=1e-6)


def test_runs_of_other_lengths_and_batch_splits_on_the_same_input_validate_on_the_same_set(tmp_path):
    """The held-out set is gathered from the read-ahead before the first update (100 documents here), so a
    run three times as long, with another microbatch and accumulation, validates on the very same set."""
    short = train(tmp_path / "short", "--data.shuffle_buffer_docs", "100", "--trainer.max_steps", "3",
                  "--microbatch", "8")
    long = train(tmp_path / "long", "--data.shuffle_buffer_docs", "100", "--trainer.max_steps", "9",
                 "--microbatch", "16", "--accumulation", "2")
    a, b = (record_of(out)["comparability"]["validation"] for out in (short, long))
    assert a["formed"] == "held out from the input" and a["closed_by"] == "read_ahead" and a["documents"] > 0
    assert (a["sha256"], a["documents"], a["tokens"]) == (b["sha256"], b["documents"], b["tokens"])
    assert record_of(short)["input"]["held_out_documents"] == record_of(long)["input"]["held_out_documents"]
    assert b["ce_before"] == pytest.approx(a["ce_before"], rel=1e-6) and b["ce_after"] < a["ce_after"]


def test_a_validation_file_is_the_set_and_evaluate_scores_it_alike(tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_bytes(records(560)[len(records(500)):])  # records the training input does not hold
    out = train(tmp_path / "run", "--data.val_path", str(val))
    record = record_of(out)
    validation = record["comparability"]["validation"]
    assert validation["formed"] == "file" and validation["source"] == str(val) and validation["documents"] == 60
    assert record["input"]["held_out_documents"] == 0 and "file" not in validation  # nothing saved: the file is it
    scored = json.loads(tool("evaluate", out / "model", "--data", val).stdout)
    assert scored["documents"]["sha256"] == validation["sha256"]
    assert scored["cross_entropy"] == pytest.approx(validation["ce_after"], rel=1e-6)


def test_evaluate_reads_text_records_by_the_trainers_rules(runs, tmp_path):
    data = tmp_path / "text.jsonl"
    data.write_bytes(records(20) + b"not json\n" + b'{"text": ""}\n')
    result = tool("evaluate", runs["baseline"] / "model", "--data", data)
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout)
    assert scored["rejected"] == {"empty_text": 1, "invalid_json": 1} and scored["documents"]["documents"] == 20
    assert tool("evaluate", runs["baseline"] / "model", "--data", tmp_path / "absent.jsonl").returncode == 2
    assert tool("evaluate", tmp_path, "--data", data).returncode == 2


def test_sample_prints_the_text_alone_greedy_or_seeded(runs):
    model = runs["baseline"] / "model"
    greedy = [tool("sample", model, "--prompt", "def main", "--max-new-tokens", "8") for _ in range(2)]
    assert greedy[0].returncode == 0, greedy[0].stderr
    assert greedy[0].stdout == greedy[1].stdout and greedy[0].stdout.startswith("def main")
    assert greedy[0].stderr == ""  # no progress, no warnings
    seeded = [tool("sample", model, "--prompt", "def main", "--max-new-tokens", "8", "--temperature", "1.0",
                   "--top-k", "50", "--seed", str(seed), "--continuation-only") for seed in (1, 1, 2)]
    assert seeded[0].stdout == seeded[1].stdout != seeded[2].stdout
    assert tool("sample", model, "--prompt", "x", "--max-new-tokens", "0").returncode == 2


# ----------------------------------------------------------------------------- prepared shards


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shards")
    (folder / "corpus.jsonl").write_bytes(records(300))
    result = tool("prepare", "--input", folder / "corpus.jsonl", "--output", folder / "rows", "--config",
                  "conf/smoke.yaml", "--workers", "1", *as_args(SHARD_VALUES))
    assert result.returncode == 0, result.stderr
    return folder / "rows"


def train_shards(prepared: Path, output: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    result = run([str(ROOT / "train.py"), "--config", "conf/smoke.yaml", *as_args(SHARD_VALUES), "--data.source",
                  "litdata", "--data.path", str(prepared), "--trainer.max_steps", str(steps), *extra], output)
    assert result.returncode == 0, result.stderr.decode()[-3000:]
    return result


def test_prepare_holds_out_a_validation_split_and_fingerprints_what_decides_the_rows(prepared, tmp_path):
    meta = json.loads((prepared / "runfab-shards.json").read_text())
    lines = (prepared / "validation.jsonl").read_text().splitlines()
    assert meta["validation"]["documents"] == len(lines) == meta["summary"]["held_out_documents"] > 0
    assert meta["summary"]["documents"] - meta["summary"]["held_out_documents"] > 0
    # The same input prepared again elsewhere: the same fingerprint; one record changed: another.
    (tmp_path / "again.jsonl").write_bytes(records(300))
    (tmp_path / "changed.jsonl").write_bytes(records(300).replace(b"a", b"b", 1))
    fingerprints = []
    for name in ("again", "changed"):
        assert tool("prepare", "--input", tmp_path / f"{name}.jsonl", "--output", tmp_path / name, "--config",
                    "conf/smoke.yaml", "--workers", "1", *as_args(SHARD_VALUES)).returncode == 0
        fingerprints.append(json.loads((tmp_path / name / "runfab-shards.json").read_text())["fingerprint"])
    assert fingerprints[0] == meta["fingerprint"] != fingerprints[1]


def test_a_shard_run_validates_on_the_split_and_records_the_fingerprint(prepared, tmp_path):
    train_shards(prepared, tmp_path / "one", 5)
    comparability = record_of(tmp_path / "one")["comparability"]
    assert comparability["shards_fingerprint"] == json.loads((prepared / "runfab-shards.json").read_text())["fingerprint"]
    validation = comparability["validation"]
    assert validation["source"].endswith("validation.jsonl") and validation["ce_before"] > validation["ce_after"]
    scored = json.loads(tool("evaluate", tmp_path / "one" / "model", "--data", prepared / "validation.jsonl").stdout)
    assert scored["cross_entropy"] == pytest.approx(validation["ce_after"], rel=1e-6)
    assert scored["documents"]["sha256"] == validation["sha256"]


RANKS_SCRIPT = """
import sys
from config import load_config
from runtime import training_run
from runtime.batch_split import BatchSplit
ranks = int(sys.argv[1])
cfg = load_config("conf/smoke.yaml", sys.argv[2:])
training_run.run_training(cfg, BatchSplit(6 // ranks, 1, ranks, 6), stdin=sys.stdin.buffer)
"""


def test_a_3_rank_run_has_the_history_of_a_1_rank_run_and_is_comparable(tmp_path):
    """The stdin path trains the same updates on any number of ranks (6 rows per update here)."""
    values = tiny({"trainer.max_steps": 5, "trainer.val_every_steps": 2, "optim.warmup_steps": 1,
                   "metrics.interval_seconds": 0, "data.val_fraction": 0.05, "trainer.accelerator": "cpu"})
    for ranks in (1, 3):
        result = run(["-c", RANKS_SCRIPT, str(ranks), *as_dotlist(values), f"output.root={tmp_path / str(ranks)}"],
                     tmp_path / str(ranks), records(300))
        assert result.returncode == 0, result.stderr.decode()[-3000:]
    one, three = (read_history(tmp_path / name / "model" / "history.npz") for name in ("1", "3"))
    assert one["update"].tolist() == [1, 2, 3, 4, 5]
    for exact in ("update", "target_tokens", "tokens_digest", "lr"):
        assert one[exact].tolist() == three[exact].tolist(), exact
    assert three["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert three["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
    assert record_of(tmp_path / "3")["world_size"] == 3
    sets = [record_of(tmp_path / name)["comparability"]["validation"] for name in ("1", "3")]
    same = ("formed", "closed_by", "closed_after_updates", "documents_read", "sha256", "documents", "tokens")
    assert [sets[1][k] for k in same] == [sets[0][k] for k in same]  # one set, closed alike, on every rank
    assert sets[1]["ce_after"] == pytest.approx(sets[0]["ce_after"], rel=1e-5)
    losses = [[line["val_loss"] for line in map(json.loads, (tmp_path / name / "run/metrics.jsonl").open())
               if "val_loss" in line] for name in ("1", "3")]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-4)
    compared = tool("compare", tmp_path / "1", tmp_path / "3", "--out", tmp_path / "page")
    assert compared.returncode == 0, compared.stdout + compared.stderr


def test_a_resumed_shard_run_has_the_history_of_an_uninterrupted_one(prepared, tmp_path):
    train_shards(prepared, tmp_path / "whole", 6)
    train_shards(prepared, tmp_path / "parts", 3, "--trainer.checkpoint_every_steps", "3")
    train_shards(prepared, tmp_path / "parts", 6, "--ckpt_path", "last")
    whole, parts = (read_history(tmp_path / name / "model" / "history.npz") for name in ("whole", "parts"))
    assert parts["update"].tolist() == [1, 2, 3, 4, 5, 6]
    for exact in ("update", "target_tokens", "tokens_digest", "lr"):
        assert whole[exact].tolist() == parts[exact].tolist(), exact
    assert parts["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert np.all(np.diff(parts["seconds"]) >= 0)  # the second segment's time continues the first's
    a, b = (record_of(tmp_path / name)["comparability"] for name in ("whole", "parts"))
    assert a["initial_weights_sha256"] == b["initial_weights_sha256"]
    assert a["training_tokens"] == b["training_tokens"]
    assert b["validation"]["ce_before"] == pytest.approx(a["validation"]["ce_before"], rel=1e-6)


def test_a_resumed_muon_run_ends_on_the_uninterrupted_runs_weights_bit_for_bit(prepared, tmp_path):
    """Both optimizers' state (Muon's momentum, AdamW's moments) and the wsd schedule survive a checkpoint."""
    muon = ("--optim.name", "muon", "--optim.schedule", "wsd", "--optim.decay_steps", "6")
    train_shards(prepared, tmp_path / "whole", 6, *muon)
    train_shards(prepared, tmp_path / "parts", 3, "--trainer.checkpoint_every_steps", "3", *muon)
    train_shards(prepared, tmp_path / "parts", 6, "--ckpt_path", "last", *muon)
    whole, parts = (read_history(tmp_path / name / "model" / "history.npz") for name in ("whole", "parts"))
    assert whole["loss"].tolist() == parts["loss"].tolist() and whole["lr"].tolist() == parts["lr"].tolist()
    weights = [load_file(tmp_path / name / "model" / "model.safetensors") for name in ("whole", "parts")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    optimizers = record_of(tmp_path / "parts")["optimizers"]
    assert [(o["name"], o["lr"]) for o in optimizers] == [("Muon", 0.02), ("AdamW", 3e-3)]
    assert [[g["lr"] for g in o["groups"]] for o in optimizers] == [[0.02], [3e-3, 3e-3]]  # AdamW: decay, no decay
    assert all(o["parameters"] == sum(g["parameters"] for g in o["groups"]) for o in optimizers)
