"""Samplers as objects: Recency and Mixture draw by the probabilities they state (chi-square
against a distribution computed here, independently), report them exactly, go through files
and readers, and refuse settings they cannot work with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from stats_helpers import chi_square_p

from h5replay.errors import ConfigError
from h5replay.samplers import (
    Fifo,
    Mixture,
    Prioritized,
    Recency,
    Sampler,
    Uniform,
    kinds,
    sampler_from_json,
    sampler_to_json,
)
from h5replay.sampling import Table
from h5replay.storage import BoxSpace, ReplayBuffer

pytestmark = pytest.mark.timeout(60)

SPACE = BoxSpace(0, 2**40, (), np.int64)  # every row holds its own id
DRAWS = 200_000


def recency_law(held: np.ndarray, end: int, half_life: float) -> np.ndarray:
    weights = 0.5 ** ((end - 1 - held) / half_life)
    return weights / weights.sum()


def filled(path: Path, sampler: Sampler, rows: int = 150, capacity: int | None = 100,
           priorities: np.ndarray | None = None) -> ReplayBuffer:
    rb = ReplayBuffer.create(SPACE, capacity, path, sampler=sampler)
    for first in range(0, rows, 10):  # episodes of 10 rows; the ring wraps past 100
        rb.extend(np.arange(first, first + 10), priorities=None if priorities is None else priorities[first:first + 10])
        rb.end_episode()
    rb.flush()
    return rb


def test_recency_draws_by_its_stated_law_and_reports_it(tmp_path: Path) -> None:
    with filled(tmp_path / "b.h5", Recency(15.0)) as rb:
        held = np.arange(rb.view.begin, rb.view.end)
        expected = recency_law(held, rb.view.end, 15.0)
        _, info = rb.sample(DRAWS, np.random.default_rng(1), with_info=True)
        ids = info.row_ids.astype(np.int64)
        observed = np.bincount(ids - held[0], minlength=held.size)
        assert chi_square_p(observed, expected * DRAWS) > 1e-4
        np.testing.assert_allclose(info.probabilities, expected[ids - held[0]], rtol=1e-12)
        # The test can fail: the same draws against a law of another half life are refused.
        assert chi_square_p(observed, recency_law(held, rb.view.end, 20.0) * DRAWS) < 1e-9


@pytest.mark.parametrize("with_prioritized", [False, True])
def test_a_mixture_draws_by_its_components_weights_and_reports_the_mixtures_probability(
        tmp_path: Path, with_prioritized: bool) -> None:
    first: Sampler = Prioritized(1.0) if with_prioritized else Uniform()
    priorities = np.linspace(0.5, 5.0, 150)
    mixture = Mixture({first: 0.3, Recency(8.0): 0.7})
    with filled(tmp_path / "b.h5", mixture, priorities=priorities if with_prioritized else None) as rb:
        held = np.arange(rb.view.begin, rb.view.end)
        base = priorities[held] / priorities[held].sum() if with_prioritized else np.full(held.size, 1 / held.size)
        expected = 0.3 * base + 0.7 * recency_law(held, rb.view.end, 8.0)
        _, info = rb.sample(DRAWS, np.random.default_rng(2), with_info=True)
        ids = info.row_ids.astype(np.int64)
        observed = np.bincount(ids - held[0], minlength=held.size)
        assert chi_square_p(observed, expected * DRAWS) > 1e-4
        np.testing.assert_allclose(info.probabilities, expected[ids - held[0]], rtol=1e-9)
        wrong = 0.5 * base + 0.5 * recency_law(held, rb.view.end, 8.0)
        assert chi_square_p(observed, wrong * DRAWS) < 1e-9


@pytest.mark.parametrize("sampler", [Recency(6.0), Mixture({Uniform(): 0.5, Recency(6.0): 0.5})])
def test_windows_are_weighted_by_the_age_of_their_first_row(tmp_path: Path, sampler: Sampler) -> None:
    steps = 4
    with filled(tmp_path / "b.h5", sampler) as rb:
        episodes = rb.episode_table()
        starts = np.concatenate([np.arange(s, s + n - steps + 1) for _, s, n in episodes.tolist()])
        rec = recency_law(starts, rb.view.end, 6.0)
        expected = rec if isinstance(sampler, Recency) else 0.5 / starts.size + 0.5 * rec
        _, info = rb.sample_sequences(50_000, steps, np.random.default_rng(3), with_info=True, rows=False)
        first = info.row_ids.astype(np.int64)
        index = np.searchsorted(starts, first)
        assert np.array_equal(starts[index], first)  # every window inside one episode
        observed = np.bincount(index, minlength=starts.size)
        assert chi_square_p(observed, expected * 50_000) > 1e-4
        np.testing.assert_allclose(info.probabilities, expected[index], rtol=1e-9)


def test_a_reader_process_draws_recency_and_mixtures_as_the_writer_does(tmp_path: Path) -> None:
    mixture = Mixture({Prioritized(1.0): 0.5, Recency(30.0): 0.5})
    with filled(tmp_path / "b.h5", mixture, priorities=np.linspace(1.0, 3.0, 150)) as rb:
        with ReplayBuffer.load_from(tmp_path / "b.h5", read_only=True, multiprocessing=True) as reader:
            assert reader.sampling.sampler == mixture
            _, writer_info = rb.sample(64, np.random.default_rng(5), with_info=True)
            _, reader_info = reader.sample(64, np.random.default_rng(5), with_info=True)
            assert np.array_equal(writer_info.row_ids, reader_info.row_ids)
            np.testing.assert_allclose(writer_info.probabilities, reader_info.probabilities, rtol=1e-12)


@pytest.mark.parametrize("sampler", [Recency(3.5), Mixture({Uniform(): 1, Recency(10): 2.5}),
                                     Mixture({Prioritized(0.5, 2.0): 0.5, Recency(1e9): 0.5})])
def test_samplers_round_trip_through_json_and_files(tmp_path: Path, sampler: Sampler) -> None:
    assert sampler_from_json(sampler_to_json(sampler)) == sampler
    ReplayBuffer.create(SPACE, 10, tmp_path / "b.h5", sampler=sampler).close()
    with ReplayBuffer.load_from(tmp_path / "b.h5") as rb:
        assert rb.sampling.sampler == sampler
    assert {"uniform", "prioritized", "fifo", "lifo", "recency", "mixture"} <= set(kinds())


@pytest.mark.parametrize(("make", "says"), [
    (lambda: Recency(0), "half_life must be a finite number of rows > 0"),
    (lambda: Recency(float("inf")), "half_life"),
    (lambda: Recency(True), "half_life"),  # type: ignore[arg-type]
    (lambda: Mixture({}), "at least one component"),
    (lambda: Mixture({Fifo(): 1.0}), "components draw by chance"),
    (lambda: Mixture({Mixture({Uniform(): 1.0}): 1.0}), "components draw by chance"),
    (lambda: Mixture({Uniform(): -1.0}), "weights are finite numbers > 0"),
    (lambda: Mixture({Uniform(): float("nan")}), "weights are finite numbers > 0"),
    (lambda: Mixture({Prioritized(1.0): 1.0, Prioritized(0.5): 1.0}), "one prioritized component"),
    (lambda: Table(Recency(10.0), max_times_sampled=1), "Recency\\(\\) draws with replacement and cannot remove"),
    (lambda: Table(Mixture({Uniform(): 1.0}), max_times_sampled=2), "cannot remove rows"),
    (lambda: sampler_from_json('{"kind": "recency", "half_life": -3}'), "half_life"),
    (lambda: sampler_from_json('{"kind": "mixture", "components": 3}'), "a mixture is"),
    (lambda: sampler_from_json('{"kind": "nope"}'), "unknown sampler kind 'nope'"),
])
def test_settings_a_sampler_cannot_work_with_are_refused_naming_them(make: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        make()  # type: ignore[operator]


def test_priorities_go_to_a_mixtures_prioritized_component(tmp_path: Path) -> None:
    mixture = Mixture({Prioritized(1.0): 0.5, Uniform(): 0.5})
    with filled(tmp_path / "b.h5", mixture, rows=20, priorities=np.ones(20)) as rb:
        rb.update_priorities([19], [11.0])
        assert rb.priorities([18, 19]).tolist() == [1.0, 11.0]
        _, info = rb.sample(4, np.random.default_rng(0), with_info=True)
        held = 20
        total = 19 + 11.0
        expected = np.where(info.row_ids == 19, 0.5 * 11 / total + 0.5 / held, 0.5 / total + 0.5 / held)
        np.testing.assert_allclose(info.probabilities, expected)
