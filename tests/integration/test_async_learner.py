"""The learner's reads through both drivers of the client core, against a real server: the
blocking `LearnerClient` and the asyncio `AsyncLearnerClient` (h5replay.client.aio) run the same
scenarios (the `learner` fixture is parametrized over both), then what only asyncio has: many
coroutines on one client beside actor traffic, cancellation, a server that is down.

The asyncio client is driven here through `AsyncLearnerFront` (tests/client_fronts.py), which
runs each of its coroutines on a loop of its own, so one test body serves both drivers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from client_fronts import AsyncLearnerFront
from service_helpers import EPISODE_SPACE, episode_rows, free_port, row_problems, wait_until
from shard_helpers import running_shards
from transition_helpers import SPACE as TRANSITION_SPACE
from transition_helpers import Model, check_sample, episode

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.client._local import CONFIRM_INTERVAL
from h5replay.client.aio import AsyncLearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError, NotEnoughDataError, RateLimitedError, ServerUnavailableError
from h5replay.sampling import Fifo, Prioritized, SamplingConfig
from h5replay.server.auth import generate_keys

pytestmark = pytest.mark.timeout(120)
QUEUE = SamplingConfig(Fifo(), max_times_sampled=1)


def fill(endpoint: str, episodes: int = 20, length: int = 50) -> None:
    with ActorClient(endpoint, timeout=10) as actor:
        for e in range(episodes):
            actor.push_episode(episode_rows(1, e, length))


def queue_rows(endpoint: str, first: int, rows: int) -> None:
    """`rows` rows whose "step" is first, first + 1, ...: a queue's rows say where they came from."""
    with ActorClient(endpoint, timeout=10) as actor:
        batch = episode_rows(1, first, rows)
        batch["step"] = np.arange(first, first + rows, dtype=np.int32)
        batch["length"] = np.full(rows, 10**6 - 1, np.int32)
        actor.push_episode(batch)


# ------------------------------------------------------------------ both drivers


def test_reads_split_over_messages_come_back_whole_and_in_order(start_server: Any, learner_of: Any) -> None:
    server = start_server(limits=P.Limits(max_rows_per_message=64))
    fill(server.endpoint)
    learner = learner_of(server.endpoint)
    assert len(learner) == 1000 and learner.wait_for_size(1000, timeout=5) == 1000
    batch, info = learner.sample(300, seed=4, with_info=True)  # 5 messages
    assert not row_problems(batch) and len(info) == 300
    again = learner.get_rows(info.row_ids)  # by id, 5 messages again
    np.testing.assert_array_equal(again["obs"], batch["obs"])
    rows = learner.get(np.arange(-1, 199))  # the newest row first, then the oldest 199
    assert rows["step"][0] == 49 and rows["step"][1:].tolist() == [s for e in range(4) for s in range(50)][:199]
    assert [e.length for e in learner.episodes()] == [50] * 20
    info_figures = learner.info()
    assert info_figures["length"] == 1000 and learner.view is not None and learner.view.length == 1000
    windows, winfo = learner.sample_sequences(30, 10, seed=2, with_info=True)  # 300 rows: 5 messages
    assert windows["step"].shape == (30, 10)
    assert (np.diff(windows["step"], axis=1) == 1).all() and (windows["episode"] == windows["episode"][:, :1]).all()
    padded = learner.sample_sequences(40, 8, pad=True)
    assert padded["mask"].shape == (40, 8) and padded["mask"][:, 0].all()
    with pytest.raises(NotEnoughDataError, match="no complete episode holds 70 consecutive rows"):
        learner.sample_sequences(2, 70)
    with pytest.raises(NotEnoughDataError, match="fewer than the 2000"):
        learner.wait_for_size(2000, timeout=0.3)


def test_the_view_never_goes_back_and_a_learner_sees_what_was_acknowledged(start_server: Any, learner_of: Any) -> None:
    server = start_server(num_readers=2)
    learner = learner_of(server.endpoint)
    with ActorClient(server.endpoint, timeout=10) as actor:
        last = 0
        for e in range(10):
            actor.push_episode(episode_rows(2, e, 10))
            assert len(learner) == 10 * (e + 1), "an acknowledged episode is visible to the next read"
            seq = learner.view.seq
            assert seq >= last
            last = seq


def test_seeded_batches_are_the_seeded_samples(start_server: Any, learner_of: Any) -> None:
    server = start_server()
    fill(server.endpoint)
    learner = learner_of(server.endpoint)
    loop = learner.batches(16, prefetch=4, seed=7, with_info=True)
    for k in range(5):
        batch, info = next(loop)
        want, want_info = learner.sample(16, seed=7 + k, with_info=True)
        np.testing.assert_array_equal(batch["obs"], want["obs"])
        np.testing.assert_array_equal(info.row_ids, want_info.row_ids)
    loop.close()
    unseeded = learner.batches(8, prefetch=8)
    assert all(not row_problems(next(unseeded)) for _ in range(20))
    unseeded.close()
    assert learner.sample(4)["step"].shape == (4,), "the client still reads after leaving loops"
    with pytest.raises(ConfigError, match="prefetch must be a positive int"):
        learner.batches(8, prefetch=0)


def test_priority_updates_are_seen_by_the_next_read(start_server: Any, learner_of: Any) -> None:
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)))
    fill(server.endpoint, episodes=2, length=10)
    learner = learner_of(server.endpoint)
    priorities = np.zeros(20)
    priorities[7] = 1.0
    assert learner.update_priorities(np.arange(20), priorities) == 0
    _, info = learner.sample(50, with_info=True)
    assert set(info.row_ids.tolist()) == {7}, "only the row with weight is drawn, at once"
    with pytest.raises(IndexError, match="never committed"):
        learner.update_priorities([10**6], [1.0])
    with pytest.raises(ConfigError, match="NaN|finite|negative"):
        learner.update_priorities([1], [float("nan")])


def test_unwaited_priority_updates_are_seen_by_the_next_read_and_a_refused_one_raises_later(
        start_server: Any, learner_of: Any) -> None:
    server = start_server(sampling=SamplingConfig(Prioritized(exponent=1.0)), capacity=20)
    fill(server.endpoint, episodes=2, length=10)
    learner = learner_of(server.endpoint)
    for k in range(6):  # more than max_in_flight (4) travel one after another
        priorities = np.zeros(20)
        priorities[k] = 1.0
        assert learner.update_priorities(np.arange(20), priorities, wait=False) is None
    _, info = learner.sample(50, with_info=True)
    assert set(info.row_ids.tolist()) == {5}, "the read waited for every update before it"
    fill(server.endpoint, episodes=1, length=10)  # rows 0-9 are evicted
    learner.update_priorities(np.arange(10), np.ones(10), wait=False)
    learner.flush_priorities()
    assert learner.ignored_priority_updates == 10
    learner.update_priorities([10**6], [1.0], wait=False)  # never committed: refused by the server
    with pytest.raises(IndexError, match="never committed"):
        learner.flush_priorities()
    learner.flush_priorities()  # reported once
    assert learner.sample(4)["step"].shape == (4,)


def test_a_queue_split_sample_that_falls_short_keeps_what_it_drew(start_server: Any, learner_of: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE, limits=P.Limits(max_rows_per_message=64))
    queue_rows(server.endpoint, 0, 70)
    learner = learner_of(config=ClientConfig(endpoint=server.endpoint, timeout=10.0, name="learner",
                                             rate_limit_timeout=0.5))
    with pytest.raises(RateLimitedError, match="64 rows .* are kept by this client"):
        learner.sample(80)
    assert learner.num_kept == 64
    queue_rows(server.endpoint, 70, 10)
    batch, info = learner.sample(80, with_info=True)
    assert batch["step"].tolist() == list(range(80)) and learner.num_kept == 0
    assert learner.info()["sampled"] == 80
    queue_rows(server.endpoint, 80, 30)
    got = []
    for batch in learner.batches(10, prefetch=2):
        got += batch["step"].tolist()
        if len(got) == 20:
            break
    got += learner.sample(10 - learner.num_kept + learner.num_kept)["step"].tolist()
    assert got == list(range(80, 110)), "every row once, in commit order"


def test_transitions_are_the_models(start_server: Any, learner_of: Any) -> None:
    server = start_server(space=TRANSITION_SPACE, capacity=1000, observation_keys=("obs",))
    model = Model()
    first = 0
    with ActorClient(server.endpoint, timeout=10) as actor:
        for length, kind in ((10, "truncated"), (3, "terminated"), (2, "cut"), (9, "terminated")):
            rows, final = episode(first, length, kind)
            model.episodes.append((first, rows, final))
            actor.push_episode(rows, final=final)
            first += length
    learner = learner_of(server.endpoint)
    for n in (1, 3):
        check_sample(learner, model, n, 0.9, size=200)


def test_curve_keys_let_a_learner_in_and_a_stranger_gets_no_answer_in_time(tmp_path: Any, start_server: Any,
                                                                            learner_of: Any) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    server = start_server(auth_dir=str(keys), num_readers=1)
    with ActorClient(server.endpoint, timeout=10, secret_key=keys / "actor.key_secret",
                     server_key=keys / "server.key") as actor:
        actor.push_episode(episode_rows(1, 0, 20))
    learner = learner_of(server.endpoint, secret_key=keys / "learner.key_secret", server_key=keys / "server.key")
    assert learner.sample(8, seed=1)["step"].shape == (8,) and len(learner) == 20
    generate_keys(tmp_path / "rogue")
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="CURVE keys"):
        learner_of(server.endpoint, timeout=1.0, secret_key=tmp_path / "rogue" / "learner.key_secret",
                   server_key=keys / "server.key")
    assert time.monotonic() - started < 5.0


def test_a_server_that_is_down_raises_server_unavailable_in_time(learner_of: Any) -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="no answer from"):
        learner_of(f"tcp://127.0.0.1:{free_port()}", timeout=0.5)
    assert time.monotonic() - started < 5.0


def test_a_server_that_goes_away_mid_session_raises_server_unavailable(start_server: Any, learner_of: Any) -> None:
    server = start_server()
    fill(server.endpoint, episodes=2, length=10)
    learner = learner_of(server.endpoint, timeout=1.0)
    assert learner.sample(5)["step"].shape == (5,)
    server.stop(timeout=10)
    time.sleep(CONFIRM_INTERVAL)  # on the file's host the learner draws from the file, and asks the server this often
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        learner.sample(5)
    assert time.monotonic() - started < 5.0


# ------------------------------------------------------------------ asyncio only


@pytest.mark.asyncio
async def test_four_sample_tasks_share_one_loop_beside_four_actors(start_server: Any) -> None:
    server = start_server(num_readers=2)
    fill(server.endpoint, episodes=4, length=25)
    stop = asyncio.Event()

    def push(actor_id: int) -> int:
        sent = 0
        with ActorClient(server.endpoint, timeout=10) as actor:
            while sent < 40:
                actor.push_episode(episode_rows(10 + actor_id, sent, 25))
                sent += 1
        return sent

    async def draw(learner: AsyncLearnerClient, seed: int) -> int:
        batches = 0
        while not stop.is_set() or batches < 10:
            batch, info = await learner.sample(64, seed=seed + batches, with_info=True)
            problems = row_problems(batch)
            assert not problems, problems
            batches += 1
        return batches

    async with AsyncLearnerClient(server.endpoint, timeout=10) as learner:
        drawers = [asyncio.create_task(draw(learner, 1000 * k)) for k in range(4)]
        pushed = await asyncio.wait_for(asyncio.gather(*(asyncio.to_thread(push, a) for a in range(4))), 90)
        stop.set()
        drawn = await asyncio.wait_for(asyncio.gather(*drawers), 30)
        assert pushed == [40] * 4 and min(drawn) >= 10
        assert await learner.wait_for_size(100 + 4 * 40 * 25, timeout=10) == 4100
        held = await learner.get(np.arange(await learner.size()))
        for a in range(4):  # every actor's episodes whole and in order
            mine = held["actor"] == 10 + a
            assert held["step"][mine].tolist() == list(range(25)) * 40
            assert held["episode"][mine].tolist() == [e for e in range(40) for _ in range(25)]


@pytest.mark.asyncio
async def test_batches_of_a_queue_keep_requests_ahead_and_leaving_keeps_what_they_drew(start_server: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE)
    queue_rows(server.endpoint, 0, 60)
    async with AsyncLearnerClient(server.endpoint, timeout=10) as learner:
        stream = learner.batches(10, prefetch=4)
        first = await stream.__anext__()
        await stream.aclose()  # three batches were drawn ahead, in flight
        assert first["step"].tolist() == list(range(10)) and learner.num_kept == 30
        rest = await learner.sample(30)
        assert rest["step"].tolist() == list(range(10, 40)) and learner.num_kept == 0
        cancelled = asyncio.create_task(_collect(learner.batches(10, prefetch=2), 5))
        await asyncio.sleep(0.2)  # it took what there was (rows 40-59) and its next draws wait
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert learner.num_kept == 0, "the draws waiting for the rate limit were cancelled, not made"
        queue_rows(server.endpoint, 60, 20)
        again = await learner.sample(20)
        assert again["step"].tolist() == list(range(60, 80)), "no row drawn for nobody"


@pytest.mark.asyncio
async def test_a_cancelled_sample_of_a_queue_keeps_its_rows_for_the_next_call(start_server: Any) -> None:
    server = start_server(capacity=1000, sampling=QUEUE, heartbeat_interval=0.2)
    config = ClientConfig(endpoint=server.endpoint, timeout=10.0, name="learner", rate_limit_timeout=20.0)
    async with AsyncLearnerClient(config=config) as learner:
        waiting = asyncio.create_task(learner.sample(10))
        assert await _until(lambda: learner.info(), lambda figures: figures["waiting_samples"] == 1), "never waited"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.to_thread(queue_rows, server.endpoint, 0, 15)
        batch = await asyncio.wait_for(learner.sample(15), 30)  # the 10 kept first, then 5 fresh
        assert batch["step"].tolist() == list(range(15)), "a cancelled call's rows are the next call's"
        assert learner.num_kept == 0 and (await learner.info())["sampled"] == 15


@pytest.mark.asyncio
async def test_a_cancelled_read_leaves_the_client_usable_and_late_replies_are_dropped(start_server: Any) -> None:
    server = start_server()
    fill(server.endpoint)
    async with AsyncLearnerClient(server.endpoint, timeout=10) as learner:
        for _ in range(5):
            task = asyncio.create_task(learner.sample(500))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        batch, info = await learner.sample(20, with_info=True, seed=3)
        assert not row_problems(batch) and len(info) == 20
        stream = learner.batches(32, prefetch=8)
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # type: ignore[attr-defined]
        assert [b["step"].shape for b in got] == [(32,)] * 3
        assert (await learner.sample(4))["step"].shape == (4,)


@pytest.mark.asyncio
async def test_over_shards_concurrent_and_cancelled_queue_draws_hand_out_every_row_once(tmp_path: Any) -> None:
    """A queue on each of two shards: four tasks draw at once through one sharded client, some
    are cancelled while they wait for rows; every row is handed out exactly once."""
    config = ClientConfig(timeout=10.0, name="learner", rate_limit_timeout=20.0)
    with running_shards(tmp_path, 2, capacity=1000, sampling=QUEUE, heartbeat_interval=0.2) as shards:
        for shard in range(2):
            queue_rows(shards.endpoints[shard], 1000 * shard, 60)
        async with AsyncLearnerClient(config=config, endpoints=shards.endpoints) as learner:
            got: list[int] = []

            async def draw(n: int) -> None:
                batch, info = await learner.sample(n, with_info=True)
                assert set(info.shard_ids.tolist()) <= {0, 1}
                got.extend(batch["step"].tolist())

            await asyncio.gather(*(draw(10) for _ in range(4)))  # 40 of the 120 rows
            waiting = asyncio.create_task(draw(100))  # 80 are left: each shard gives its 40 and waits
            assert await _until(lambda: learner.shards.shard(0).info(), lambda figures: figures["waiting_samples"] == 1)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            for shard in range(2):  # room for every share: the shards' draws end, and are kept
                await asyncio.to_thread(queue_rows, shards.endpoints[shard], 5000 + 1000 * shard, 20)
            assert await _until(lambda: asyncio.sleep(0, learner.num_kept), lambda kept: kept == 100), \
                "a cancelled draw's rows are kept for the next call, not lost"
            started = time.monotonic()
            while len(got) < 160:
                await asyncio.wait_for(draw(10), 30)
            # Each shard was asked for what its client kept and its server held, never more (which
            # would wait out the 20 s rate limit).
            assert time.monotonic() - started < 10.0
            assert learner.num_kept == 0
        assert sorted(got) == [*range(60), *range(1000, 1060), *range(5000, 5020), *range(6000, 6020)], \
            "each row exactly once"


@pytest.mark.asyncio
async def test_a_down_server_and_shards_are_refused_clearly() -> None:
    started = time.monotonic()
    learner = AsyncLearnerClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.5)
    with pytest.raises(ServerUnavailableError, match="no answer from"):
        await learner.sample(4)
    assert time.monotonic() - started < 5.0
    await learner.aclose()
    sharded = AsyncLearnerClient(endpoints=[f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"],
                                 timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="none of the 2 shards answered"):
        await sharded.sample(4)
    assert time.monotonic() - started < 5.0
    await sharded.aclose()
    with pytest.raises(ConfigError, match="secret_key and server_key go together"):
        AsyncLearnerClient(secret_key="x")


async def _until(call: Callable[[], Any], check: Callable[[Any], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check(await call()):
            return True
        await asyncio.sleep(0.05)
    return False


async def _collect(stream: AsyncIterator[Any], n: int) -> list[Any]:
    return [await stream.__anext__() for _ in range(n)]


def test_every_request_of_the_blocking_and_async_drivers_is_the_same(start_server: Any) -> None:
    """Both drivers run the same plans: the same seeds give the same draws."""
    server = start_server()
    fill(server.endpoint)
    with LearnerClient(server.endpoint) as blocking:
        front = AsyncLearnerFront(server.endpoint)
        try:
            for seed in range(3):
                np.testing.assert_array_equal(blocking.sample(100, seed=seed)["obs"], front.sample(100, seed=seed)["obs"])
            assert wait_until(lambda: len(front) == len(blocking), 5)
        finally:
            front.close()
    assert EPISODE_SPACE is not None
