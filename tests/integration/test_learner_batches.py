"""`LearnerClient.batches`: a prefetching iterator that keeps requests in flight. The batches are
the ones `sample` would draw with the same seeds, a loop left early leaves the client exact, and
errors end the iterator with the same exception `sample` raises."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
from service_helpers import episode_rows, row_problems

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.errors import ConfigError, NotEnoughDataError, ServerUnavailableError
from h5replay.sampling import Fifo, SamplingConfig

pytestmark = pytest.mark.timeout(120)


def _fill(endpoint: str, episodes: int = 6, length: int = 40) -> None:
    with ActorClient(endpoint, timeout=10) as actor:
        for e in range(episodes):
            actor.push_episode(episode_rows(1, e, length))


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_batches_are_the_samples_of_the_same_seeds(start_server: Any) -> None:
    server = start_server()
    _fill(server.endpoint)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        got = list(itertools.islice(learner.batches(64, prefetch=3, seed=10, with_info=True), 5))
        for k, (batch, info) in enumerate(got):
            expected, expected_info = learner.sample(64, seed=10 + k, with_info=True)
            assert _same(batch, expected) and np.array_equal(info.row_ids, expected_info.row_ids)
            assert not row_problems(batch)
        windows = list(itertools.islice(learner.batches(16, sequence_length=5, seed=3), 3))
        for k, batch in enumerate(windows):
            assert _same(batch, learner.sample_sequences(16, 5, seed=3 + k))
            assert batch["obs"].shape[:2] == (16, 5)


def test_a_batch_bigger_than_a_message_comes_in_parts(start_server: Any) -> None:
    server = start_server(limits=P.Limits(max_rows_per_message=100))
    _fill(server.endpoint)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        first, second = itertools.islice(learner.batches(230, prefetch=2, seed=0), 2)
        assert first["obs"].shape[0] == second["obs"].shape[0] == 230
        assert _same(first, learner.sample(230, seed=0))  # parts seeded 0, 1, 2
        assert _same(second, learner.sample(230, seed=3))  # the next batch's parts: 3, 4, 5


def test_leaving_the_loop_early_leaves_the_client_exact(start_server: Any) -> None:
    server = start_server()
    _fill(server.endpoint)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        for _ in range(20):
            batches = learner.batches(32, prefetch=8)
            next(batches)
            batches.close()  # seven requests still travelling are dropped
            # Their late replies never answer a later call.
            assert _same(learner.sample(32, seed=99), learner.sample(32, seed=99))
            assert len(learner) == 240
            assert learner.get([0, 1])["obs"].shape == (2, 16)


def test_refusals_come_at_once_and_errors_end_the_iterator(start_server: Any) -> None:
    server = start_server()
    with LearnerClient(server.endpoint, timeout=2) as learner:
        for bad in ({"batch_size": 0}, {"batch_size": 8, "prefetch": 0}, {"batch_size": 8, "sequence_length": -1},
                    {"batch_size": 8, "prefetch": True}):
            with pytest.raises(ConfigError):
                learner.batches(**bad)  # before any batch is asked for
        batches = learner.batches(8)
        with pytest.raises(NotEnoughDataError):
            next(batches)  # an empty buffer, as sample() says
        with pytest.raises(StopIteration):
            next(batches)
        _fill(server.endpoint, episodes=1)
        assert next(learner.batches(8))["obs"].shape == (8, 16)
        server.kill()
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError):
            for _ in learner.batches(8, prefetch=4):
                pass
        assert time.monotonic() - started < 2 * 2 + 2


def test_a_writer_side_sampler_pipelines_too(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(Fifo(), max_times_sampled=1))
    _fill(server.endpoint, episodes=5, length=20)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.sampling["writer_samples"]
        rows = [info.row_ids for _, info in itertools.islice(learner.batches(10, prefetch=3, with_info=True), 10)]
    assert np.array_equal(np.concatenate(rows), np.arange(100))  # a queue: every row once, in order


def test_without_a_seed_one_request_carries_several_batches_of_independent_draws(start_server: Any) -> None:
    server = start_server()
    _fill(server.endpoint)  # 6 episodes of 40: row id r is step r % 40 of episode r // 40
    with LearnerClient(server.endpoint, timeout=10) as learner:
        before = learner.info()["read_requests"]
        got = list(itertools.islice(learner.batches(16, prefetch=8, with_info=True), 40))
        # Groups of 4 batches (prefetch // 2), two groups in flight: 10 requests, and 2 ahead.
        assert learner.info()["read_requests"] - before <= 12
        for batch, info in got:
            ids = info.row_ids.astype(np.int64)
            assert batch["obs"].shape == (16, 16) and len(info) == 16 and not row_problems(batch)
            assert np.array_equal(batch["episode"], ids // 40) and np.array_equal(batch["step"], ids % 40)
            assert np.array_equal(info.episode_ids, ids // 40) and np.allclose(info.probabilities, 1 / 240)
        assert len({tuple(info.row_ids.tolist()) for _, info in got}) == 40  # every batch its own draw
        before = learner.info()["read_requests"]
        windows = list(itertools.islice(learner.batches(4, sequence_length=5, prefetch=4, with_info=True), 10))
        assert learner.info()["read_requests"] - before <= 7  # groups of 2
        for batch, info in windows:
            ids = info.row_ids.astype(np.int64)
            assert batch["step"].shape == (4, 5) and np.array_equal(batch["step"][:, 0], ids % 40)
            assert np.array_equal(batch["step"], batch["step"][:, :1] + np.arange(5)) and not row_problems(batch)


def test_wait_for_size_waits_for_rows_arriving_and_says_how_many_when_it_gives_up(start_server: Any) -> None:
    import threading

    server = start_server()
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.wait_for_size(0, timeout=0) == 0
        started = time.monotonic()
        with pytest.raises(NotEnoughDataError, match="0 rows may be sampled after 0.3 s of waiting, fewer than the 50"):
            learner.wait_for_size(50, timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 3
        later = threading.Timer(0.5, _fill, args=(server.endpoint, 2, 40))
        later.start()
        try:
            started = time.monotonic()
            assert learner.wait_for_size(50, timeout=20) == 80
            assert 0.4 < time.monotonic() - started < 10
        finally:
            later.join()
        assert learner.sample(50, seed=0)["obs"].shape[0] == 50
        for bad in (-1, 2.5, True, "3"):
            with pytest.raises(ConfigError, match="size must be an int >= 0"):
                learner.wait_for_size(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="timeout must be a number of seconds"):
            learner.wait_for_size(1, timeout=-1)


def test_wait_for_size_over_shards_counts_every_shard(tmp_path: Any) -> None:
    from shard_helpers import running_shards

    with running_shards(tmp_path, 2) as shards:
        _fill(shards.endpoints[0], 1, 30)
        _fill(shards.endpoints[1], 1, 25)
        with LearnerClient(endpoints=shards.endpoints, timeout=10) as learner:
            assert learner.wait_for_size(55, timeout=10) == 55
            with pytest.raises(NotEnoughDataError, match="55 rows may be sampled"):
                learner.wait_for_size(56, timeout=0.2)
