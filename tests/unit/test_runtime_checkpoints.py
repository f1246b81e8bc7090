"""How the checkpoints of a run from shards are written and kept (runtime/checkpoints.py)."""

from __future__ import annotations

import pytest
import torch

from callbacks.resume_fingerprint import FINGERPRINT_KEY, ResumeFingerprint
from runtime import checkpoints


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("the write is cut short here")


def test_a_save_cut_short_leaves_the_earlier_checkpoint_and_takes_no_name(tmp_path):
    io = checkpoints.DurableCheckpointIO()
    earlier = tmp_path / "epoch=0-step=2.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}}, earlier)
    newer = tmp_path / "epoch=0-step=4.ckpt"
    with pytest.raises(RuntimeError, match="cut short"):
        io.save_checkpoint({"state_dict": {"w": torch.ones(1000)}, "tail": Unpicklable()}, newer)
    assert not newer.exists() and sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.WRITTEN, earlier.name]
    assert torch.equal(checkpoints.load_metadata(earlier)["state_dict"]["w"], torch.ones(1000))
    assert checkpoints.newest_loadable(tmp_path)[0] == earlier


def test_a_safe_save_keeps_the_one_before_it_and_removes_older_ones_this_trainer_wrote_and_nothing_else(tmp_path):
    io = checkpoints.DurableCheckpointIO()
    (tmp_path / "yours.ckpt").write_bytes(b"a file of yours")
    for step in (2, 4, 6):
        io.save_checkpoint({"state_dict": {"step": torch.tensor(step)}}, tmp_path / f"epoch=0-step={step}.ckpt")
    io.save_checkpoint({"state_dict": {"step": torch.tensor(6)}}, tmp_path / "stopped.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.WRITTEN, "epoch=0-step=6.ckpt", "stopped.ckpt",
                                                          "yours.ckpt"]
    assert checkpoints.written(tmp_path) == ["epoch=0-step=6.ckpt", "stopped.ckpt"]
    checkpoints.remove_written(tmp_path, "stopped.ckpt")
    checkpoints.remove_written(tmp_path, "yours.ckpt")  # not this trainer's: stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.WRITTEN, "epoch=0-step=6.ckpt", "yours.ckpt"]


def test_a_new_checkpoint_that_does_not_load_back_leaves_the_earlier_one(tmp_path, monkeypatch):
    io = checkpoints.DurableCheckpointIO()
    earlier = tmp_path / "epoch=0-step=2.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, earlier)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, file: (real_save(obj, file), file.truncate(100)))  # torn on disk
    with pytest.raises(Exception):
        io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, tmp_path / "epoch=0-step=4.ckpt")
    assert earlier.is_file() and checkpoints.newest_loadable(tmp_path)[0] == earlier


def _run_code(marker):
    marker.write_text("the checkpoint's code ran")


class PickledCallable:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return _run_code, (self.marker,)


def test_a_checkpoint_with_pickled_code_is_refused_and_its_code_never_runs(tmp_path):
    marker = tmp_path / "ran"
    crafted = tmp_path / "checkpoints" / "epoch=0-step=9.ckpt"
    crafted.parent.mkdir()
    torch.save({"state_dict": {"w": torch.ones(1)}, "payload": PickledCallable(marker)}, crafted)
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoints.load_metadata(crafted)
    with pytest.raises(Exception, match="Weights only load failed"):
        checkpoints.DurableCheckpointIO().load_checkpoint(crafted)
    with pytest.raises(checkpoints.ConfigError, match="none of the 1 checkpoint"):
        checkpoints.newest_loadable(crafted.parent)
    assert not marker.exists()


def test_last_refuses_a_checkpoints_folder_that_is_a_symbolic_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    checkpoints.DurableCheckpointIO().save_checkpoint({"state_dict": {}}, real / "a.ckpt")
    (tmp_path / "checkpoints").symlink_to(real)
    with pytest.raises(checkpoints.ConfigError, match="is a symbolic link"):
        checkpoints.newest_loadable(tmp_path / "checkpoints")


def test_the_fingerprint_holds_every_optim_key_the_run_reads_and_the_process_count():
    import dataclasses
    from types import SimpleNamespace

    from config import RunConfig

    cfg = RunConfig()
    cfg.data.path = "rows"
    cfg.optim.name, cfg.optim.schedule = "muon", "wsd"
    cfg.model.tie_embeddings = False  # a head of its own: optim.head_lr is read
    rows = checkpoints.shards_identity(cfg, "rows")
    values = checkpoints.fingerprint(cfg, SimpleNamespace(effective=8), rows, "tok", 4)
    assert {f"optim.{field.name}" for field in dataclasses.fields(cfg.optim)} <= set(values)
    assert values["processes (trainer.devices x trainer.num_nodes)"] == 4
    assert values["model.qk_norm"] is False  # another architecture: a resume cannot change it
    cfg.optim.name, cfg.optim.schedule = "adamw", "constant"  # no horizon and no Muon: training longer may resume
    cfg.model.tie_embeddings = True  # the head is the embedding: no learning rate of its own
    values = checkpoints.fingerprint(cfg, SimpleNamespace(effective=8), rows, "tok", 4)
    assert not {"optim.decay_steps", "optim.min_lr_ratio", "optim.muon_lr", "optim.head_lr"} & set(values)
    assert {"optim.lr", "optim.embed_lr", "optim.warmup_steps", "optim.schedule"} <= set(values)


def test_a_stored_fingerprint_refuses_the_first_changed_key_in_one_line():
    stored: dict = {}
    ResumeFingerprint({"model.n_layer": 2, "seed": 5}).on_save_checkpoint(None, None, stored)
    assert stored == {FINGERPRINT_KEY: {"model.n_layer": 2, "seed": 5}}
    checkpoints.refuse_changes("c.ckpt", stored, {"model.n_layer": 2, "seed": 5})
    with pytest.raises(checkpoints.ConfigError) as refused:
        checkpoints.refuse_changes("c.ckpt", stored, {"model.n_layer": 2, "seed": 7})
    assert "\n" not in str(refused.value) and "it was trained with seed 5, this run has 7" in str(refused.value)
