"""Fuzzing the protocol: the decoder in-process, then a live server; the limits a client cannot exceed.

The decoder takes at least 100,000 generated and mutated messages and lets only ProtocolError
(and its subclasses) escape. The live server takes as many as fit in FUZZ_SECONDS from several raw
sockets, on the writer's and the readers' endpoints, while an actor commits real episodes: it must
answer every message with a well-formed reply (an error for the bad ones, never an internal
error), never die or stall, and afterwards hold exactly what was committed.
"""

from __future__ import annotations

import collections
import re
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import zmq
from fault_helpers import Fuzzer
from service_helpers import RawClient, episode_problems, episode_rows, error_of, header, server_config, wait_until

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import LimitExceededError, ProtocolError, ServerUnavailableError
from h5replay.server import ServerProcess
from h5replay.storage import ReplayBuffer

# The module's `limited` server serves several tests: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("test_fuzz_live")

PACKAGE = Path(__file__).resolve().parents[2] / "h5replay"
DECODER_MESSAGES = 100_000
FUZZ_SECONDS = 20.0
WINDOW = 8  # requests in flight per fuzzing socket (the server queues max_in_flight=8 per client)
STALL = 10.0  # seconds without a reply, with requests in flight, that count as a hung server


# ------------------------------------------------------------------------------ the decoder alone


@pytest.mark.timeout(180)
def test_decoder_refuses_100k_mutated_messages_with_protocol_errors_only():
    fuzzer = Fuzzer(seed=1)
    small = P.Limits(max_message_bytes=4096, max_frames=4, max_header_bytes=512)
    expects = [P.Message, P.Request, P.Reply]
    categories, outcomes = collections.Counter(), collections.Counter()
    escaped = []
    started = time.monotonic()
    for i in range(DECODER_MESSAGES):
        category, frames = fuzzer.message(replies=True)
        categories[category] += 1
        limits = small if i % 10 == 0 else P.DEFAULT_LIMITS
        try:
            msg = P.decode(frames, limits, expect=expects[i % 3])
        except ProtocolError as exc:
            outcomes[type(exc).__name__] += 1
        except Exception as exc:  # anything else is a decoder bug
            escaped.append((category, frames[:3], repr(exc)))
        else:
            outcomes["decoded"] += 1
            try:
                P.encode(msg)  # what decode accepts, encode can send
            except Exception as exc:
                escaped.append(("re-encode " + category, frames[:3], repr(exc)))
        rid = P.peek_request_id(frames, limits)  # never raises
        assert rid is None or (type(rid) is int and rid >= 0)
    elapsed = time.monotonic() - started
    print(f"\ndecoder fuzz: {DECODER_MESSAGES} messages in {elapsed:.1f} s; inputs {dict(categories)}; "
          f"outcomes {dict(outcomes)}")
    assert not escaped, escaped[:5]
    assert outcomes["decoded"] > 1000 and outcomes["ProtocolError"] > 10_000 and outcomes["LimitExceededError"] > 100


# --------------------------------------------------------------------------------- a live server


class FuzzSocket:
    """A raw DEALER that keeps up to WINDOW fuzz messages in flight and matches replies in order."""

    def __init__(self, ctx: zmq.Context, endpoint: str, name: str) -> None:
        self.name = name
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self.pending: collections.deque[tuple[int | None, str]] = collections.deque()
        self.last_reply = time.monotonic()
        self.segment_ids: list[int] = []


def _fuzz_server(server: ServerProcess, limits: P.Limits, seconds: float) -> dict:
    """Drive the fuzz; returns counts and what was committed through the fuzzing sockets."""
    fuzzer = Fuzzer(seed=2)
    ctx = zmq.Context.instance()
    writer_socks = [FuzzSocket(ctx, server.endpoint, f"w{i}") for i in range(4)]
    reader_sock = FuzzSocket(ctx, server.read_endpoint, "r")
    socks = [*writer_socks, reader_sock]
    poller = zmq.Poller()
    for s in socks:
        poller.register(s.sock, zmq.POLLIN)
    stats = collections.Counter()
    codes = collections.Counter()
    problems: list[str] = []
    committed: dict[int, int] = {}  # episode id -> length, committed by fuzz messages
    deadline = time.monotonic() + seconds
    try:
        while True:
            now = time.monotonic()
            sending = now < deadline
            if sending:
                for s in socks:
                    while len(s.pending) < WINDOW:
                        category, frames = fuzzer.message(s.segment_ids)
                        expected = P.peek_request_id(frames, limits)
                        if expected == 0:  # id 0 is the server's liveness probe: keep it unambiguous
                            continue
                        try:
                            s.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if not s.pending:
                            s.last_reply = now
                        s.pending.append((expected, category))
                        stats["sent"] += 1
                        stats[category] += 1
            elif not any(s.pending for s in socks):
                break
            for s in socks:
                if s.pending and time.monotonic() - s.last_reply > STALL:
                    raise AssertionError(f"socket {s.name}: no reply for {STALL} s with {len(s.pending)} in flight; "
                                         f"{stats['replies']} replies so far")
            for sock, _ in poller.poll(200):
                s = next(x for x in socks if x.sock is sock)
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    reply = P.decode(frames, expect=P.Reply)  # every reply is well formed
                    if isinstance(reply, P.HeartbeatReply) and reply.request_id == 0:
                        continue  # a liveness probe (no fuzz message carries id 0)
                    s.last_reply = time.monotonic()
                    if not s.pending:
                        problems.append(f"socket {s.name}: a reply nobody asked for: {reply!r}"[:300])
                        continue
                    expected, category = s.pending.popleft()
                    stats["replies"] += 1
                    if reply.request_id != expected:
                        problems.append(f"socket {s.name}: reply id {reply.request_id}, expected {expected}")
                    if isinstance(reply, P.ErrorReply):
                        codes[reply.code] += 1
                        if reply.code == P.ErrorCode.INTERNAL.value:
                            problems.append(f"internal error for a {category} message: {reply.message}")
                    else:
                        codes["ok:" + reply.KIND.value] += 1
                        if isinstance(reply, P.OpenSegmentReply):
                            s.segment_ids = [*s.segment_ids[-15:], reply.segment_id]
                        if isinstance(reply, (P.CommitReply, P.PushEpisodeReply)) and reply.length:
                            committed[reply.episode_id] = reply.length
    finally:
        for s in socks:
            s.sock.close(0)
    return {"stats": stats, "codes": codes, "problems": problems, "committed": committed}


def _actor_loop(endpoint: str, stop: threading.Event, receipts: list, errors: list) -> None:
    rng = np.random.default_rng(3)
    try:
        with ActorClient(endpoint, timeout=20, name="fuzz-time-actor") as actor:
            e = 0
            while not stop.is_set():
                n = int(rng.integers(1, 120))
                rows = episode_rows(1, e, n)
                if e % 2:
                    receipt = actor.push_episode(rows)
                else:
                    with actor.segment() as seg:
                        seg.extend({k: v[: n // 2] for k, v in rows.items()})
                        seg.extend({k: v[n // 2 :] for k, v in rows.items()})
                    receipt = seg.receipt
                receipts.append((e, n, receipt.episode_id))
                e += 1
    except Exception as exc:  # reported to the test, which fails on it
        errors.append(repr(exc))


def _no_pickle_in_file(path: Path) -> list[str]:
    """Every dataset holds plain numbers or fixed bytes, every attribute plain text or numbers."""
    problems = []

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset) and obj.dtype.kind not in "biufS":
            problems.append(f"dataset {name} has dtype {obj.dtype}")
        for key, value in obj.attrs.items():
            if isinstance(value, (bytes, np.bytes_)) and value[:1] == b"\x80":
                problems.append(f"attribute {name}/{key} looks pickled")
            elif not isinstance(value, (str, int, float, np.integer, np.floating, np.ndarray)):
                problems.append(f"attribute {name}/{key} is a {type(value).__name__}")

    with h5py.File(path, "r") as f:
        visit("/", f)
        f.visititems(visit)
    return problems


@pytest.mark.timeout(180)
def test_live_server_survives_fuzzing_and_holds_exactly_what_was_committed(tmp_path):
    limits = P.Limits(max_message_bytes=1 << 20, max_rows_per_segment=5000)
    config = server_config(tmp_path / "fuzz.h5", capacity=None, num_readers=1, limits=limits)
    server = ServerProcess(config, timeout=60)
    stop, receipts, actor_errors = threading.Event(), [], []
    actor = threading.Thread(target=_actor_loop, args=(server.endpoint, stop, receipts, actor_errors), daemon=True)
    try:
        actor.start()
        started = time.monotonic()
        result = _fuzz_server(server, limits, FUZZ_SECONDS)
        elapsed = time.monotonic() - started
        stop.set()
        actor.join(30)
        assert server.process.is_alive(), "the server died under fuzzing"
        with ActorClient(server.endpoint, timeout=10) as client, LearnerClient(server.endpoint, timeout=10) as learner:
            info = client.info()
            assert learner.sample(64)["step"].shape == (64,)
            assert learner.get_segments()
    finally:
        stop.set()
        exit_code = server.stop(30)
    stats, codes = result["stats"], result["codes"]
    print(f"\nlive fuzz: {stats['sent']} messages in {elapsed:.1f} s ({stats['sent'] / elapsed:.0f}/s), "
          f"{stats['replies']} replies; inputs {dict((k, v) for k, v in stats.items() if k not in ('sent', 'replies'))}; "
          f"replies {dict(codes)}; actor commits {len(receipts)}; fuzz commits {len(result['committed'])}")
    assert exit_code == 0
    assert not actor_errors, actor_errors
    assert not result["problems"], result["problems"][:10]
    assert stats["replies"] == stats["sent"]
    assert stats["sent"] >= 5_000, "too few messages to call this a fuzz test"
    assert len(receipts) >= 20
    refused = sum(v for k, v in codes.items() if not k.startswith("ok:"))
    assert refused >= stats["sent"] // 2 and info["errors"] >= 1  # most fuzz is refused, by error replies

    # The reopened file holds exactly the committed episodes: the actor's, whole, and the fuzzers'.
    expected = {eid: (1, e, n) for e, n, eid in receipts}
    with ReplayBuffer.load_from(config.path) as rb:
        segments = rb.get_segments()
        rows = rb.get_at(slice(None))
        total = rb.info()["total_episodes"]
    assert total == len(segments) == len(expected) + len(result["committed"])
    for eid, (start, n) in enumerate(segments):
        part = {k: v[start:start + n] for k, v in rows.items()}
        if eid in expected:
            assert (int(part["actor"][0]), int(part["episode"][0]), n) == expected[eid]
            assert not episode_problems(part, n)
        else:
            assert result["committed"].get(eid) == n, f"episode {eid} ({n} rows) was never committed"
    assert not _no_pickle_in_file(config.path)


# ------------------------------------------------------------------------------------ the limits

SMALL = P.Limits(max_message_bytes=64 * 1024, max_header_bytes=8192, max_frames=8, max_rows_per_message=500,
                 max_rows_per_segment=100, max_open_segments_per_client=3, max_clients=6)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    config = server_config(tmp_path_factory.mktemp("limits") / "limits.h5", num_readers=0, limits=SMALL)
    server = ServerProcess(config, timeout=60)
    try:
        yield server
    finally:
        assert server.stop(30) == 0


def _clients(server: ServerProcess) -> int:
    """Sessions the server holds, this probe's own included (many when it is refused)."""
    with RawClient(server.endpoint) as raw:
        reply = raw.request(P.encode(P.Info(raw.next_id())))
    return int(reply.stats["clients"]) if isinstance(reply, P.InfoReply) else 1_000


@pytest.fixture
def room(limited):
    """Wait until the clients of earlier tests are gone (the server drops a closed peer's session)."""
    assert wait_until(lambda: _clients(limited) <= 1, timeout=10)
    return limited


def _refused(reply: P.Reply, limit: str) -> None:
    exc = error_of(reply)
    assert isinstance(exc, LimitExceededError), repr(exc)
    assert re.search(rf"\b{limit}=", str(exc)), str(exc)


@pytest.mark.timeout(60)
def test_max_message_bytes(room):
    with RawClient(room.endpoint) as raw:
        rid = raw.next_id()
        big = 40_000  # two frames under the limit, together over it
        frames = [header("push_episode", rid, {"num_rows": 1, "timeout": 0.0}, [["a", "|u1", [big]], ["b", "|u1", [big]]]),
                  bytes(big), bytes(big)]
        _refused(raw.request(frames), "max_message_bytes")
        assert isinstance(raw.call(lambda r: P.Heartbeat(r)), P.HeartbeatReply)  # still served
    # A client configured to batch 1000 rows (80 kB) a message keeps within the server's limit instead.
    config = ClientConfig(endpoint=room.endpoint, timeout=10, batch_rows=1000, batch_bytes=1 << 20)
    with ActorClient(config=config) as actor:
        assert actor.rows_per_message * 80 <= 65536 - P.ROWS_MESSAGE_OVERHEAD
        assert actor.push_episode(episode_rows(1, 0, 90)).length == 90


@pytest.mark.timeout(60)
def test_an_actor_with_default_settings_streams_within_the_servers_limits(tmp_path):
    limits = P.Limits(max_message_bytes=16 * 1024, max_rows_per_message=100)
    server = ServerProcess(server_config(tmp_path / "small.h5", num_readers=0, limits=limits), timeout=60)
    try:
        with ActorClient(server.endpoint, timeout=10) as actor:
            assert actor.push_episode(episode_rows(1, 0, 1000)).length == 1000
    finally:
        assert server.stop(30) == 0


@pytest.mark.timeout(60)
def test_one_frame_over_max_message_bytes_gets_an_error_reply(room):
    with RawClient(room.endpoint, timeout=3) as raw:
        rid = raw.next_id()
        size = SMALL.max_message_bytes + 1
        frames = [header("push_episode", rid, {"num_rows": 1, "timeout": 0.0}, [["a", "|u1", [size]]]), bytes(size)]
        _refused(raw.request(frames), "max_message_bytes")


@pytest.mark.timeout(60)
def test_max_header_bytes_and_max_frames(room):
    with RawClient(room.endpoint) as raw:
        rid = raw.next_id()
        _refused(raw.request([header("info", rid, padding="x" * 9000)]), "max_header_bytes")
        rid = raw.next_id()
        arrays = [[f"a{i}", "|u1", [1]] for i in range(9)]
        _refused(raw.request([header("push_episode", rid, {"num_rows": 1, "timeout": 0.0}, arrays), *[b"\0"] * 9]), "max_frames")
        assert isinstance(raw.call(lambda r: P.Heartbeat(r)), P.HeartbeatReply)


@pytest.mark.timeout(60)
def test_max_rows_per_message(room):
    with RawClient(room.endpoint) as raw:
        _refused(raw.request(P.encode(P.Sample(raw.next_id(), 501, None))), "max_rows_per_message")
        _refused(raw.request(P.encode(P.Get(raw.next_id(), 0, np.zeros(501, np.int64)))), "max_rows_per_message")
        _refused(raw.request(P.encode(P.SampleSequences(raw.next_id(), 100, 6, None))), "max_rows_per_message")


@pytest.mark.timeout(60)
def test_max_open_segments_per_client(room):
    # batch_rows=1: every step leaves at once, so each segment is open on the server from its first step
    with ActorClient(config=ClientConfig(endpoint=room.endpoint, timeout=10, batch_rows=1)) as actor:
        segments = [actor.segment() for _ in range(SMALL.max_open_segments_per_client)]
        for seg in segments:
            seg.extend(episode_rows(1, 0, 1))
        with pytest.raises(LimitExceededError, match=r"max_open_segments_per_client=3"):
            actor.segment().extend(episode_rows(1, 0, 1))
        segments[0].extend(episode_rows(1, 1, 4))
        assert segments[0].commit().length == 5
        spare = actor.segment()
        spare.extend(episode_rows(1, 2, 1))  # a slot is free again
        spare.abort()
        for seg in segments[1:]:
            seg.abort()


@pytest.mark.timeout(60)
def test_max_rows_per_segment(room):
    with ActorClient(room.endpoint, timeout=10) as actor:
        before = actor.info()["total_episodes"]
        with pytest.raises(LimitExceededError, match=r"max_rows_per_segment=100"):
            actor.push_episode(episode_rows(2, 0, 101))
        seg = actor.segment()
        seg.extend(episode_rows(2, 1, 60))
        seg.extend({k: v[60:] for k, v in episode_rows(2, 1, 101).items()})
        with pytest.raises(LimitExceededError, match=r"max_rows_per_segment=100"):
            seg.commit()
        assert actor.push_episode(episode_rows(2, 2, 100)).length == 100  # at the limit is fine
        assert actor.info()["total_episodes"] == before + 1  # nothing of the refused ones


@pytest.mark.timeout(60)
def test_max_clients(room):
    clients: list[ActorClient] = []

    def full() -> bool:
        """Admit clients until the server holds max_clients of ours. A session of an earlier probe
        may still count at first, making the server refuse early; it goes once the server notices
        that probe gone, and then there is room for one more of ours."""
        try:
            clients.append(ActorClient(room.endpoint, timeout=10))
        except LimitExceededError as exc:
            assert re.search(r"\bmax_clients=6\b", str(exc)), str(exc)
        return len(clients) == SMALL.max_clients

    try:
        assert wait_until(full, timeout=20), f"only {len(clients)} clients admitted"
        # Every session now is one of ours, alive: whoever comes next is refused, whatever the timing.
        with pytest.raises(LimitExceededError, match=r"max_clients=6"):
            clients.append(ActorClient(room.endpoint, timeout=10))
        with RawClient(room.endpoint) as raw:
            _refused(raw.request(P.encode(P.Info(raw.next_id()))), "max_clients")
        assert clients[0].info()["clients"] == SMALL.max_clients  # the admitted ones are served
    finally:
        for client in clients:
            client.close()
    # Closed clients' sessions are dropped, so new ones are admitted again.
    assert wait_until(lambda: _admitted(room.endpoint), timeout=10)


def _admitted(endpoint: str) -> bool:
    try:
        ActorClient(endpoint, timeout=2).close()
    except (LimitExceededError, ServerUnavailableError):
        return False
    return True


# ------------------------------------------------------------------------------------ no pickle

_PICKLE_ON_THE_WIRE = re.compile(r"recv_pyobj|send_pyobj|pickle\.loads?|pickle\.dumps?|import pickle|cPickle|"
                                 r"cloudpickle|dill|allow_pickle\s*=\s*True|ExtType")


def test_no_pickle_anywhere_in_the_package():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _PICKLE_ON_THE_WIRE.search(line):
                hits.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not hits, hits
