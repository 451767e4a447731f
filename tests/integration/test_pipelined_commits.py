"""Commits in flight (`wait=False`) and several episodes in one message (`push_episodes`),
against a real server over loopback TCP: receipts in order, rows exactly as sent, one message for
the episodes that fit, failures reported where the caller looks, and hand-made push_episodes
messages refused whole.
"""

from __future__ import annotations

import os
import queue
import signal
import time

import numpy as np
import pytest
from service_helpers import (
    SPAWN,
    RawClient,
    episode_rows,
    error_of,
    file_episodes,
    pipelining_actor_main,
    processes,
    read_file,
    wait_until,
)

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient, PendingCommit, Receipt
from h5replay.config import ClientConfig
from h5replay.errors import (
    ConfigError,
    DiskFullError,
    LimitExceededError,
    ProtocolError,
    SegmentStateError,
    SpaceMismatchError,
)
from h5replay.storage import BoxSpace, DictSpace


def assert_held(endpoint: str, receipt: Receipt, rows: dict[str, np.ndarray]) -> None:
    with LearnerClient(endpoint, timeout=10) as learner:
        got = learner.get_rows(np.arange(receipt.first_row_id, receipt.first_row_id + receipt.length))
    for key, expected in rows.items():
        np.testing.assert_array_equal(got[key], expected, err_msg=f"leaf {key!r}")


@pytest.mark.timeout(60)
def test_push_episodes_commits_each_episode_in_one_message_with_its_own_receipt(start_server):
    server = start_server()
    lengths = [3, 0, 5, 1, 300, 2]  # an empty one records nothing; 300 rows are more than one message takes
    episodes = [episode_rows(1, i, n) for i, n in enumerate(lengths)]
    with ActorClient(server.endpoint, timeout=10) as actor:
        assert actor.rows_per_message < 300
        before = actor.info()["requests"]
        receipts = actor.push_episodes(episodes)
        requests = actor.info()["requests"] - before
    assert [r.length for r in receipts] == [3, 0, 5, 1, 300, 2]
    assert receipts[1] == Receipt(-1, -1, 0)
    recorded = [r for r in receipts if r.length]
    assert [r.episode_id for r in recorded] == sorted(r.episode_id for r in recorded)
    assert len({r.episode_id for r in recorded}) == 5
    # [3, 5, 1] share one message, 300 is streamed (open, 2 appends, commit), 2 goes alone; + the info call.
    assert requests == 1 + 4 + 1 + 1
    for receipt, rows in zip(receipts, episodes):
        if receipt.length:
            assert_held(server.endpoint, receipt, rows)
    server.stop()
    segments, _ = read_file(server.config.path)
    assert [n for _, n in segments] == [3, 5, 1, 300, 2]


@pytest.mark.timeout(60)
def test_commits_in_flight_settle_in_order_and_never_borrow_the_callers_arrays(tmp_path, start_server):
    # Rows of 16 KB: an 8-row message is over ZeroMQ's copy threshold, so its frames would leave
    # from the caller's memory, later, if the client did not own a copy.
    space = DictSpace({"obs": BoxSpace(-np.inf, np.inf, (4096,), np.float32)})
    server = start_server(space=space, capacity=4_000)
    rows = np.zeros((8, 4096), np.float32)
    sent, pending = [], []
    with ActorClient(server.endpoint, timeout=10) as actor:
        for i in range(40):
            rows[:] = i
            sent.append(rows.copy())
            pending.append(actor.push_episode({"obs": rows}, wait=False))
            rows[:] = -1  # the caller reuses its array at once
        assert all(isinstance(p, PendingCommit) for p in pending)
        actor.flush()
        assert all(p.done() for p in pending)
        receipts = [p.result() for p in pending]
    assert [r.length for r in receipts] == [8] * 40
    assert [r.episode_id for r in receipts] == sorted(r.episode_id for r in receipts)
    for receipt, expected in zip(receipts, sent):
        assert_held(server.endpoint, receipt, {"obs": expected})


@pytest.mark.timeout(60)
def test_push_episodes_wait_false_gives_one_pending_commit_per_episode(start_server):
    server = start_server()
    episodes = [episode_rows(2, i, 4 + i) for i in range(10)]
    with ActorClient(server.endpoint, timeout=10) as actor:
        pending = actor.push_episodes(episodes, wait=False)
        assert len(pending) == 10 and len({p.key for p in pending}) == 10
        receipts = [p.result() for p in pending]
    assert [r.length for r in receipts] == [4 + i for i in range(10)]
    for receipt, rows in zip(receipts, episodes):
        assert_held(server.endpoint, receipt, rows)


@pytest.mark.timeout(60)
def test_a_refused_commit_in_flight_is_raised_by_result_and_once_by_flush(start_server):
    server = start_server(min_free_bytes=1 << 60)  # more than any disk: every new row is refused
    with ActorClient(server.endpoint, timeout=10) as actor:
        seen = actor.push_episode(episode_rows(3, 0, 4), wait=False)
        unseen = [actor.push_episode(episode_rows(3, i, 4), wait=False) for i in (1, 2)]
        with pytest.raises(DiskFullError):
            seen.result()
        with pytest.raises(DiskFullError, match="and 1 more commit"):
            actor.flush()
        actor.flush()  # each failure is reported once
        assert all(p.done() for p in unseen)
        with pytest.raises(DiskFullError):
            unseen[0].result()  # still there for whoever looks
        segment = actor.segment()
        segment.extend(episode_rows(3, 9, 4))
        pending = segment.commit(wait=False)
        with pytest.raises(DiskFullError):
            pending.result()
        with pytest.raises(DiskFullError):
            segment.commit()  # refused for a full disk, a segment stays open: commit again later...
        segment.abort()  # ... or drop it
        with pytest.raises(SegmentStateError):
            segment.commit()
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.info()["commits"] == 0


@pytest.mark.timeout(60)
def test_close_waits_for_commits_in_flight_and_raises_one_nobody_saw(start_server):
    server = start_server(min_free_bytes=1 << 60)
    actor = ActorClient(server.endpoint, timeout=10)
    actor.push_episode(episode_rows(4, 0, 4), wait=False)
    with pytest.raises(DiskFullError):
        actor.close()
    actor.close()  # closed: nothing more to say
    ok = start_server("ok.h5")
    with ActorClient(ok.endpoint, timeout=10) as actor:
        pending = [actor.push_episode(episode_rows(4, i, 4), wait=False) for i in range(12)]
    assert all(p.done() for p in pending)
    assert [p.result().length for p in pending] == [4] * 12


@pytest.mark.timeout(60)
def test_push_episodes_checks_every_episode_before_any_leaves(start_server):
    server = start_server()
    good = episode_rows(5, 0, 3)
    bad = {**episode_rows(5, 1, 3), "obs": np.zeros((3, 7), np.float32)}
    with ActorClient(server.endpoint, timeout=10) as actor:
        with pytest.raises(SpaceMismatchError, match="obs"):
            actor.push_episodes([good, bad])
        with pytest.raises(ConfigError, match="2 priority entries for 1 episodes"):
            actor.push_episodes([good], priorities=[None, None])
        with pytest.raises(ConfigError, match="sequence of episodes"):
            actor.push_episodes(good)
        assert actor.push_episodes([]) == []
        assert actor.info()["commits"] == 0


def _push_episodes_frames(request_id: int, lengths: list[int], keys: np.ndarray, rows: dict[str, np.ndarray]) -> list:
    """A push_episodes message as a hostile client may build it: `encode` without limits skips
    the checks a client makes."""
    message = P.PushEpisodes(request_id, int(sum(lengths)), np.array(lengths, np.int64), keys, rows)
    return P.encode(message)


def learner_info(endpoint: str) -> dict:
    with LearnerClient(endpoint, timeout=10) as learner:
        return learner.info()


def _keys(k: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (k, P.IDEMPOTENCY_KEY_BYTES), dtype=np.uint8)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["lengths off", "empty episode", "same key twice", "a key short", "no episodes",
                                  "a bad row in the last episode"])
def test_a_hand_made_push_episodes_is_refused_whole_and_the_server_serves_on(start_server, case):
    server = start_server()
    rows = episode_rows(6, 0, 6)
    lengths, keys, expected = [2, 4], _keys(2), ProtocolError
    if case == "lengths off":
        lengths = [2, 3]
    elif case == "empty episode":
        lengths, keys = [0, 2, 4], _keys(3)
    elif case == "same key twice":
        keys = np.stack([keys[0], keys[0]])
    elif case == "a key short":
        keys = keys[:1]
    elif case == "no episodes":
        lengths, keys, rows = [], _keys(0), {k: v[:0] for k, v in rows.items()}
    else:
        rows["step"] = rows["step"].copy()
        rows["step"][-1] = -5  # below the Box's low bound
        expected = SpaceMismatchError
    with RawClient(server.endpoint) as raw:
        reply = raw.request(_push_episodes_frames(raw.next_id(), lengths, keys, rows))
        assert isinstance(error_of(reply), expected), reply
        ok = raw.request(_push_episodes_frames(raw.next_id(), [2, 4], _keys(2, seed=1), episode_rows(6, 1, 6)))
        assert isinstance(ok, P.PushEpisodesReply), ok
    server.stop()
    segments, _ = read_file(server.config.path)
    assert [n for _, n in segments] == [2, 4]  # only the good message's episodes


@pytest.mark.timeout(60)
def test_a_push_episodes_sent_again_is_answered_with_the_same_receipts_and_stored_once(start_server):
    server = start_server()
    keys = _keys(3, seed=7)
    rows = episode_rows(7, 0, 9)
    with RawClient(server.endpoint) as raw:
        # The first episode's key was used before, by a push of one episode of the same length.
        alone = raw.call(lambda rid: P.PushEpisode(rid, 2, {k: v[:2] for k, v in rows.items()}, 0.0,
                                                   idempotency_key=bytes(keys[0])))
        first = raw.request(_push_episodes_frames(raw.next_id(), [2, 3, 4], keys, rows))
        again = raw.request(_push_episodes_frames(raw.next_id(), [2, 3, 4], keys, rows))
        other_length = raw.request(_push_episodes_frames(raw.next_id(), [3, 2, 4], keys, rows))
    assert isinstance(first, P.PushEpisodesReply) and isinstance(again, P.PushEpisodesReply)
    assert first.episodes[0].tolist() == [alone.episode_id, alone.first_row_id, 2]
    np.testing.assert_array_equal(first.episodes, again.episodes)
    assert isinstance(error_of(other_length), SegmentStateError)
    server.stop()
    segments, _ = read_file(server.config.path)
    assert [n for _, n in segments] == [2, 3, 4]


@pytest.mark.timeout(90)
def test_an_actor_killed_with_commits_in_flight_leaves_only_whole_episodes(start_server):
    server = start_server()
    out = SPAWN.Queue()
    with processes() as procs:
        proc = SPAWN.Process(target=pipelining_actor_main, args=(server.endpoint, 9, out))
        proc.start()
        procs.append(proc)
        with LearnerClient(server.endpoint, timeout=10) as learner:
            assert wait_until(lambda: learner.info()["commits"] >= 200, 60)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    acknowledged = []
    while True:
        try:
            acknowledged.append(out.get(timeout=0.5))
        except queue.Empty:
            break
    # The server serves on: another actor commits at once.
    with ActorClient(server.endpoint, timeout=10) as actor:
        assert actor.push_episodes([episode_rows(10, 0, 3), episode_rows(10, 1, 2)])[1].length == 2
    server.stop()
    found, problems = file_episodes(server.config.path)
    assert not problems  # every row belongs to one whole episode, as sent
    held = {episode for actor, episode in found if actor == 9}
    assert found[-2:] == [(10, 0), (10, 1)]
    assert {episode for episode, _, _ in acknowledged} <= held  # every acknowledged episode is there
    assert held == set(range(len(held)))  # committed in order, none skipped, none twice


@pytest.mark.timeout(60)
def test_segments_committed_in_flight_share_messages_under_load_and_keep_their_order(start_server, actor_of):
    server = start_server()
    config = ClientConfig(endpoint=server.endpoint, timeout=10, max_in_flight=1)  # a queue forms at once
    episodes = [episode_rows(11, i, 1 + i % 6) for i in range(60)]
    actor = actor_of(config=config)
    before = actor.info()["requests"]
    pending = []
    for rows in episodes:
        seg = actor.segment()
        for step in range(len(rows["step"])):
            seg.append({key: value[step] for key, value in rows.items()})
        pending.append(seg.commit(wait=False))
        assert seg.receipt is None or seg.receipt.length == len(rows["step"])
    last = actor.push_episode(episode_rows(11, 60, 2))  # waited for: after every queued one
    requests = actor.info()["requests"] - before - 2
    receipts = [p.result() for p in pending]
    assert all(p.done() for p in pending) and seg.receipt == receipts[-1]
    actor.close()
    assert requests < 30, requests  # 61 episodes; one message each would be 61
    assert [r.length for r in receipts] == [1 + i % 6 for i in range(60)]
    assert [r.episode_id for r in receipts] == list(range(receipts[0].episode_id, receipts[0].episode_id + 60))
    assert last.episode_id == receipts[-1].episode_id + 1
    for receipt, rows in zip(receipts[::7], episodes[::7]):
        assert_held(server.endpoint, receipt, rows)


def test_unwaited_pushes_queued_behind_a_full_window_leave_together_in_order(start_server, actor_of):
    """Pushes with wait=False that find max_in_flight messages out wait in the client's next
    message and leave together as one push_episodes (they used to leave one message each); the
    blocking and the asyncio actor alike."""
    server = start_server()
    config = ClientConfig(endpoint=server.endpoint, timeout=10, max_in_flight=1)
    episodes = [episode_rows(13, i, 1 + i % 5) for i in range(80)]
    actor = actor_of(config=config)
    before = actor.info()["requests"]
    pending = []
    for rows in episodes:
        batch = {key: value.copy() for key, value in rows.items()}
        pending.append(actor.push_episode(batch, wait=False))
        for value in batch.values():  # the caller may reuse its arrays at once
            value[...] = 0
    actor.flush()
    requests = actor.info()["requests"] - before - 1
    receipts = [p.result() for p in pending]
    actor.close()
    assert requests < 40, requests  # 80 episodes; one message each would be 80
    assert [r.length for r in receipts] == [1 + i % 5 for i in range(80)]
    assert [r.episode_id for r in receipts] == list(range(receipts[0].episode_id, receipts[0].episode_id + 80))
    for receipt, rows in zip(receipts[::9], episodes[::9]):
        assert_held(server.endpoint, receipt, rows)


@pytest.mark.timeout(60)
def test_a_queued_commit_leaves_when_polled(start_server):
    ok = start_server("ok.h5")
    config = ClientConfig(endpoint=ok.endpoint, timeout=10, max_in_flight=1)
    with ActorClient(config=config) as actor:
        first, second = actor.segment(), actor.segment()
        first.extend(episode_rows(12, 0, 3))
        second.extend(episode_rows(12, 1, 2))
        pending = [first.commit(wait=False), second.commit(wait=False)]
        deadline = time.monotonic() + 10
        while not pending[1].done():  # done() alone moves the queue on: no other call needed
            assert time.monotonic() < deadline, "a queued commit never left"
            time.sleep(0.001)
        assert [p.result().length for p in pending] == [3, 2]
        assert first.receipt == pending[0].result() and second.receipt == pending[1].result()


@pytest.mark.timeout(60)
def test_refused_segments_in_flight_stay_open_to_commit_again_or_abort(start_server):
    server = start_server(min_free_bytes=1 << 60)
    config = ClientConfig(endpoint=server.endpoint, timeout=10, max_in_flight=1)
    with ActorClient(config=config) as actor:
        segments = [actor.segment() for _ in range(3)]
        pending = []
        for i, seg in enumerate(segments):
            seg.extend(episode_rows(14, i, 2))
            pending.append(seg.commit(wait=False))
        actor_failures = []
        for p in pending:
            try:
                p.result()
            except DiskFullError as exc:
                actor_failures.append(exc)
        assert len(actor_failures) == 3
        actor.flush()  # every failure was seen through result(): nothing left to report
        with pytest.raises(DiskFullError):
            segments[0].commit()  # still open, its rows kept: commit again later...
        for seg in segments:
            seg.abort()  # ... or drop it
        with pytest.raises(SegmentStateError):
            segments[1].commit()


@pytest.mark.timeout(60)
def test_push_episodes_into_a_small_buffer_never_sends_more_rows_than_the_capacity_at_once(start_server):
    server = start_server(capacity=50)
    episodes = [episode_rows(15, i, 20) for i in range(5)]  # 100 rows: more than the capacity together
    with ActorClient(server.endpoint, timeout=10) as actor:
        assert actor.rows_per_push <= 50
        receipts = actor.push_episodes(episodes)
        assert [r.length for r in receipts] == [20] * 5
        segments = [actor.segment() for _ in range(5)]
        pending = []
        for i, seg in enumerate(segments):
            seg.extend(episode_rows(15, 5 + i, 20))
            pending.append(seg.commit(wait=False))
        assert [p.result().length for p in pending] == [20] * 5
    with RawClient(server.endpoint) as raw:  # a client that sends them together anyway
        reply = raw.request(_push_episodes_frames(raw.next_id(), [20, 20, 20], _keys(3, seed=4),
                                                  episode_rows(15, 10, 60)))
        error = error_of(reply)
        assert isinstance(error, LimitExceededError) and "capacity of 50" in str(error), error
        assert learner_info(server.endpoint)["commits"] == 10  # the refused message wrote nothing
    server.stop()
    _, rows = read_file(server.config.path)
    assert rows["episode"][-20:].tolist() == [9] * 20
