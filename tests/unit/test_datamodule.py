"""datamodule.py: the LightningDataModule that trains complete updates from the stream."""

from __future__ import annotations

import time

import lightning as L
import numpy as np
import torch

from datamodule import StreamingDataModule
from pipeline.feeder import INPUT_PENDING
from pipeline.packing import Row
from pipeline.records import StreamStats
from pipeline.stream import split_update
from pipeline.validation_split import ValidationPool
from tests.pipeline_helpers import stream_settings


def test_each_update_is_trained_before_the_stream_is_asked_for_the_next_and_the_wait_is_measured():
    """Lightning fetches one microbatch ahead: without a stand-in for a microbatch that has not
    arrived, the last microbatch of every update would wait, untrained, for the next update."""
    from lit_module import DecoderTrainingModule, OptimConfig
    from model.decoder import ModelConfig

    rng = np.random.default_rng(0)
    rows = [Row(rng.integers(0, 50, 16).astype(np.int32), np.arange(16, dtype=np.int32)) for _ in range(16)]
    updates = [split_update(rows[i : i + 4], 1, 2, StreamStats())[0] for i in range(0, 16, 4)]
    trainer = L.Trainer(accelerator="cpu", max_steps=10, max_epochs=1, accumulate_grad_batches=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)
    steps_when_asked = []

    def stream():
        for k, update in enumerate(updates):
            if k:
                yield INPUT_PENDING  # the next update has not arrived
                steps_when_asked.append(trainer.global_step)
                time.sleep(0.2)  # and arrives after a while
            yield from update
        yield INPUT_PENDING  # then the input ends

    torch.manual_seed(0)
    module = DecoderTrainingModule(ModelConfig(vocab_size=50, n_layer=1, n_head=2, n_embd=16, max_seq_len=16),
                                   OptimConfig())
    datamodule = StreamingDataModule(stream, ValidationPool(0), stream_settings())
    trainer.fit(module, datamodule=datamodule)
    assert trainer.global_step == 4 and steps_when_asked == [1, 2, 3]
    assert 0.6 <= datamodule.input_wait_seconds < 5


def test_periodic_validation_waits_for_the_whole_set_and_every_rank_agrees_when(caplog):
    """A set closed after update 2 was assembled (the input was slower than training) is whole on every
    rank from update 3 on; validation after updates 1 and 2 is skipped on every rank, never run on part."""
    from types import SimpleNamespace

    pool = ValidationPool(10**6)
    for n in (40, 50, 60):
        pool.offer(np.arange(1, n + 1, dtype=np.int32))
    loaders = []
    for rank in (0, 1):
        datamodule = StreamingDataModule(lambda: iter(()), pool, stream_settings(world_size=2), rank=rank)
        datamodule.trainer = SimpleNamespace(global_step=0)
        loaders.append((datamodule, datamodule.val_dataloader()))

    def batches_after(update: int) -> list[int]:
        counts = []
        for datamodule, loader in loaders:
            datamodule.trainer.global_step = update
            counts.append(sum(len(batch["input_ids"]) for batch in loader))
        return counts

    assert batches_after(1) == [0, 0] and "validation after update 1 skipped" in caplog.text
    pool.close("read_ahead", after_updates=2, documents_read=300)
    assert batches_after(2) == [0, 0]
    assert batches_after(3) == [3, 2]  # 150 tokens in rows of 32: 5 rows dealt to 2 ranks
