"""The rate limit's window sizes what clients send, and the server's "can never go ahead" agrees:
fast ingest (push_episodes, segment commits sharing a message) under a samples-per-insert limit,
inserts in the min-size zone, and retries of a partly applied message (issue 21, defects 3-4)."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from service_helpers import EPISODE_SPACE, episode_rows

from h5replay import protocol as P
from h5replay import sampling
from h5replay.client import ActorClient, LearnerClient
from h5replay.client._connection import say_hello
from h5replay.config import ClientConfig
from h5replay.errors import RateLimitedError
from h5replay.sampling import RateLimit, SamplingConfig
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(120)


def _sampling_learner(endpoint: str, stop: threading.Event, errors: list[BaseException]) -> None:
    """Samples as fast as the limit lets it, until `stop`."""
    config = ClientConfig(endpoint=endpoint, timeout=10.0, name="sampler", rate_limit_timeout=0.5)
    try:
        with LearnerClient(config=config) as learner:
            while not stop.is_set():
                try:
                    learner.sample(256)
                except RateLimitedError:
                    pass
    except BaseException as exc:  # noqa: B036 (reported to the test)
        errors.append(exc)


def test_push_episodes_under_a_ratio_limit_is_sized_by_its_window(start_server: Any) -> None:
    # 32 episodes of 100 rows move the balance by 25,600 at samples_per_insert 8: more than the
    # window of 8,192 as one message. Split by half the window (512 rows: what the limit admits
    # from the start, before anything can be sampled), every message can go.
    limit = RateLimit(min_size_to_sample=1, samples_per_insert=8.0, error_buffer=4096.0)
    server = start_server(capacity=100_000, sampling=SamplingConfig(rate_limit=limit))
    stop, errors = threading.Event(), []  # type: ignore[var-annotated]
    sampler = threading.Thread(target=_sampling_learner, args=(server.endpoint, stop, errors), daemon=True)
    sampler.start()
    try:
        config = ClientConfig(endpoint=server.endpoint, timeout=10.0, name="pusher", rate_limit_timeout=30.0)
        with ActorClient(config=config) as actor:
            assert actor.rows_per_push == 512
            receipts = actor.push_episodes([episode_rows(1, k, 100) for k in range(32)])
            assert [r.length for r in receipts] == [100] * 32
            assert [r.episode_id for r in receipts] == list(range(32))
            # Segments committed with wait=False share messages under load: within the window too.
            pending = []
            for k in range(32, 64):
                with actor.segment() as seg:
                    seg.extend(episode_rows(1, k, 100))
                    pending.append(seg.commit(wait=False))
            actor.flush()
            assert sorted(p.result().episode_id for p in pending) == list(range(32, 64))
    finally:
        stop.set()
        sampler.join(30)
    assert not errors, errors
    with LearnerClient(server.endpoint, timeout=10) as learner:
        info = learner.info()
        assert info["num_episodes"] == 64 and info["length"] == 6400
        balance = info["inserted"] * 8.0 - info["sampled"]
        assert balance <= 8.0 + 4096.0


def test_an_insert_within_the_min_size_zone_or_the_initial_balance_is_never_refused_as_impossible(
    tmp_path: Any,
) -> None:
    # Empty buffer, min_size 1000, window 600: one insert of 700 rows keeps the buffer below the
    # minimum, where inserts are not limited; 1,300 rows fit the balance as it starts (0, below the
    # window [700, 1300]). Neither can ever be refused as "never".
    limit = RateLimit(min_size_to_sample=1000, samples_per_insert=1.0, error_buffer=300.0)
    with ReplayBuffer.create(EPISODE_SPACE, 10_000, tmp_path / "a.h5", rate_limit=limit) as rb:
        assert rb.rate_limit_blocker(700, sampling=False) == (None, False)
        rb.extend(episode_rows(1, 0, 700))
        rb.end_episode()
        assert len(rb) == 700
    with ReplayBuffer.create(EPISODE_SPACE, 10_000, tmp_path / "b.h5", rate_limit=limit) as rb:
        assert rb.rate_limit_blocker(1300, sampling=False) == (None, False)
        rb.extend(episode_rows(1, 0, 1300))
        rb.end_episode()
        why, never = rb.rate_limit_blocker(1, sampling=False)  # the balance is at the top now: wait
        assert why is not None and not never
        # A sample of more than the whole window can never go: refused at once, saying the bound.
        why, never = rb.rate_limit_blocker(601, sampling=True)
        assert never and "at most 300 can always go" in str(why)
        assert rb.rate_limit_blocker(600, sampling=True) == (None, False)


def test_what_a_client_sends_at_once_goes_ahead_from_the_start(tmp_path: Any) -> None:
    # The worst case for a client's first message: nothing held, nothing sampled. An insert of
    # `rows_at_once` rows goes at once; once min_size rows are held, so does a sample of as many.
    for k, limit in enumerate((RateLimit(1, 8.0, 4096.0), RateLimit(1000, 1.0, 300.0), RateLimit(5, 0.3, 1.0),
                               RateLimit(1, 3.0, 3.5), RateLimit.queue(10))):
        described = SamplingConfig(rate_limit=limit).describe()
        inserts = sampling.rows_at_once(described, sampling=False)
        samples = sampling.rows_at_once(described, sampling=True)
        assert inserts is not None and samples is not None
        with ReplayBuffer.create(EPISODE_SPACE, None, tmp_path / f"{k}.h5", rate_limit=limit) as rb:
            assert rb.rate_limit_blocker(inserts, sampling=False) == (None, False), limit
            rb.extend(episode_rows(1, 0, limit.min_size_to_sample))
            rb.end_episode()
            assert rb.rate_limit_blocker(samples, sampling=True)[1] is False, limit
            if samples <= len(rb):
                assert rb.rate_limit_blocker(samples, sampling=True) == (None, False), limit
    assert sampling.rows_at_once(SamplingConfig().describe(), sampling=False) is None
    assert sampling.rows_at_once({"samples_per_insert": float("nan"), "error_buffer": 1.0, "min_size_to_sample": 1},
                        sampling=False) is None  # a description that is no rate limit bounds nothing


def test_a_retried_push_episodes_is_gated_only_by_the_episodes_it_still_inserts(start_server: Any) -> None:
    # Window [-199, 201]: a first message of 150 rows leaves the balance at 150. Its retry, with a
    # second episode of 50 rows, inserts 50 more (balance 200: goes at once); gated by all 200 rows
    # it carries it would have to wait, and with a timeout of 0 be refused.
    limit = RateLimit(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=200.0)
    server = start_server(capacity=10_000, sampling=SamplingConfig(rate_limit=limit))
    conn, _ = say_hello(ClientConfig(endpoint=server.endpoint, timeout=10.0, name="retrier"), "actor", None)
    try:
        keys = np.frombuffer(np.random.default_rng(0).bytes(32), np.uint8).reshape(2, 16).copy()
        first, second = episode_rows(1, 0, 150), episode_rows(1, 1, 50)
        reply = conn.request(lambda rid: P.PushEpisodes(rid, 150, np.array([150]), keys[:1], first, 0.0))
        assert reply.episodes.tolist() == [[0, 0, 150]]  # type: ignore[attr-defined]
        both = {k: np.concatenate([first[k], second[k]]) for k in first}
        reply = conn.request(lambda rid: P.PushEpisodes(rid, 200, np.array([150, 50]), keys, both, 0.0))
        assert reply.episodes.tolist() == [[0, 0, 150], [1, 150, 50]]  # type: ignore[attr-defined]
    finally:
        conn.close()
