"""pipeline/resume.py: a resumed run reads its input again, checks the updates its checkpoint trained
by their digests, hands on only the later ones, and names the first update that differs."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.resume import InputDiffers, TrainedUpdates, skip_trained


def updates(digests: list[int]) -> list[list[list[dict]]]:
    """Updates of two ranks, one microbatch each, carrying the whole update's digest as split_update does."""
    return [[[{"update_digest": d, "n": i}], [{"update_digest": d, "n": i}]] for i, d in enumerate(digests, 1)]


def trained(digests: list[int], stride: int = 1) -> TrainedUpdates:
    """What a checkpoint's history holds after ``len(digests)`` updates, rows merged ``stride`` at a time."""
    last = list(range(stride, len(digests) + 1, stride))
    if not last or last[-1] != len(digests):
        last.append(len(digests))
    bounds = [0, *last]
    rows = [sum(digests[a:b]) % (1 << 63) for a, b in zip(bounds, bounds[1:])]
    return TrainedUpdates(len(digests), np.array(last, dtype=np.int64), np.array(rows, dtype=np.int64))


def test_the_trained_updates_are_checked_and_skipped_and_the_rest_handed_on():
    stream = updates([11, 12, 13, 14, 15])
    out = list(skip_trained(stream, trained([11, 12, 13])))
    assert [per_rank[0][0]["n"] for per_rank in out] == [4, 5]
    assert list(skip_trained(stream, None)) == stream


@pytest.mark.parametrize("differs_at", [1, 3, 4])
def test_the_first_update_whose_tokens_differ_is_named(differs_at):
    recorded = [11, 12, 13, 14]
    given = list(recorded)
    given[differs_at - 1] += 1
    with pytest.raises(InputDiffers, match=rf"update {differs_at} holds other tokens"):
        list(skip_trained(updates([*given, 99]), trained(recorded)))


def test_a_merged_history_names_the_range_of_updates_that_differs():
    recorded = [11, 12, 13, 14, 15]
    given = [11, 12, 13, 40, 15]
    with pytest.raises(InputDiffers, match=r"one of updates 3-4 holds other tokens"):
        list(skip_trained(updates(given), trained(recorded, stride=2)))
    assert len(list(skip_trained(updates([*recorded, 16]), trained(recorded, stride=2)))) == 1


def test_an_input_shorter_than_what_the_checkpoint_trained_is_refused():
    with pytest.raises(InputDiffers, match="ended after 2 complete update"):
        list(skip_trained(updates([11, 12]), trained([11, 12, 13])))


def test_a_history_that_does_not_end_at_the_trained_count_is_refused():
    with pytest.raises(ValueError, match="does not describe 4 trained updates"):
        TrainedUpdates(4, np.array([1, 2, 3]), np.array([1, 2, 3]))
