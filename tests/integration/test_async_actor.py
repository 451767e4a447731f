"""The actor's writes through both drivers of the client core, against a real server: the blocking
`ActorClient` and the asyncio `AsyncActorClient` (h5replay.client.aio) run the same scenarios (the
`actor_of` fixture is parametrized over both), then what only asyncio has: actor and learner
tasks on one event loop, cancellation mid-episode, a commit whose waiter is cancelled.

The asyncio client is driven here through `client_fronts.AsyncActorFront`, which runs each of its
coroutines on a loop of the test's own, so one test body serves both drivers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from service_helpers import episode_problems, episode_rows, free_port, row_problems
from transition_helpers import SPACE as TRANSITION_SPACE
from transition_helpers import Model, check_sample, episode

from h5replay import protocol as P
from h5replay.client import LearnerClient
from h5replay.client.aio import AsyncActorClient, AsyncLearnerClient
from h5replay.errors import ConfigError, SegmentStateError, ServerUnavailableError, SpaceMismatchError
from h5replay.sampling import Prioritized, SamplingConfig
from h5replay.server.auth import generate_keys

pytestmark = pytest.mark.timeout(120)


def held_episodes(endpoint: str) -> list[dict[str, np.ndarray]]:
    """Every episode the server holds, oldest first, as read back by a blocking learner."""
    with LearnerClient(endpoint, timeout=10) as learner:
        rows = learner.get(np.arange(len(learner))) if len(learner) else {}
        out, start = [], 0
        for found in learner.episodes():
            out.append({k: v[start : start + found.length] for k, v in rows.items()})
            start += found.length
        return out


# ------------------------------------------------------------------ both drivers


def test_pushes_and_streamed_segments_land_whole_in_order_with_their_receipts(start_server: Any,
                                                                            actor_of: Any) -> None:
    server = start_server(limits=P.Limits(max_rows_per_message=16))
    actor = actor_of(server.endpoint)
    assert actor.rows_per_message == 16
    receipts = [actor.push_episode(episode_rows(1, 0, 10))]  # one message
    receipts.append(actor.push_episode(episode_rows(1, 1, 50)))  # streamed: 4 appends
    receipts += actor.push_episodes([episode_rows(1, 2, 5), episode_rows(1, 3, 0), episode_rows(1, 4, 40),
                                     episode_rows(1, 5, 6)])
    with actor.segment() as seg:  # step by step, over several messages
        for step in range(37):
            one = {k: v[step] for k, v in episode_rows(1, 6, 37).items()}
            seg.append(one)
    receipts.append(seg.receipt)
    seg = actor.segment()
    seg.extend(episode_rows(1, 7, 3))
    receipts.append(seg.commit())  # fits one message: a push at commit
    lengths = [10, 50, 5, 0, 40, 6, 37, 3]
    assert [r.length for r in receipts] == lengths
    kept = [r for r in receipts if r.length]
    assert [r.first_row_id for r in kept] == np.cumsum([0] + [r.length for r in kept])[:-1].tolist()
    held = held_episodes(server.endpoint)
    assert [len(e["step"]) for e in held] == [n for n in lengths if n]
    for rows, n in zip(held, [n for n in lengths if n]):
        assert not episode_problems(rows, n), episode_problems(rows, n)
    assert [int(e["episode"][0]) for e in held] == [0, 1, 2, 4, 5, 6, 7]


def test_unwaited_commits_settle_in_order_and_flush_waits_for_them_all(start_server: Any, actor_of: Any) -> None:
    server = start_server()
    actor = actor_of(server.endpoint)
    pending = [actor.push_episode(episode_rows(2, e, 8), wait=False) for e in range(12)]
    pending += actor.push_episodes([episode_rows(2, 12 + e, 4) for e in range(3)], wait=False)
    seg = actor.segment()
    seg.extend(episode_rows(2, 15, 9))
    pending.append(seg.commit(wait=False))
    actor.flush()
    assert all(p.done() for p in pending)
    got = [p.result() for p in pending]
    assert [r.length for r in got] == [8] * 12 + [4] * 3 + [9]
    assert [r.first_row_id for r in got] == np.cumsum([0] + [r.length for r in got])[:-1].tolist()
    held = held_episodes(server.endpoint)
    assert [int(e["episode"][0]) for e in held] == list(range(16))


def test_bad_input_is_refused_before_anything_leaves_and_a_segment_stays_usable(start_server: Any,
                                                                                actor_of: Any) -> None:
    server = start_server()
    actor = actor_of(server.endpoint)
    bad = episode_rows(3, 0, 5)
    bad["obs"] = bad["obs"][:, :2]
    with pytest.raises(SpaceMismatchError, match="obs"):
        actor.push_episode(bad)
    with pytest.raises(SpaceMismatchError, match="obs"):
        actor.push_episodes([episode_rows(3, 1, 5), bad])  # checked before any leaves
    with pytest.raises(ConfigError, match="2 priority entries for 1 episodes"):
        actor.push_episodes([episode_rows(3, 1, 5)], priorities=[None, None])
    with pytest.raises(ConfigError, match="keeps no final observations"):
        actor.push_episode(episode_rows(3, 1, 5), final={"obs": np.zeros(4, np.float32)})
    seg = actor.segment()
    rows = episode_rows(3, 2, 4)
    seg.extend(rows)
    with pytest.raises(SpaceMismatchError):
        seg.append({"nonsense": 1})
    assert seg.commit().length == 4, "the refused step left the segment open with its good rows"
    with pytest.raises(SegmentStateError, match="committed"):
        seg.append({k: v[0] for k, v in rows.items()})
    held = held_episodes(server.endpoint)
    assert len(held) == 1 and not episode_problems(held[0], 4)


def test_an_aborted_or_failed_block_leaves_nothing_of_its_episode(start_server: Any, actor_of: Any) -> None:
    server = start_server(limits=P.Limits(max_rows_per_message=8))
    actor = actor_of(server.endpoint)
    seg = actor.segment()
    seg.extend(episode_rows(4, 0, 30))  # three appends are on the server
    seg.abort()
    seg.abort()  # twice is fine
    with pytest.raises(RuntimeError, match="boom"):
        with actor.segment() as doomed:
            doomed.extend(episode_rows(4, 1, 20))
            raise RuntimeError("boom")
    actor.push_episode(episode_rows(4, 2, 5))
    held = held_episodes(server.endpoint)
    assert [int(e["episode"][0]) for e in held] == [2]
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.info()["open_segments"] == 0


def test_finals_and_priorities_go_with_their_episodes(start_server: Any, actor_of: Any) -> None:
    server = start_server(space=TRANSITION_SPACE, capacity=1000, observation_keys=("obs",),
                          sampling=SamplingConfig(Prioritized(exponent=1.0)), limits=P.Limits(max_rows_per_message=4))
    actor = actor_of(server.endpoint)
    assert actor.keeps_finals
    model = Model()
    first = 0
    shapes = [(10, "truncated"), (3, "terminated"), (2, "cut"), (9, "terminated"), (6, "truncated")]
    made = []
    for length, kind in shapes:
        rows, final = episode(first, length, kind)
        model.episodes.append((first, rows, final))
        made.append((rows, final))
        first += length
    actor.push_episode(made[0][0], np.ones(10), final=made[0][1])  # streamed (4 rows a message)
    actor.push_episodes([made[1][0], made[2][0]], priorities=[np.ones(3), None], finals=[made[1][1], made[2][1]])
    seg = actor.segment()
    seg.extend(made[3][0], np.ones(9))
    seg.commit(final=made[3][1])
    seg = actor.segment()
    seg.extend(made[4][0])
    seg.set_final(made[4][1])
    seg.commit()
    with LearnerClient(server.endpoint, timeout=10) as learner:
        for n in (1, 3):
            check_sample(learner, model, n, 0.9, size=200)
        assert learner.update_priorities(np.arange(first), np.ones(first)) == 0


def test_curve_keys_let_an_actor_in_and_a_stranger_gets_no_answer_in_time(tmp_path: Any, start_server: Any,
                                                                          actor_of: Any) -> None:
    keys = tmp_path / "keys"
    generate_keys(keys)
    server = start_server(auth_dir=str(keys))
    actor = actor_of(server.endpoint, secret_key=keys / "actor.key_secret", server_key=keys / "server.key")
    assert actor.push_episode(episode_rows(5, 0, 7)).length == 7
    generate_keys(tmp_path / "rogue")
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="CURVE keys"):
        actor_of(server.endpoint, timeout=1.0, secret_key=tmp_path / "rogue" / "actor.key_secret",
                 server_key=keys / "server.key")
    assert time.monotonic() - started < 5.0


def test_a_server_that_is_down_raises_server_unavailable_in_time(actor_of: Any) -> None:
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="no answer from"):
        actor_of(f"tcp://127.0.0.1:{free_port()}", timeout=0.5)
    assert time.monotonic() - started < 5.0


def test_a_server_that_goes_away_leaves_a_commit_in_doubt_not_hanging(start_server: Any, actor_of: Any) -> None:
    server = start_server()
    actor = actor_of(server.endpoint, timeout=0.5)
    actor.push_episode(episode_rows(6, 0, 5))
    server.stop(timeout=10)
    started = time.monotonic()
    seg = actor.segment()
    seg.extend(episode_rows(6, 1, 5))
    with pytest.raises(ServerUnavailableError):
        seg.commit()
    assert time.monotonic() - started < 3 * 0.5 + 3.0, "within commit_attempts x timeout"


# ------------------------------------------------------------------ asyncio only


@pytest.mark.asyncio
async def test_four_actor_tasks_and_four_sample_tasks_share_one_loop(start_server: Any) -> None:
    server = start_server(num_readers=2, limits=P.Limits(max_rows_per_message=16))
    stop = asyncio.Event()

    async def push(actor_id: int) -> int:
        async with AsyncActorClient(server.endpoint, timeout=10, name=f"actor-{actor_id}") as actor:
            for e in range(30):
                rows = episode_rows(10 + actor_id, e, 25)
                if e % 3 == 0:
                    await actor.push_episode(rows)
                elif e % 3 == 1:
                    await actor.push_episode(rows, wait=False)
                else:
                    async with actor.segment() as seg:
                        for step in range(25):
                            await seg.append({k: v[step] for k, v in rows.items()})
        return 30

    async def draw(learner: AsyncLearnerClient, seed: int) -> int:
        await learner.wait_for_size(25, timeout=30)
        batches = 0
        while not stop.is_set() or batches < 10:
            batch = await learner.sample(32, seed=seed + batches)
            assert not row_problems(batch), row_problems(batch)
            batches += 1
        return batches

    async with AsyncLearnerClient(server.endpoint, timeout=10) as learner:
        drawers = [asyncio.create_task(draw(learner, 1000 * k)) for k in range(4)]
        pushed = await asyncio.wait_for(asyncio.gather(*(push(a) for a in range(4))), 90)
        stop.set()
        drawn = await asyncio.wait_for(asyncio.gather(*drawers), 30)
        assert pushed == [30] * 4 and min(drawn) >= 10
        assert await learner.wait_for_size(4 * 30 * 25, timeout=10) == 3000
        held = await learner.get(np.arange(await learner.size()))
    for a in range(4):  # every actor's episodes whole and in order
        mine = held["actor"] == 10 + a
        assert held["step"][mine].tolist() == list(range(25)) * 30
        assert held["episode"][mine].tolist() == [e for e in range(30) for _ in range(25)]


@pytest.mark.asyncio
async def test_a_task_cancelled_mid_episode_leaves_nothing_of_it_visible(start_server: Any) -> None:
    server = start_server(limits=P.Limits(max_rows_per_message=8))
    started = asyncio.Event()

    async def stream(actor: AsyncActorClient) -> None:
        async with actor.segment() as seg:
            rows = episode_rows(7, 0, 10_000)
            for step in range(10_000):
                await seg.append({k: v[step] for k, v in rows.items()})
                if step == 40:
                    started.set()

    async with AsyncActorClient(server.endpoint, timeout=10) as actor:
        task = asyncio.create_task(stream(actor))
        await asyncio.wait_for(started.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (await actor.push_episode(episode_rows(7, 1, 6))).length == 6, "the client goes on"
        async with AsyncLearnerClient(server.endpoint, timeout=10) as learner:
            deadline = time.monotonic() + 10
            while (await learner.info())["open_segments"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the abort went without waiting for the server's word
            figures = await learner.info()
            assert figures["open_segments"] == 0 and await learner.size() == 6
            held = await learner.get(np.arange(6))
    assert held["episode"].tolist() == [1] * 6


@pytest.mark.asyncio
async def test_a_cancelled_wait_for_a_commit_does_not_lose_its_outcome(start_server: Any) -> None:
    server = start_server()
    async with AsyncActorClient(server.endpoint, timeout=10) as actor:
        pending = await actor.push_episode(episode_rows(8, 0, 12), wait=False)
        waiter = asyncio.create_task(pending.result())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        receipt = await pending  # the settling went on
        assert receipt.length == 12 and receipt.first_row_id == 0
        await actor.flush()
        assert (await actor.info())["length"] == 12


@pytest.mark.asyncio
async def test_down_shards_are_refused_in_time_and_an_unconnected_client_says_so() -> None:
    sharded = AsyncActorClient(endpoints=[f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"],
                               timeout=0.3)
    with pytest.raises(ConfigError, match="not connected yet"):
        _ = sharded.space
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match="none of the 2 shards answered"):
        await sharded.push_episode(episode_rows(9, 0, 3))
    assert time.monotonic() - started < 3.0
    await sharded.aclose()
    actor = AsyncActorClient(f"tcp://127.0.0.1:{free_port()}", timeout=0.3)
    with pytest.raises(ConfigError, match="not connected yet"):
        _ = actor.space
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        await actor.push_episode(episode_rows(9, 0, 3))
    assert time.monotonic() - started < 3.0
    await actor.aclose()
