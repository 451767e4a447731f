"""A draw that changes state is a transaction (issue 21): queue rows (fifo, max_times_sampled=1)
and rate-limited samples are never dropped on the way, whatever splits, routes or outlives the
request: a batch split over several messages, shards that cannot give their share, a learner
that dies while its sample waits. And a reply too long for one message (the episode list) is
read in pages."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import msgpack
import numpy as np
import pytest
from service_helpers import RawClient, episode_rows, error_of, processes, wait_until

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import LimitExceededError, ProtocolError, RateLimitedError
from h5replay.sampling import Fifo, SamplingConfig

SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(120)
QUEUE = SamplingConfig(Fifo(), max_times_sampled=1)


def waiting_learner_main(endpoint: str, rows: int) -> None:
    """Ask a queue for `rows` rows and wait for them (killed by the test meanwhile)."""
    config = ClientConfig(endpoint=endpoint, timeout=10.0, name="doomed", rate_limit_timeout=60.0)
    with LearnerClient(config=config) as learner:
        learner.sample(rows)


def test_a_learner_that_dies_while_its_sample_waits_takes_no_row(start_server: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE, heartbeat_interval=0.2)
    with LearnerClient(server.endpoint, timeout=10) as watcher, processes() as procs:
        doomed = SPAWN.Process(target=waiting_learner_main, args=(server.endpoint, 10))
        procs.append(doomed)
        doomed.start()
        assert wait_until(lambda: watcher.info()["waiting_samples"] == 1, 30), "the sample never waited"
        doomed.kill()
        doomed.join(10)
        # The server notices the connection is gone (its next liveness probe fails) and drops
        # what the departed client had waiting.
        assert wait_until(lambda: watcher.info()["waiting_samples"] == 0, 10), "a dead client's sample still waits"
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 10))
    config = ClientConfig(endpoint=server.endpoint, timeout=10.0, name="heir", rate_limit_timeout=10.0)
    with LearnerClient(config=config) as learner:
        batch = learner.sample(10)
        assert batch["step"].tolist() == list(range(10)), "rows went to a learner that had died"
        assert learner.info()["sampled"] == 10


def _learner(endpoint: str | None = None, *, endpoints: list[str] | None = None, rate_limit_timeout: float = 0.5,
             timeout: float = 10.0) -> LearnerClient:
    config = ClientConfig(endpoint=endpoint or "tcp://127.0.0.1:1", timeout=timeout, name="learner",
                          rate_limit_timeout=rate_limit_timeout)
    return LearnerClient(config=config, endpoints=endpoints)


def _push(endpoint: str, first: int, rows: int) -> None:
    """`rows` rows whose "step" is first, first + 1, ...: a queue's rows say where they came from."""
    with ActorClient(endpoint, timeout=10) as actor:
        batch = episode_rows(1, first, rows)
        batch["step"] = np.arange(first, first + rows, dtype=np.int32)
        batch["length"] = np.full(rows, 10**6 - 1, np.int32)
        actor.push_episode(batch)


def test_a_split_sample_that_falls_short_keeps_what_it_drew_for_the_next(start_server: Any) -> None:
    # 80 rows in messages of 64: the second part finds 6 of the 16 rows it needs. The 64 the first
    # part took from the queue are kept by the client and come first in its next sample.
    server = start_server(capacity=1000, sampling=QUEUE, limits=P.Limits(max_rows_per_message=64))
    _push(server.endpoint, 0, 70)
    with _learner(server.endpoint) as learner:
        with pytest.raises(RateLimitedError, match="64 rows .* are kept by this client"):
            learner.sample(80)
        assert learner.num_kept == 64
        _push(server.endpoint, 70, 10)
        batch, info = learner.sample(80, with_info=True)
        assert batch["step"].tolist() == list(range(80)), "every committed row once, in commit order"
        assert info.row_ids.tolist() == list(range(80)) and learner.num_kept == 0
        assert learner.info()["sampled"] == 80


def test_leaving_a_batches_loop_keeps_the_rows_in_flight_and_cancels_what_waits(start_server: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE)
    _push(server.endpoint, 0, 100)
    with _learner(server.endpoint, rate_limit_timeout=30.0) as learner:
        got = []
        for batch in learner.batches(10, prefetch=4):  # 3 batches taken; 3 more (prefetch - 1) in flight
            got += batch["step"].tolist()
            if len(got) == 30:
                break
        assert learner.num_kept == 30, "the batches in flight were drawn: they are the learner's"
        got += learner.sample(70)["step"].tolist()
        assert got == list(range(100))
        # Fewer rows than the loop asks for ahead: what waits for rows is cancelled when the loop
        # is left (not left waiting for rows that nobody then gets), and leaving takes no time.
        _push(server.endpoint, 100, 25)
        loop = learner.batches(10, prefetch=4)
        got = next(loop)["step"].tolist() + next(loop)["step"].tolist()
        started = time.monotonic()
        loop.close()
        assert time.monotonic() - started < 5.0, "leaving the loop waited for the rate limit"
        assert learner.num_kept == 0 and learner.info()["waiting_samples"] == 0
        got += learner.sample(5)["step"].tolist()
        assert got == list(range(100, 125))


def test_over_shards_a_share_one_queue_cannot_give_comes_from_the_others(start_server: Any) -> None:
    a = start_server("a.h5", capacity=1000, sampling=QUEUE)
    b = start_server("b.h5", capacity=1000, sampling=QUEUE)
    _push(a.endpoint, 0, 50)
    _push(b.endpoint, 1000, 100)
    got: list[int] = []
    with _learner(endpoints=[a.endpoint, b.endpoint]) as learner:
        assert len(learner) == 150
        got += learner.sample(1)["step"].tolist()  # its shares now come from the lengths it saw
        with _learner(a.endpoint) as other:  # shard a is drained behind its back
            got += other.sample(49)["step"].tolist()
        batch = learner.sample(60)["step"].tolist()
        # The share asked of a could not be given: b gave it; nothing b drew was dropped.
        assert len(batch) == 60 and len(set(batch)) == 60
        got += batch
        got += learner.sample(40)["step"].tolist()  # exactly what is left on both
        with pytest.raises(RateLimitedError):  # nothing left anywhere
            learner.sample(1)
        assert learner.num_kept == 0
    assert sorted(got) == [*range(50), *range(1000, 1100)], "every committed row exactly once"


def test_over_shards_a_shard_going_down_mid_draw_loses_none_of_the_others_rows(start_server: Any) -> None:
    a = start_server("a.h5", capacity=1000, sampling=QUEUE)
    b = start_server("b.h5", capacity=1000, sampling=QUEUE)
    _push(a.endpoint, 0, 100)
    _push(b.endpoint, 1000, 100)
    with _learner(endpoints=[a.endpoint, b.endpoint], timeout=1.0) as learner:
        assert len(learner) == 200
        a.kill()  # its share times out; b's part of the same call must reach the caller
        got = learner.sample(50)["step"].tolist()
        assert sorted(got) == list(range(1000, 1050))
        assert learner.sample(50)["step"].tolist() == list(range(1050, 1100))
        assert learner.info()["sampled"] == 100


def test_an_episode_list_longer_than_a_message_comes_in_pages(start_server: Any) -> None:
    # 64 KiB messages hold 2,048 episode records: 5,000 episodes take three pages.
    limits = P.Limits(max_message_bytes=64 << 10)
    server = start_server(capacity=100_000, limits=limits)
    with ActorClient(server.endpoint, timeout=10) as actor:
        for first in range(0, 5000, 250):
            actor.push_episodes([episode_rows(1, k, 1) for k in range(first, first + 250)])
    with LearnerClient(server.endpoint, timeout=10) as learner:
        episodes = learner.episodes()
        assert [e.episode_id for e in episodes] == list(range(5000))
        assert [e.first_row_id for e in episodes] == list(range(5000))
        assert learner.get_segments() == [(k, 1) for k in range(5000)]
    with RawClient(server.read_endpoint) as raw:  # the whole list at once: refused, saying how to page
        reply = raw.call(lambda rid: P.Episodes(rid))
        assert isinstance(error_of(reply), LimitExceededError) and "pages" in str(error_of(reply))


def test_over_shards_len_and_shares_leave_out_rows_max_times_sampled_removed(start_server: Any) -> None:
    # Uniform draws with max_times_sampled=1 remove rows anywhere in the ring, not only at its head:
    # those rows are held (the ring has not moved past them) but can never be drawn again.
    once = SamplingConfig(max_times_sampled=1)
    a = start_server("a.h5", capacity=1000, sampling=once)
    b = start_server("b.h5", capacity=1000, sampling=once)
    _push(a.endpoint, 0, 50)
    _push(b.endpoint, 1000, 50)
    with _learner(a.endpoint) as other:
        taken = other.sample(30)["step"].tolist()
    with _learner(endpoints=[a.endpoint, b.endpoint]) as learner:
        assert len(learner) == 70
        got = learner.sample(70)["step"].tolist()  # exactly what may still be drawn, none asked of a twice
    assert sorted(taken + got) == [*range(50), *range(1000, 1050)]


def test_a_client_can_cancel_only_its_own_waiting_samples(start_server: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE)
    with RawClient(server.endpoint) as waiter, RawClient(server.endpoint) as other:
        waiter.send(P.encode(P.Sample(7, 5, None, 0, 30.0)))  # waits: the queue is empty
        with LearnerClient(server.endpoint, timeout=10) as watcher:
            assert wait_until(lambda: watcher.info()["waiting_samples"] == 1, 10)
            reply = other.call(lambda rid: P.Cancel(rid, np.array([7], np.uint64)))  # another client's id 7
            assert reply.request_ids.tolist() == []  # type: ignore[attr-defined]
            assert watcher.info()["waiting_samples"] == 1
            reply = waiter.call(lambda rid: P.Cancel(rid, np.array([7, 99, 2**64 - 1], np.uint64)))
            assert reply.request_ids.tolist() == [7]  # type: ignore[attr-defined]
            assert watcher.info()["waiting_samples"] == 0
            # Hand-made nonsense is refused, and the server goes on.
            header = {"version": P.PROTOCOL_VERSION, "kind": "cancel", "id": 5, "fields": {},
                      "arrays": [["request_ids", "<f8", [1]]]}
            refused = other.request([msgpack.packb(header), np.zeros(1).tobytes()])
            assert isinstance(error_of(refused), ProtocolError)
            with RawClient(server.read_endpoint) as reader:
                reply = reader.call(lambda rid: P.Episodes(rid, 0, 2**64 - 1, 2**64 - 1))
                assert len(reply.episodes) == 0  # type: ignore[attr-defined]
        _push(server.endpoint, 0, 5)
        with _learner(server.endpoint) as learner:
            assert learner.sample(5)["step"].tolist() == list(range(5)), "a cancelled sample took rows"


def test_over_shards_rows_kept_by_a_shard_that_goes_down_come_back_first(start_server: Any) -> None:
    """Rows a shard's client kept from a split draw that fell short outlive that shard: when it
    goes down, the sharded learner keeps them under the same kind of draw (the table named as the
    shard's client names it) and its next sample returns them first."""
    limits = P.Limits(max_rows_per_message=8)
    a = start_server("a.h5", capacity=1000, sampling=QUEUE, limits=limits)
    b = start_server("b.h5", capacity=1000, sampling=QUEUE, limits=limits)
    _push(a.endpoint, 0, 20)
    with _learner(endpoints=[a.endpoint, b.endpoint], timeout=1.0, rate_limit_timeout=0.2) as learner:
        assert len(learner) == 20
        with pytest.raises(RateLimitedError):
            learner.sample(30)  # a's client draws in messages of 8, and one falls short
        kept = learner.num_kept
        assert kept in (8, 16)
        a.kill()
        len(learner)  # a does not answer: it is retired, and what its client kept moves here
        assert learner.num_kept == kept
        _push(b.endpoint, 1000, 10)
        got = learner.sample(kept + 5)["step"].tolist()
        assert got[:kept] == list(range(kept)) and sorted(got[kept:]) == list(range(1000, 1005))
        assert learner.num_kept == 0
