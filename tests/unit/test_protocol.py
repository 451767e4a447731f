"""The wire protocol: every kind encodes and decodes, every malformed message is refused by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
import pytest

from h5replay import protocol as P
from h5replay.errors import (
    AccessDeniedError,
    ClosedError,
    ConfigError,
    DiskFullError,
    EvictedError,
    LimitExceededError,
    NotEnoughDataError,
    ProtocolError,
    RateLimitedError,
    ReadOnlyError,
    RemoteError,
    SegmentStateError,
    ServerUnavailableError,
    SpaceMismatchError,
    StorageError,
    UnsupportedVersionError,
)
from h5replay.spaces import BoxSpace, DictSpace

ROWS: dict[str, np.ndarray] = {
    "obs/image": np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3),
    "obs/vec": np.ones((2, 7), np.float32),
    "done": np.array([False, True]),
    "note": np.array([b"hi", b"\xc3\xa9t\xc3\xa9"], dtype="S16"),
}
SEQ_ROWS: dict[str, np.ndarray] = {"obs": np.zeros((3, 4, 2), np.float64), "reward": np.ones((3, 4), "<f4")}

EXAMPLES: list[P.Message] = [
    P.Hello(1, "actor-0", "actor"),
    P.OpenSegment(2),
    P.Append(3, 7, 2, ROWS),
    P.Commit(4, 7),
    P.Abort(5, 7),
    P.PushEpisode(6, 2, ROWS),
    P.Append(3, 7, 2, ROWS, np.array([0.5, np.nan])),
    P.Commit(4, 7, 2.5),
    P.PushEpisode(6, 2, ROWS, 10.0, np.array([1.0, 2.0])),
    P.PushEpisodes(6, 2, np.array([1, 1]), np.arange(32, dtype=np.uint8).reshape(2, 16), ROWS, 5.0),
    P.UpdatePriorities(13, np.array([4, 2**40], np.int64), np.array([0.0, 7.5])),
    P.Sample(8, 32, None, 0, 0.25),
    P.Get(7, 0, np.array([5, 0, 5, -1], np.int64)),
    P.GetRows(7, 3, np.array([2**40, 0, 5], np.int64)),
    P.Sample(8, 32, None),
    P.Sample(8, 32, 2**64 - 1, 17),
    P.SampleSequences(9, 3, 4, 123),
    P.SampleSequences(9, 3, 4, None, 5, False),
    P.SampleSequences(9, 3, 4, None, 5, True, 0.5, "replay", True),
    P.SampleTransitions(9, 4, 3, 0.5, 7, 2, 0.0, "replay"),
    P.PushEpisode(13, 1, {"obs": np.zeros((1, 3), np.float32)}, finals={"obs": np.ones((1, 3), np.float32)}),
    P.Commit(14, 3, 0.0, None, {"obs": np.ones((1, 3), np.float32)}),
    P.Episodes(10),
    P.Episodes(10, 2**63),
    P.Episodes(10, 3, 4096, 2048),
    P.Info(11),
    P.Heartbeat(12),
    P.Cancel(14, np.array([3, 2**64 - 1], np.uint64)),
    P.Cancel(14, np.zeros(0, np.uint64)),
    P.HelloReply(1, DictSpace({"x": BoxSpace(0, 1, (2,))}).to_json(), None, 0, 0, "0.1.0", 1, P.Limits(),
                 "tcp://127.0.0.1:5556", "a" * 32, "b" * 32),
    P.HelloReply(1, {"type": "text", "max_length": 3, "min_length": 0}, 1000, 10, 2, "0.1.0", 1,
                 P.Limits(max_frames=8), "ipc:///tmp/x.read", "", ""),
    P.OpenSegmentReply(2, 0),
    P.AppendReply(3, 64),
    P.CommitReply(4, 9, 100, 64),
    P.CommitReply(4, None, None, 0),
    P.AbortReply(5),
    P.PushEpisodeReply(6, 10, 164, 2),
    P.PushEpisodesReply(6, np.array([[10, 164, 1], [11, 165, 1]])),
    P.GetReply(7, 4, 0, 100, 164, np.array([101, 163], np.int64), ROWS),
    P.GetRowsReply(7, 4, 1, 100, 164, 2, ROWS),
    P.SampleReply(8, 4, 0, 0, 5, np.array([3, 1], np.int64), np.array([0, 2**64 - 1], np.uint64),
                  np.array([0.2, 0.2]), ROWS),
    P.SampleSequencesReply(9, 1, 0, 0, 12, np.array([0, 4, 8], np.int64), np.array([0, 1, 2], np.uint64),
                           np.full(3, 1 / 3), SEQ_ROWS),
    P.SampleSequencesReply(9, 1, 0, 0, 12, np.array([0, 4], np.int64), np.zeros(2, np.uint64), np.ones(2), {}),
    P.SampleSequencesReply(9, 1, 0, 0, 12, np.array([0, 4, 8], np.int64), np.array([0, 1, 2], np.uint64),
                           np.full(3, 1 / 3), SEQ_ROWS, np.array([1, 2, 1], np.int64)),
    P.SampleTransitionsReply(9, 1, 0, 0, 12, np.array([0, 4], np.int64), np.zeros(2, np.uint64), np.ones(2),
                             np.array([1, 0], np.uint8), {"obs": np.zeros((2, 3), np.float32),
                                                          "next/obs": np.ones((2, 3), np.float32),
                                                          "discount": np.ones(2, np.float32)}),
    P.EpisodesReply(10, 2, 0, 0, 8, np.array([[0, 0, 5], [1, 5, 3]], np.int64)),
    P.EpisodesReply(10, 0, 0, 0, 0, np.zeros((0, 3), np.int64)),
    P.InfoReply(11, {"length": 5, "capacity": None, "uptime": 1.5, "file": "x.h5", "swmr": True}),
    P.HeartbeatReply(12),
    P.UpdatePrioritiesReply(13, 1, 42),
    P.CancelReply(14, np.array([3], np.uint64)),
    P.HelloReply(1, {"type": "text", "max_length": 3, "min_length": 0}, 1000, 10, 2, "0.1.0", 1, P.Limits(),
                 "", "", "", {"sampler": "prioritized", "writer_samples": False, "priority_exponent": 0.6}),
    P.ErrorReply(13, "space_mismatch", "field 'obs' arrived as float64 but the space stores float32"),
    P.ErrorReply(None, "bad_request", "header frame is not valid msgpack"),
]


def assert_same(a: P.Message, b: P.Message) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("arrays", "finals"):
            assert list(x) == list(y)
            for k in x:
                assert_same_array(np.asarray(x[k]), y[k])
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert_same_array(np.asarray(x), y)
        else:
            assert x == y and type(x) is type(y), f.name


def assert_same_array(x: np.ndarray, y: np.ndarray) -> None:
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def frames_of(msg: P.Message) -> list[bytes]:
    return [bytes(f) for f in P.encode(msg)]


def header_of(msg: P.Message) -> dict[str, Any]:
    header: dict[str, Any] = msgpack.unpackb(frames_of(msg)[0])
    return header


def with_header(msg: P.Message, **changes: Any) -> list[bytes]:
    """The frames of `msg` with its header edited (a value of DROP deletes the key)."""
    frames = frames_of(msg)
    header = msgpack.unpackb(frames[0])
    for key, value in changes.items():
        if value is DROP:
            del header[key]
        else:
            header[key] = value
    return [msgpack.packb(header), *frames[1:]]


DROP = object()
APPEND = P.Append(3, 7, 2, {"obs": np.zeros((2, 3), np.float32)})


def refused(frames: list[Any], *words: str, limits: P.Limits = P.DEFAULT_LIMITS,
            cls: type[Exception] = ProtocolError) -> None:
    with pytest.raises(cls) as info:
        P.decode(frames, limits)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ----------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips(msg: P.Message) -> None:
    frames = P.encode(msg)
    assert isinstance(frames[0], bytes)
    assert all(isinstance(f, memoryview) for f in frames[1:])
    out = P.decode(frames)
    assert_same(msg, out)
    assert_same(out, P.decode(frames_of(out)))  # bytes frames decode the same


def test_every_kind_has_a_request_and_a_reply_class() -> None:
    reply_classes = [c for c in P.Reply.__subclasses__() if c is not P.ReadReply] + P.ReadReply.__subclasses__()
    requests = {c.KIND for c in P.Request.__subclasses__()}
    replies = {c.KIND for c in reply_classes if c is not P.ErrorReply}
    assert requests == replies == set(P.Kind) - {P.Kind.REPLY}
    assert {type(m) for m in EXAMPLES} == set(P.Request.__subclasses__()) | set(reply_classes)


def test_header_layout_is_as_documented() -> None:
    assert header_of(APPEND) == {
        "version": P.PROTOCOL_VERSION, "kind": "append", "id": 3,
        "fields": {"segment_id": 7, "num_rows": 2}, "arrays": [["obs", "<f4", [2, 3]]],
    }
    assert header_of(P.CommitReply(4, 1, 2, 3))["for"] == "commit"
    assert header_of(P.ErrorReply(4, "busy", "later")) == {
        "version": P.PROTOCOL_VERSION, "kind": "reply", "id": 4, "ok": False,
        "fields": {"code": "busy", "message": "later"}, "arrays": [],
    }


def test_arrays_travel_without_copies() -> None:
    image = np.zeros((64, 84, 84, 3), np.uint8)
    frames = P.encode(P.Append(1, 0, 64, {"image": image}))
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), image)
    out = P.decode(frames)
    assert isinstance(out, P.Append)
    assert np.shares_memory(out.arrays["image"], image)
    assert not out.arrays["image"].flags.writeable


def test_non_contiguous_arrays_are_made_contiguous() -> None:
    arr = np.arange(24, dtype=np.int32).reshape(4, 6)[:, ::2]
    out = P.decode(P.encode(P.Append(1, 0, 4, {"x": arr})))
    assert isinstance(out, P.Append)
    np.testing.assert_array_equal(out.arrays["x"], arr)


def test_frames_may_be_any_buffer() -> None:
    frames = frames_of(APPEND)
    assert_same(APPEND, P.decode([bytearray(f) for f in frames]))
    assert_same(APPEND, P.decode([memoryview(f) for f in frames]))
    assert_same(APPEND, P.decode([frames[0], np.zeros((2, 3), np.float32)]))


def test_index_fields_are_int64_and_lists_are_accepted() -> None:
    out = P.decode(P.encode(P.Get(1, 0, [3, 1, 2])))  # type: ignore[arg-type]
    assert isinstance(out, P.Get) and out.indices.dtype == np.int64
    out = P.decode(P.encode(P.Get(1, 0, np.array([], np.uint8))))
    assert isinstance(out, P.Get) and out.indices.dtype == np.int64 and out.indices.shape == (0,)


def test_numpy_scalars_in_fields_are_packed_as_python_values() -> None:
    out = P.decode(P.encode(P.Commit(np.int64(4), np.uint32(7))))  # type: ignore[arg-type]
    assert_same(out, P.Commit(4, 7))


def test_expect_refuses_the_other_direction() -> None:
    reply_frames = P.encode(P.CommitReply(1, 0, 0, 0))
    with pytest.raises(ProtocolError, match="expected a Request"):
        P.decode(reply_frames, expect=P.Request)
    assert isinstance(P.decode(P.encode(P.Info(1)), expect=P.Request), P.Info)
    with pytest.raises(ProtocolError, match="expected a Reply"):
        P.decode(P.encode(P.Info(1)), expect=P.Reply)


# ---------------------------------------------------------------------------------------- refusals


def test_empty_message() -> None:
    refused([], "empty message")


@pytest.mark.parametrize("frame", [b"", b"\xc1", b"\x92\x01", b"\x81\xa1a\x01\x00", b"\xd9\x02\xff\xfe"])
def test_header_not_msgpack(frame: bytes) -> None:
    refused([frame], "not valid msgpack")


@pytest.mark.parametrize("obj", [[1, 2], 5, "hello", None, b"raw"])
def test_header_not_a_map(obj: Any) -> None:
    refused([msgpack.packb(obj)], "must be a msgpack map")


def test_header_with_non_string_keys() -> None:
    refused([msgpack.packb({1: 2})], "not valid msgpack")


def test_non_buffer_frame() -> None:
    refused([12345], "frame 0 is a int, not a contiguous buffer")
    refused([frames_of(APPEND)[0], np.zeros((4, 6), np.float32)[:, ::2]], "frame 1")


def test_unknown_version() -> None:
    refused(with_header(APPEND, version=1), "protocol version 1", "speaks 3", cls=UnsupportedVersionError)
    refused(with_header(APPEND, version=True), "'version'")
    refused(with_header(APPEND, version=DROP), "'version'")


def test_unknown_kind() -> None:
    refused(with_header(APPEND, kind="explode"), "unknown message kind", "explode")
    refused(with_header(APPEND, kind=7), "unknown message kind")


def test_reply_header_checks() -> None:
    reply = P.CommitReply(1, 2, 3, 4)
    refused(with_header(reply, ok=1), "bool 'ok'")
    refused(with_header(reply, **{"for": "teleport"}), "'for' must name a request kind", "teleport")
    refused(with_header(reply, **{"for": DROP}), "'for'")
    refused(with_header(P.ErrorReply(1, "busy", "x"), **{"for": "commit"}), "header keys")


def test_wrong_header_keys() -> None:
    refused(with_header(APPEND, extra=1), "header keys", "extra")
    refused(with_header(APPEND, fields=DROP), "header keys")


@pytest.mark.parametrize("request_id", [True, -1, "7", 1.0, None, [1]])
def test_request_id_type(request_id: Any) -> None:
    refused(with_header(APPEND, id=request_id), "field 'id' must be an int")


def test_error_reply_may_have_no_request_id() -> None:
    out = P.decode(P.encode(P.ErrorReply(None, "bad_request", "x")))
    assert isinstance(out, P.ErrorReply) and out.request_id is None


def test_missing_or_extra_fields() -> None:
    refused(with_header(APPEND, fields={"segment_id": 7}), "needs fields ['num_rows', 'segment_id']")
    refused(with_header(APPEND, fields={"segment_id": 7, "num_rows": 2, "x": 1}), "'x'")
    refused(with_header(APPEND, fields=[7, 2]), "needs fields")


@pytest.mark.parametrize("value", [True, -1, 1.5, "7", None, [7]])
def test_int_fields_are_strict(value: Any) -> None:
    refused(with_header(APPEND, fields={"segment_id": value, "num_rows": 2}), "field 'segment_id' must be an int")


def test_text_and_enum_fields() -> None:
    hello = P.Hello(1, "a", "actor")
    refused(with_header(hello, fields={"client_name": "a", "role": "admin"}), "'role' must be one of", "admin")
    refused(with_header(hello, fields={"client_name": b"a", "role": "actor"}), "'client_name' must be a string")
    refused(with_header(hello, fields={"client_name": "", "role": "actor"}), "1 to 256 characters")
    refused(with_header(hello, fields={"client_name": "x" * 257, "role": "actor"}), "got 257")


def test_optional_fields_are_explicit() -> None:
    refused(with_header(P.Sample(1, 4, None), fields={"batch_size": 4}), "needs fields")
    refused(with_header(P.Sample(1, 4, None), fields={"batch_size": 4, "seed": -3, "min_seq": 0, "timeout": 0.0}), "'seed'")
    refused(with_header(P.Sample(1, 4, None), fields={"batch_size": 0, "seed": None, "min_seq": 0, "timeout": 0.0}),
            "'batch_size' must be >= 1")
    for timeout in (-1.0, float("nan"), float("inf"), 86_401, "1", None, True):
        refused(with_header(P.Sample(1, 4, None), fields={"batch_size": 4, "seed": None, "min_seq": 0,
                                                          "timeout": timeout}), "'timeout' must be seconds")
    refused(with_header(P.Sample(1, 4, None), fields={"batch_size": 1, "seed": None, "min_seq": -1, "timeout": 0.0}), "'min_seq'")
    refused(with_header(P.SampleSequences(1, 4, 2), fields={"batch_size": 4, "length": 2, "seed": None,
                                                            "min_seq": 0, "with_rows": 1, "timeout": 0.0}), "'with_rows' must be a bool")
    refused(with_header(P.SampleSequences(1, 4, 2), fields={"batch_size": 4, "length": 0, "seed": None,
                                                            "min_seq": 0, "with_rows": True, "timeout": 0.0}),
            "'length' must be >= 1")


def test_map_fields_are_checked() -> None:
    reply = P.InfoReply(1, {"a": 1})
    refused(with_header(reply, fields={"stats": {"a": [1]}}), "'stats' must map names to scalars")
    refused(with_header(reply, fields={"stats": {"a": b"x"}}), "'stats'")
    hello = P.HelloReply(1, {}, None, 0, 0, "v", 1, P.Limits(), "tcp://127.0.0.1:5556", "", "")
    fields = header_of(hello)["fields"]
    refused(with_header(hello, fields={**fields, "space": {"type": b"box"}}), "'space' must be a JSON-like map")
    refused(with_header(hello, fields={**fields, "limits": {"max_frames": 0}}), "limit 'max_frames'")
    refused(with_header(hello, fields={**fields, "limits": [1]}), "'limits' must be a map")


def test_frame_count_must_match_the_arrays() -> None:
    frames = frames_of(APPEND)
    refused(frames[:1], "declares 1 arrays but the message has 0 array frames")
    refused([*frames, b"extra"], "declares 1 arrays but the message has 2 array frames")
    refused(with_header(APPEND, arrays="obs"), "declares str")


def test_frame_size_must_match_dtype_and_shape() -> None:
    frames = frames_of(APPEND)
    refused([frames[0], frames[1][:-1]], "'obs' declares <f4 (2, 3) = 24 bytes but its frame has 23 bytes")
    refused([frames[0], frames[1] + b"\x00"], "its frame has 25 bytes")


@pytest.mark.parametrize("dtype", ["|O", "O", "<U4", "|V8", "i4,f8", "<c8", "<M8[ns]", "|S0", "S4", "<f16", 3, None])
def test_dtypes_the_wire_does_not_carry(dtype: Any) -> None:
    refused(with_header(APPEND, arrays=[["obs", dtype, [2, 3]]]), "array 'obs' has dtype", "does not carry")


def test_object_arrays_are_refused_on_encode() -> None:
    with pytest.raises(ProtocolError, match="never objects"):
        P.encode(P.Append(1, 0, 2, {"x": np.array(["a", None], dtype=object)}))
    with pytest.raises(ProtocolError, match="cannot travel"):
        P.encode(P.Append(1, 0, 2, {"x": np.array(["ab", "c"])}))  # unicode: text travels as S{k}


@pytest.mark.parametrize("shape", [[2, -3], [2, True], "23", [2.0, 3], [1] * 33, None])
def test_bad_shapes(shape: Any) -> None:
    refused(with_header(APPEND, arrays=[["obs", "<f4", shape]]), "array 'obs' has shape")


def test_absurd_shapes() -> None:
    refused(with_header(APPEND, arrays=[["obs", "<f4", [0, 2**40, 2**40]]]), "absurd shape")
    refused(with_header(APPEND, arrays=[["obs", "<f4", [2, 2**62]]]), "declares <f4 (2, 4611686018427387904)")


def test_array_entries() -> None:
    refused(with_header(APPEND, arrays=[["obs", "<f4"]]), "[name, dtype, shape]")
    refused(with_header(APPEND, arrays=[["", "<f4", [2, 3]]]), "array name must be a non-empty string")
    refused(with_header(APPEND, arrays=[[b"obs", "<f4", [2, 3]]]), "array name")


def test_duplicate_leaf_names() -> None:
    frames = frames_of(APPEND)
    refused(with_header(APPEND, arrays=[["obs", "<f4", [2, 3]]] * 2) + frames[1:], "must be unique")


def test_leaf_arrays_need_the_message_rows() -> None:
    refused(frames_of(P.Append(1, 0, 3, {"obs": np.zeros((2, 3), np.float32)})),
            "'obs' has shape (2, 3) but the message has 3 rows")
    refused(frames_of(P.PushEpisode(1, 2, {"obs": np.array(1.0, np.float32)})), "has shape ()")
    info = (np.arange(3), np.zeros(3, np.uint64), np.ones(3))
    refused(frames_of(P.SampleReply(1, 0, 0, 0, 9, *info, {"x": np.zeros(2)})), "has 3 rows")
    refused(frames_of(P.SampleReply(1, 0, 0, 0, 9, np.arange(3), np.zeros(2, np.uint64), np.ones(3), {})),
            "one entry per sample")
    info = (np.arange(2), np.zeros(2, np.uint64), np.ones(2))
    refused(frames_of(P.SampleSequencesReply(1, 0, 0, 0, 9, *info, {"x": np.zeros(2)})), "(batch, length, ...)")
    refused(frames_of(P.SampleSequencesReply(1, 0, 0, 0, 9, *info, {"x": np.zeros((2, 3)), "y": np.zeros((2, 4))})),
            "(batch, length, ...)")
    for valid, says in [(np.ones(3, np.int64), "one per window"), (np.array([1, 0]), "must be >= 1"),
                        (np.array([1, 4]), "at most the windows' length 3")]:
        refused(frames_of(P.SampleSequencesReply(1, 0, 0, 0, 9, *info, {"x": np.zeros((2, 3))}, valid)), says)


def test_array_fields_are_checked() -> None:
    get = P.Get(1, 0, np.arange(3))
    refused(with_header(get, arrays=[["indices", "<f8", [3]]]), "'indices' must be int64")
    refused(with_header(get, arrays=[["indices", "<i4", [6]]]), "'indices' must be int64")
    refused(with_header(get, arrays=[["indices", "<i8", [3, 1]]]), "'indices' must be int64 of shape (n,)")
    refused(with_header(get, arrays=[["idx", "<i8", [3]]]), "starts with arrays ['indices']")
    episodes = P.EpisodesReply(1, 0, 0, 0, 0, np.zeros((2, 2), np.int64))
    refused(frames_of(episodes), "'episodes' must be int64 of shape (n, 3), got <i8 (2, 2)")
    sample = P.SampleReply(1, 0, 0, 0, 9, np.arange(1), np.zeros(1, np.uint64), np.ones(1), {})
    refused(with_header(sample, arrays=[["row_ids", "<i8", [1]], ["episode_ids", "<i8", [1]],
                                        ["probabilities", "<f8", [1]]]), "'episode_ids' must be uint64")
    refused(P.encode(P.GetRows(1, 0, np.array([-1]))), "row ids must be >= 0")
    refused(P.encode(P.SampleSequences(1, 2, 2**64 - 1, None, 0, False)), "max_rows_per_segment",
            cls=LimitExceededError)
    refused(with_header(P.Info(1), arrays=[["x", "<i8", [1]]]) + [bytes(8)], "carries no leaf arrays")
    with pytest.raises(ProtocolError, match="'indices' must be a 1-d int64 array"):
        P.encode(P.Get(1, 0, np.array([1.5])))


def test_big_endian_index_arrays_become_native() -> None:
    get = P.Get(1, 0, np.arange(3))
    out = P.decode(with_header(get, arrays=[["indices", ">i8", [3]]])[:1] + [np.arange(3, dtype=">i8").tobytes()])
    assert isinstance(out, P.Get)
    assert out.indices.dtype == np.int64 and out.indices.dtype.isnative and out.indices.tolist() == [0, 1, 2]


# ------------------------------------------------------------------------------------------ limits


def test_too_many_frames() -> None:
    refused([b""] * 9, "9 frames", "max_frames=8", limits=P.Limits(max_frames=8), cls=LimitExceededError)


def test_header_too_large() -> None:
    frames = frames_of(P.Hello(1, "x" * 200, "actor"))
    refused(frames, "max_header_bytes=100", limits=P.Limits(max_header_bytes=100), cls=LimitExceededError)


def test_message_too_large() -> None:
    frames = frames_of(P.Append(1, 0, 10, {"x": np.zeros((10, 100), np.uint8)}))
    refused(frames, "1000", "max_message_bytes=1000", limits=P.Limits(max_message_bytes=1000), cls=LimitExceededError)


def test_too_many_rows() -> None:
    small = P.Limits(max_rows_per_message=4)
    refused(frames_of(P.Append(1, 0, 5, {"x": np.zeros(5)})), "max_rows_per_message=4", limits=small,
            cls=LimitExceededError)
    refused(frames_of(P.Sample(1, 5)), "'batch_size' is 5 rows", limits=small, cls=LimitExceededError)
    refused(frames_of(P.Get(1, 0, np.arange(5))), "indices is 5 rows", limits=small, cls=LimitExceededError)
    refused(frames_of(P.SampleSequences(1, 2, 3)), "batch_size * length is 6 rows", limits=small,
            cls=LimitExceededError)
    refused(frames_of(P.SampleSequencesReply(1, 0, 0, 0, 9, np.arange(2), np.zeros(2, np.uint64), np.ones(2),
                                             {"x": np.zeros((2, 3))})), "is 6 rows",
            limits=small, cls=LimitExceededError)


def test_encode_checks_limits_when_given() -> None:
    msg = P.Append(1, 0, 10, {"x": np.zeros((10, 100), np.uint8)})
    with pytest.raises(LimitExceededError, match="max_message_bytes=1000"):
        P.encode(msg, P.Limits(max_message_bytes=1000))
    with pytest.raises(LimitExceededError, match="max_rows_per_message=5"):
        P.encode(msg, P.Limits(max_rows_per_message=5))
    with pytest.raises(ProtocolError, match="has 9 rows"):
        P.encode(P.Append(1, 0, 9, msg.arrays), P.Limits())
    P.encode(msg)  # without limits nothing is checked


def test_limits_defaults_and_json() -> None:
    limits = P.Limits()
    assert limits.max_message_bytes == 32 << 20 and limits.max_frames == 1024
    assert P.Limits.from_json(limits.to_json()) == limits
    assert P.Limits.from_json({"max_frames": 9, "max_from_the_future": 3}) == P.Limits(max_frames=9)
    with pytest.raises(ConfigError, match="max_frames"):
        P.Limits(max_frames=0)
    with pytest.raises(ProtocolError, match="max_clients"):
        P.Limits.from_json({"max_clients": True})


def test_peek_request_id() -> None:
    assert P.peek_request_id(with_header(APPEND, kind="nope")) == 3
    assert P.peek_request_id(with_header(APPEND, id=-1)) is None
    assert P.peek_request_id([b"\xc1"]) is None
    assert P.peek_request_id([msgpack.packb([1])]) is None
    assert P.peek_request_id([]) is None


# ------------------------------------------------------------------------------------- error codes

CLASS_OF_CODE = {
    "bad_request": ProtocolError, "unsupported_version": UnsupportedVersionError,
    "limit_exceeded": LimitExceededError, "space_mismatch": SpaceMismatchError,
    "index_out_of_range": IndexError, "evicted": EvictedError, "not_enough_data": NotEnoughDataError, "rate_limited": RateLimitedError, "unknown_segment": SegmentStateError, "read_only": ReadOnlyError,
    "access_denied": AccessDeniedError, "storage_error": StorageError, "disk_full": DiskFullError, "busy": ServerUnavailableError, "shutting_down": ServerUnavailableError,
    "internal": RemoteError,
}


@pytest.mark.parametrize("code", list(P.ErrorCode))
def test_error_codes_round_trip(code: P.ErrorCode) -> None:
    exc = P.error_to_exception(code.value, "what went wrong")
    assert type(exc) is CLASS_OF_CODE[code.value] is P.ERROR_CLASSES[code.value]
    assert str(exc) == "what went wrong"
    expected = P.ErrorCode.BUSY if code is P.ErrorCode.SHUTTING_DOWN else code  # both are "try later"
    assert P.exception_to_error(exc) == (expected, "what went wrong")


def test_unknown_codes_become_remote_errors() -> None:
    exc = P.error_to_exception("quota_exceeded", "from a newer server")
    assert isinstance(exc, RemoteError) and exc.code == "quota_exceeded"
    assert P.exception_to_error(exc) == (P.ErrorCode.INTERNAL, "RemoteError: from a newer server")
    exc = P.error_to_exception("internal", "boom")
    assert isinstance(exc, RemoteError) and exc.code == "internal"


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ConfigError("bad seed"), P.ErrorCode.BAD_REQUEST),
        (ClosedError("closed"), P.ErrorCode.SHUTTING_DOWN),
        (RemoteError("relayed", "busy"), P.ErrorCode.BUSY),
        (IndexError("index 9 is out of range"), P.ErrorCode.INDEX_OUT_OF_RANGE),
        (LimitExceededError("too many open segments"), P.ErrorCode.LIMIT_EXCEEDED),
    ],
)
def test_exception_to_error(exc: Exception, code: P.ErrorCode) -> None:
    assert P.exception_to_error(exc) == (code, str(exc))


def test_unexpected_exceptions_are_internal_and_name_their_type() -> None:
    assert P.exception_to_error(KeyError("k")) == (P.ErrorCode.INTERNAL, "KeyError: 'k'")
    assert P.exception_to_error(ValueError()) == (P.ErrorCode.INTERNAL, "ValueError: ValueError")


def test_error_reply_helpers() -> None:
    reply = P.ErrorReply.from_exception(4, SpaceMismatchError("x" * 10_000))
    assert reply.code == "space_mismatch" and len(reply.message) == 4096 and not reply.ok
    assert isinstance(reply.exception(), SpaceMismatchError)
    assert P.CommitReply(1, 0, 0, 0).ok


def test_the_idempotency_key_is_optional_and_left_out_when_none() -> None:
    without = P.encode(P.Commit(5, 3, 1.0))
    assert "idempotency_key" not in msgpack.unpackb(without[0])["fields"]  # as an earlier version 3 client sends it
    assert P.decode(without).idempotency_key is None  # type: ignore[attr-defined]
    key = bytes(range(16))
    with_key = P.decode(P.encode(P.Commit(5, 3, 1.0, key)))
    assert isinstance(with_key, P.Commit) and with_key.idempotency_key == key


@pytest.mark.parametrize("key", [b"", b"x" * 15, b"x" * 17, "x" * 16, 7, [1] * 16])
def test_an_idempotency_key_must_be_16_bytes(key: Any) -> None:
    head = msgpack.unpackb(P.encode(P.Commit(5, 3, 1.0))[0])
    head["fields"]["idempotency_key"] = key
    with pytest.raises(ProtocolError, match="'idempotency_key' must be 16 bytes"):
        P.decode([msgpack.packb(head, use_bin_type=True)])


def test_what_each_kind_is_is_said_by_its_class() -> None:
    """The server dispatches on these (read or write, a draw, rows carried, answered after the
    publish); a new kind says what it is here, where the table pins it."""
    from h5replay.server.reads import _READS

    requests = {c.KIND.value: (c.READS, c.WRITES, c.DRAWS, c.CARRIES_ROWS) for c in P.Request.__subclasses__()}
    assert requests == {
        "hello": (False, False, False, False), "open_segment": (False, True, False, False),
        "append": (False, True, False, True), "commit": (False, True, False, False), "abort": (False, True, False, False),
        "push_episode": (False, True, False, True), "push_episodes": (False, True, False, True),
        "update_priorities": (False, False, False, False), "get": (True, False, False, False),
        "get_rows": (True, False, False, False), "sample": (True, False, True, False),
        "sample_sequences": (True, False, True, False), "sample_transitions": (True, False, True, False), "episodes": (True, False, False, False),
        "info": (False, False, False, False), "heartbeat": (False, False, False, False),
        "cancel": (False, False, False, False),
    }
    replies = [c for c in P.Reply.__subclasses__() if c not in (P.ReadReply, P.ErrorReply)] + P.ReadReply.__subclasses__()
    assert {c.KIND.value for c in replies if c.ACKNOWLEDGES} == {"commit", "push_episode", "push_episodes",
                                                                 "update_priorities"}
    assert {c.KIND.value for c in replies if c.DRAWN} == {"sample", "sample_sequences", "sample_transitions"}
    assert {c for c in P.Request.__subclasses__() if c.READS} == set(_READS)  # every read has its answer
    assert P.Sample(1, 7).num_drawn == 7 and P.SampleSequences(1, 3, 4).num_drawn == 12
