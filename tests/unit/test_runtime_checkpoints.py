"""How the checkpoints of a run from shards are written and kept (runtime/checkpoints.py)."""

from __future__ import annotations

import pytest
import torch

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


def test_a_safe_save_removes_the_earlier_ones_this_trainer_wrote_and_nothing_else(tmp_path):
    io = checkpoints.DurableCheckpointIO()
    (tmp_path / "yours.ckpt").write_bytes(b"a file of yours")
    for step in (2, 4, 6):
        io.save_checkpoint({"state_dict": {"step": torch.tensor(step)}}, tmp_path / f"epoch=0-step={step}.ckpt")
    io.save_checkpoint({"state_dict": {"step": torch.tensor(6)}}, tmp_path / "stopped.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.WRITTEN, "stopped.ckpt", "yours.ckpt"]
    assert checkpoints.written(tmp_path) == ["stopped.ckpt"]


def test_a_stored_fingerprint_refuses_the_first_changed_key_in_one_line():
    stored = {checkpoints.FINGERPRINT_KEY: {"model.n_layer": 2, "seed": 5}}
    checkpoints.refuse_changes("c.ckpt", stored, {"model.n_layer": 2, "seed": 5})
    with pytest.raises(checkpoints.ConfigError) as refused:
        checkpoints.refuse_changes("c.ckpt", stored, {"model.n_layer": 2, "seed": 7})
    assert "\n" not in str(refused.value) and "it was trained with seed 5, this run has 7" in str(refused.value)
