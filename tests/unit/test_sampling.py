"""Sampling control in the storage: the sum tree, prioritized draws (statistically), priorities
in and out, rate limits, queues, settings kept in the file, and every refusal."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from h5replay.errors import (
    ConfigError,
    EvictedError,
    NotEnoughDataError,
    RateLimitedError,
    ReadOnlyError,
)
from h5replay.samplers.sumtree import SumTree
from h5replay.sampling import Fifo, Lifo, Prioritized, RateLimit, SamplingConfig, Uniform, sampler_from_json
from h5replay.storage import BoxSpace, ReplayBuffer, export_buffer
from h5replay.storage.replay import table_file as _sampling_file

SPACE = BoxSpace(0, 2**40, (), np.int64)  # every row holds its own id
# Chi-square critical value for 9 degrees of freedom at p = 0.001: a right sampler fails 1 in 1000.
CHI2_CRIT_9 = 27.877


def chi_square(counts: np.ndarray, expected_p: np.ndarray) -> float:
    expected = expected_p / expected_p.sum() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def make(tmp_path: os.PathLike[str], capacity: int | None = 100, **kwargs: object) -> ReplayBuffer:
    return ReplayBuffer.create(SPACE, capacity, os.path.join(tmp_path, "b.h5"), **kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------- the tree


def test_sum_tree_matches_numpy_prefix_sums() -> None:
    rng = np.random.default_rng(0)
    tree = SumTree(37)
    weights = np.zeros(37)
    for _ in range(50):
        leaves = rng.integers(0, 37, size=rng.integers(1, 12))
        values = rng.random(leaves.shape[0]) * rng.choice([0.0, 1.0, 100.0])
        tree.set(leaves, values)
        for leaf, value in zip(leaves, values, strict=True):  # numpy semantics: the last one wins
            weights[leaf] = value
        assert tree.total == pytest.approx(weights.sum())
        assert np.allclose(tree.get(np.arange(37)), weights)
        if weights.sum() > 0:
            targets = rng.random(64) * weights.sum()
            found = tree.find(targets)
            cum = np.cumsum(weights)
            assert np.all(weights[found] > 0)
            assert np.all(cum[found] - weights[found] <= targets + 1e-9) and np.all(targets < cum[found] + 1e-9)
        starts = rng.integers(0, 38, size=10)
        stops = np.maximum(starts, rng.integers(0, 38, size=10))
        assert np.allclose(tree.range_sums(starts, stops), [weights[a:b].sum() for a, b in zip(starts, stops, strict=True)])
    tree.grow(100)
    assert len(tree) == 100 and tree.total == pytest.approx(weights.sum())
    assert np.allclose(tree.get(np.arange(37)), weights)


def test_sum_tree_never_lands_on_a_zero_weight_leaf_at_the_edges() -> None:
    """Targets on a boundary, or at the total (rounding can make one), go to a weighted leaf."""
    tree = SumTree(7)
    tree.set(np.arange(7), [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    found = tree.find(np.array([0.0, 1.0 - 1e-12, 1.0, 2.0 - 1e-12, 2.0, 2.0 + 1e-9]))
    assert found.tolist() == [0, 0, 3, 3, 3, 3]


# ---------------------------------------------------------------------------------------------- prioritized


def fill(rb: ReplayBuffer, priorities: list[float]) -> None:
    writer = rb.open_segment_writer()
    for i, p in enumerate(priorities):
        writer.append(np.int64(i), priority=p)
    rb.commit_segment(writer)


def frequencies(rb: ReplayBuffer, n: int, rows: int, seed: int = 0) -> np.ndarray:
    batch = rb.sample(n, np.random.default_rng(seed))
    return np.bincount(batch, minlength=rows).astype(np.float64)


def test_a_reopened_writer_checkpoints_the_updates_it_read_from_the_log(tmp_path: os.PathLike[str],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer reopening the file applies the log past the last checkpoint; its own next
    checkpoint must write those priorities too, or the log entries it then lets go are lost
    (found by the sampling state machine: row 2's 20.0 came back as the default after a reopen)."""
    monkeypatch.setattr(_sampling_file, "LOG_ENTRIES", 8)  # a checkpoint every few updates
    path = os.path.join(tmp_path, "b.h5")
    with ReplayBuffer.create(SPACE, None, path, sampler=Prioritized(1.0)) as rb:
        rb.extend(np.arange(3))
        rb.end_episode()
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        rb.update_priorities([0], [0.0])
        rb.update_priorities([0] * 10, [0.0] * 10)  # a checkpoint after 5 of the 11 updates
        rb.update_priorities([0, 2], [0.0, 20.0])  # in the log only (13 updates, 8 since the checkpoint)
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        rb.update_priorities([0], [0.0])  # checkpoints first: the ring holds no more
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.priorities([0, 1, 2]).tolist() == [0.0, 1.0, 20.0]
        assert rb.info()["priority_sum"] == 21.0


def test_prioritized_frequencies_follow_priority_to_the_exponent(tmp_path: os.PathLike[str]) -> None:
    priorities = np.arange(1.0, 11.0)
    with make(tmp_path, sampler=Prioritized(exponent=0.6)) as rb:
        fill(rb, priorities.tolist())
        counts = frequencies(rb, 200_000, 10)
        assert chi_square(counts, priorities**0.6) < CHI2_CRIT_9
        # Enough draws to tell a wrong exponent apart: the same counts fail against 0.5 and 0.7.
        assert chi_square(counts, priorities**0.5) > CHI2_CRIT_9
        assert chi_square(counts, priorities**0.7) > CHI2_CRIT_9
        # After an update, the frequencies follow the new priorities.
        new = priorities[::-1].copy()
        new[3] = 0.0
        assert rb.update_priorities(np.arange(10), new) == 0
        counts = frequencies(rb, 200_000, 10, seed=1)
        assert counts[3] == 0
        keep = new > 0
        assert chi_square(counts[keep], new[keep] ** 0.6) < CHI2_CRIT_9 - 3.0  # 8 degrees of freedom
        assert rb.priorities([3, 0]).tolist() == [0.0, 10.0]


def test_sample_info_probabilities_and_importance_weights(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Prioritized(exponent=1.0)) as rb:
        fill(rb, [1.0, 3.0])
        batch, info = rb.sample(64, np.random.default_rng(0), with_info=True)
        expected = np.where(batch == 0, 0.25, 0.75)
        assert np.allclose(info.probabilities, expected)
        weights = info.importance_weights(1.0)
        # (N * P) ** -1 normalised by the largest: the rare row weighs 1, the common one 1/3.
        assert np.allclose(weights, np.where(batch == 0, 1.0, 1 / 3))


def test_prioritized_windows_are_drawn_by_their_first_row(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Prioritized(exponent=1.0)) as rb:
        fill(rb, [1.0, 2.0, 3.0, 4.0, 100.0])  # one episode; windows of 2 start at rows 0..3
        batch, info = rb.sample_sequences(100_000, 2, np.random.default_rng(0), with_info=True)
        starts = info.row_ids.astype(np.int64)
        assert np.array_equal(batch[:, 1] - batch[:, 0], np.ones(100_000))
        assert starts.max() == 3, "row 4 cannot start a window of 2 in a 5-row episode"
        counts = np.bincount(starts, minlength=4).astype(np.float64)
        expected = np.array([1.0, 2.0, 3.0, 4.0])
        assert chi_square(counts, expected) < 16.27  # 3 degrees of freedom, p = 0.001
        assert np.allclose(info.probabilities, expected[starts] / 10.0)


def test_rows_without_a_priority_get_the_largest_so_far_or_the_initial_one(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Prioritized()) as rb:
        rb.extend(np.arange(2))  # nothing given yet: 1.0, as in PER
        rb.extend(np.arange(2, 4), priorities=[5.0, 2.0])
        rb.append(np.int64(4))
        rb.update_priorities([0], [9.0])
        rb.append(np.int64(5))
        assert rb.priorities(np.arange(6)).tolist() == [9.0, 1.0, 5.0, 2.0, 5.0, 9.0]
    with ReplayBuffer.create(SPACE, 10, os.path.join(tmp_path, "c.h5"), sampler=Prioritized(initial_priority=0.5)) as rb:
        rb.extend(np.arange(2), priorities=[7.0, float(3)])
        rb.append(np.int64(2))
        assert rb.priorities([2]).tolist() == [0.5]


def test_priority_updates_of_rows_no_longer_held_are_ignored_and_counted(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, capacity=4, sampler=Prioritized()) as rb:
        rb.extend(np.arange(6))  # rows 0 and 1 are gone
        assert rb.update_priorities([0, 1, 5], [2.0, 2.0, 3.0]) == 2
        assert rb.info()["priority_updates_ignored"] == 2
        assert rb.priorities([5]).tolist() == [3.0]
        with pytest.raises(EvictedError):
            rb.priorities([0])


@pytest.mark.parametrize(
    ("ids", "values", "error", "words"),
    [
        ([0, 1], [1.0], ConfigError, "got 1 priorities for 2 rows"),
        ([0], [-1.0], ConfigError, "finite and >= 0"),
        ([0], [float("nan")], ConfigError, "finite and >= 0"),
        ([0], [float("inf")], ConfigError, "finite and >= 0"),
        ([0], ["high"], ConfigError, "must be numbers"),
        ([0, 99], [1.0, 1.0], IndexError, "never committed"),
        ([-1], [1.0], IndexError, "negative"),
        ([0.5], [1.0], TypeError, "integers"),
    ],
)
def test_bad_priority_updates_are_refused_and_change_nothing(
    tmp_path: os.PathLike[str], ids: list[object], values: list[object], error: type[Exception], words: str
) -> None:
    with make(tmp_path, sampler=Prioritized()) as rb:
        fill(rb, [1.0, 2.0, 3.0])
        with pytest.raises(error, match=words):
            rb.update_priorities(ids, values)
        assert rb.priorities([0, 1, 2]).tolist() == [1.0, 2.0, 3.0]
        assert rb.info()["priority_updates"] == 0


def test_bad_priorities_on_append_leave_the_writer_unchanged(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Prioritized()) as rb:
        writer = rb.open_segment_writer()
        writer.append(np.int64(0), priority=2.0)
        with pytest.raises(ConfigError, match="finite and >= 0"):
            writer.append(np.int64(1), priority=-3.0)
        with pytest.raises(ConfigError, match="got 1 priorities for 2 rows"):
            writer.extend(np.arange(2), priorities=[1.0])
        assert len(writer) == 1
        rb.commit_segment(writer)
        assert rb.priorities([0]).tolist() == [2.0]
        with pytest.raises(ConfigError):
            rb.extend(np.arange(2), priorities=[1.0, float("nan")])
        assert len(rb) == 1


def test_a_sampler_without_priorities_refuses_updates(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path) as rb:
        rb.extend(np.arange(3))
        with pytest.raises(ConfigError, match="only a Prioritized sampler keeps priorities"):
            rb.update_priorities([0], [1.0])
        with pytest.raises(ConfigError, match="only a Prioritized sampler"):
            rb.priorities([0])


def test_every_priority_zero_is_not_enough_data(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Prioritized()) as rb:
        fill(rb, [0.0, 0.0])
        with pytest.raises(NotEnoughDataError, match="priority 0"):
            rb.sample(1)


# ---------------------------------------------------------------------------------------------- bounded weights


@pytest.mark.parametrize(("exponent", "huge", "shown"), [(2.0, 1e200, "1e\\+200"), (1.0, 1.7e308, "1.7e\\+308")],
                         ids=["1e200 squared", "1.7e308 twice"])
def test_a_priority_whose_weight_would_overflow_is_refused_by_every_way_in(
    tmp_path: os.PathLike[str], exponent: float, huge: float, shown: str
) -> None:
    """priority ** exponent past MAX_WEIGHT would make the sum tree's total inf (every draw then
    returned the last row with probability 0 and NaN importance weights): refused, naming the
    value, the exponent and the bound, and nothing changes."""
    words = f"priority 1 is {shown}: its weight priority \\*\\* exponent \\({exponent:g}\\) would exceed 1e\\+280"
    with make(tmp_path, sampler=Prioritized(exponent)) as rb:
        fill(rb, [1.0, 2.0, 3.0])
        with pytest.raises(ConfigError, match=words):
            rb.update_priorities([0, 1], [1.0, huge])
        with pytest.raises(ConfigError, match=words):
            rb.extend(np.arange(3, 5), priorities=[1.0, huge])
        with pytest.raises(ConfigError, match=words.replace("priority 1", "priority 0")):
            rb.append(np.int64(3), priority=huge)
        writer = rb.open_segment_writer()
        writer.append(np.int64(3), priority=1.0)
        with pytest.raises(ConfigError, match=words.replace("priority 1", "priority 0")):
            writer.append(np.int64(4), priority=huge)
        with pytest.raises(ConfigError, match=words):
            writer.extend(np.arange(4, 6), priorities=[1.0, huge])
        assert len(writer) == 1 and writer.state == "open"
        writer.abort()
        plain = rb.storage.open_segment_writer()  # knows no sampler: refused at the commit, left open
        plain.extend(np.arange(3, 5), priorities=[1.0, huge])
        for commit in (lambda: rb.commit_segment(plain), lambda: rb.commit_episodes(plain, [1, 1])):
            with pytest.raises(ConfigError, match=words):
                commit()
            assert plain.state == "open"
        plain.abort()
        assert len(rb) == 3 and rb.priorities([0, 1, 2]).tolist() == [1.0, 2.0, 3.0]
        assert rb.info()["priority_updates"] == 0 and rb.info()["max_priority"] == 3.0
        # The bound itself is allowed, for every row at once: the total stays finite.
        limit = Prioritized(exponent).priority_limit
        assert rb.update_priorities([0, 1, 2], [limit] * 3) == 0
        total = rb.info()["priority_sum"]
        assert np.isfinite(total) and total == pytest.approx(3 * limit**exponent)
        _, info = rb.sample(64, np.random.default_rng(0), with_info=True)
        assert np.allclose(info.probabilities, 1 / 3) and np.all(np.isfinite(info.importance_weights(0.4)))


def test_initial_priority_is_bounded_by_its_exponent() -> None:
    with pytest.raises(ConfigError, match="initial_priority 1e\\+200: its weight .* at most 1e\\+140"):
        Prioritized(exponent=2.0, initial_priority=1e200)
    with pytest.raises(ConfigError, match="would exceed 1e\\+280"):
        sampler_from_json('{"kind": "prioritized", "exponent": 1.0, "initial_priority": 1e300}')
    assert Prioritized(exponent=1.0, initial_priority=1e280).priority_limit == 1e280
    # Exponent 0 (and small ones): every finite priority's weight is within the bound.
    assert Prioritized(exponent=0.0, initial_priority=1.7e308).priority_limit == float("inf")
    assert Prioritized(exponent=0.5).priority_limit == float("inf")


def test_exponent_zero_draws_every_row_alike_whatever_its_priority(tmp_path: os.PathLike[str]) -> None:
    """0 ** 0 is 1 (as in Reverb): with exponent 0 a priority of 0 is drawn like any other."""
    with make(tmp_path, sampler=Prioritized(exponent=0.0)) as rb:
        fill(rb, [0.0, 1.7e308, 5.0])
        _, info = rb.sample(32, np.random.default_rng(0), with_info=True)
        assert rb.info()["priority_sum"] == 3.0 and np.allclose(info.probabilities, 1 / 3)


def test_a_draw_without_replacement_after_a_huge_weight_keeps_probabilities(tmp_path: os.PathLike[str]) -> None:
    """The weight left before the second pick cancels to 0 in float64 (1e280 - 1e280): its
    probability must still be at most 1 (it is 1: the only row left), never inf or NaN."""
    with make(tmp_path, sampler=Prioritized(exponent=1.0), max_times_sampled=1) as rb:
        fill(rb, [1e280, 1.0])
        batch, info = rb.sample(2, np.random.default_rng(0), with_info=True)
        assert sorted(batch.tolist()) == [0, 1]
        assert np.all(np.isfinite(info.probabilities)) and np.all((info.probabilities > 0) & (info.probabilities <= 1))


def test_priorities_in_a_file_beyond_the_bound_are_clipped_when_read(tmp_path: os.PathLike[str]) -> None:
    """A file holding a priority past the bound (written by hand, or damaged) cannot make the
    tree's total inf either: a value read from the file is clipped to the bound."""
    path = os.path.join(tmp_path, "b.h5")
    with ReplayBuffer.create(SPACE, 10, path, sampler=Prioritized(exponent=2.0)) as rb:
        fill(rb, [1.0, 2.0, 3.0])
    with h5py.File(path, "r+") as f:
        f["_h5replay/replay/tables/default/priorities"][1] = 1e200
    for read_only in (True, False):
        with ReplayBuffer.load_from(path, read_only=read_only) as rb:
            assert rb.priorities([0, 1, 2]).tolist() == [1.0, 1e140, 3.0]
            assert np.isfinite(rb.info()["priority_sum"])
            _, info = rb.sample(16, np.random.default_rng(0), with_info=True)
            assert np.all(np.isfinite(info.probabilities)) and np.all(info.probabilities > 0)


# ---------------------------------------------------------------------------------------------- the running maximum


def test_the_running_maximum_priority_survives_a_reopen_and_an_export(tmp_path: os.PathLike[str]) -> None:
    """With initial_priority None a row committed without one gets the largest priority seen so
    far, held or not: the file keeps it (it used to be the largest held after a reopen)."""
    path = os.path.join(tmp_path, "b.h5")
    with ReplayBuffer.create(SPACE, 10, path, sampler=Prioritized(exponent=1.0)) as rb:
        fill(rb, [1.0, 2.0])
        rb.update_priorities([0], [50.0])
        rb.update_priorities([0], [1.0])  # 50 is held no more
        assert rb.info()["max_priority"] == 50.0
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        assert rb.info()["max_priority"] == 50.0
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.info()["max_priority"] == 50.0
        rb.append(np.int64(2))
        rb.end_episode()
        assert rb.priorities([2]).tolist() == [50.0]
        rb.update_priorities([2], [0.5])
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.info()["max_priority"] == 50.0 and rb.priorities([0, 1, 2]).tolist() == [1.0, 2.0, 0.5]
        export_buffer(rb, os.path.join(tmp_path, "copy.h5"))
    with ReplayBuffer.load_from(os.path.join(tmp_path, "copy.h5"), read_only=False) as copy:
        assert copy.info()["max_priority"] == 50.0
        copy.append(np.int64(3))
        assert copy.priorities([3]).tolist() == [50.0]


def test_a_file_made_before_the_running_maximum_gets_it_at_its_first_writable_open(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "b.h5")
    with ReplayBuffer.create(SPACE, 10, path, sampler=Prioritized(exponent=1.0)) as rb:
        fill(rb, [1.0, 4.0])
    with h5py.File(path, "r+") as f:
        del f["_h5replay/replay/tables/default/priority_max"]  # as a file made before it
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        assert rb.info()["max_priority"] == 4.0  # the largest held stands in
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.info()["max_priority"] == 4.0
        rb.update_priorities([1, 1], [9.0, 1.0])
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.info()["max_priority"] == 9.0


# ---------------------------------------------------------------------------------------------- settings


def test_settings_and_counters_survive_a_reopen(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "b.h5")
    limit = RateLimit(min_size_to_sample=2, samples_per_insert=2.0, error_buffer=10.0)
    with ReplayBuffer.create(SPACE, 50, path, sampler=Prioritized(0.7, 2.0), rate_limit=limit) as rb:
        rb.extend(np.arange(4), priorities=[1.0, 2.0, 3.0, 4.0])
        rb.sample(3)
        rb.update_priorities([1], [8.0])
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.sampling == SamplingConfig(Prioritized(0.7, 2.0), limit, 0)
        info = rb.info()
        assert (info["inserted"], info["sampled"], info["priority_updates"]) == (4, 3, 1)
        assert (info["sampler"], info["priority_exponent"], info["initial_priority"]) == ("prioritized", 0.7, 2.0)
        assert (info["min_size_to_sample"], info["samples_per_insert"], info["error_buffer"]) == (2, 2.0, 10.0)
        assert rb.priorities(np.arange(4)).tolist() == [1.0, 8.0, 3.0, 4.0]


def test_export_keeps_settings_priorities_and_counters(tmp_path: os.PathLike[str]) -> None:
    limit = RateLimit(samples_per_insert=1.0, error_buffer=3.0)
    with make(tmp_path, sampler=Prioritized(), rate_limit=limit) as rb:
        rb.extend(np.arange(3), priorities=[1.0, 2.0, 3.0])
        rb.sample(2)
        rb.update_priorities([2], [5.0])
        target = os.path.join(tmp_path, "copy.h5")
        export_buffer(rb, target)
    with ReplayBuffer.load_from(target) as copy:
        assert copy.sampling.rate_limit == limit
        assert copy.priorities(np.arange(3)).tolist() == [1.0, 2.0, 5.0]
        assert (copy.info()["inserted"], copy.info()["sampled"]) == (3, 2)


@pytest.mark.parametrize(
    ("make_it", "words"),
    [
        (lambda: Prioritized(exponent=-1), "exponent"),
        (lambda: Prioritized(initial_priority=0.0), "initial_priority"),
        (lambda: RateLimit(min_size_to_sample=0), "min_size_to_sample"),
        (lambda: RateLimit(samples_per_insert=2.0), "needs an error_buffer"),
        (lambda: RateLimit(samples_per_insert=4.0, error_buffer=2.0), "no single row"),
        (lambda: RateLimit(error_buffer=2.0), "goes with samples_per_insert"),
        (lambda: SamplingConfig(max_times_sampled=-1), "max_times_sampled"),
        (lambda: SamplingConfig(sampler="prioritized"), "sampler must be"),  # type: ignore[arg-type]
        (lambda: RateLimit.queue(1), "queue's size"),
    ],
)
def test_bad_settings_are_refused(make_it: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        make_it()  # type: ignore[operator]


def test_bad_settings_create_no_file(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ConfigError):
        make(tmp_path, max_times_sampled=True)
    assert not os.path.exists(os.path.join(tmp_path, "b.h5"))


def test_a_read_only_buffer_refuses_sampling_that_changes_the_buffer(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "b.h5")
    with ReplayBuffer.create(SPACE, 10, path, rate_limit=RateLimit(samples_per_insert=1.0, error_buffer=5.0)) as rb:
        rb.extend(np.arange(3))
    with ReplayBuffer.load_from(path) as rb:
        with pytest.raises(ReadOnlyError, match="the rate limit counts every sample"):
            rb.sample(1)
        assert rb.get_rows([0, 1]).tolist() == [0, 1]


# ---------------------------------------------------------------------------------------------- rate limits


def test_min_size_holds_samples_back(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, rate_limit=RateLimit(min_size_to_sample=3)) as rb:
        rb.extend(np.arange(2))
        with pytest.raises(RateLimitedError, match="fewer than min_size_to_sample=3: inserts are behind by 1 rows"):
            rb.sample(1)
        rb.append(np.int64(2))
        assert rb.sample(5).shape == (5,)


def test_samples_per_insert_keeps_the_ratio_within_the_error_buffer(tmp_path: os.PathLike[str]) -> None:
    limit = RateLimit(min_size_to_sample=1, samples_per_insert=2.0, error_buffer=4.0)
    with make(tmp_path, capacity=None, rate_limit=limit) as rb:
        rb.extend(np.arange(1))
        rb.sample(4)  # 1 * 2 - 4 = -2 >= 2 - 4
        with pytest.raises(RateLimitedError, match="sampling is ahead of inserts: 4 rows sampled for 1 inserted"):
            rb.sample(1)
        rb.extend(np.arange(4))  # 5 * 2 - 4 = 6 <= 2 + 4
        with pytest.raises(RateLimitedError, match="inserts are ahead of sampling"):
            rb.append(np.int64(0))
        with pytest.raises(RateLimitedError, match="more than the whole window"):
            rb.sample(9)  # can never go ahead, however long it waits
        assert len(rb) == 5
        rb.sample(4)
        rb.append(np.int64(0))


def test_a_rate_limited_commit_keeps_its_writer_open(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, rate_limit=RateLimit.queue(3)) as rb:
        rb.extend(np.arange(3))
        writer = rb.open_segment_writer()
        writer.extend(np.arange(3, 5))
        with pytest.raises(RateLimitedError):
            rb.commit_segment(writer)
        assert writer.state == "open" and len(rb) == 3
        rb.sample(2)
        assert rb.commit_segment(writer).length == 2


# ---------------------------------------------------------------------------------------------- queues


def test_fifo_with_max_times_sampled_one_is_a_queue(tmp_path: os.PathLike[str]) -> None:
    # 20 rows through a ring of 8: consumed rows leave, so their slots take new rows, none lost.
    with make(tmp_path, capacity=8, sampler=Fifo(), max_times_sampled=1) as rb:
        out: list[int] = []
        for round_, start in enumerate(range(0, 20, 4)):
            rb.extend(np.arange(start, start + 4))
            out += rb.sample(3).tolist()
            assert len(rb) == round_ + 1 and rb.view.begin == out[-1] + 1
        out += rb.sample(5).tolist()
        assert out == list(range(20)), "each row once, in order"
        with pytest.raises(NotEnoughDataError):
            rb.sample(1)
        with pytest.raises(EvictedError):
            rb.get_rows([19])


@pytest.mark.parametrize("capacity", [4, 64, 130])
def test_a_queue_never_drops_a_row_when_its_rate_limit_matches_its_capacity(
    tmp_path: os.PathLike[str], capacity: int
) -> None:
    # From 64 rows on, the ring releases capacity // 64 rows ahead of need: never a row that may
    # still be sampled (it did, and a full queue lost its oldest row).
    with make(tmp_path, capacity=capacity, sampler=Fifo(), max_times_sampled=1,
              rate_limit=RateLimit.queue(capacity)) as rb:
        out: list[int] = []
        nxt = 0
        rng = np.random.default_rng(0)
        for _ in range(40 * capacity):
            if rng.random() < 0.5:
                n = int(rng.integers(1, 6))
                try:
                    rb.extend(np.arange(nxt, nxt + n))
                    nxt += n
                except RateLimitedError:
                    assert rb.info()["sampleable"] + n > capacity
            else:
                try:
                    out += rb.sample(1).tolist()
                except RateLimitedError:
                    assert rb.info()["sampleable"] == 0
            info = rb.info()
            assert info["sampleable"] == info["inserted"] - info["sampled"] == len(rb), info
        out += rb.sample(rb.info()["sampleable"]).tolist() if rb.info()["sampleable"] else []
        assert out == list(range(nxt)), "every row exactly once, in order"


def test_lifo_hands_out_the_newest_rows(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Lifo()) as rb:
        rb.extend(np.arange(6))
        batch, info = rb.sample(3, with_info=True)
        assert batch.tolist() == [5, 4, 3] and info.probabilities.tolist() == [1.0, 1.0, 1.0]
        assert rb.sample(3).tolist() == [5, 4, 3], "without max_times_sampled nothing leaves"
    with ReplayBuffer.create(SPACE, 10, os.path.join(tmp_path, "s.h5"), sampler=Lifo(), max_times_sampled=1) as rb:
        rb.extend(np.arange(6))
        assert rb.sample(2).tolist() == [5, 4]
        rb.append(np.int64(6))
        assert rb.sample(3).tolist() == [6, 3, 2]
        with pytest.raises(NotEnoughDataError, match="needs 3 rows that may be sampled; the buffer has 2"):
            rb.sample(3)


def test_max_times_sampled_counts_survive_a_reopen(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "b.h5")
    with ReplayBuffer.create(SPACE, 10, path, sampler=Uniform(), max_times_sampled=2) as rb:
        rb.extend(np.arange(4))
        taken = rb.sample(4)  # every row once
        taken2 = rb.sample(2)  # two rows twice: they are removed
        assert sorted(taken.tolist()) == [0, 1, 2, 3]
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.info()["sampleable"] == 2
        rest = rb.sample(2)
        assert sorted(rest.tolist() + taken2.tolist()) == [0, 1, 2, 3]
        with pytest.raises(NotEnoughDataError):
            rb.sample(1)


def test_windows_refused_where_rows_are_handed_out_in_order(tmp_path: os.PathLike[str]) -> None:
    with make(tmp_path, sampler=Fifo()) as rb:
        rb.extend(np.arange(6))
        rb.end_episode()
        with pytest.raises(ConfigError, match="use sample"):
            rb.sample_sequences(1, 2)
