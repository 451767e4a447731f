"""How a learner over shards splits a call and puts the answers back (h5replay.client._shards._merge):
pure functions, shared by the blocking and the asyncio routers, tested without a socket."""

from __future__ import annotations

import numpy as np
import pytest

from h5replay.client._shards._merge import add_up_info, merge_draws, packed_episodes, qualified, shares
from h5replay.records import Episode, SampleInfo, pack_ids
from h5replay.storage import BoxSpace, DictSpace

pytestmark = pytest.mark.timeout(60)


def test_shares_add_up_and_ask_no_shard_beyond_its_rows_while_others_have_room() -> None:
    rng = np.random.default_rng(0)
    for _ in range(500):
        k = int(rng.integers(1, 5))
        lengths = rng.integers(0, 50, size=k)
        if lengths.sum() == 0:
            lengths[0] = 1
        weights = lengths / lengths.sum()
        n = int(rng.integers(1, 120))
        counts = shares(n, lengths, weights, rng)
        assert counts.sum() == n and (counts >= 0).all()
        if n <= lengths.sum():  # room enough: nobody is asked for rows it has not got
            assert (counts <= lengths).all(), (n, lengths, counts)
        else:  # every shard is asked for all it has, and only the lack goes beyond
            assert (counts >= lengths).all(), (n, lengths, counts)


def test_merge_puts_each_shards_rows_back_where_the_draw_placed_them() -> None:
    space = DictSpace({"x": BoxSpace(0, 100, (2,), np.float32)})
    assign = np.array([1, 0, 1, 1, 0])  # batch position -> index into live
    live = [3, 5]  # shard ids
    weights = np.array([0.25, 0.75])
    drawn = {
        3: ({"x": np.array([[30, 30], [31, 31]], np.float32)},
            SampleInfo(np.array([0, 1], np.uint64), np.zeros(2, np.uint64), np.array([0.5, 0.5]))),
        5: ({"x": np.array([[50, 50], [51, 51], [52, 52]], np.float32)},
            SampleInfo(np.array([7, 8, 9], np.uint64), np.zeros(3, np.uint64), np.array([0.1, 0.2, 0.3]))),
    }
    batch, info = merge_draws(space, live, assign, weights, drawn, with_info=True)
    assert batch["x"][:, 0].tolist() == [50, 30, 51, 52, 31]
    assert info.row_ids.tolist() == [7, 0, 8, 9, 1] and info.shard_ids.tolist() == [5, 3, 5, 5, 3]
    np.testing.assert_allclose(info.probabilities, [0.075, 0.125, 0.15, 0.225, 0.125])
    assert merge_draws(space, live, assign, weights, drawn, with_info=False)["x"].shape == (5, 2)


def test_qualified_ids_come_as_packed_ids_or_pairs_and_bad_ones_are_refused() -> None:
    shards, local = qualified(pack_ids(2, np.array([5, 6], np.uint64)), 3)
    assert shards.tolist() == [2, 2] and local.tolist() == [5, 6]
    shards, local = qualified(np.array([[1, 4], [0, 9]]), 3)
    assert shards.tolist() == [1, 0] and local.tolist() == [4, 9]
    with pytest.raises(IndexError, match="shard 3 does not exist"):
        qualified(np.array([[3, 0]]), 3)
    with pytest.raises(IndexError, match="negative"):
        qualified(np.array([-1]), 3)
    with pytest.raises(TypeError, match="integers"):
        qualified(np.array([0.5]), 3)
    with pytest.raises(TypeError, match="shape"):
        qualified(np.zeros((2, 3), np.int64), 3)


def test_figures_add_up_and_those_that_do_not_stay_per_shard() -> None:
    a = {"length": 10, "seq": 4, "capacity": 100, "sampler": "uniform", "flag": True}
    b = {"length": 5, "seq": 9, "capacity": 50, "sampler": "uniform", "flag": False}
    total = add_up_info({0: a, 2: b}, 3, [0, 0, 7])
    assert total["length"] == 15 and "seq" not in total and "sampler" not in total and "flag" not in total
    assert total["capacity"] == 150 and total["live_shards"] == [0, 2] and total["skipped"] == [0, 0, 7]
    assert total["shards"] == [a, None, b] and total["num_shards"] == 3
    assert add_up_info({0: a, 1: {**b, "capacity": None}}, 2, [0, 0])["capacity"] is None


def test_episodes_of_every_shard_come_shard_by_shard_with_packed_ids() -> None:
    eps = packed_episodes({1: [Episode(0, 10, 3)], 0: [Episode(2, 0, 4), Episode(3, 4, 1)], 2: []})
    assert [e.length for e in eps] == [4, 1, 3]
    assert eps[2] == Episode(int(pack_ids(1, 0)), int(pack_ids(1, 10)), 3) and eps[0] == Episode(2, 0, 4)
