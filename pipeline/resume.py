"""Resuming a run on stdin: the updates its checkpoint already trained are read again, checked, and skipped.

A stream cannot seek, so a resumed run reads its input from the start, through the same stages with the
same seed, and rebuilds the same updates; the held-out validation set forms again on the way. The first
``TrainedUpdates.count`` updates are not trained again: each is compared, by the digest of its tokens
(pipeline/fingerprints.py), with the one the checkpoint's history recorded, and the first that differs
ends the run in one line naming that update. Past them, the updates go to training as in any run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from pipeline.fingerprints import DIGEST_MODULUS
from pipeline.records import UnusableInputError


class InputDiffers(UnusableInputError):
    """The input of a resumed run is not the one its checkpoint trained on."""


@dataclass
class TrainedUpdates:
    """What a checkpoint trained: ``count`` updates, and its history's rows, each the digest of the
    updates up to ``last_updates[i]`` since the row before (one update per row until the history merges
    rows, callbacks/history.py)."""

    count: int
    last_updates: np.ndarray
    digests: np.ndarray

    def __post_init__(self) -> None:
        if len(self.last_updates) != len(self.digests) or (len(self.last_updates) and
                                                           int(self.last_updates[-1]) != self.count):
            raise ValueError(f"a history of {len(self.last_updates)} row(s) ending at update "
                             f"{int(self.last_updates[-1]) if len(self.last_updates) else 0} does not describe "
                             f"{self.count} trained updates")


def skip_trained(updates: Iterable[list[list[dict]]], trained: TrainedUpdates | None) -> Iterator[list[list[dict]]]:
    """The updates after the ``trained`` ones, each of those checked against its recorded digest first."""
    iterator = iter(updates)
    if trained is not None and trained.count:
        row, since = 0, 0
        for update in range(1, trained.count + 1):
            per_rank = next(iterator, None)
            if per_rank is None:
                raise InputDiffers(f"the input ended after {update - 1} complete update(s), but the checkpoint "
                                   f"trained {trained.count} on it: resume with the input the run was started with")
            since = (since + per_rank[0][0]["update_digest"]) % DIGEST_MODULUS
            if update < trained.last_updates[row]:
                continue
            if since != int(trained.digests[row]) % DIGEST_MODULUS:
                first = int(trained.last_updates[row - 1]) + 1 if row else 1
                which = f"update {update}" if first == update else f"one of updates {first}-{update}"
                raise InputDiffers(f"the input differs from the one the checkpoint trained on: {which} holds other "
                                   "tokens (its digest differs from the run's history); resume with the same input, "
                                   "or start a new run in another output.root")
            row, since = row + 1, 0
    yield from iterator
