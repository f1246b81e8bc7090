"""The ranks' per-update agreement of a run from shards: one all-reduce settles the update's target tokens, its rows
digest, a stop requested on any rank and rank 0's metric line, the same on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.update_agreement import UpdateAgreement


def trainer(rank: int = 0, world: int = 1, step: int = 0) -> SimpleNamespace:
    """What the agreement reads of Lightning's Trainer."""
    return SimpleNamespace(global_step=step, global_rank=rank, world_size=world,
                           strategy=SimpleNamespace(root_device=torch.device("cpu")))


def test_a_single_rank_settles_its_own_share_and_stops_after_the_next_update():
    agreement = UpdateAgreement(report_every_seconds=0.0)
    assert agreement.settle(trainer(step=4), 100, 7) == (100, 7)
    assert agreement.report_marks.due(5) and agreement.stopped_by is None
    agreement.request_stop("SIGTERM")
    agreement.request_stop("SIGINT")  # the first signal is the one kept
    assert agreement.stop_after is None  # no rank stops before the ranks settle an update
    agreement.settle(trainer(step=5), 100, 7)
    assert (agreement.stop_after, agreement.stopped_by) == (6, "SIGTERM")


def settle_on_rank(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        agreement = UpdateAgreement(report_every_seconds=0.0 if rank == 0 else 1e9)
        if rank == 1:
            agreement.request_stop("SIGTERM")
        settled = agreement.settle(trainer(rank, world=2, step=9), 10 + rank, 100 * (rank + 1))
        results[rank] = (settled, agreement.stop_after, agreement.stopped_by, agreement.report_marks.due(10))
    finally:
        dist.destroy_process_group()


def test_two_ranks_settle_the_sums_and_stop_and_report_after_the_same_update(tmp_path):
    results = mp.Manager().dict()
    mp.spawn(settle_on_rank, args=(str(tmp_path / "store"), results), nprocs=2)
    assert results[0] == ((21, 300), 10, "a stop signal on another rank", True)
    assert results[1] == ((21, 300), 10, "SIGTERM", True)
