"""Bad input gets an error reply naming the problem, and loses nothing.

Hand-made frames go through a bare DEALER: each test asserts the class the client would raise
and words of the message, then that the same socket and everyone else are still served and the
committed episodes are untouched. A fuzz test then fires thousands of random and mutated messages
at a live server between real commits, and checks the file holds exactly what was committed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
from service_helpers import DROP, RawClient, error_of, header, running_server, server_config

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient, Receipt
from h5replay.errors import (
    LimitExceededError,
    ProtocolError,
    ReadOnlyError,
    SegmentStateError,
    SpaceMismatchError,
    UnsupportedVersionError,
)
from h5replay.protocol import Limits
from h5replay.storage import BinarySpace, BoxSpace, DictSpace, ReplayBuffer, TextSpace

# One server (the module's `live` fixture) serves every test here: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("test_bad_input")

SPACE = DictSpace({
    "done": BinarySpace(),
    "note": TextSpace(4),  # stored as |S16: up to 4 characters of up to 4 UTF-8 bytes each
    "obs": BoxSpace(-1e6, 1e6, (4,), np.float32),
    "step": BoxSpace(0, 10**6, (), np.int32),
})
MAX_MESSAGE_BYTES = 64 * 1024
LIMITS = Limits(max_message_bytes=MAX_MESSAGE_BYTES, max_rows_per_segment=1000, max_open_segments_per_client=4)


def wire_rows(n: int, tag: int = 0) -> dict[str, np.ndarray]:
    """Rows as they travel: each leaf in its storage dtype. `tag` marks whose rows they are."""
    return {
        "done": np.arange(n) % 2 == 1,
        "note": np.array([f"t{tag % 100}".encode()] * n, dtype="S16"),
        "obs": np.full((n, 4), tag, np.float32) + np.arange(n, dtype=np.float32)[:, None],
        "step": np.arange(n, dtype=np.int32),
    }


def user_rows(n: int, tag: int = 0) -> dict[str, object]:
    rows = wire_rows(n, tag)
    return {**rows, "note": [f"t{tag % 100}"] * n}


def push(rows: dict[str, np.ndarray], request_id: int = 1, num_rows: int | None = None) -> list[bytes]:
    n = len(next(iter(rows.values()))) if num_rows is None else num_rows
    return [bytes(f) for f in P.encode(P.PushEpisode(request_id, n, rows))]


def append(segment_id: int, rows: dict[str, np.ndarray], request_id: int = 1) -> list[bytes]:
    return [bytes(f) for f in P.encode(P.Append(request_id, segment_id, len(rows["step"]), rows))]


def entries(rows: dict[str, np.ndarray]) -> list[list[object]]:
    return [[name, a.dtype.str, list(a.shape)] for name, a in rows.items()]


@dataclass
class Live:
    """The module's server, the episodes committed to it, and a learner to check them with."""

    endpoint: str
    read_endpoint: str
    committed: list[tuple[Receipt, dict[str, np.ndarray]]] = field(default_factory=list)

    def check_untouched(self) -> None:
        with LearnerClient(self.endpoint, timeout=5) as learner:
            assert learner.get_segments() == [(r.first_row_id, r.length) for r, _ in self.committed]
            for receipt, rows in self.committed:
                got = learner.get(np.arange(receipt.first_row_id, receipt.first_row_id + receipt.length))
                for key in ("done", "obs", "step"):
                    np.testing.assert_array_equal(got[key], rows[key])


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad-input") / "rb.h5"
    config = server_config(path, space=SPACE, capacity=10_000, limits=LIMITS)
    with running_server(config) as server:
        state = Live(server.endpoint, server.read_endpoint)
        with ActorClient(server.endpoint, timeout=10) as actor:
            for tag in range(3):
                state.committed.append((actor.push_episode(user_rows(5 + tag, tag)), wire_rows(5 + tag, tag)))
        yield state
        state.check_untouched()
        assert server.stop() == 0
    with ReplayBuffer.load_from(path) as rb:  # the file holds exactly what was committed
        assert rb.get_segments() == [(r.first_row_id, r.length) for r, _ in state.committed]


def refused(live: Live, frames: list[bytes], cls: type[Exception], *words: str, role: str | None = None,
            where: str = "writer", request_id: int | None = 1, timeout: float = 5.0) -> Exception:
    """Send `frames`; the reply must raise `cls` with each of `words`; then all is still served."""
    with RawClient(live.endpoint if where == "writer" else live.read_endpoint, timeout=timeout) as raw:
        if role is not None:
            assert isinstance(raw.call(lambda rid: P.Hello(rid, "raw", role)), P.HelloReply)
        reply = raw.request(frames)
        exc = error_of(reply)
        assert type(exc) is cls, f"{type(exc).__name__}: {exc}"
        for word in words:
            assert word in str(exc), f"{word!r} not in {str(exc)!r}"
        assert reply.request_id == request_id
        # the same socket is served next...
        follow_up = P.Info if where == "writer" else P.Episodes
        assert not isinstance(raw.call(follow_up), P.ErrorReply)
    live.check_untouched()  # ... so is everyone else, and committed data is intact
    return exc


# ------------------------------------------------------------------------------ malformed frames


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["writer", "reader"])
@pytest.mark.parametrize("frames, words", [
    ([b"\xc1 this is not msgpack"], ["not valid msgpack"]),
    ([b""], ["not valid msgpack"]),
    ([b"\x93\x01\x02"], ["not valid msgpack"]),  # a truncated array
    ([msgpack.packb([1, 2, 3])], ["must be a msgpack map", "list"]),
    ([msgpack.packb(7)], ["must be a msgpack map", "int"]),
    ([msgpack.packb({1: 2})], ["not valid msgpack"]),  # an int map key
], ids=["garbage", "empty", "truncated", "list", "int", "int-key"])
def test_garbage_header_frames(live, where, frames, words):
    refused(live, frames, ProtocolError, *words, where=where, request_id=None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["writer", "reader"])
def test_unknown_protocol_version(live, where):
    exc = refused(live, [header("info", version=99)], UnsupportedVersionError, "version 99", where=where)
    assert isinstance(exc, ProtocolError)
    refused(live, [header("info", version=DROP)], ProtocolError, "'version'", where=where)
    refused(live, [header("info", version="1")], ProtocolError, "'version'", where=where)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["writer", "reader"])
def test_unknown_kind(live, where):
    refused(live, [header("frobnicate")], ProtocolError, "unknown message kind", "frobnicate", where=where)
    refused(live, [header(7)], ProtocolError, "unknown message kind", where=where)


@pytest.mark.timeout(30)
def test_a_reply_sent_as_a_request(live):
    frames = P.encode(P.InfoReply(1, {"length": 0}))
    refused(live, frames, ProtocolError, "expected a Request")


@pytest.mark.timeout(30)
def test_wrong_header_keys_and_fields(live):
    refused(live, [header("info", extra="surplus")], ProtocolError, "header keys")
    refused(live, [header("info", fields=DROP)], ProtocolError, "header keys")
    refused(live, [header("commit", fields={})], ProtocolError, "needs fields", "segment_id")
    refused(live, [header("commit", fields={"segment_id": "3", "timeout": 0.0})], ProtocolError, "'segment_id'", "int")
    refused(live, [header("commit", fields={"segment_id": -1, "timeout": 0.0})], ProtocolError, "'segment_id'", ">= 0")
    refused(live, [header("sample", fields={"batch_size": 0, "seed": None})], ProtocolError, "'batch_size'")
    refused(live, [header("hello", fields={"client_name": "x", "role": "admin"})], ProtocolError, "'role'", "admin")
    refused(live, [header("info", request_id="7")], ProtocolError, "'id'", request_id=None)


@pytest.mark.timeout(30)
def test_wrong_frame_count(live):
    frames = push(wire_rows(2))
    refused(live, frames[:-1], ProtocolError, "declares 4 arrays", "3 array frames")
    refused(live, [*frames, b"surplus"], ProtocolError, "declares 4 arrays", "5 array frames")
    refused(live, [header("info"), b"stray"], ProtocolError, "declares 0 arrays", "1 array frames")


@pytest.mark.timeout(30)
def test_frame_size_does_not_match_the_declared_array(live):
    frames = push(wire_rows(2))  # frames: header, done, note, obs, step
    refused(live, [*frames[:3], frames[3][:-1], frames[4]], ProtocolError, "'obs'", "32 bytes", "31 bytes")
    refused(live, [*frames[:3], frames[3] + b"\0" * 16, frames[4]], ProtocolError, "'obs'", "48 bytes")


@pytest.mark.timeout(30)
def test_object_and_unknown_dtypes_never_travel(live):
    rows = wire_rows(2)
    for bad in ("|O", "<U4", "V8", "|S0", "float32", "i4"):
        arrays = entries(rows)
        arrays[2][1] = bad  # obs
        frames = [header("push_episode", fields={"num_rows": 2, "timeout": 0.0}, arrays=arrays),
                  *(a.tobytes() for a in rows.values())]
        refused(live, frames, ProtocolError, "'obs'", repr(bad), "wire does not carry")


@pytest.mark.timeout(30)
def test_wrong_leaf_keys(live):
    rows = wire_rows(2)
    rows["bogus"] = rows.pop("step")
    refused(live, push(rows), SpaceMismatchError, "missing ['step']", "unexpected ['bogus']")
    rows = wire_rows(2)
    del rows["note"]
    refused(live, push(rows), SpaceMismatchError, "missing ['note']")


@pytest.mark.timeout(30)
def test_wrong_dtypes_shapes_and_row_counts(live):
    rows = wire_rows(2)
    refused(live, push({**rows, "obs": rows["obs"].astype(np.float64)}), SpaceMismatchError, "'obs'", "float64", "float32")
    refused(live, push({**rows, "step": rows["step"].astype(">i4")}), SpaceMismatchError, "'step'", ">i4")
    refused(live, push({**rows, "obs": np.zeros((2, 5), np.float32)}), SpaceMismatchError, "'obs'", "(5,)", "(4,)")
    refused(live, push({**rows, "note": rows["note"].astype("S8")}), SpaceMismatchError, "'note'", "S8", "S16")
    refused(live, push({**rows, "done": np.zeros(3, bool)}, num_rows=2), ProtocolError, "'done'", "2 rows")
    refused(live, push(rows, num_rows=3), ProtocolError, "3 rows")


@pytest.mark.timeout(30)
def test_bad_values_for_text_and_bool_leaves(live):
    rows = wire_rows(2)
    too_long = np.array([b"ok", b"abcdefghij"], dtype="S16")  # 10 characters, the space allows 4
    refused(live, push({**rows, "note": too_long}), SpaceMismatchError, "'note'", "[1]", "10 characters", "0 to 4")
    not_utf8 = np.array([b"\xff\xfe", b"ok"], dtype="S16")
    refused(live, push({**rows, "note": not_utf8}), SpaceMismatchError, "'note'", "[0]", "UTF-8")
    bad_bool = np.frombuffer(b"\x00\x02", dtype=bool)
    refused(live, push({**rows, "done": bad_bool}), SpaceMismatchError, "'done'", "0 and 1")
    with ActorClient(live.endpoint, timeout=5) as actor:  # a client refuses before sending
        with pytest.raises(SpaceMismatchError, match="note"):
            actor.push_episode({**user_rows(2), "note": ["ok", "abcdefghij"]})


# ------------------------------------------------------------------------------- wrong sequences


@pytest.mark.timeout(30)
def test_unknown_segment_ids(live):
    refused(live, append(999, wire_rows(1)), SegmentStateError, "no open segment 999")
    refused(live, [header("commit", fields={"segment_id": 2**64 - 1, "timeout": 0.0})], SegmentStateError, str(2**64 - 1))
    refused(live, [header("abort", fields={"segment_id": 0})], SegmentStateError, "no open segment 0")


@pytest.mark.timeout(30)
def test_segments_belong_to_the_client_that_opened_them(live):
    with RawClient(live.endpoint) as owner:
        segment_id = owner.call(P.OpenSegment).segment_id
        refused(live, [header("commit", fields={"segment_id": segment_id, "timeout": 0.0})], SegmentStateError,
                f"segment {segment_id} belongs to another client")
        assert isinstance(owner.call(lambda rid: P.Abort(rid, segment_id)), P.AbortReply)


@pytest.mark.timeout(30)
def test_commit_twice(live):
    with RawClient(live.endpoint) as raw:
        segment_id = raw.call(P.OpenSegment).segment_id
        assert raw.call(lambda rid: P.Append(rid, segment_id, 2, wire_rows(2, 50))).segment_length == 2
        first = raw.call(lambda rid: P.Commit(rid, segment_id))
        assert first.length == 2
        live.committed.append((Receipt(first.episode_id, first.first_row_id, first.length), wire_rows(2, 50)))
        again = raw.call(lambda rid: P.Commit(rid, segment_id))
        exc = error_of(again)
        assert type(exc) is SegmentStateError and f"no open segment {segment_id}" in str(exc)
        assert "already committed" in str(exc)
    live.check_untouched()
    with ActorClient(live.endpoint, timeout=5) as actor:  # the client refuses without asking
        seg = actor.segment()
        seg.append({"done": True, "note": "x", "obs": np.zeros(4, np.float32), "step": 0})
        receipt = seg.commit()
        live.committed.append((receipt, {**wire_rows(1), "done": np.array([True]), "obs": np.zeros((1, 4), np.float32)}))
        with pytest.raises(SegmentStateError, match="committed"):
            seg.commit()
    live.check_untouched()


@pytest.mark.timeout(30)
def test_a_refused_append_leaves_the_segment_usable(live):
    good_a, good_b = wire_rows(2, 60), wire_rows(3, 61)
    with RawClient(live.endpoint) as raw:
        segment_id = raw.call(P.OpenSegment).segment_id
        raw.call(lambda rid: P.Append(rid, segment_id, 2, good_a))
        bad = {**good_b, "obs": good_b["obs"].astype(np.float64)}
        exc = error_of(raw.call(lambda rid: P.Append(rid, segment_id, 3, bad)))
        assert type(exc) is SpaceMismatchError
        assert raw.call(lambda rid: P.Append(rid, segment_id, 3, good_b)).segment_length == 5
        done = raw.call(lambda rid: P.Commit(rid, segment_id))
    expected = {k: np.concatenate([good_a[k], good_b[k]]) for k in good_a}
    live.committed.append((Receipt(done.episode_id, done.first_row_id, done.length), expected))
    live.check_untouched()


@pytest.mark.timeout(30)
def test_a_learner_may_not_write(live):
    refused(live, [header("open_segment")], ReadOnlyError, "learner", "connect as an actor", role="learner")
    refused(live, push(wire_rows(2)), ReadOnlyError, "learner", role="learner")
    refused(live, append(1, wire_rows(1)), ReadOnlyError, "learner", role="learner")


@pytest.mark.timeout(30)
def test_index_out_of_range(live):
    refused(live, P.encode(P.Get(1, 0, np.array([0, 10**6]))), IndexError, "index 1000000", "out of range",
            where="reader")
    refused(live, P.encode(P.Get(1, 0, np.array([-(10**6)]))), IndexError, "out of range", where="reader")
    with LearnerClient(live.endpoint, timeout=5) as learner:
        with pytest.raises(IndexError, match="out of range"):
            learner.get([0, 123_456])
        assert learner.get([0])["step"].tolist() == [0]


@pytest.mark.timeout(30)
def test_reads_on_the_writer_endpoint_are_refused_naming_the_read_endpoint(live):
    """While reader processes run, the writer serves writes, hello, info and heartbeats only
    (issue 14, case 9): a read sent there is refused with the endpoint to read from."""
    refused(live, P.encode(P.Get(1, 0, np.array([0]))), ProtocolError, "get is a read", live.read_endpoint)
    refused(live, P.encode(P.Sample(1, 4)), ProtocolError, "sample is a read", live.read_endpoint)


@pytest.mark.timeout(30)
def test_kinds_a_reader_does_not_serve(live):
    """A read endpoint serves reads, info and heartbeats (all from its view of the file); hello and
    writes get an error that names the writer endpoint's job."""
    refused(live, push(wire_rows(1)), ProtocolError, "push_episode is not a read request", "read endpoint",
            live.endpoint, where="reader")
    refused(live, [header("open_segment")], ProtocolError, "open_segment", "read endpoint", where="reader")
    with RawClient(live.read_endpoint) as raw:
        stats = raw.call(P.Info).stats
        assert stats["length"] == sum(r.length for r, _ in live.committed) and stats["replay_id"]


# ----------------------------------------------------------------------------------------- limits


@pytest.mark.timeout(30)
def test_a_message_over_max_message_bytes_is_refused(live):
    frames = push(wire_rows(2))
    padding = [b"x" * (MAX_MESSAGE_BYTES // 2)] * 3  # every frame is under the limit, the message is not
    refused(live, [frames[0], *padding], LimitExceededError, "max_message_bytes=65536")
    refused(live, [header("info")] * 1100, LimitExceededError, "max_frames=1024")


@pytest.mark.timeout(30)
def test_a_single_frame_over_max_message_bytes_gets_an_error_reply(live):
    rows = wire_rows(MAX_MESSAGE_BYTES // 16 + 100)  # the obs frame alone is over the limit
    assert len(push(rows)[3]) > MAX_MESSAGE_BYTES
    refused(live, push(rows), LimitExceededError, "max_message_bytes", timeout=2.0)


@pytest.mark.timeout(30)
def test_a_client_refuses_to_send_a_message_over_the_limits(live):
    """A connection checks each request against the limits from the hello before it sends it
    (however the actor batches rows, no single message may break them)."""
    with ActorClient(live.endpoint, timeout=5) as actor:
        before = actor.info()["rows_in"]
        rows = wire_rows(3000)  # 3000 rows of 37 bytes: over 64 KiB in one message
        with pytest.raises(LimitExceededError, match="max_message_bytes=65536"):
            actor.connection.request(lambda rid: P.PushEpisode(rid, 3000, rows))
        assert actor.info()["rows_in"] == before
    with LearnerClient(live.endpoint, timeout=5) as learner:  # a learner splits what is over the limits
        batch = learner.sample(5000)
        assert batch["step"].shape == (5000,) and set(batch["step"].tolist()) <= set(range(50))
    live.check_untouched()


@pytest.mark.timeout(30)
def test_a_read_over_max_message_bytes_is_split_by_the_learner(live):
    """A read whose reply would not fit one message is asked for in parts and put back together in
    order (issue 8, case 3); a reply over the limits that does reach the learner is refused with an
    error naming the limit, and its connection keeps working."""
    with LearnerClient(live.endpoint, timeout=5) as learner:
        got = learner.get(np.zeros(3000, np.int64))  # 3000 rows of 37 bytes: about 2 messages
        assert got["step"].tolist() == [0] * 3000
        held = sum(r.length for r, _ in live.committed)
        order = np.arange(3000) % held
        np.testing.assert_array_equal(learner.get(order[::-1])["obs"], learner.get(order)["obs"][::-1])
        reads = learner._reads
        assert reads is not None
        small = P.Limits(max_message_bytes=1024)
        reads.limits = small  # this connection now refuses what the server may send
        with pytest.raises(LimitExceededError, match="max_message_bytes=1024"):
            reads.request(lambda rid: P.Get(rid, 0, np.zeros(100, np.int64)))
        reads.limits = P.Limits(max_message_bytes=MAX_MESSAGE_BYTES)
        assert learner.get([0, 0])["step"].tolist() == [0, 0]
    live.check_untouched()


@pytest.mark.timeout(30)
def test_per_client_limits_name_the_limit(live):
    with RawClient(live.endpoint) as raw:
        opened = [raw.call(P.OpenSegment).segment_id for _ in range(4)]
        exc = error_of(raw.call(P.OpenSegment))
        assert type(exc) is LimitExceededError and "max_open_segments_per_client=4" in str(exc)
        rows = wire_rows(600, 70)
        assert raw.call(lambda rid: P.Append(rid, opened[0], 600, rows)).segment_length == 600
        exc = error_of(raw.call(lambda rid: P.Append(rid, opened[0], 600, rows)))
        assert type(exc) is LimitExceededError and "max_rows_per_segment=1000" in str(exc)
        done = raw.call(lambda rid: P.Commit(rid, opened[0]))  # the refused rows are not in it
        assert done.length == 600
        live.committed.append((Receipt(done.episode_id, done.first_row_id, done.length), rows))
        for segment_id in opened[1:]:
            assert isinstance(raw.call(lambda rid, sid=segment_id: P.Abort(rid, sid)), P.AbortReply)
    live.check_untouched()


# -------------------------------------------------------------------------------------------- fuzz

FUZZ_SEED = 20_240_601
FUZZ_MESSAGES = 3000
FUZZ_SECONDS = 20.0
KINDS = [k.value for k in P.Kind]


def random_value(rng: random.Random, depth: int = 0) -> object:
    """A random msgpack-able value: the kinds of thing a broken or hostile peer would send."""
    choice = rng.randrange(12 if depth < 3 else 8)
    if choice == 0:
        return None
    if choice == 1:
        return rng.random() < 0.5
    if choice == 2:
        return rng.choice([0, 1, -1, 7, 255, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 65_536, 65_537])
    if choice == 3:
        return rng.randrange(-100, 1000)
    if choice == 4:
        return rng.choice([0.5, -1.0, float("nan"), float("inf"), 1e308])
    if choice == 5:
        return rng.choice(["", "x", "actor", "learner", "append", "\u00e9\u65e5", "a" * 300, "|O", "<f4"])
    if choice == 6:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(12)))
    if choice == 7:
        return rng.choice(KINDS)
    if choice in (8, 9):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["version", "kind", "id", "fields", "arrays", "segment_id", "num_rows", "x", ""]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(5))}


class Fuzzer:
    """Valid requests of every kind, mutated at random; all bytes from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_id = 1

    def template(self) -> list[bytes]:
        rng = self.rng
        self.next_id += 1
        rid = self.next_id
        n = rng.randrange(1, 6)
        rows = wire_rows(n, 90 + rng.randrange(10))
        segment_id = rng.randrange(1, 24)
        request = rng.choice([
            lambda: P.Hello(rid, "fuzz", "actor" if rng.random() < 0.9 else "learner"),
            lambda: P.OpenSegment(rid),
            lambda: P.OpenSegment(rid),
            lambda: P.Append(rid, segment_id, n, rows),
            lambda: P.Append(rid, segment_id, n, rows),
            lambda: P.Append(rid, segment_id, n, rows),
            lambda: P.Commit(rid, segment_id),
            lambda: P.Abort(rid, segment_id),
            lambda: P.PushEpisode(rid, n, rows),
            lambda: P.Get(rid, 0, np.array([rng.randrange(-50, 50) for _ in range(n)], np.int64)),
            lambda: P.Sample(rid, rng.randrange(1, 64), rng.choice([None, rng.randrange(100)])),
            lambda: P.SampleSequences(rid, rng.randrange(1, 8), rng.randrange(1, 8), None),
            lambda: P.Episodes(rid),
            lambda: P.Info(rid),
            lambda: P.Heartbeat(rid),
        ])()
        return [bytes(f) for f in P.encode(request)]

    def message(self) -> tuple[str, list[bytes]]:
        rng = self.rng
        frames = self.template()
        op = rng.choice(["valid", "valid", "bitflip", "bitflip", "truncate", "drop", "duplicate", "swap",
                         "extend", "header", "header", "header", "arrays", "random_map", "random_bytes"])
        i = rng.randrange(len(frames))
        if op == "bitflip":
            frame = bytearray(frames[i])
            for _ in range(rng.randrange(1, 9)):
                if frame:
                    frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
            frames[i] = bytes(frame)
        elif op == "truncate":
            frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
        elif op == "drop" and len(frames) > 1:
            del frames[i]
        elif op == "duplicate":
            frames.insert(i, frames[i])
        elif op == "swap":
            rng.shuffle(frames)
        elif op == "extend":
            frames[i] += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20)))
        elif op == "header":
            head = msgpack.unpackb(frames[0])
            key = rng.choice([*head, "fields", "fields", "surplus"])
            if key == "fields" and head["fields"] and rng.random() < 0.7:
                name = rng.choice(list(head["fields"]))
                if rng.random() < 0.2:
                    del head["fields"][name]
                else:
                    head["fields"][name] = random_value(rng)
            elif rng.random() < 0.2:
                head.pop(key, None)
            else:
                head[key] = random_value(rng)
            frames[0] = msgpack.packb(head)
        elif op == "arrays":
            head = msgpack.unpackb(frames[0])
            if head["arrays"]:
                entry = rng.choice(head["arrays"])
                slot = rng.randrange(3)
                entry[slot] = (rng.choice(["|O", "<f8", ">i4", "|b1", "|S0", "|S16", "|S99999999999", "<U4", "V8"])
                               if slot == 1 and rng.random() < 0.7 else random_value(rng))
            frames[0] = msgpack.packb(head)
        elif op == "random_map":
            frames[0] = msgpack.packb(random_value(rng, depth=2) if rng.random() < 0.2 else {
                "version": 1, "kind": rng.choice(KINDS), "id": random_value(rng),
                "fields": random_value(rng), "arrays": random_value(rng)})
        elif op == "random_bytes":
            frames = [bytes(rng.randrange(256) for _ in range(rng.randrange(40)))]
        if P.peek_request_id(frames) == 0:  # its reply would look like the server's liveness probe
            return self.message()
        return op, frames


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_fuzzed_messages_between_real_commits(tmp_path):
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=100_000, limits=Limits(max_message_bytes=1 << 20))
    fuzzer = Fuzzer(FUZZ_SEED)
    actor_receipts: list[tuple[Receipt, dict[str, np.ndarray]]] = []
    fuzz_commits: list[tuple[int, int, int]] = []  # what the fuzzer itself managed to commit
    codes: dict[str, int] = {}
    internal: list[str] = []
    sent = 0
    with running_server(config) as server:
        with ActorClient(server.endpoint, timeout=10) as actor, RawClient(server.endpoint, timeout=10) as raw, \
                RawClient(server.read_endpoint, timeout=10) as raw_reads:
            deadline = time.monotonic() + FUZZ_SECONDS
            while sent < FUZZ_MESSAGES and time.monotonic() < deadline:
                op, frames = fuzzer.message()
                to = raw_reads if fuzzer.rng.random() < 0.2 else raw  # a fifth go to the reader process
                reply = to.request(frames)  # exactly one reply to every message, in time
                sent += 1
                if isinstance(reply, P.ErrorReply):
                    codes[reply.code] = codes.get(reply.code, 0) + 1
                    if reply.code == P.ErrorCode.INTERNAL.value:
                        internal.append(f"{op}: {reply.message}")
                elif isinstance(reply, (P.CommitReply, P.PushEpisodeReply)) and reply.length:
                    fuzz_commits.append((reply.episode_id, reply.first_row_id, reply.length))
                if sent % 100 == 0:  # a well-behaved actor keeps committing all along
                    tag = sent // 100
                    rows = user_rows(1 + tag % 7, tag)
                    if tag % 2:
                        receipt = actor.push_episode(rows)
                    else:
                        with actor.segment() as seg:
                            seg.extend(rows)
                        receipt = seg.receipt
                    actor_receipts.append((receipt, wire_rows(1 + tag % 7, tag)))
            # still serving: a fresh client works, and the fuzzing socket is still answered
            assert isinstance(raw.call(P.Info), P.InfoReply)
            assert isinstance(raw_reads.call(P.Episodes), P.EpisodesReply)
            with LearnerClient(server.endpoint, timeout=5) as learner:
                last, rows = actor_receipts[-1]
                got = learner.get(np.arange(last.first_row_id, last.first_row_id + last.length))
                np.testing.assert_array_equal(got["obs"], rows["obs"])
        assert server.stop() == 0

    assert sent >= 1000, f"only {sent} messages in {FUZZ_SECONDS} s"
    assert internal == [], f"unhandled server exceptions: {internal[:5]}"
    for code in ("bad_request", "space_mismatch", "unknown_segment"):  # the fuzzer reached deep
        assert codes.get(code, 0) > 0, codes

    with ReplayBuffer.load_from(config.path) as rb:
        segments = rb.get_segments()
        assert len(segments) == len(actor_receipts) + len(fuzz_commits)  # nothing more, nothing less
        for receipt, rows in actor_receipts:
            assert segments[receipt.episode_id] == (receipt.first_row_id, receipt.length)
            got = rb.get_rows(np.arange(receipt.first_row_id, receipt.first_row_id + receipt.length), decode=False)
            for key in rows:
                np.testing.assert_array_equal(got[key], rows[key])
        for episode_id, start, length in fuzz_commits:
            assert segments[episode_id] == (start, length)
        assert sum(n for _, n in segments) == len(rb)  # no row outside a committed episode
