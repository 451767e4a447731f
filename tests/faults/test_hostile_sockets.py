"""Hostile clients at the socket level: no sequence of socket actions aborts a server process, and
no client makes one hold more than its budget (issue 14, cases 2 and 4).

Real servers (ServerProcess, with and without reader processes), real sockets on 127.0.0.1, raw
DEALERs doing what the official clients never do. Each test watches the server processes' RSS
from /proc while it attacks, and checks they are alive and still serve an honest client after.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
import zmq
from fault_helpers import children_of, process_figures, process_status
from service_helpers import header, server_config

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace

# Each test here pushes hundreds of MB through a server: one xdist worker runs them one at a
# time, so two of them never load the machine at once (the tests beside them still run).
pytestmark = pytest.mark.xdist_group("test_hostile_sockets")

MB = 1 << 20
RSS_LIMIT = 512 * MB
IMAGE = DictSpace({"img": BoxSpace(0, 255, (128, 128, 4), np.uint8), "step": BoxSpace(0, 1 << 30, (), np.int64)})
ROW_BYTES = 128 * 128 * 4 + 8  # 64 KiB a row


def _rows(n: int, start: int = 0) -> dict[str, np.ndarray]:
    steps = np.arange(start, start + n, dtype=np.int64)
    return {"img": np.broadcast_to((steps % 251).astype(np.uint8)[:, None, None, None], (n, 128, 128, 4)).copy(),
            "step": steps}


def _rss(pid: int) -> tuple[int, int]:
    """(VmRSS, RssAnon) bytes of a process: all it holds in memory, and what is not file pages
    (a reader maps the file it reads; those pages are the page cache's)."""
    status = process_status(pid)
    return status.get("VmRSS", 0), status.get("RssAnon", 0)


@dataclass
class Watch:
    """Peak and current RSS of some processes, sampled every 10 ms in a thread."""

    pids: dict[str, int]
    peak: dict[str, int] = field(default_factory=dict)
    before: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.before = {name: _rss(pid)[0] for name, pid in self.pids.items()}
        self.peak = dict(self.before)
        self.peak_anon = {name: _rss(pid)[1] for name, pid in self.pids.items()}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    rss, anon = _rss(pid)
                    self.peak[name] = max(self.peak[name], rss)
                    self.peak_anon[name] = max(self.peak_anon[name], anon)
            time.sleep(0.01)

    def stop(self) -> dict[str, tuple[int, int, int, int]]:
        """{name: (MB before, MB at the peak, MB now, MB at the peak of anonymous memory)}"""
        self._stop.set()
        self._thread.join(5)
        now = {name: _rss(pid)[0] for name, pid in self.pids.items()}
        return {name: (self.before[name] // MB, self.peak[name] // MB, now[name] // MB, self.peak_anon[name] // MB)
                for name in self.pids}


@contextlib.contextmanager
def dealer(endpoint: str, **options: int) -> Iterator[zmq.Socket[bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    for name, value in options.items():
        setattr(sock, name, value)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)


def _alive_and_serving(server: ServerProcess, readers: list[int]) -> None:
    assert server.process.is_alive(), f"the writer died (exit code {server.process.exitcode})"
    for pid in readers:
        assert os.path.exists(f"/proc/{pid}") and process_figures(pid), f"reader {pid} died"
    with ActorClient(server.endpoint, timeout=10) as actor:
        assert actor.push_episode(_rows(3)).length == 3
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.sample(2)["step"].shape == (2,)


def _filled(tmp_path, readers: int, rows: int = 1000, **changes) -> ServerProcess:
    server = ServerProcess(server_config(tmp_path / "rb.h5", space=IMAGE, capacity=2000, num_readers=readers, **changes),
                           timeout=60)
    with ActorClient(server.endpoint, timeout=20) as actor:
        for lo in range(0, rows, 200):
            actor.push_episode(_rows(200, lo))
    return server


def _reader_pids(server: ServerProcess) -> list[int]:
    """The server's reader processes (spawned children; not multiprocessing's resource tracker)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = []
        for pid in children_of(server.pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"spawn_main" in cmdline.read():
                    found.append(pid)
        if len(found) >= server.config.num_readers:
            return found
        time.sleep(0.1)
    return []


def _sample_request(rid: int, batch: int) -> list[bytes]:
    return [bytes(f) for f in P.encode(P.Sample(rid, batch))]


# --------------------------------------------------------------- case 2: the libzmq abort


@pytest.mark.timeout(120)
@pytest.mark.parametrize("readers", [0, 1], ids=["writer-serves-reads", "reader-process"])
def test_unread_large_replies_then_a_close_do_not_abort_the_server(tmp_path, readers):
    """Issue 14, case 2: 20-30 large `sample` requests, no reply read, then close: libzmq 4.3.5
    aborted the process (`!_io_error`, libzmq issue 4841) once it had stopped reading that peer."""
    with _filled(tmp_path, readers) as server:
        pids = _reader_pids(server) if readers else []
        endpoint = server.read_endpoint if readers else server.endpoint
        for round_ in range(5):
            with dealer(endpoint, rcvhwm=1, heartbeat_ivl=20) as sock:
                for k in range(30):
                    sock.send_multipart(_sample_request(1000 * round_ + k, 400))  # 25 MiB replies
                time.sleep(0.3)
            time.sleep(0.3)
        time.sleep(2.0)  # a heartbeat later: the state that aborted libzmq has had its chance
        _alive_and_serving(server, pids)


# --------------------------------------------------------------- case 4: memory before allocation


@pytest.mark.timeout(120)
def test_one_message_of_300_frames_of_4_mib_is_cut_at_the_budget(tmp_path):
    """Issue 14, case 4: a single message of 300 frames of 4 MiB took the writer to 1.26 GB RSS."""
    with _filled(tmp_path, 0, rows=200) as server:
        watch = Watch({"writer": server.pid})
        frame = bytes(4 * MB)
        with dealer(server.endpoint, sndhwm=0) as sock:
            with contextlib.suppress(zmq.ZMQError):
                for _ in range(299):
                    sock.send(frame, zmq.SNDMORE)
                sock.send(frame)
            time.sleep(3.0)
        figures = watch.stop()
        print(f"\nRSS MB (before, peak, after, peak anonymous) under 300 x 4 MiB frames: {figures}")
        assert figures["writer"][1] * MB < RSS_LIMIT, figures
        _alive_and_serving(server, [])


@pytest.mark.timeout(120)
def test_a_single_500_mib_frame_is_refused_before_it_is_allocated(tmp_path):
    """Issue 14, case 4: a 500 MiB frame took the writer to 2.5 GB before the limit reply."""
    with _filled(tmp_path, 0, rows=200) as server:
        watch = Watch({"writer": server.pid})
        with dealer(server.endpoint, sndhwm=0) as sock:
            big = np.zeros(500 * MB, np.uint8)
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([header("push_episode", 1, {"num_rows": 1}, [["img", "|u1", [500 * MB]]]), big])
            del big
            time.sleep(3.0)
        figures = watch.stop()
        print(f"\nRSS MB (before, peak, after, peak anonymous) under one 500 MiB frame: {figures}")
        assert figures["writer"][1] * MB < RSS_LIMIT, figures
        _alive_and_serving(server, [])


@pytest.mark.timeout(180)
def test_many_open_segments_share_a_bounded_staging_memory(tmp_path):
    """Issue 14, case 4: 12 clients x 16 open segments took the writer from 61 MB to 1.6 GB (8 MiB
    a segment, up front). Each gets 4 MiB of rows here, and none is committed."""
    with _filled(tmp_path, 0, rows=200) as server, contextlib.ExitStack() as clients:
        watch = Watch({"writer": server.pid})
        rows = _rows(64)  # 4 MiB
        for client in range(12):  # all connected at once: every segment stays open
            conn = clients.enter_context(ActorClient(server.endpoint, timeout=30)).connection
            segments = [int(conn.request(lambda rid: P.OpenSegment(rid)).segment_id) for _ in range(16)]
            for segment in segments:
                conn.request(lambda rid, s=segment: P.Append(rid, s, 64, rows))
            assert watch.peak["writer"] < RSS_LIMIT, (client, watch.peak)
        info = ActorClient(server.endpoint, timeout=10)
        try:
            assert info.info()["open_segments"] == 12 * 16
        finally:
            info.close()
        figures = watch.stop()
        print(f"\nRSS MB (before, peak, after, peak anonymous) with 12 x 16 open segments of 4 MiB: {figures}")
        assert figures["writer"][1] * MB < RSS_LIMIT, figures
        _alive_and_serving(server, [])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("readers", [1, 2], ids=["reader-process", "proxy"])
def test_a_client_that_never_reads_its_replies_is_disconnected_not_buffered(tmp_path, readers):
    """Issue 14, case 4: replies to a client that never read them grew a reader by 1.8 GB. Behind
    the proxy they pile up in the writer process instead: both are watched."""
    with _filled(tmp_path, readers, rows=1000) as server:
        pids = _reader_pids(server)
        watch = Watch({"writer": server.pid, **{f"reader{k}": pid for k, pid in enumerate(pids)}})
        with dealer(server.read_endpoint, rcvhwm=1, rcvbuf=4096) as sock:
            for k in range(80):  # 80 replies of 25 MiB: 2 GB if all were kept
                sock.send_multipart(_sample_request(k + 1, 400))
            time.sleep(6.0)
        figures = watch.stop()
        print(f"\nRSS MB (before, peak, after, peak anonymous) with a client that never reads 80 x 25 MiB replies: {figures}")
        assert all(peak * MB < RSS_LIMIT for _, peak, _, _ in figures.values()), figures
        _alive_and_serving(server, pids)


# --------------------------------------------------------------- chaos


_ACTIONS = ("connect_send_close", "garbage", "unread_large", "half_message", "same_routing_id", "tiny_hwm_flood",
            "heartbeat_spam", "hello_then_vanish", "valid_then_close")


def _chaos_action(kind: str, endpoint: str, rng: random.Random, stash: list[zmq.Socket[bytes]]) -> None:
    """One hostile thing a client can do with a socket. Sockets may be left open in `stash`
    (closed later, at random), as a client that connects and lingers would."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    if kind == "same_routing_id":
        sock.routing_id = b"chaos-%d" % rng.randrange(3)  # the same few ids, reconnecting over and over
    if kind in ("tiny_hwm_flood", "unread_large"):
        sock.rcvhwm = 1
        sock.sndhwm = 0
    if kind == "heartbeat_spam":
        sock.heartbeat_ivl = 1
        sock.heartbeat_ttl = 100
    sock.connect(endpoint)
    try:
        if kind == "garbage":
            for _ in range(rng.randrange(1, 20)):
                sock.send_multipart([os.urandom(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 5))], zmq.NOBLOCK)
        elif kind == "unread_large":
            for k in range(rng.randrange(5, 30)):
                sock.send_multipart(_sample_request(k + 1, 400), zmq.NOBLOCK)
            time.sleep(rng.uniform(0, 0.2))
        elif kind == "half_message":
            sock.send(header("info", 1), zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(bytes(rng.randrange(0, 1 << 20)), zmq.SNDMORE | zmq.NOBLOCK)
            time.sleep(rng.uniform(0, 0.05))
        elif kind == "tiny_hwm_flood":
            for k in range(rng.randrange(50, 500)):
                sock.send_multipart([bytes(f) for f in P.encode(P.Heartbeat(k + 1))], zmq.NOBLOCK)
        elif kind == "heartbeat_spam":
            for k in range(rng.randrange(1, 50)):
                sock.send_multipart(_sample_request(k + 1, 50), zmq.NOBLOCK)
            time.sleep(rng.uniform(0, 0.1))
        elif kind == "hello_then_vanish":
            sock.send_multipart([bytes(f) for f in P.encode(P.Hello(1, "chaos", "actor"))], zmq.NOBLOCK)
            sock.send_multipart([bytes(f) for f in P.encode(P.OpenSegment(2))], zmq.NOBLOCK)
        elif kind == "valid_then_close":
            sock.send_multipart([bytes(f) for f in P.encode(P.Info(1))], zmq.NOBLOCK)
            if sock.poll(50):
                sock.recv_multipart()
        else:
            sock.send_multipart([bytes(f) for f in P.encode(P.Heartbeat(1))], zmq.NOBLOCK)
    except zmq.Again:
        pass
    if rng.random() < 0.3 and len(stash) < 20:
        stash.append(sock)  # left open for now
    else:
        sock.close(0)
    while stash and rng.random() < 0.3:
        stash.pop(rng.randrange(len(stash))).close(0)


@pytest.mark.timeout(180)
def test_socket_chaos_against_the_writer_and_the_reader_endpoints(tmp_path):
    """Random connect / send N / disconnect / tiny high-water marks / reconnect with the same
    routing id / heartbeat spam / half-sent messages, for a bounded time, against both endpoints.
    Both processes stay alive (and under the RSS limit) and serve an honest client after."""
    rng = random.Random(20_261_201)
    with _filled(tmp_path, 1, rows=1000) as server:
        pids = _reader_pids(server)
        watch = Watch({"writer": server.pid, "reader": pids[0]})
        endpoints = [server.endpoint, server.read_endpoint]
        stash: list[zmq.Socket[bytes]] = []
        actions = 0
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline:
                _chaos_action(rng.choice(_ACTIONS), rng.choice(endpoints), rng, stash)
                actions += 1
                if actions % 200 == 0:
                    assert server.process.is_alive() and os.path.exists(f"/proc/{pids[0]}")
        finally:
            for sock in stash:
                sock.close(0)
        time.sleep(2.0)
        figures = watch.stop()
        print(f"\nchaos: {actions} socket actions survived in 20 s; RSS MB (before, peak, after, peak anonymous): {figures}")
        assert actions > 500
        # What the processes hold: anonymous memory. Their whole RSS also counts the replay file's
        # pages a reader maps (page cache, shared and reclaimable), which the chaos reads pull in.
        assert all(anonymous * MB < RSS_LIMIT for _, _, _, anonymous in figures.values()), figures
        _alive_and_serving(server, pids)
