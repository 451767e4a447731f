"""Sampling control over the wire (issue 10): prioritized replay with priorities from actors and
learners, the rate limiter holding samples and commits back (several processes), a queue that hands
every row out exactly once, settings kept across restarts, and the refusals."""

from __future__ import annotations

import multiprocessing as mp
import re
import threading
import time
from typing import Any

import numpy as np
import pytest
from service_helpers import (
    EPISODE_SPACE,
    RawClient,
    endpoint,
    episode_rows,
    error_of,
    processes,
    row_problems,
    wait_until,
)

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError, LimitExceededError, ProtocolError, RateLimitedError, ServerUnavailableError
from h5replay.sampling import Fifo, Prioritized, RateLimit, SamplingConfig
from h5replay.spaces import Schema

SPAWN = mp.get_context("spawn")
pytestmark = pytest.mark.timeout(120)


def _client_config(endpoint: str, name: str, rate_limit_timeout: float = 10.0) -> ClientConfig:
    return ClientConfig(endpoint=endpoint, timeout=10.0, name=name, rate_limit_timeout=rate_limit_timeout)


# ------------------------------------------------------------------------------------ prioritized


def test_priorities_from_actors_and_learners_decide_the_draws(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)))
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 4), priorities=[1.0, 1.0, 1.0, 5.0])
        with actor.segment() as seg:
            for step in range(4):
                one = {k: v[step] for k, v in episode_rows(2, 0, 4).items()}
                seg.append(one, priority=2.0 if step else None)  # a step without one: the largest so far (5)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.sampling["sampler"] == "prioritized" and not learner.sampling["writer_samples"]
        batch, info = learner.sample(4000, seed=1, with_info=True)
        assert not row_problems(batch)
        expected = np.array([1, 1, 1, 5, 5, 2, 2, 2], np.float64)
        ids = info.row_ids.astype(np.int64)
        assert np.allclose(info.probabilities, expected[ids] / expected.sum())
        counts = np.bincount(ids, minlength=8)
        assert counts[3] > 3 * counts[0]  # 5 against 1
        # A learner's update reaches every later sample of that learner (read-your-writes).
        assert learner.update_priorities([3, 4, 99_000_000 % 8], [0.0, 0.0, 1.0]) == 0
        _, info = learner.sample(2000, seed=2, with_info=True)
        assert not set(info.row_ids.tolist()) & {3, 4}
        stats = learner.info()
        assert stats["priority_updates"] == 3 and stats["sampler"] == "prioritized"
        assert stats["priority_sum"] == pytest.approx(1 + 1 + 1 + 0 + 0 + 2 + 2 + 2)


def test_priorities_survive_a_restart_and_evicted_ids_are_counted(start_server: Any, tmp_path: Any) -> None:
    sampling = SamplingConfig(Prioritized(exponent=1.0))
    server = start_server("p.h5", capacity=8, sampling=sampling)
    with ActorClient(server.endpoint, timeout=10) as actor:
        for k in range(3):
            actor.push_episode(episode_rows(1, k, 4), priorities=np.full(4, float(k + 1)))
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.update_priorities([0, 1, 11], [9.0, 9.0, 7.0]) == 2  # rows 0..3 left the ring of 8
        assert learner.info()["priority_updates_ignored"] == 2
    server.stop()
    again = start_server("p.h5", capacity=8)  # no sampling settings: the file's own
    with LearnerClient(again.endpoint, timeout=10) as learner:
        assert learner.sampling["sampler"] == "prioritized" and learner.sampling["priority_exponent"] == 1.0
        _, info = learner.sample(64, seed=3, with_info=True)
        weights = {i: 2.0 for i in range(4, 8)} | {8: 3.0, 9: 3.0, 10: 3.0, 11: 7.0}
        total = sum(weights.values())
        assert np.allclose(info.probabilities, [weights[i] / total for i in info.row_ids.tolist()])


def test_priority_updates_are_answered_after_their_publish_and_a_sigkill_loses_none_acknowledged(
    start_server: Any,
) -> None:
    """An update's reply leaves once the publish carrying it is made, within
    `priority_publish_interval` of the first update it waited with: what a learner holds an
    acknowledgement for is in the file, and its next read sees it. A SIGKILL loses no
    acknowledged update, and every row is there."""
    interval = 0.3
    sampling = SamplingConfig(Prioritized(exponent=1.0))
    server = start_server("k.h5", capacity=64, sampling=sampling, priority_publish_interval=interval)
    with ActorClient(server.endpoint, timeout=10) as actor:
        for k in range(4):
            actor.push_episode(episode_rows(1, k, 8), priorities=np.ones(8))
    with LearnerClient(server.endpoint, timeout=10) as learner:
        seq = learner.info()["seq"]
        started = time.monotonic()
        assert learner.update_priorities([0, 1], [0.0, 0.0]) == 0
        assert time.monotonic() - started >= 0.8 * interval, "acknowledged before the publish was due"
        for first in range(2, 16, 2):
            learner.update_priorities([first, first + 1], [0.0, 0.0], wait=False)
        _, info = learner.sample(2000, seed=1, with_info=True)  # after the replies: the publishes are made
        assert learner.views[0] is not None and learner.views[0].seq > seq
        assert not set(info.row_ids.tolist()) & set(range(16)), "a read after an update must see it"
        assert learner.info()["priority_updates"] == 16
        assert learner.update_priorities([20, 21], [0.0, 0.0]) == 0  # acknowledged: in the file
    server.kill()
    again = start_server("k.h5", capacity=64)
    with LearnerClient(again.endpoint, timeout=10) as learner:
        assert len(learner) == 32, "a SIGKILL never loses rows"
        assert not row_problems(learner.get_rows(np.arange(32)))
        assert learner.info()["priority_updates"] == 18, "an acknowledged update was lost"
        _, info = learner.sample(4000, seed=2, with_info=True)
        weights = np.ones(32)
        weights[:16] = weights[20:22] = 0.0
        assert np.allclose(info.probabilities, weights[info.row_ids.astype(np.int64)] / weights.sum())


def test_a_learner_reads_on_after_the_writer_is_killed_right_after_an_update(start_server: Any) -> None:
    """A restarted server is at the last publish the killed one made; every publish a learner
    was told of was made before it was told, so its reads go on (they once named a publish the
    writer had only promised, and failed until the new server had published as often)."""
    sampling = SamplingConfig(Prioritized(exponent=1.0))
    config = {"bind": endpoint(), "read_bind": endpoint(), "sampling": sampling, "priority_publish_interval": 0.5}
    server = start_server("r.h5", capacity=64, **config)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 8), priorities=np.ones(8))
    learner = LearnerClient(server.endpoint, timeout=10)
    try:
        learner.sample(8, seed=0)
        assert learner.update_priorities([0, 1, 2, 3], [0.0] * 4) == 0
        server.kill()
        again = start_server("r.h5", capacity=64, **{k: v for k, v in config.items() if k != "sampling"})
        assert again.endpoint == server.endpoint
        _, info = learner.sample(500, seed=1, with_info=True)
        assert not set(info.row_ids.tolist()) & {0, 1, 2, 3}, "an acknowledged update was lost"
    finally:
        learner.close()


def test_a_read_naming_a_publish_never_made_is_refused_at_once(start_server: Any) -> None:
    """min_seq is a client's number: one far ahead of the file (a lie, or another replay's) is
    refused after one look at the state row, so it cannot hold a reader for others."""
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)))
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 8), priorities=np.ones(8))
    liar = RawClient(server.read_endpoint)
    try:
        with LearnerClient(server.endpoint, timeout=10) as learner:
            started = time.monotonic()
            for k in range(4):
                liar.send(P.encode(P.Sample(k + 1, 4, None, 2**62, 0.0)))
            for _ in range(4):
                reply = liar.recv()
                assert isinstance(error_of(reply), ServerUnavailableError), reply
                assert "older than publish 4611686018427387904" in str(error_of(reply))
            assert len(learner.sample(8, seed=1)["step"]) == 8
            assert time.monotonic() - started < 1.0, "a read for a publish never made held the reader"
    finally:
        liar.close()


def test_a_writer_serving_reads_publishes_updates_before_a_read(start_server: Any) -> None:
    """With --readers 0 the writer answers reads itself: one after an update publishes it first
    (the read asks for the publish the update's reply named, and the writer never waits)."""
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)), num_readers=0,
                          priority_publish_interval=1.0)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 8), priorities=np.ones(8))
    with LearnerClient(server.endpoint, timeout=10) as learner:
        for round_ in range(3):
            assert learner.update_priorities([round_], [0.0]) == 0
            started = time.monotonic()
            _, info = learner.sample(500, seed=round_, with_info=True)
            assert time.monotonic() - started < 0.5, "the read waited for the interval instead of publishing"
            assert not set(info.row_ids.tolist()) & set(range(round_ + 1))


def test_a_file_with_other_settings_is_refused(start_server: Any, tmp_path: Any) -> None:
    start_server("s.h5", sampling=SamplingConfig(Prioritized())).stop()
    with pytest.raises(RuntimeError, match="did not start"):
        start_server("s.h5", sampling=SamplingConfig(Fifo()))


def test_bad_priority_updates_are_refused_and_the_server_keeps_serving(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(Prioritized()))
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 4))
        with pytest.raises(ConfigError, match="finite and >= 0"):
            actor.push_episode(episode_rows(1, 1, 2), priorities=[1.0, -2.0])
    with RawClient(server.endpoint) as raw:
        for ids, values, cls, words in [
            ([0], [float("nan")], ProtocolError, "priority 0 is nan: priorities must be finite and >= 0"),
            ([0, 1], [1.0, float("inf")], ProtocolError, "priority 1 is inf"),
            ([50], [1.0], IndexError, "never committed"),
        ]:
            reply = raw.call(lambda rid, i=ids, v=values: P.UpdatePriorities(rid, np.array(i), np.array(v)))
            exc = error_of(reply)
            assert isinstance(exc, cls) and words in str(exc), exc
        # One priority per row of a push: refused before anything is touched.
        exc = error_of(raw.call(lambda rid: P.PushEpisode(rid, 2, episode_rows(1, 2, 2), 0.0, np.ones(3))))
        assert isinstance(exc, ProtocolError) and "one per row" in str(exc)
        exc = error_of(raw.call(lambda rid: P.UpdatePriorities(rid, np.zeros(70_000, np.int64), np.ones(70_000))))
        assert isinstance(exc, LimitExceededError)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert len(learner) == 4 and learner.info()["priority_updates"] == 0


def test_priorities_whose_weight_would_overflow_are_refused_before_anything_is_written(start_server: Any) -> None:
    """1e200 ** 2 overflows float64: the sum tree would hold inf and every draw come back with
    probability 0 and NaN weights. The server refuses it in a push, a push of several episodes
    and an update, naming the bound; the file is as before and the server keeps serving."""
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=2.0)))
    words = r"priority 1 is 1e\+200: its weight priority \*\* exponent \(2\) would exceed 1e\+280"
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        actor.push_episode(episode_rows(1, 0, 4), priorities=[1.0, 2.0, 3.0, 4.0])
        with pytest.raises(ConfigError, match=words):  # the actor checks the server's bound: nothing is sent
            actor.push_episode(episode_rows(1, 1, 2), priorities=[1.0, 1e200])
        with pytest.raises(ConfigError, match=words):
            actor.push_episodes([episode_rows(1, 2, 2), episode_rows(1, 3, 2)], priorities=[[1.0, 1.0], [1.0, 1e200]])
        with RawClient(server.endpoint) as raw:  # a push that skips the check is refused by the server
            rows, _ = Schema(EPISODE_SPACE).encode_batch(episode_rows(1, 1, 2))
            reply = raw.call(lambda rid: P.PushEpisode(rid, 2, rows, 0.0, np.array([1.0, 1e200]), bytes(16)))
            assert isinstance(error_of(reply), ProtocolError) and re.search(words, str(error_of(reply)))
        with pytest.raises(ConfigError, match=words):  # the learner checks the server's bound too: nothing is sent
            learner.update_priorities([0, 1], [1.0, 1e200])
        with RawClient(server.endpoint) as raw:  # one that does not is refused by the server all the same
            reply = raw.call(lambda rid: P.UpdatePriorities(rid, np.array([0, 1]), np.array([1.0, 1e200])))
            assert isinstance(error_of(reply), ProtocolError) and re.search(words, str(error_of(reply)))
        assert len(learner) == 4 and learner.info()["priority_updates"] == 0
        assert learner.info()["priority_sum"] == pytest.approx(1 + 4 + 9 + 16)
        _, info = learner.sample(64, seed=0, with_info=True)
        assert np.all(np.isfinite(info.probabilities)) and np.all(np.isfinite(info.importance_weights(0.4)))
        actor.push_episode(episode_rows(1, 4, 2), priorities=[1e140, 0.0])  # the bound itself is allowed
        assert len(learner) == 6 and np.isfinite(learner.info()["priority_sum"])


def test_pipelined_priority_updates_are_seen_by_the_next_read_and_their_refusals_raise_there(
        start_server: Any, caplog: Any) -> None:
    """update_priorities(wait=False) returns at once with several updates travelling; the next read
    reads their replies first (so it sees them), their ignored ids add up, and a refusal is raised
    there, after the other updates were applied; close() reads what is left and logs a refusal."""
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)), capacity=8)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 8), priorities=[1.0] * 8)
    with LearnerClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, max_in_flight=2)) as learner:
        for row in range(6):  # more than max_in_flight: the oldest replies are read on the way
            assert learner.update_priorities([row], [0.0], wait=False) is None
        _, info = learner.sample(500, seed=3, with_info=True)
        assert set(info.row_ids.tolist()) <= {6, 7} and learner.ignored_priority_updates == 0
        learner.update_priorities([6], [0.0], wait=False)
        learner.update_priorities([50], [1.0], wait=False)  # never committed: refused
        # The refusal raises in the first call that reads its reply: the next update when that
        # reply has already come (after holding its own update), else flush_priorities.
        refusals = []
        for call in (lambda: learner.update_priorities([0], [3.0], wait=False), learner.flush_priorities):
            try:
                call()
            except IndexError as exc:
                refusals.append(str(exc))
        assert len(refusals) == 1 and "never committed" in refusals[0], refusals
        _, info = learner.sample(500, seed=4, with_info=True)  # the updates around the refused one count
        assert set(info.row_ids.tolist()) == {0, 7}
        assert learner.info()["priority_updates"] == 8
        learner.update_priorities([60], [1.0], wait=False)
    assert "a priority update sent with wait=False failed" in caplog.text and "never committed" in caplog.text


# ------------------------------------------------------------------------------------ rate limits


def test_a_learner_waits_for_min_size_and_gives_up_after_its_timeout(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(rate_limit=RateLimit(min_size_to_sample=6)))
    with LearnerClient(config=_client_config(server.endpoint, "learner", rate_limit_timeout=0.5)) as learner:
        assert learner.sampling["writer_samples"]
        started = time.monotonic()
        with pytest.raises(RateLimitedError, match="fewer than min_size_to_sample=6: inserts are behind by 6 rows"):
            learner.sample(2)
        assert 0.4 < time.monotonic() - started < 5
    with LearnerClient(config=_client_config(server.endpoint, "patient")) as learner, \
            ActorClient(server.endpoint, timeout=10) as actor:
        def later() -> None:
            time.sleep(0.5)
            actor.push_episode(episode_rows(1, 0, 3))
            actor.push_episode(episode_rows(1, 1, 3))

        with processes():
            import threading

            writer = threading.Thread(target=later)
            writer.start()
            started = time.monotonic()
            batch = learner.sample(8)  # waits on the server until 6 rows are held
            writer.join()
        assert time.monotonic() - started >= 0.4 and not row_problems(batch)
        stats = learner.info()
        assert stats["sampled"] == 8 and stats["inserted"] == 6 and stats["sample_wait_s"] >= 0.4


def limited_actor_main(endpoint: str, actor: int, episodes: int, out: Any) -> None:
    with ActorClient(config=_client_config(endpoint, f"actor-{actor}", rate_limit_timeout=60)) as client:
        for k in range(episodes):
            client.push_episode(episode_rows(actor, k, 8))
    out.put(("done", actor))


def limited_learner_main(endpoint: str, batches: int, pause: float, out: Any) -> None:
    with LearnerClient(config=_client_config(endpoint, "learner", rate_limit_timeout=60)) as learner:
        for _ in range(batches):
            batch = learner.sample(16)
            assert not row_problems(batch)
            time.sleep(pause)
    out.put(("done", -1))


@pytest.mark.parametrize("fast", ["actors", "learner"])
def test_samples_per_insert_holds_across_processes(start_server: Any, fast: str) -> None:
    """4 actors and 1 learner, one side slowed down: the observed samples per insert stays within
    the error buffer throughout, and the fast side waits (counted in stats)."""
    spi, error_buffer, min_size = 2.0, 40.0, 16
    server = start_server(capacity=None, sampling=SamplingConfig(
        rate_limit=RateLimit(min_size_to_sample=min_size, samples_per_insert=spi, error_buffer=error_buffer)))
    out = SPAWN.Queue()
    episodes, batches = 6, 4 * 6 * 8 * int(spi) // 16  # the learner takes exactly its share
    with processes() as procs:
        for a in range(4):
            procs.append(SPAWN.Process(target=limited_actor_main, args=(server.endpoint, a, episodes, out)))
        procs.append(SPAWN.Process(target=limited_learner_main,
                                   args=(server.endpoint, batches, 0.05 if fast == "actors" else 0.0, out)))
        if fast == "learner":  # the actors are the slow side: they start once the learner waits
            procs[-1].start()
            with LearnerClient(server.endpoint, timeout=10) as watcher:
                # Not a fixed head start: under load the learner's process may take longer than
                # that to start, and would then find the rows already there.
                assert wait_until(lambda: watcher.info()["waiting_samples"] > 0, timeout=60)
            for p in procs[:-1]:
                p.start()
        else:
            for p in procs:
                p.start()
        seen = []
        with LearnerClient(server.endpoint, timeout=10) as watcher:
            deadline = time.monotonic() + 90
            while len(seen) < 5 and time.monotonic() < deadline:
                stats = watcher.info()
                diff = stats["inserted"] * spi - stats["sampled"]
                if stats["inserted"] > min_size:
                    assert min_size * spi - error_buffer - 1e-9 <= diff <= min_size * spi + error_buffer + 1e-9, stats
                while not out.empty():
                    seen.append(out.get())
                time.sleep(0.02)
            final = watcher.info()
    assert len(seen) == 5, seen
    assert final["inserted"] == 4 * episodes * 8 and final["sampled"] == batches * 16
    waited = final["insert_wait_s"] if fast == "actors" else final["sample_wait_s"]
    assert waited > 0.1, final


def test_a_commit_the_limit_holds_back_too_long_stays_open_and_can_be_committed_later(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(rate_limit=RateLimit.queue(20)))
    config = ClientConfig(endpoint=server.endpoint, timeout=10, name="actor", batch_rows=4, rate_limit_timeout=0.3)
    with ActorClient(config=config) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        actor.push_episode(episode_rows(1, 0, 15))
        seg = actor.segment()
        seg.extend(episode_rows(1, 1, 10))  # 4 rows a message: a segment on the server
        with pytest.raises(RateLimitedError, match="inserts are ahead of sampling: 15 rows inserted for 0 sampled"):
            seg.commit()
        assert len(learner) == 15  # nothing of the held-back episode is visible
        learner.sample(6)
        receipt = seg.commit()  # the same segment, still open on the server
        assert receipt.length == 10 and len(learner) == 25
        with pytest.raises(RateLimitedError, match="an insert of 50 rows .* more than the whole window"):
            actor.push_episode(episode_rows(1, 2, 50))  # could never fit: refused at once
        assert learner.info()["inserted"] == 25


def test_a_held_back_push_is_waited_for_not_sent_again(start_server: Any) -> None:
    """A push the limit holds longer than the client's timeout is not lost, so the client waits
    the hold out instead of retrying: the waiting room holds it once, and it lands once."""
    server = start_server(sampling=SamplingConfig(rate_limit=RateLimit.queue(20)))
    config = ClientConfig(endpoint=server.endpoint, timeout=0.5, name="actor", rate_limit_timeout=4.0)
    with ActorClient(config=config) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        actor.push_episode(episode_rows(1, 0, 15))
        pushed: list[Any] = []
        thread = threading.Thread(target=lambda: pushed.append(actor.push_episode(episode_rows(1, 1, 10))))
        thread.start()
        waiting = []
        deadline = time.monotonic() + 2.5  # five client timeouts
        while time.monotonic() < deadline:
            waiting.append(learner.info()["waiting_inserts"])
            time.sleep(0.05)
        assert max(waiting) == 1, waiting
        learner.sample(10)  # room for it
        thread.join(10)
        assert len(pushed) == 1 and pushed[0].length == 10
        assert learner.info()["total_episodes"] == 2


# ------------------------------------------------------------------------------------ queues


def queue_actor_main(endpoint: str, actor: int, episodes: int, out: Any) -> None:
    with ActorClient(config=_client_config(endpoint, f"actor-{actor}", rate_limit_timeout=60)) as client:
        for k in range(episodes):
            client.push_episode(episode_rows(actor, k, 5))
    out.put(("actor", actor, None))


def queue_learner_main(endpoint: str, learner: int, stop: Any, out: Any) -> None:
    got: list[tuple[int, int, int]] = []
    ids: list[int] = []
    with LearnerClient(config=_client_config(endpoint, f"learner-{learner}", rate_limit_timeout=0.5)) as client:
        while not stop.is_set():
            try:
                batch, info = client.sample(4, with_info=True)  # 4 does not divide an episode (5 rows): batches straddle them
            except RateLimitedError:
                continue  # empty for now
            got += list(zip(batch["actor"].tolist(), batch["episode"].tolist(), batch["step"].tolist()))
            ids += info.row_ids.tolist()
    out.put(("learner", learner, (got, ids)))


def test_a_fifo_queue_hands_every_row_out_exactly_once_in_order(start_server: Any) -> None:
    """fifo + max_times_sampled=1 (Reverb's Queue), 4 actors and 2 learners: every committed row
    is returned exactly once, each learner gets rows in commit order, and the ring of 64 reuses
    the slots of rows taken (240 rows pass through it) without losing one."""
    server = start_server(capacity=64, sampling=SamplingConfig(Fifo(), RateLimit.queue(64), 1))
    out = SPAWN.Queue()
    stop = SPAWN.Event()
    episodes = 12
    results: dict[int, Any] = {}
    with processes() as procs:
        for a in range(4):
            procs.append(SPAWN.Process(target=queue_actor_main, args=(server.endpoint, a, episodes, out)))
        for k in range(2):
            procs.append(SPAWN.Process(target=queue_learner_main, args=(server.endpoint, k, stop, out)))
        for p in procs:
            p.start()
        actors_done = 0
        with LearnerClient(server.endpoint, timeout=10) as watcher:
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                while not out.empty():
                    kind, who, what = out.get()
                    actors_done += kind == "actor"
                    if kind == "learner":
                        results[who] = what
                stats = watcher.info()
                if actors_done == 4 and stats["sampled"] == 4 * episodes * 5:
                    break
                time.sleep(0.05)
            stop.set()
            while len(results) < 2 and time.monotonic() < deadline + 20:
                kind, who, what = out.get(timeout=20)
                if kind == "learner":
                    results[who] = what
            final = watcher.info()
    assert final["inserted"] == final["sampled"] == 4 * episodes * 5, final
    rows = [r for got, _ in results.values() for r in got]
    assert len(rows) == len(set(rows)) == 4 * episodes * 5, "every row exactly once"
    assert set(rows) == {(a, k, s) for a in range(4) for k in range(episodes) for s in range(5)}
    for _got, ids in results.values():
        assert ids == sorted(ids), "each learner gets the rows in the order they were committed"
    with LearnerClient(config=_client_config(server.endpoint, "late", rate_limit_timeout=0.2)) as learner:
        with pytest.raises(RateLimitedError):
            learner.sample(1)


def test_a_reader_endpoint_refuses_samples_that_only_the_writer_may_draw(start_server: Any) -> None:
    server = start_server(sampling=SamplingConfig(Fifo(), RateLimit(), 1))
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 3))
    with RawClient(server.read_endpoint) as raw:
        exc = error_of(raw.call(lambda rid: P.Sample(rid, 1, None, 0, 0.0)))
        assert "only the writer samples" in str(exc)
    with LearnerClient(config=_client_config(server.endpoint, "learner", rate_limit_timeout=0.2)) as learner:
        assert learner.sample(3)["step"].tolist() == [0, 1, 2]
        with pytest.raises(RateLimitedError, match="holds 0 rows, fewer than min_size_to_sample=1"):
            learner.sample(1)


def test_updates_made_while_others_travel_leave_merged_in_call_order(start_server: Any) -> None:
    """With wait=False and one message in flight, updates made meanwhile are held and leave merged:
    fewer messages than calls, every id applied, and a later priority for a row still wins."""
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)), capacity=8)
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 8), priorities=[1.0] * 8)
    with LearnerClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, max_in_flight=1)) as learner:
        learner.sample(8, seed=1)  # ids this client has seen: its updates of them may be merged
        before = learner.info()
        calls = 300
        for k in range(calls):  # each row gets 1..5 in turn; rows 0-3 get 0 last
            row = k % 8
            learner.update_priorities([row], [0.0 if k >= calls - 8 and row < 4 else 1.0 + k % 5], wait=False)
        learner.flush_priorities()
        # A read waits for the publish that carries the last update (info() alone need not).
        _, info = learner.sample(2000, seed=2, with_info=True)
        assert set(info.row_ids.tolist()) == {4, 5, 6, 7}
        after = learner.info()
        messages = after["requests"] - before["requests"] - 1  # the writer's: less the second info (a reader sampled)
        assert messages < calls / 2, f"{messages} messages for {calls} updates: nothing was merged"
        assert after["priority_updates"] - before["priority_updates"] == calls
        assert learner.ignored_priority_updates == 0


def test_a_priority_beyond_the_bound_is_refused_by_the_learner_before_it_joins_a_merged_message(
    start_server: Any,
) -> None:
    """Updates made with wait=False leave merged: one the server would refuse (its weight would
    overflow the sum tree) must be refused at the call, or it would take the others with it."""
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)))
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(episode_rows(1, 0, 8), priorities=np.ones(8))
    with LearnerClient(server.endpoint, timeout=10) as learner:
        learner.sample(8, seed=0)
        learner.update_priorities([0], [0.0], wait=False)
        with pytest.raises(ConfigError, match="would exceed"):
            learner.update_priorities([1], [1e300], wait=False)
        learner.update_priorities([2], [0.0], wait=False)
        learner.flush_priorities()
        _, info = learner.sample(1000, seed=1, with_info=True)
        assert not set(info.row_ids.tolist()) & {0, 2}, "the updates around the refused one were lost"
        assert learner.info()["priority_updates"] == 2
