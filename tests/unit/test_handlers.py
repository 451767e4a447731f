"""The server's request handling (handlers.Service) without sockets, processes or files.

The Service runs over a ReplayBuffer on the in-memory backend of tests/memory_backend.py, which
passes the same storage contract as the HDF5 one: sessions, segment ownership, group commit,
limits, roles, the read-only mode after a failed write, and the reads a reader serves.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from memory_backend import MemoryJournal, MemoryStorage, memory_replay_buffer

from h5replay import protocol as P
from h5replay.errors import (
    AccessDeniedError,
    LimitExceededError,
    NotEnoughDataError,
    RateLimitedError,
    ReadOnlyError,
    SegmentStateError,
    SpaceMismatchError,
    StorageError,
)
from h5replay.sampling import Prioritized, SamplingConfig
from h5replay.server.handlers import Service, read_reply
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer

SPACE = DictSpace({"x": BoxSpace(0, 1000, (), np.int32), "v": BoxSpace(-1, 1, (2,), np.float32)})
A, B = b"actor-a", b"actor-b"


def wire(values: Any) -> dict[str, np.ndarray]:
    x = np.asarray(values, np.int32).reshape(-1)
    return {"v": np.zeros((x.size, 2), np.float32), "x": x}


class Harness:
    """A Service, and a request id counter: `call(identity, Kind, *fields)`."""

    def __init__(self, capacity: int | None = 100, **limits: int) -> None:
        self.buffer: ReplayBuffer = memory_replay_buffer(SPACE, capacity)
        self.service = Service(self.buffer, P.Limits(**limits), "tcp://127.0.0.1:9", instance_id="i")
        self.rid = 0

    def call(self, identity: bytes, cls: Any, *fields: Any, role: str | None = None, key: str | None = None) -> Any:
        """`role` and `key`: what authentication says of this message (None: no --auth)."""
        self.rid += 1
        return self.service.handle(identity, cls(self.rid, *fields), role, key)

    @property
    def journal(self) -> MemoryJournal:
        return self.buffer._journal  # type: ignore[return-value]


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_a_commit_is_placed_then_published_once_for_the_whole_pass(h: Harness) -> None:
    receipts = []
    for actor in (A, B):
        segment = h.call(actor, P.OpenSegment).segment_id
        assert h.call(actor, P.Append, segment, 3, wire([1, 2, 3])).segment_length == 3
        receipts.append(h.call(actor, P.Commit, segment))
    receipts.append(h.call(A, P.PushEpisode, 2, wire([7, 8])))
    assert [(r.episode_id, r.first_row_id, r.length) for r in receipts] == [(0, 0, 3), (1, 3, 3), (2, 6, 2)]
    assert h.service.unpublished == 3 and h.buffer.published.end == 0  # nothing acknowledged yet
    publishes = h.journal.publishes
    h.service.publish()
    assert h.journal.publishes == publishes + 1 and h.buffer.published.end == 8
    assert h.service.unpublished == 0 and h.service.stats.commits == 3


def test_segment_ids_are_unique_and_belong_to_their_client(h: Harness) -> None:
    ids = [h.call(A, P.OpenSegment).segment_id, h.call(B, P.OpenSegment).segment_id]
    h.service.drop_session(A)  # a session made anew never reuses an id
    ids.append(h.call(A, P.OpenSegment).segment_id)
    assert len(set(ids)) == 3
    with pytest.raises(SegmentStateError, match=f"segment {ids[1]} belongs to another client"):
        h.call(A, P.Append, ids[1], 1, wire([1]))
    with pytest.raises(SegmentStateError, match=f"no open segment {ids[0]}"):
        h.call(A, P.Commit, ids[0])


def test_limits_name_themselves() -> None:
    h = Harness(max_clients=2, max_open_segments_per_client=1, max_rows_per_segment=4)
    segment = h.call(A, P.OpenSegment).segment_id
    with pytest.raises(LimitExceededError, match="max_open_segments_per_client=1"):
        h.call(A, P.OpenSegment)
    h.call(A, P.Append, segment, 3, wire([1, 2, 3]))
    with pytest.raises(LimitExceededError, match="max_rows_per_segment=4"):
        h.call(A, P.Append, segment, 2, wire([4, 5]))
    assert h.call(A, P.Commit, segment).length == 3  # the refused rows are not in it
    h.call(B, P.Heartbeat)
    with pytest.raises(LimitExceededError, match="max_clients=2"):
        h.call(b"third", P.Heartbeat)


def test_rows_that_do_not_fit_the_space_are_refused_before_anything_is_written(h: Harness) -> None:
    segment = h.call(A, P.OpenSegment).segment_id
    with pytest.raises(SpaceMismatchError, match="missing \\['v'\\]"):
        h.call(A, P.Append, segment, 1, {"x": np.zeros(1, np.int32)})
    with pytest.raises(SpaceMismatchError, match="'x' arrived as int64"):
        h.call(A, P.Append, segment, 1, {"x": np.zeros(1, np.int64), "v": np.zeros((1, 2), np.float32)})
    assert h.call(A, P.Commit, segment).length == 0 and h.service.stats.rows_in == 0


def test_a_learner_may_not_write_and_cannot_claim_more_than_it_was_granted(h: Harness) -> None:
    with pytest.raises(ReadOnlyError, match="learner may not open segment"):
        h.call(B, P.OpenSegment, role="learner", key="kb")
    h.call(B, P.Hello, "sneaky", "actor", role="learner", key="kb")  # asks for more than its key gives
    with pytest.raises(ReadOnlyError):
        h.call(B, P.PushEpisode, 1, wire([1]), role="learner", key="kb")
    h.call(A, P.Hello, "modest", "learner", role="actor", key="ka")  # an actor may ask for less
    with pytest.raises(ReadOnlyError):
        h.call(A, P.OpenSegment, role="actor", key="ka")


def test_roles_are_those_of_each_message_and_a_routing_id_keeps_its_key(h: Harness) -> None:
    """Issue 14, cases 6 and 7: the role is the key's now (a key moved to learners/ writes no
    more), and another key cannot use a routing id bound to a session."""
    C = b"actor-c"
    h.call(C, P.OpenSegment, role="actor", key="kc")
    with pytest.raises(ReadOnlyError):
        h.call(C, P.OpenSegment, role="learner", key="kc")
    with pytest.raises(AccessDeniedError, match="another key"):
        h.call(C, P.PushEpisode, 1, wire([1]), role="actor", key="kd")
    assert h.service.stats.commits == 0


def test_silent_or_departed_clients_lose_their_open_segments(h: Harness) -> None:
    segment = h.call(A, P.OpenSegment).segment_id
    h.call(A, P.Append, segment, 2, wire([1, 2]))
    h.call(B, P.OpenSegment)
    h.service.sessions[A].last_seen = time.monotonic() - 100
    assert h.service.expire(50) == [(A, 1)] and h.service.open_segments == 1
    assert h.service.drop_session(B) == 1 and h.service.open_segments == 0
    assert h.service.stats.aborts == 2 and len(h.buffer) == 0


def test_after_a_failed_write_the_service_refuses_writes_and_serves_reads(h: Harness, monkeypatch: Any) -> None:
    h.call(A, P.PushEpisode, 2, wire([5, 6]))
    h.service.publish()

    def refuse(start: int, encoded: Any) -> None:
        raise StorageError("injected: the disk refused the rows")

    monkeypatch.setattr(h.buffer.storage, "write_ring", refuse)
    with pytest.raises(StorageError, match="injected"):
        h.call(A, P.PushEpisode, 1, wire([7]))
    assert h.service.write_failure is not None
    with pytest.raises(StorageError, match="stopped writing after a failed write"):
        h.call(B, P.OpenSegment)
    reply = h.call(B, P.Get, 0, np.array([0, 1]))
    assert reply.arrays["x"].tolist() == [5, 6] and reply.end == 2


def test_commits_an_eviction_already_published_are_durable_when_the_pass_fails(monkeypatch: Any) -> None:
    h = Harness(capacity=64)
    for e in range(16):
        h.call(A, P.PushEpisode, 4, wire([e] * 4))
    h.service.publish()
    first = h.call(A, P.PushEpisode, 1, wire([99]))  # placed, not published (its eviction came before it)
    second = h.call(A, P.PushEpisode, 4, wire([100] * 4))  # evicts again: that publish shows `first`

    def refuse(state: Any, fsync: bool = False) -> None:
        raise StorageError("injected: the state row could not be written")

    monkeypatch.setattr(h.journal, "publish", refuse)
    with pytest.raises(StorageError):
        h.service.publish()
    assert h.service.is_durable(first) and not h.service.is_durable(second)


def prioritized_service(interval: float = 0.0) -> Service:
    storage = MemoryStorage(SPACE, 100)
    buffer = ReplayBuffer(storage, journal=MemoryJournal(storage), sampling=SamplingConfig(Prioritized()))  # type: ignore[arg-type]
    service = Service(buffer, P.Limits(), "tcp://127.0.0.1:9", instance_id="i", priority_publish_interval=interval)
    service.handle(A, P.PushEpisode(1, 4, wire([1, 2, 3, 4])), None, None)
    service.publish()
    return service


def test_a_priority_update_is_answered_before_its_publish_and_names_it() -> None:
    service = prioritized_service()
    buffer, seq = service.buffer, service.buffer.published.seq
    reply = service.handle(B, P.UpdatePriorities(2, np.array([0, 1]), np.array([3.0, 1.0])), None, None)
    with pytest.raises(IndexError, match="never committed"):  # refused whole: nothing of it applied
        service.handle(B, P.UpdatePriorities(3, np.array([1, 50]), np.array([7.0, 7.0])), None, None)
    assert reply.seq == seq + 1 and service.updates_pending and buffer.published.seq == seq
    assert buffer.priorities([0, 1]).tolist() == [3.0, 1.0]  # applied at once, in the writer's tree
    service.publish()  # the end of the pass
    assert buffer.published.seq == seq + 1 and not service.updates_pending and buffer.published.tables[0].plog == 2


def test_an_update_whose_ids_were_all_evicted_names_no_publish_to_come() -> None:
    """Regression: it named the next publish, which never came (nothing changed), so the
    learner's next read asked for a state the file never reached and was refused as if the file
    had gone back in time ("older than publish N this client has already seen")."""
    service = prioritized_service()
    for k in range(30):  # capacity 100: rows 0-19 are evicted
        service.handle(A, P.PushEpisode(10 + k, 4, wire([1, 2, 3, 4])), None, None)
    service.publish()
    seq = service.buffer.published.seq
    reply = service.handle(B, P.UpdatePriorities(2, np.array([0, 1]), np.array([3.0, 1.0])), None, None)
    assert reply.ignored == 2 and not service.updates_pending
    assert reply.seq == seq, "nothing to publish: the state it names is the one the file has"
    reply = service.handle(B, P.UpdatePriorities(3, np.array([0, 119]), np.array([3.0, 1.0])), None, None)
    assert reply.ignored == 1 and reply.seq == seq + 1 and service.updates_pending


def test_an_interval_lets_updates_wait_unless_a_read_forces_them_and_a_failed_publish_is_not_retried(
    monkeypatch: Any,
) -> None:
    service = prioritized_service(interval=60.0)
    seq = service.buffer.published.seq
    service.handle(B, P.UpdatePriorities(2, np.array([0]), np.array([3.0])), None, None)
    service.publish()
    assert service.buffer.published.seq == seq and 59 < (service.updates_due_in() or 0) <= 60
    service.publish(force=True)
    assert service.buffer.published.seq == seq + 1 and service.updates_due_in() is None
    service.handle(B, P.UpdatePriorities(3, np.array([1]), np.array([4.0])), None, None)

    def refuse(state: Any, fsync: bool = False) -> None:
        raise StorageError("injected: the state row could not be written")

    monkeypatch.setattr(service.buffer._journal, "publish", refuse)
    with pytest.raises(StorageError):
        service.publish(force=True)
    assert service.write_failure is not None
    assert not service.updates_pending and service.updates_due_in() is None  # the loop does not spin on it


def test_reads_answer_from_a_view_and_refuse_what_cannot_be(h: Harness) -> None:
    rng = np.random.default_rng(0)
    limits = P.Limits(max_message_bytes=64 * 1024)
    with pytest.raises(NotEnoughDataError):
        read_reply(h.buffer, P.Sample(1, 4, None, 0), rng, limits)
    for e in range(3):
        h.call(A, P.PushEpisode, 5, wire(range(10 * e, 10 * e + 5)))
    h.service.publish()
    reply = read_reply(h.buffer, P.Sample(1, 64, 3, 0), rng, limits)
    assert reply.end == 15 and reply.seq == h.buffer.published.seq
    np.testing.assert_array_equal(reply.arrays["x"] // 10, reply.episode_ids.astype(np.int64))
    episodes = read_reply(h.buffer, P.Episodes(2, 0), rng, limits).episodes
    assert episodes.tolist() == [[0, 0, 5], [1, 5, 5], [2, 10, 5]]
    with pytest.raises(LimitExceededError, match="max_message_bytes"):
        read_reply(h.buffer, P.Get(3, 0, np.zeros(5000, np.int64)), rng, limits)
    h.call(B, P.Info)
    assert h.service.snapshot()["clients"] == 2 and h.service.snapshot()["replay_id"] == "memory"


def test_quotas_keep_slots_for_actor_keys_and_bound_one_keys_clients() -> None:
    """Issue 14, case 8: one learner key filled every client slot. Now a key holds at most
    max_clients_per_key sessions, the last actor_slots slots take actor keys only, and a session
    without an open segment expires after the idle timeout."""
    h = Harness(max_clients=6)
    h.service.max_clients_per_key, h.service.actor_slots = 3, 2
    for k in range(3):
        h.call(b"l%d" % k, P.Heartbeat, role="learner", key="learner-1")
    with pytest.raises(LimitExceededError, match="max_clients_per_key=3"):
        h.call(b"l3", P.Heartbeat, role="learner", key="learner-1")
    h.call(b"m0", P.Heartbeat, role="learner", key="learner-2")
    with pytest.raises(LimitExceededError, match="kept for actor keys"):
        h.call(b"m1", P.Heartbeat, role="learner", key="learner-2")
    h.call(b"a0", P.OpenSegment, role="actor", key="actor-1")
    h.call(b"a1", P.Heartbeat, role="actor", key="actor-1")
    with pytest.raises(LimitExceededError, match="max_clients=6"):
        h.call(b"a2", P.Heartbeat, role="actor", key="actor-1")
    for session in h.service.sessions.values():
        session.last_seen -= 10
    expired = h.service.expire(300, idle_timeout=5)
    assert sorted(identity for identity, _ in expired) == [b"a1", b"l0", b"l1", b"l2", b"m0"]
    assert list(h.service.sessions) == [b"a0"]  # its open segment keeps it, up to the session timeout


def test_a_removed_or_demoted_key_loses_its_sessions_or_its_segments() -> None:
    """Issue 14, case 7, in the service: `revoke` drops the sessions of keys no longer listed and
    aborts the open segments of keys that are learners now."""
    h = Harness()
    for identity, key in ((b"a", "gone"), (b"b", "demoted"), (b"c", "kept")):
        segment = h.call(identity, P.OpenSegment, role="actor", key=key).segment_id
        h.call(identity, P.Append, segment, 1, wire([1]), role="actor", key=key)
    roles = {"demoted": "learner", "kept": "actor"}
    dropped, demoted = h.service.revoke(roles.get)
    assert (dropped, demoted) == ([b"a"], [b"b"])
    assert set(h.service.sessions) == {b"b", b"c"} and h.service.open_segments == 1


# ------------------------------------------------------------------------------ idempotency keys

KEY = bytes(range(16))


def test_a_retry_in_the_same_pass_gets_the_receipt_of_the_placed_commit(h: Harness) -> None:
    first = h.call(A, P.PushEpisode, 2, wire([1, 2]), 0.0, np.zeros(0), KEY)
    segment = h.call(A, P.OpenSegment).segment_id
    h.call(A, P.Append, segment, 2, wire([1, 2]))
    again = h.call(A, P.Commit, segment, 0.0, KEY)  # the same key on a segment of the same length
    assert (again.episode_id, again.first_row_id, again.length) == (first.episode_id, 0, 2)
    assert h.call(A, P.Info).stats["open_segments"] == 0  # that segment was aborted, not committed
    h.service.publish()
    assert len(h.buffer) == 2 and h.buffer.num_episodes == 1


def test_a_retried_push_is_not_held_back_by_the_rate_limit() -> None:
    from memory_backend import MemoryStorage

    from h5replay.sampling import RateLimit, SamplingConfig

    storage = MemoryStorage(SPACE, 100)
    limit = RateLimit(1, samples_per_insert=1.0, error_buffer=3.0)  # inserts wait once 4 rows are ahead
    buffer = ReplayBuffer(storage, journal=MemoryJournal(storage), sampling=SamplingConfig(rate_limit=limit))  # type: ignore[arg-type]
    service = Service(buffer, P.Limits(), "tcp://127.0.0.1:9", instance_id="i")
    first = service.submit(A, P.PushEpisode(1, 4, wire([1, 2, 3, 4]), 0.0, np.zeros(0), KEY))
    service.publish()
    assert first is not None and first.length == 4
    with pytest.raises(RateLimitedError):  # another episode must wait for samples
        service.submit(A, P.PushEpisode(2, 4, wire([5, 6, 7, 8]), 0.0, np.zeros(0), bytes(16)))
    retry = service.submit(A, P.PushEpisode(3, 4, wire([1, 2, 3, 4]), 0.0, np.zeros(0), KEY))
    assert retry is not None and (retry.episode_id, retry.length) == (first.episode_id, 4)


def _keys(*first_bytes: int) -> np.ndarray:
    return np.array([[b] * 16 for b in first_bytes], dtype=np.uint8)


def test_push_episodes_places_every_episode_with_one_publish_and_a_retry_commits_only_the_new_ones(
        h: Harness) -> None:
    one = h.call(A, P.PushEpisode, 2, wire([1, 2]), 0.0, np.zeros(0), bytes([3] * 16))
    publishes = h.journal.publishes
    # Episode 2 of this message (key 3...) was pushed alone before: answered, not stored again.
    reply = h.call(A, P.PushEpisodes, 6, np.array([1, 2, 3]), _keys(1, 3, 5), wire([10, 1, 2, 30, 31, 32]))
    assert isinstance(reply, P.PushEpisodesReply)
    assert reply.episodes.tolist() == [[1, 2, 1], [one.episode_id, one.first_row_id, 2], [2, 3, 3]]
    h.service.publish()
    assert h.journal.publishes == publishes + 1
    assert h.buffer.get_at(slice(None))["x"].tolist() == [1, 2, 10, 30, 31, 32]
    assert [tuple(e)[1:] for e in h.buffer.episodes()] == [(0, 2), (2, 1), (3, 3)]
    again = h.call(A, P.PushEpisodes, 6, np.array([1, 2, 3]), _keys(1, 3, 5), wire([10, 1, 2, 30, 31, 32]))
    np.testing.assert_array_equal(again.episodes, reply.episodes)
    h.service.publish()
    assert len(h.buffer) == 6 and h.buffer.num_episodes == 3


def test_push_episodes_refused_for_one_episode_writes_none_of_them(h: Harness) -> None:
    h.call(A, P.PushEpisode, 2, wire([1, 2]), 0.0, np.zeros(0), bytes([3] * 16))
    with pytest.raises(SegmentStateError):  # key 3... names an episode of 2 rows, not 3
        h.call(A, P.PushEpisodes, 4, np.array([1, 3]), _keys(1, 3), wire([5, 6, 7, 8]))
    with pytest.raises(SpaceMismatchError):  # rows of another dtype (bounds: the integration tests)
        h.call(A, P.PushEpisodes, 4, np.array([1, 3]), _keys(1, 2), {**wire([5, 6, 7, 8]), "x": np.zeros(4)})
    small = Harness(capacity=3)
    with pytest.raises(LimitExceededError, match="capacity"):
        small.call(A, P.PushEpisodes, 5, np.array([1, 4]), _keys(1, 2), wire([1, 2, 3, 4, 5]))
    h.service.publish()
    assert h.buffer.get_at(slice(None))["x"].tolist() == [1, 2] and h.buffer.num_episodes == 1


def test_push_episodes_waits_for_the_rate_limit_as_a_whole_and_a_retry_is_not_held_back() -> None:
    from h5replay.sampling import RateLimit

    storage = MemoryStorage(SPACE, 100)
    limit = RateLimit(1, samples_per_insert=1.0, error_buffer=3.0)  # inserts wait once 4 rows are ahead
    buffer = ReplayBuffer(storage, journal=MemoryJournal(storage), sampling=SamplingConfig(rate_limit=limit))  # type: ignore[arg-type]
    service = Service(buffer, P.Limits(), "tcp://127.0.0.1:9", instance_id="i")
    first = service.submit(A, P.PushEpisodes(1, 4, np.array([2, 2]), _keys(1, 2), wire([1, 2, 3, 4])))
    service.publish()
    assert isinstance(first, P.PushEpisodesReply) and first.episodes[:, 2].tolist() == [2, 2]
    with pytest.raises(RateLimitedError):  # more rows must wait for samples; a timeout of 0 waits for none
        service.submit(A, P.PushEpisodes(2, 2, np.array([1, 1]), _keys(5, 6), wire([5, 6])))
    assert service.submit(A, P.PushEpisodes(3, 2, np.array([1, 1]), _keys(5, 6), wire([5, 6]), 10.0)) is None
    assert service.waiting and service._waiting_bytes > 0  # held back whole, its rows counted
    retry = service.submit(A, P.PushEpisodes(4, 4, np.array([2, 2]), _keys(1, 2), wire([1, 2, 3, 4])))
    assert isinstance(retry, P.PushEpisodesReply)
    np.testing.assert_array_equal(retry.episodes, first.episodes)
