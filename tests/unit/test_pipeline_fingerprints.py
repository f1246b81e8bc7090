"""The digests that make runs comparable, the per-update history's bound, and the exported pad token."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline import fingerprints
from callbacks.history import COLUMNS, History, merge_pairs, model_weights_digest
from model.decoder import ModelConfig
from model.gpt import GPT
from pipeline.packing import Row, collate_rows, pack_rows
from pipeline.records import StreamStats
from pipeline.stream import split_update

from tests.helpers import ROOT

SEQ_LEN = 16


def rows(seed: int = 0, count: int = 12) -> list[Row]:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(1, 500, n).astype(np.int32) for n in rng.integers(1, 40, 60)]
    return list(pack_rows(docs, SEQ_LEN, StreamStats()))[:count]


def test_an_updates_digest_is_the_same_however_its_rows_are_split_over_ranks():
    update = rows()
    values = set()
    for world, microbatch in ((1, 12), (1, 4), (2, 3), (3, 2), (4, 1)):
        per_rank = split_update(update, world, microbatch, StreamStats())
        batches = [b for share in per_rank for b in share]
        assert len({b["update_digest"] for b in batches}) == 1  # every rank's microbatch carries the whole update's
        assert sum(b["rows_digest"] for b in batches) == batches[0]["update_digest"]
        values.add(batches[0]["update_digest"])
    assert len(values) == 1


def test_the_digest_changes_with_one_token_or_one_document_boundary():
    update = rows()
    base = collate_rows(update)["rows_digest"]
    changed = [Row(r.tokens.copy(), r.positions.copy()) for r in update]
    changed[5].tokens[3] += 1
    assert collate_rows(changed)["rows_digest"] != base
    moved = [Row(r.tokens.copy(), r.positions.copy()) for r in update]
    moved[2].positions[:] = np.arange(SEQ_LEN)  # the same tokens as one document
    assert collate_rows(moved)["rows_digest"] != base


def test_the_tokens_chain_depends_on_the_order_of_updates():
    assert fingerprints.tokens_chain([1, 2, 3]) == fingerprints.tokens_chain([1, 2, 3])
    assert fingerprints.tokens_chain([1, 2, 3]) != fingerprints.tokens_chain([1, 3, 2])


def test_the_initial_weights_digest_follows_the_seed_and_the_shape_not_the_dtype():
    def built(seed: int, layers: int = 1) -> GPT:
        torch.manual_seed(seed)
        return GPT(ModelConfig(vocab_size=64, n_layer=layers, n_head=2, n_embd=16, max_seq_len=SEQ_LEN))

    digest = model_weights_digest(built(1))
    assert digest == model_weights_digest(built(1))
    assert digest != model_weights_digest(built(2))
    assert digest != model_weights_digest(built(1, layers=2))
    model = built(1).double()  # another dtype of the same weights: the canonical form is fp32
    assert model_weights_digest(model) == digest


def test_the_validation_digest_is_built_a_document_at_a_time():
    docs = [np.array([1, 2, 3], np.int32), np.array([4], np.int32)]
    digest = fingerprints.ValidationDigest()
    for doc in docs:
        digest.update(doc)
    assert digest.result() == fingerprints.validation_digest(docs) | {"documents": 2, "tokens": 4}
    assert fingerprints.validation_digest(docs[::-1])["sha256"] != digest.result()["sha256"]
    assert fingerprints.validation_digest([np.array([1, 2]), np.array([3, 4])])["sha256"] != \
        fingerprints.validation_digest([np.array([1]), np.array([2, 3, 4])])["sha256"]


def history_rows(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"update": np.arange(1, count + 1), "loss": rng.uniform(2, 4, count), "lr": np.linspace(0, 1, count),
            "grad_norm": rng.uniform(0, 1, count), "target_tokens": rng.integers(100, 200, count),
            "seconds": np.arange(count) * 0.5, "tokens_digest": rng.integers(0, 1 << 50, count)}


def test_merged_rows_keep_the_token_weighted_loss_and_the_sums():
    columns = {name: values.astype(COLUMNS[name]) for name, values in history_rows(5).items()}
    merged = merge_pairs(columns)
    assert merged["update"].tolist() == [2, 4, 5]
    t, loss = columns["target_tokens"], columns["loss"]
    assert merged["loss"][0] == pytest.approx((loss[0] * t[0] + loss[1] * t[1]) / (t[0] + t[1]))
    assert merged["target_tokens"].sum() == t.sum()
    assert merged["tokens_digest"][1] == columns["tokens_digest"][2] + columns["tokens_digest"][3]
    assert merged["loss"][2] == loss[4]


def test_the_history_stays_within_its_bound_and_says_its_stride():
    """Updates reach the history as Lightning reports them, one microbatch per update here."""
    history = History(max_rows=8)
    rows = history_rows(37)
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])
    trainer = SimpleNamespace(world_size=1, global_step=0, optimizers=[optimizer], is_global_zero=True, loggers=[])
    for i in range(37):
        tokens = int(rows["target_tokens"][i])
        batch = {"update_target_tokens": tokens, "update_digest": int(rows["tokens_digest"][i])}
        optimizer.param_groups[0]["lr"] = float(rows["lr"][i])
        history.on_train_batch_start(trainer, None, batch, i)
        trainer.global_step = i + 1  # the optimizer stepped: the update is complete
        module = SimpleNamespace(last_grad_norm=torch.tensor(rows["grad_norm"][i]))
        outputs = {"loss_sum": torch.tensor(rows["loss"][i] * tokens, dtype=torch.float64)}
        history.on_train_batch_end(trainer, module, outputs, batch, i)
        if (i + 1) % 5 == 0:  # flushed at other updates than every FLUSH_UPDATES, so rows join at a stride
            history.flush(trainer)
    history.on_train_end(trainer, None)
    assert len(history.columns["update"]) <= 8 and history.stride == 8
    assert history.columns["target_tokens"].sum() == rows["target_tokens"].sum()  # no update lost in merging
    assert history.columns["update"][-1] == 37 and history.updates == 37
    weighted = (rows["loss"] * rows["target_tokens"]).sum() / rows["target_tokens"].sum()
    got = (history.columns["loss"] * history.columns["target_tokens"]).sum() / history.columns["target_tokens"].sum()
    assert got == pytest.approx(weighted)
    assert history.tokens_chain == fingerprints.tokens_chain(rows["tokens_digest"].tolist())


def test_an_exported_tokenizer_pads_and_config_and_generation_config_agree(tmp_path):
    from transformers import AutoTokenizer

    from callbacks.export import export_model

    model = GPT(ModelConfig(vocab_size=8192, n_layer=1, n_head=2, n_embd=16, max_seq_len=SEQ_LEN))
    export_model(model, ROOT / "conf" / "tokenizer.json", tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    batch = tokenizer(["a", "a longer text than that"], padding=True)
    assert len(batch["input_ids"][0]) == len(batch["input_ids"][1]) and 0 in batch["attention_mask"][0]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert tokenizer.pad_token_id == config["pad_token_id"] == generation["pad_token_id"] == tokenizer.eos_token_id


def test_a_files_digest_is_the_sha256_of_all_its_bytes_across_read_chunks(tmp_path):
    data = bytes(range(256)) * (5 * 4096 + 3)  # over 5 MiB: several reads, the last one short
    (tmp_path / "file").write_bytes(data)
    assert fingerprints.sha256_file(tmp_path / "file") == hashlib.sha256(data).hexdigest()
