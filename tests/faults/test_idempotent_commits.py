"""Idempotent commits: a commit applied after the client gave up on its reply is not stored twice.

Real servers on loopback. `ReplyDropper` stands between an actor and the server as a lossy network
would: it forwards every message and drops the first reply to a commit or push, after the server
applied it. The restart tests SIGKILL the server (or a process holding the buffer) and reopen the
same file: the keys of published episodes are remembered, those of unpublished ones are not.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from service_helpers import EPISODE_SPACE, SPAWN, RawClient, episode_rows, file_episodes, running_server, server_config
from shard_helpers import episodes_by_shard, running_shards

from h5replay import protocol as P
from h5replay.client import ActorClient
from h5replay.client._shards import InDoubt, home_shard
from h5replay.config import ClientConfig
from h5replay.errors import CommitInDoubtError, SegmentStateError
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(60)

_CONCLUDING = (P.Kind.COMMIT.value, P.Kind.PUSH_EPISODE.value)


class ReplyDropper:
    """A relay on loopback for one client that drops the first `drops` replies to commits and
    pushes: the server applied them, the client never hears so. Runs in a thread until closed.

    `silent` (settable) drops every message both ways, as a server that went away would;
    `silent_after_drop` makes it silent from the first dropped reply on."""

    def __init__(self, server_endpoint: str, drops: int = 1, silent_after_drop: bool = False) -> None:
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.linger = 0
        port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.back = ctx.socket(zmq.DEALER)
        self.back.linger = 0
        self.back.connect(server_endpoint)
        self.drops = drops
        self.silent = False
        self.silent_after_drop = silent_after_drop
        self.dropped: list[str] = []
        self._client: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self.front in ready:
                self._client, *frames = self.front.recv_multipart()
                if not self.silent:
                    self.back.send_multipart(frames)
            if self.back in ready:
                frames = self.back.recv_multipart()
                answers = msgpack.unpackb(frames[0]).get("for")
                if answers in _CONCLUDING and len(self.dropped) < self.drops:
                    self.dropped.append(answers)
                    self.silent = self.silent or self.silent_after_drop
                    continue
                if self.silent:
                    continue
                if self._client is not None:
                    self.front.send_multipart([self._client, *frames])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close(0)
        self.back.close(0)


@contextlib.contextmanager
def reply_dropper(server_endpoint: str, drops: int = 1, silent_after_drop: bool = False) -> Iterator[ReplyDropper]:
    relay = ReplyDropper(server_endpoint, drops, silent_after_drop)
    try:
        yield relay
    finally:
        relay.close()


def _client(endpoint: str) -> ActorClient:
    # 1 s per attempt, 3 attempts within 1 + 3 s: the second attempt comes after the dropped reply.
    return ActorClient(config=_retrying(endpoint))


def _retrying(endpoint: str) -> ClientConfig:
    return ClientConfig(endpoint=endpoint, timeout=1.0, rate_limit_timeout=3.0, name="retrier")


# Both drivers of the client core (blocking and asyncio, `actor_of`) retry with the same key.


def test_a_push_whose_reply_was_lost_is_retried_with_its_key_and_stored_once(tmp_path: Path, actor_of: Any) -> None:
    with running_server(server_config(tmp_path / "rb.h5")) as server, reply_dropper(server.endpoint) as relay:
        actor = actor_of(config=_retrying(relay.endpoint))
        receipt = actor.push_episode(episode_rows(0, 0, 10))
        again = actor.push_episode(episode_rows(0, 1, 5))
        actor.close()
        assert relay.dropped == ["push_episode"]
        assert receipt == (0, 0, 10) and again == (1, 10, 5)
        assert server.stop() == 0
    assert file_episodes(tmp_path / "rb.h5") == ([(0, 0), (0, 1)], [])


def test_a_segment_commit_whose_reply_was_lost_is_retried_with_its_key_and_stored_once(tmp_path: Path,
                                                                                      actor_of: Any) -> None:
    rows = episode_rows(0, 0, 700)  # over one message: streamed as a segment, then a commit message
    with running_server(server_config(tmp_path / "rb.h5")) as server, reply_dropper(server.endpoint) as relay:
        actor = actor_of(config=_retrying(relay.endpoint))
        seg = actor.segment()
        seg.extend(rows)
        receipt = seg.commit()
        actor.close()
        assert relay.dropped == ["commit"]
        assert receipt == (0, 0, 700)
        assert server.stop() == 0
    assert file_episodes(tmp_path / "rb.h5") == ([(0, 0)], [])


def _push(raw: RawClient, key: bytes | None, rows: dict[str, np.ndarray]) -> P.Reply:
    n = len(rows["step"])
    return raw.call(lambda rid: P.PushEpisode(rid, n, rows, 0.0, idempotency_key=key))


def test_a_published_key_is_remembered_by_a_server_restarted_after_sigkill(tmp_path: Path) -> None:
    config = server_config(tmp_path / "rb.h5")
    key = os.urandom(16)
    with running_server(config) as server, RawClient(server.endpoint) as raw:
        first = _push(raw, key, episode_rows(0, 0, 7))
        assert isinstance(first, P.PushEpisodeReply) and first.episode_id == 0
        server.kill()
    with running_server(config) as server, RawClient(server.endpoint) as raw:
        retry = _push(raw, key, episode_rows(0, 0, 7))
        assert isinstance(retry, P.PushEpisodeReply)
        assert (retry.episode_id, retry.first_row_id, retry.length) == (0, 0, 7)
        other = _push(raw, os.urandom(16), episode_rows(0, 1, 3))
        assert isinstance(other, P.PushEpisodeReply) and other.episode_id == 1
        assert server.stop() == 0
    assert file_episodes(tmp_path / "rb.h5") == ([(0, 0), (0, 1)], [])


def test_a_key_reused_by_another_client_for_other_content_is_refused(tmp_path: Path) -> None:
    key = os.urandom(16)
    with running_server(server_config(tmp_path / "rb.h5")) as server:
        with RawClient(server.endpoint) as owner:
            assert isinstance(_push(owner, key, episode_rows(0, 0, 7)), P.PushEpisodeReply)
        with RawClient(server.endpoint) as thief:
            refused = _push(thief, key, episode_rows(1, 0, 4))
            assert isinstance(refused, P.ErrorReply) and refused.code == P.ErrorCode.UNKNOWN_SEGMENT.value
            assert "already the key of episode 0 (7 rows)" in refused.message and "4 rows" in refused.message
            # A segment committed with the stolen key is refused too, and stays open: its owner
            # may still commit it with a key of its own.
            opened = thief.call(lambda rid: P.OpenSegment(rid))
            assert isinstance(opened, P.OpenSegmentReply)
            sid = opened.segment_id
            rows = episode_rows(1, 0, 4)
            assert isinstance(thief.call(lambda rid: P.Append(rid, sid, 4, rows)), P.AppendReply)
            refused = thief.call(lambda rid: P.Commit(rid, sid, 0.0, key))
            assert isinstance(refused, P.ErrorReply) and refused.code == P.ErrorCode.UNKNOWN_SEGMENT.value
            fresh = os.urandom(16)
            done = thief.call(lambda rid: P.Commit(rid, sid, 0.0, fresh))
            assert isinstance(done, P.CommitReply) and (done.episode_id, done.length) == (1, 4)
            # ... and its retry, with its own key, is the same receipt.
            retry = thief.call(lambda rid: P.Commit(rid, sid, 0.0, fresh))
            assert isinstance(retry, P.CommitReply) and (retry.episode_id, retry.length) == (1, 4)
        assert server.stop() == 0
    assert file_episodes(tmp_path / "rb.h5") == ([(0, 0), (1, 0)], [])


def test_a_key_that_is_not_16_bytes_is_a_bad_request_and_the_server_keeps_serving(tmp_path: Path) -> None:
    with running_server(server_config(tmp_path / "rb.h5")) as server, RawClient(server.endpoint) as raw:
        request_id = raw.next_id()
        frames = P.encode(P.PushEpisode(request_id, 1, episode_rows(0, 0, 1), 0.0, idempotency_key=b"short"))
        reply = raw.request(frames)
        assert isinstance(reply, P.ErrorReply) and reply.code == P.ErrorCode.BAD_REQUEST.value
        assert "'idempotency_key' must be 16 bytes" in reply.message
        assert isinstance(_push(raw, None, episode_rows(0, 0, 2)), P.PushEpisodeReply)
        assert server.stop() == 0


# ------------------------------------------------------------------ the buffer's file, after SIGKILL


def _commit_then_die(path: str, published: bytes, unpublished: bytes, ready: object) -> None:
    """Commit one episode with `published` (published), one with `unpublished` (placed, never
    published), say so, then wait to be SIGKILLed."""
    buffer = ReplayBuffer.load_from(path, read_only=False)
    for key, publish in ((published, True), (unpublished, False)):
        writer = buffer.open_segment_writer()
        writer.extend(episode_rows(0, int(publish), 3))
        buffer.commit_segment(writer, publish=publish, idempotency_key=key)
    ready.set()  # type: ignore[attr-defined]
    signal.pause()


def test_after_sigkill_a_reopened_buffer_remembers_exactly_the_published_keys(tmp_path: Path) -> None:
    path = str(tmp_path / "rb.h5")
    ReplayBuffer.create(EPISODE_SPACE, 100, path, idempotency_window=8).close()
    published, unpublished = os.urandom(16), os.urandom(16)
    ready = SPAWN.Event()
    child = SPAWN.Process(target=_commit_then_die, args=(path, published, unpublished, ready))
    child.start()
    try:
        assert ready.wait(30)
    finally:
        child.kill()
        child.join(10)
    buffer = ReplayBuffer.load_from(path, read_only=False)
    try:
        assert buffer.receipt_for(published) == (0, 0, 3)
        assert buffer.receipt_for(unpublished) is None
        # The unpublished key's slot is taken by an episode without a key: never confused again.
        writer = buffer.open_segment_writer()
        writer.extend(episode_rows(0, 2, 4))
        assert buffer.commit_segment(writer) == (1, 3, 4)
        assert buffer.receipt_for(unpublished) is None
    finally:
        buffer.close()
    buffer = ReplayBuffer.load_from(path, read_only=False)
    try:
        assert buffer.receipt_for(published) == (0, 0, 3) and buffer.receipt_for(unpublished) is None
        with pytest.raises(SegmentStateError, match="make a fresh key for each episode"):
            buffer.receipt_for(published, 5)
    finally:
        buffer.close()


def test_a_sharded_actor_settles_an_episode_in_doubt_on_the_same_shard_before_moving_on(tmp_path: Path,
                                                                                        actor_of: Any) -> None:
    """Every attempt of a push to shard 0 loses its reply (the shard applied the first): the actor
    asks shard 0 again with the episode's key, gets the original receipt, and never pushes the
    episode to shard 1."""
    name = next(f"doubter-{i}" for i in range(100) if home_shard(f"doubter-{i}", 2) == 0)
    with running_shards(tmp_path, 2) as shards, reply_dropper(shards.endpoints[0], drops=3) as relay:
        config = ClientConfig(timeout=1.0, rate_limit_timeout=2.0, name=name, shard_retry_interval=0.2)
        with actor_of(config=config, endpoints=[relay.endpoint, shards.endpoints[1]]) as actor:
            receipt = actor.push_episode(episode_rows(0, 0, 6))
            assert relay.dropped == ["push_episode"] * 3
            assert receipt == (0, 0, 6) and actor.shard == 0 and actor.in_doubt == []
        for i in range(2):
            assert shards.stop(i) == 0
    assert episodes_by_shard(shards.paths) == ([(0, 0, 0)], [])


@pytest.mark.parametrize("applied", [True, False], ids=["commit-applied", "commit-never-arrived"])
def test_an_episode_in_doubt_on_a_silent_shard_is_kept_and_settled_there_never_pushed_elsewhere(
        tmp_path: Path, applied: bool, actor_of: Any) -> None:
    """Shard 0 goes silent with a push's reply (applied) or before the push reaches it (never
    arrived), and stays silent past the commit's time: the push raises CommitInDoubtError, the
    actor keeps the episode and writes the next one to shard 1; when shard 0 speaks again the
    kept episode is committed there with its key. Either way it is held exactly once, on shard 0."""
    name = next(f"doubter-{i}" for i in range(100) if home_shard(f"doubter-{i}", 2) == 0)
    with running_shards(tmp_path, 2) as shards, \
            reply_dropper(shards.endpoints[0], drops=1 if applied else 0, silent_after_drop=True) as relay:
        config = ClientConfig(timeout=0.5, commit_attempts=2, name=name, shard_retry_interval=0.2)
        with actor_of(config=config, endpoints=[relay.endpoint, shards.endpoints[1]]) as actor:
            relay.silent = not applied  # never arrived: silent from now on, both ways
            with pytest.raises(CommitInDoubtError, match="shard 0 .* do not push it again") as raised:
                actor.push_episode(episode_rows(0, 0, 6))
            assert (raised.value.shard, raised.value.length) == (0, 6)
            assert actor.in_doubt == [InDoubt(raised.value.key, 0, 6, None)]
            assert actor.push_episode(episode_rows(0, 1, 4)) == (0, 0, 4)  # on shard 1 meanwhile
            assert actor.shard == 1 and actor.settle(timeout=0.3) == actor.in_doubt  # still silent
            relay.silent = False
            assert actor.settle(timeout=20) == []
            assert actor.in_doubt == [InDoubt(raised.value.key, 0, 6, (0, 0, 6))]
            assert relay.dropped == (["push_episode"] if applied else [])
        for i in range(2):
            assert shards.stop(i) == 0
    assert episodes_by_shard(shards.paths) == ([(0, 0, 0), (1, 0, 1)], [])


def test_closing_an_actor_with_an_episode_in_doubt_on_a_silent_shard_does_not_wait_for_it(tmp_path: Path,
                                                                                          caplog, actor_of) -> None:
    """close() settles what it can at once and logs what is left (an actor stopped by a signal
    must exit promptly); settle(timeout) is the way to wait."""
    name = next(f"doubter-{i}" for i in range(100) if home_shard(f"doubter-{i}", 2) == 0)
    with running_shards(tmp_path, 2) as shards, reply_dropper(shards.endpoints[0], drops=1,
                                                               silent_after_drop=True) as relay:
        config = ClientConfig(timeout=2.0, commit_attempts=1, name=name, shard_retry_interval=0.2)
        actor = actor_of(config=config, endpoints=[relay.endpoint, shards.endpoints[1]])
        try:
            with pytest.raises(CommitInDoubtError):
                actor.push_episode(episode_rows(0, 0, 6))
        finally:
            started = time.monotonic()
            actor.close()
            took = time.monotonic() - started
        assert took < 1.0, took
        assert "still in doubt on shard 0" in caplog.text
        assert relay.dropped == ["push_episode"]
        for i in range(2):
            assert shards.stop(i) == 0
    assert episodes_by_shard(shards.paths) == ([(0, 0, 0)], [])  # shard 0 had applied it
