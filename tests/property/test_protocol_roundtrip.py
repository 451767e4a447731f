"""Protocol properties: every message survives encode -> decode; no input makes decode raise anything
but ProtocolError."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from h5replay import protocol as P
from h5replay.errors import ProtocolError

MESSAGE_CLASSES = sorted(
    {*P.Request.__subclasses__(), *P.Reply.__subclasses__(), *P.ReadReply.__subclasses__()} - {P.ReadReply},
    key=lambda c: c.__name__,
)
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u64 = st.integers(0, 2**64 - 1)
json_scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

table_names = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}", fullmatch=True)

# One strategy per field name, as the protocol has one check per field name.
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "client_name": st.text(min_size=1, max_size=256),
    "role": st.sampled_from(P.ROLES),
    "segment_id": u64, "first_row_id": st.none() | u64, "episode_id": st.none() | u64, "segment_length": u64,
    "length": u64, "num_episodes": u64, "protocol_version": u64, "min_seq": u64, "seq": u64, "generation": u64,
    "begin": u64, "end": u64, "with_rows": st.booleans(),
    "replay_id": st.text(max_size=40), "instance_id": st.text(max_size=40),
    "seed": st.none() | u64, "capacity": st.none() | u64,
    "server_version": st.text(max_size=20), "read_endpoint": st.text(max_size=40), "message": st.text(max_size=200),
    "code": st.sampled_from([c.value for c in P.ErrorCode]) | st.text(max_size=20),
    "space": st.dictionaries(st.text(max_size=8), json_values, max_size=5),
    "stats": st.dictionaries(st.text(max_size=12), json_scalars, max_size=8),
    "limits": st.builds(P.Limits, **{f.name: st.integers(1, 2**40) for f in dataclasses.fields(P.Limits)}),
    "timeout": st.floats(0, 86_400) | st.integers(0, 86_400).map(float), "ignored": u64,
    "sampling": st.dictionaries(st.text(max_size=12), json_scalars, max_size=8),
    "idempotency_key": st.none() | st.binary(min_size=16, max_size=16),
    "first_episode": st.none() | u64, "max_episodes": st.none() | u64,
    "table": st.none() | table_names, "pad": st.none() | st.booleans(), "packed": st.none() | st.booleans(),
    "skip": st.none() | u64,
    "local_file": st.none() | st.dictionaries(st.text(max_size=12), json_scalars, max_size=5),
}

wire_dtypes = (
    hnp.boolean_dtypes()
    | hnp.integer_dtypes(endianness="?")
    | hnp.unsigned_integer_dtypes(endianness="?")
    | hnp.floating_dtypes(sizes=(16, 32, 64), endianness="?")
    | hnp.byte_string_dtypes(min_len=1, max_len=12)
)
leaf_names = st.lists(st.text(min_size=1, max_size=12), max_size=4, unique=True)


@st.composite
def leaf_arrays(draw: st.DrawFn, leading: tuple[int, ...]) -> dict[str, np.ndarray]:
    out = {}
    for name in draw(leaf_names):
        row_shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        out[name] = draw(hnp.arrays(draw(wire_dtypes), leading + row_shape))
    return out


@st.composite
def messages(draw: st.DrawFn, cls: type[P.Message]) -> P.Message:
    n = draw(st.integers(1 if cls is P.PushEpisodes else 0, 6))  # push_episodes carries at least one row
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name == "request_id":
            values[f.name] = draw(st.none() | u64) if cls is P.ErrorReply else draw(u64)
        elif f.name == "num_rows":
            values[f.name] = n
        elif f.name == "indices":
            values[f.name] = draw(hnp.arrays(np.int64, (n,)))
        elif f.name == "request_ids":
            values[f.name] = draw(hnp.arrays(np.uint64, (n,)))
        elif f.name == "row_ids":
            values[f.name] = draw(hnp.arrays(np.int64, (n,), elements=st.integers(0, 2**63 - 1)))
        elif f.name == "episode_ids":
            values[f.name] = draw(hnp.arrays(np.uint64, (n,)))
        elif f.name == "probabilities":
            values[f.name] = draw(hnp.arrays(np.float64, (n,)))
        elif f.name == "priorities":  # one per row, or none (update_priorities: one per id)
            count = n if cls is P.UpdatePriorities else draw(st.sampled_from([0, n]))
            values[f.name] = draw(hnp.arrays(np.float64, (count,)))
        elif f.name == "priority_tables":  # by table: a row of table_priorities each (none for no rows)
            values[f.name] = draw(st.none() | st.lists(table_names, min_size=1, max_size=3, unique=True).map(tuple)) \
                if n else None
        elif f.name == "table_priorities":
            k = len(values["priority_tables"] or ())
            values[f.name] = draw(hnp.arrays(np.float64, (k, n))) if k else np.zeros((0, 0))
        elif f.name == "episodes":
            values[f.name] = draw(hnp.arrays(np.int64, (n, 3)))
        elif f.name == "lengths":  # push_episodes: n rows in episodes of >= 1 row each
            cuts = sorted(draw(st.sets(st.integers(1, n - 1)))) if n > 1 else []
            values[f.name] = np.diff([0, *cuts, n]).astype(np.int64)
        elif f.name == "keys":
            count = len(values["lengths"])
            values[f.name] = np.arange(count * 16, dtype=np.uint8).reshape(count, 16)
        elif f.name == "batch_size":
            values[f.name] = draw(st.integers(1, 256))
        elif f.name == "length" and cls is P.SampleSequences:
            values[f.name] = draw(st.integers(1, 256))
        elif f.name == "has_final" and cls is P.SampleTransitionsReply:
            values[f.name] = draw(hnp.arrays(np.uint8, (n,), elements=st.integers(0, 1)))
        elif f.name == "has_final":  # push_episodes: none, or one flag per episode
            k = len(values["lengths"])
            values[f.name] = draw(st.sampled_from([np.zeros(0, np.uint8), np.ones(k, np.uint8)]))
        elif f.name == "finals":  # final observations: one row a leaf per episode that has one
            count = int(np.count_nonzero(values["has_final"])) if "has_final" in values else draw(st.sampled_from([0, 1]))
            values[f.name] = (draw(leaf_arrays((count,))) or {"o": np.zeros(count, np.float32)}) if count else {}
        elif f.name == "n_step":
            values[f.name] = draw(st.integers(1, 64))
        elif f.name == "gamma":
            values[f.name] = draw(st.floats(0, 1))
        elif f.name == "arrays":
            leading = (n, draw(st.integers(0, 5))) if cls is P.SampleSequencesReply else (n,)
            values[f.name] = draw(leaf_arrays(leading))
        elif f.name == "valid_steps":  # padded windows: none, or one count in [1, length] per window
            length = next(iter(np.shape(a)[1] for a in values["arrays"].values()), 256)
            values[f.name] = draw(hnp.arrays(np.int64, (n,), elements=st.integers(1, length))) \
                if length and draw(st.booleans()) else np.zeros(0, np.int64)
        else:
            values[f.name] = draw(FIELDS[f.name])
    return cls(**values)


any_message = st.sampled_from(MESSAGE_CLASSES).flatmap(messages)


def assert_same(a: P.Message, b: P.Message) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in ("arrays", "finals"):
            assert list(x) == list(y)
            for key in x:
                assert_same_array(x[key], y[key])
        elif isinstance(x, np.ndarray):
            assert_same_array(x, y)
        else:
            assert x == y, f.name


def assert_same_array(x: np.ndarray, y: np.ndarray) -> None:
    # Bytes, not values: NaN payloads and -0.0 must survive too.
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    assert not y.flags.writeable


@SETTINGS
@given(msg=any_message)
def test_round_trip(msg: P.Message) -> None:
    frames = P.encode(msg)
    assert_same(msg, P.decode(frames))
    assert_same(msg, P.decode([bytes(f) for f in frames]))


def test_every_message_class_is_generated() -> None:
    assert len(MESSAGE_CLASSES) == 2 * (len(P.Kind) - 1) + 1


# ------------------------------------------------------------------------------------------- fuzz


def decode_or_refuse(frames: list[Any]) -> None:
    """The property: decode returns a message that round-trips, or raises ProtocolError."""
    try:
        msg = P.decode(frames, P.Limits(max_message_bytes=1 << 20, max_frames=16))
    except ProtocolError as exc:
        assert str(exc)
        return
    assert_same(msg, P.decode(P.encode(msg)))


@SETTINGS
@given(frames=st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_are_refused(frames: list[bytes]) -> None:
    decode_or_refuse(frames)


header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10)
    | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn) -> list[bytes]:
    frames = [bytes(f) for f in P.encode(draw(any_message))]
    how = draw(st.sampled_from(["flip", "truncate", "extend", "add_frame", "drop_frame", "swap", "edit_header"]))
    i = draw(st.integers(0, len(frames) - 1))
    if how == "flip" and frames[i]:
        pos = draw(st.integers(0, len(frames[i]) - 1))
        frame = bytearray(frames[i])
        frame[pos] ^= 1 << draw(st.integers(0, 7))
        frames[i] = bytes(frame)
    elif how == "truncate":
        frames[i] = frames[i][: draw(st.integers(0, max(0, len(frames[i]) - 1)))]
    elif how == "extend":
        frames[i] += draw(st.binary(min_size=1, max_size=16))
    elif how == "add_frame":
        frames.insert(draw(st.integers(0, len(frames))), draw(st.binary(max_size=32)))
    elif how == "drop_frame":
        del frames[i]
    elif how == "swap" and len(frames) > 1:
        j = draw(st.integers(0, len(frames) - 1))
        frames[i], frames[j] = frames[j], frames[i]
    elif how == "edit_header":
        header = msgpack.unpackb(frames[0])
        target = header
        if draw(st.booleans()) and header["fields"]:  # reach into fields or the array list
            target = header["fields"]
        elif draw(st.booleans()) and header["arrays"]:
            entry = draw(st.sampled_from(header["arrays"]))
            entry[draw(st.integers(0, 2))] = draw(header_values)
            return [msgpack.packb(header), *frames[1:]]
        key = draw(st.sampled_from(sorted(target)) | st.text(max_size=6))
        if draw(st.booleans()):
            target.pop(key, None)
        else:
            target[key] = draw(header_values)
        frames[0] = msgpack.packb(header)
    return frames


@SETTINGS
@given(frames=mutated())
def test_mutated_messages_decode_or_are_refused(frames: list[bytes]) -> None:
    decode_or_refuse(frames)
