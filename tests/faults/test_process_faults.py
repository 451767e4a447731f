"""Processes that die, stop, go silent or vanish: nothing hangs, nothing partial is ever seen.

Liveness settings are short here (heartbeats every 0.2 s, a peer silent for 1 s is dropped), so a
client that is gone has its open segments aborted within a couple of seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import zmq
from service_helpers import (
    SPAWN,
    RawClient,
    actor_main,
    child_pids,
    endpoint,
    episode_rows,
    error_of,
    file_episodes,
    processes,
    read_file,
    sampling_learner_main,
    wait_until,
)

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import SegmentStateError, ServerUnavailableError
from h5replay.storage import ReplayBuffer


def open_segments(client: ActorClient) -> int:
    return int(client.info()["open_segments"])


# ------------------------------------------------------------------------------------ actors


@pytest.mark.timeout(60)
def test_actors_that_die_or_stop_mid_segment_have_it_aborted(start_server, tmp_path):
    """SIGKILL closes one actor's connection; SIGSTOP silences the other's ZMTP heartbeats. Either
    way the server aborts the open segment within seconds, and none of its rows is ever visible."""
    server = start_server()
    out = SPAWN.Queue()
    victims = {7: (signal.SIGKILL, SPAWN.Event()), 8: (signal.SIGSTOP, SPAWN.Event())}
    committed = {}
    with processes() as procs, ActorClient(server.endpoint, timeout=10) as observer:
        for actor, (_, partial) in victims.items():
            procs.append(SPAWN.Process(target=actor_main, args=(server.endpoint, actor, 3, actor, out, partial)))
            procs[-1].start()
        for _ in victims:
            kind, actor, receipts = out.get(timeout=30)
            assert kind == "committed"
            committed[actor] = receipts
        assert all(partial.wait(30) for _, partial in victims.values())
        assert open_segments(observer) == 2  # 290 rows of each victim's episode 3 are on the server
        for still_open, (proc, (sig, _)) in enumerate(zip(procs, victims.values()), start=1):
            os.kill(proc.pid, sig)
            started = time.monotonic()
            left = 2 - still_open
            assert wait_until(lambda left=left: open_segments(observer) == left, 10), \
                f"the segment of a {sig.name} actor stayed open"
            assert time.monotonic() - started < 5.0
            receipt = observer.push_episode(episode_rows(9, sig, 12))  # everyone else is still served
            committed.setdefault(9, []).append((int(sig), 12, receipt.episode_id, receipt.first_row_id))
            with LearnerClient(server.endpoint, timeout=10) as learner:
                seen = learner.get(np.arange(len(learner)))
                assert not np.any(seen["episode"] == 3)
    assert server.stop() == 0
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == []
    assert sorted(found) == sorted((a, e) for a, receipts in committed.items() for e, *_ in receipts)
    assert (7, 3) not in found and (8, 3) not in found


@pytest.mark.timeout(30)
def test_a_session_silent_past_session_timeout_has_its_segments_aborted(start_server):
    server = start_server(session_timeout=1.0)
    with RawClient(server.endpoint) as quiet, ActorClient(server.endpoint, timeout=5) as observer:
        segment_id = quiet.call(P.OpenSegment).segment_id
        quiet.call(lambda rid: P.Append(rid, segment_id, 3, episode_rows(9, 0, 3)))
        # The observer polls, so it stays known; the quiet client says nothing (its libzmq still
        # answers heartbeats, so only the session timeout can catch it).
        assert wait_until(lambda: open_segments(observer) == 0, 10)
        exc = error_of(quiet.call(lambda rid: P.Commit(rid, segment_id)))
        assert isinstance(exc, SegmentStateError) and "went silent" in str(exc)
        assert observer.info()["length"] == 0
    assert server.stop() == 0


# ------------------------------------------------------------------------------------- signals


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_aborts_open_segments_flushes_and_exits_0(start_server, tmp_path, sig):
    server = start_server()
    config = ClientConfig(endpoint=server.endpoint, timeout=2.0, max_in_flight=1)
    with ActorClient(config=config) as actor, RawClient(server.endpoint) as raw:
        receipts = [actor.push_episode(episode_rows(1, e, 20 + 100 * e)) for e in range(3)]
        seg = actor.segment()
        seg.extend(episode_rows(1, 3, 600))  # at least 256 rows acknowledged by the server
        raw_segment = raw.call(P.OpenSegment).segment_id
        raw.call(lambda rid: P.Append(rid, raw_segment, 5, episode_rows(2, 0, 5)))
        assert actor.info()["open_segments"] == 2

        os.kill(server.pid, sig)
        server.process.join(20)
        assert server.process.exitcode == 0

        started = time.monotonic()  # the server is gone: the actor learns so within its timeout
        with pytest.raises(ServerUnavailableError):
            seg.commit()
        assert time.monotonic() - started < 2 * config.timeout + 1.5
    segments, _ = read_file(tmp_path / "rb.h5")
    assert segments == [(r.first_row_id, r.length) for r in receipts]
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == [] and found == [(1, 0), (1, 1), (1, 2)]


@pytest.mark.timeout(60)
def test_a_writer_killed_mid_stream_keeps_every_acknowledged_episode(start_server, tmp_path):
    server = start_server(capacity=500_000)
    receipts, stopped = [], []

    def stream(actor: ActorClient) -> None:
        try:
            for e in range(10_000):
                with actor.segment() as seg:
                    seg.extend(episode_rows(4, e, 1 + (e * 37) % 300))
                receipts.append(seg.receipt)
        except ServerUnavailableError as exc:
            stopped.append(exc)

    with ActorClient(server.endpoint, timeout=3) as actor:
        thread = threading.Thread(target=stream, args=(actor,))
        thread.start()
        try:
            assert wait_until(lambda: len(receipts) >= 20, 30)
        finally:
            server.kill()
            thread.join(20)
    assert stopped, "the actor should have noticed the server was gone"
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == []
    assert found[: len(receipts)] == [(4, e) for e in range(len(receipts))]
    assert len(found) - len(receipts) <= 1  # at most the commit whose reply was lost
    with ReplayBuffer.load_from(tmp_path / "rb.h5") as rb:
        assert rb.get_segments()[: len(receipts)] == [(r.first_row_id, r.length) for r in receipts]


# ------------------------------------------------------------------------------------- learners


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_readers", [
    0,
    1,
])
def test_a_learner_killed_mid_request_leaves_the_server_healthy(start_server, tmp_path, num_readers):
    server = start_server(capacity=50_000, num_readers=num_readers, multiprocessing=num_readers > 0)
    start_server.stop_timeout = 2.0  # a stuck shutdown is a failure here, not a 10 s wait
    with ActorClient(server.endpoint, timeout=10) as actor:
        for e in range(3):
            actor.push_episode(episode_rows(5, e, 200))
    # Freeze whichever process serves reads, so the learner's request is surely still unanswered
    # when the learner dies; the reply then goes to a peer that is gone.
    servers_of_reads = child_pids(server.pid) if num_readers else [server.pid]
    assert len(servers_of_reads) == 1
    busy = SPAWN.Event()
    with processes() as procs:
        learner_proc = SPAWN.Process(target=sampling_learner_main, args=(server.endpoint, 5000, busy))
        learner_proc.start()
        procs.append(learner_proc)
        assert busy.wait(30)
        os.kill(servers_of_reads[0], signal.SIGSTOP)
        try:
            time.sleep(0.3)  # the learner, sampling in a loop, now waits on the frozen process
            learner_proc.kill()
            learner_proc.join(10)
        finally:
            os.kill(servers_of_reads[0], signal.SIGCONT)
    time.sleep(0.5)  # the late reply has been sent to nobody by now

    with LearnerClient(server.endpoint, timeout=3) as learner:
        assert learner.get_segments() == [(0, 200), (200, 200), (400, 200)]
        assert learner.sample(10).keys() == {"actor", "episode", "step", "length", "obs"}
    with ActorClient(server.endpoint, timeout=5) as actor:
        actor.push_episode(episode_rows(5, 3, 10))
    assert server.stop(timeout=5) == 0
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == [] and found == [(5, e) for e in range(4)]


# --------------------------------------------------------------------------- servers that vanish


@pytest.mark.timeout(60)
def test_clients_of_a_server_that_vanishes_get_server_unavailable_in_time(start_server):
    server = start_server()
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        actor.push_episode(episode_rows(6, 0, 10))  # the server is warm before short timeouts count
        assert len(learner.sample(4)["step"]) == 4
    timeout = 1.0
    with ActorClient(server.endpoint, timeout=timeout) as actor, LearnerClient(server.endpoint, timeout=timeout) as learner:
        seg = actor.segment()
        seg.extend(episode_rows(6, 1, 10))
        assert len(learner.sample(4)["step"]) == 4
        server.kill()
        for call in (seg.commit, lambda: learner.sample(4), lambda: actor.push_episode(episode_rows(6, 2, 3))):
            started = time.monotonic()
            with pytest.raises(ServerUnavailableError) as caught:
                call()
            assert time.monotonic() - started < 2 * timeout + 1.5, call  # a send and a receive at most
            assert isinstance(caught.value, TimeoutError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("client_class", [ActorClient, LearnerClient])
def test_a_server_that_does_not_answer(client_class):
    where = endpoint()
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts connections, never replies
    silent.linger = 0
    silent.bind(where)
    try:
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="0.5 s"):
            client_class(where, timeout=0.5)
        assert time.monotonic() - started < 2.0
        assert silent.poll(1000)  # the hello did arrive: the server just never answered it
    finally:
        silent.close(0)


class _StallingServer(threading.Thread):
    """Answers hello and open_segment like a server, then reads appends without answering them."""

    def __init__(self, where: str, read_endpoint: str | None = None) -> None:
        super().__init__(daemon=True)
        self.where = where
        self.read_endpoint = read_endpoint or where  # what its hello names (a lying one: any string)
        self.appends = 0
        self.ready = threading.Event()
        self.done = threading.Event()

    def run(self) -> None:
        from service_helpers import EPISODE_SPACE

        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.linger = 0
        sock.bind(self.where)
        self.ready.set()
        try:
            while not self.done.is_set():
                if not sock.poll(50):
                    continue
                identity, *frames = sock.recv_multipart()
                request = P.decode(frames, expect=P.Request)
                if isinstance(request, P.Hello):
                    reply: P.Reply = P.HelloReply(
                        request.request_id, EPISODE_SPACE.to_json(), 1000, 0, 0, "stalling",
                        P.PROTOCOL_VERSION, P.DEFAULT_LIMITS, self.read_endpoint, "", "")
                elif isinstance(request, P.OpenSegment):
                    reply = P.OpenSegmentReply(request.request_id, 1)
                else:
                    self.appends += isinstance(request, P.Append)
                    continue
                sock.send_multipart([identity, *P.encode(reply)])
        finally:
            sock.close(0)


@pytest.mark.timeout(30)
def test_an_actor_keeps_a_bounded_number_of_appends_in_flight():
    stalling = _StallingServer(endpoint())
    stalling.start()
    try:
        assert stalling.ready.wait(5)
        config = ClientConfig(endpoint=stalling.where, timeout=1.0, max_in_flight=3, batch_rows=10)
        with ActorClient(config=config) as actor:
            seg = actor.segment()
            started = time.monotonic()
            with pytest.raises(ServerUnavailableError):
                seg.extend(episode_rows(1, 0, 200))  # 20 messages' worth; only 3 may be unanswered
            assert time.monotonic() - started < 4.0  # one timeout for the append, one for the abort
            with pytest.raises(SegmentStateError):  # the episode cannot be whole: it was given up
                seg.commit()
        assert stalling.appends == 3
    finally:
        stalling.done.set()
        stalling.join(5)


@pytest.mark.timeout(30)
def test_a_learner_told_an_undialable_read_endpoint_raises_that_error_not_its_own():
    lying = _StallingServer(endpoint(), read_endpoint="nonsense://here")
    lying.start()
    try:
        assert lying.ready.wait(5)
        with pytest.raises(zmq.ZMQError):  # was: AttributeError from close() in __init__, hiding it
            LearnerClient(lying.where, timeout=2.0)
    finally:
        lying.done.set()
        lying.join(5)
