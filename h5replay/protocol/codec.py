"""The frames of a message: the msgpack header, then one raw frame per array.

`encode` and `decode` are the only code that knows the bytes; `decode` checks every one of them
(version, kind, fields, dtypes, shapes, sizes) and raises ProtocolError saying what was wrong.
One Packer per thread is reused. Pure (msgpack and numpy only).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, fields
from functools import lru_cache
from typing import Any, TypeVar, overload

import msgpack
import numpy as np

from h5replay.codecs import META_COLUMNS, PackedRows
from h5replay.errors import LimitExceededError, ProtocolError, UnsupportedVersionError
from h5replay.protocol.admin import Cancel, CancelReply, Heartbeat, HeartbeatReply, Hello, HelloReply, Info, InfoReply
from h5replay.protocol.base import ErrorReply, Kind, Message, Reply, Request
from h5replay.protocol.checks import (
    _ARRAY_FIELDS,
    _LEFT_OUT,
    _MAX_NDIM,
    _OPTIONAL_SCALARS,
    _SCALAR_CHECKS,
    _U64_MAX,
    DEFAULT_LIMITS,
    Array,
    Limits,
    _check_rows_limit,
    _check_sizes,
    _show,
    _uint,
)
from h5replay.protocol.reads import (
    Episodes,
    EpisodesReply,
    Get,
    GetReply,
    GetRows,
    GetRowsReply,
    Sample,
    SampleReply,
    SampleSequences,
    SampleSequencesReply,
    SampleTransitions,
    SampleTransitionsReply,
)
from h5replay.protocol.writes import (
    Abort,
    AbortReply,
    Append,
    AppendReply,
    Commit,
    CommitReply,
    OpenSegment,
    OpenSegmentReply,
    PushEpisode,
    PushEpisodeReply,
    PushEpisodes,
    PushEpisodesReply,
    UpdatePriorities,
    UpdatePrioritiesReply,
)

__all__ = ["PROTOCOL_VERSION", "encode", "decode", "peek_request_id"]

PROTOCOL_VERSION = 3

_REQUEST_CLASSES: dict[str, type[Request]] = {
    c.KIND.value: c
    for c in (Hello, OpenSegment, Append, Commit, Abort, PushEpisode, PushEpisodes, UpdatePriorities, Get, GetRows, Sample,
              SampleSequences, SampleTransitions, Episodes, Info, Heartbeat, Cancel)
}
_REPLY_CLASSES: dict[str, type[Reply]] = {
    c.KIND.value: c
    for c in (HelloReply, OpenSegmentReply, AppendReply, CommitReply, AbortReply, PushEpisodeReply, PushEpisodesReply,
              UpdatePrioritiesReply, GetReply, GetRowsReply, SampleReply, SampleSequencesReply, SampleTransitionsReply,
              EpisodesReply, InfoReply, HeartbeatReply,
              CancelReply)
}


@dataclass(frozen=True)
class _Layout:
    scalars: tuple[str, ...]
    required: frozenset[str]  # the scalars a message must carry
    array_fields: tuple[str, ...]
    has_leaves: bool
    has_finals: bool  # a second set of leaf arrays, `finals` (episodes' final observations)
    header_keys: frozenset[str]


def _layout(cls: type[Message]) -> _Layout:
    names = [f.name for f in fields(cls) if f.name != "request_id"]
    unknown = [n for n in names if n not in _SCALAR_CHECKS and n not in _ARRAY_FIELDS and n not in ("arrays", "finals")]
    if unknown:  # a new field needs a check above
        raise TypeError(f"{cls.__name__} has fields without a wire check: {unknown}")
    header_keys = {"version", "kind", "id", "fields", "arrays"}
    if issubclass(cls, Reply):
        header_keys |= {"ok", "for"} if cls.ok else {"ok"}
    return _Layout(
        scalars=tuple(n for n in names if n in _SCALAR_CHECKS),
        required=frozenset(f.name for f in fields(cls) if f.name in _SCALAR_CHECKS and (
            f.name not in _OPTIONAL_SCALARS or (f.default is MISSING and f.default_factory is MISSING))),
        array_fields=tuple(n for n in names if n in _ARRAY_FIELDS),
        has_leaves="arrays" in names,
        has_finals="finals" in names,
        header_keys=frozenset(header_keys),
    )


#: Where an episode's final observation travels: leaf arrays named FINALS_PREFIX + leaf path.
FINALS_PREFIX = "/final/"
#: A compressed leaf of a read reply, as stored: its records and their meta (codecs.PackedRows).
PACKED_PREFIX = "/packed/"
PACKED_META_PREFIX = "/packed-meta/"

_LAYOUTS = {cls: _layout(cls) for cls in [*_REQUEST_CLASSES.values(), *_REPLY_CLASSES.values(), ErrorReply]}

# ----------------------------------------------------------------------------------------- dtypes

_NUMERIC_DTYPES: dict[str, np.dtype[Any]] = {
    dt.str: dt
    for name in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float16", "float32", "float64")
    for dt in (np.dtype(name), np.dtype(name).newbyteorder())
}
_BYTES_DTYPE = re.compile(r"\|S([1-9][0-9]{0,8})")


@lru_cache(maxsize=256)
def _wire_dtype(text: str) -> np.dtype[Any] | None:
    """The dtype for a header's dtype string, or None when the wire does not carry it.

    Only exact strings from the allow-list are parsed: never np.dtype(untrusted text), which also
    accepts object and structured types.
    """
    if text in _NUMERIC_DTYPES:
        return _NUMERIC_DTYPES[text]
    match = _BYTES_DTYPE.fullmatch(text)
    return np.dtype(f"S{match.group(1)}") if match else None


def _dtype_problem(dtype: np.dtype[Any]) -> str | None:
    if dtype.str in _NUMERIC_DTYPES or (dtype.kind == "S" and dtype.itemsize > 0):
        return None
    return (f"dtype {dtype} cannot travel; the wire carries bool, int, uint, float and fixed bytes "
            "(S{k}) arrays only, never objects")


# ----------------------------------------------------------------------------------------- encode

_local = threading.local()  # one Packer per thread: a Packer is not safe to share between threads


def _to_builtin(obj: Any) -> Any:
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    raise TypeError(f"cannot put a {type(obj).__name__} in a message header")


def _pack(header: dict[str, Any]) -> bytes:
    packer = getattr(_local, "packer", None)
    if packer is None:
        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=_to_builtin)
    return packer.pack(header)  # type: ignore[no-any-return]


def _field_to_wire(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value.to_json() if isinstance(value, Limits) else value


def _own_array(value: Any, name: str) -> Array:
    spec = _ARRAY_FIELDS[name]
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(spec.dtype).reshape((0,) if spec.ndim == 1 else (0, spec.columns or 0))
    if arr.dtype.kind not in ("f" if spec.dtype.kind == "f" else "iu") or arr.ndim != spec.ndim:
        raise ProtocolError(f"array field {name!r} must be a {spec.ndim}-d {spec.dtype} array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr, dtype=spec.dtype)


def _leaf_array(value: Any, name: str) -> Array:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    problem = _dtype_problem(arr.dtype)
    if problem:
        raise ProtocolError(f"array {name!r}: {problem}")
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _packed_part(value: np.ndarray, dtype: type[np.generic], name: str) -> Array:
    if not isinstance(value, np.ndarray) or value.dtype != dtype:
        raise ProtocolError(f"the records of compressed leaf {name!r} must be {np.dtype(dtype)} arrays")
    return np.ascontiguousarray(value)


def _packed_leaves(leaves: dict[str, Array]) -> dict[str, Any]:
    """Leaves with each compressed one's two arrays (records, meta) joined into PackedRows,
    checked: records 1-d uint8, meta int64 (*lead, 3), sizes >= 0 that add up to the records."""
    if not any(name.startswith(PACKED_PREFIX) or name.startswith(PACKED_META_PREFIX) for name in leaves):
        return leaves
    out: dict[str, Any] = {}
    for name, arr in leaves.items():
        if name.startswith(PACKED_META_PREFIX):
            if PACKED_PREFIX + name[len(PACKED_META_PREFIX):] not in leaves:
                raise ProtocolError(f"compressed leaf {name[len(PACKED_META_PREFIX):]!r} has meta but no records")
            continue
        if not name.startswith(PACKED_PREFIX):
            out[name] = arr
            continue
        leaf = name[len(PACKED_PREFIX):]
        meta = leaves.get(PACKED_META_PREFIX + leaf)
        if meta is None:
            raise ProtocolError(f"compressed leaf {leaf!r} has records but no meta")
        if leaf in leaves:
            raise ProtocolError(f"leaf {leaf!r} comes both compressed and raw")
        if arr.dtype != np.uint8 or arr.ndim != 1:
            raise ProtocolError(f"the records of compressed leaf {leaf!r} must be 1-d uint8, got {arr.dtype} {arr.shape}")
        if meta.dtype.newbyteorder("<") != np.dtype("<i8") or meta.ndim < 2 or meta.shape[-1] != META_COLUMNS:
            raise ProtocolError(f"the meta of compressed leaf {leaf!r} must be int64 of shape (rows, {META_COLUMNS}), "
                                f"got {meta.dtype.str} {meta.shape}")
        meta = meta if meta.dtype.isnative else meta.astype(np.int64)
        sizes = meta[..., 0]
        if sizes.size and (int(sizes.min()) < 0 or int(sizes.sum()) != arr.shape[0]):
            raise ProtocolError(f"compressed leaf {leaf!r}: its records declare {int(sizes.sum())} bytes (sizes >= 0), "
                                f"its frame has {arr.shape[0]}")
        out[leaf] = PackedRows(arr, meta)
    return out


def encode(msg: Message, limits: Limits | None = None) -> list[bytes | memoryview]:
    """Frames for `msg`: the msgpack header, then one raw frame per array.

    Array frames are memoryviews of the message's arrays (a copy is made only for a non-contiguous
    array), so send them with copy=False and do not modify the arrays until the send is done.

    Args:
        msg: the message.
        limits: when given (the server's, from the hello reply), check the message against them here
            rather than have the server refuse it.

    Raises:
        ProtocolError: an array has a dtype the wire does not carry, or a field cannot be packed.
        LimitExceededError: the message is over `limits`.
    """
    layout = _LAYOUTS[type(msg)]
    arrays = [(name, _own_array(getattr(msg, name), name)) for name in layout.array_fields]
    arrays = [(name, a) for name, a in arrays if a.size or not _ARRAY_FIELDS[name].optional]
    if layout.has_leaves:
        for name, a in getattr(msg, "arrays").items():  # noqa: B009
            if isinstance(a, PackedRows):  # a compressed leaf as stored: its records, then their meta
                arrays += [(PACKED_PREFIX + name, _packed_part(a.blob, np.uint8, name)),
                           (PACKED_META_PREFIX + name, _packed_part(a.meta, np.int64, name))]
            else:
                arrays.append((name, _leaf_array(a, name)))
    if layout.has_finals:  # after the leaves, under a prefix no leaf path can have (keys are non-empty)
        arrays += [(FINALS_PREFIX + name, _leaf_array(a, name)) for name, a in getattr(msg, "finals").items()]  # noqa: B009
    header: dict[str, Any] = {"version": PROTOCOL_VERSION, "kind": msg.KIND.value, "id": msg.request_id}
    if isinstance(msg, Reply):
        header["kind"], header["ok"] = Kind.REPLY.value, msg.ok
        if msg.ok:
            header["for"] = msg.KIND.value
    header["fields"] = {name: _field_to_wire(getattr(msg, name)) for name in layout.scalars
                        if name not in _OPTIONAL_SCALARS or getattr(msg, name) is not None}
    header["arrays"] = [[name, a.dtype.str, list(a.shape)] for name, a in arrays]
    try:
        frames: list[bytes | memoryview] = [_pack(header)]
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"cannot encode a {msg.KIND.value} message: {exc}") from exc
    frames += [a.reshape(-1).view(np.uint8).data for _, a in arrays]
    if limits is not None:
        _check_sizes([len(frames[0]), *(a.nbytes for _, a in arrays)], limits)
        for name in {"num_rows", "batch_size"}.intersection(layout.scalars):
            _check_rows_limit(int(getattr(msg, name)), f"field {name!r}", limits)
        msg._validate(limits)
    return frames


# ----------------------------------------------------------------------------------------- decode

M = TypeVar("M", bound=Message)


def _as_view(frame: Any, index: int) -> memoryview:
    try:
        view = memoryview(frame)
        return view if view.ndim == 1 and view.format == "B" else view.cast("B")
    except TypeError as exc:
        raise ProtocolError(f"frame {index} is a {type(frame).__name__}, not a contiguous buffer") from exc


def _unpack_header(view: memoryview) -> dict[str, Any]:
    try:
        header = msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"header frame is not valid msgpack ({type(exc).__name__}: {exc})") from exc
    if type(header) is not dict:
        raise ProtocolError(f"header frame must be a msgpack map, got {_show(header)}")
    return header


def _message_class(header: dict[str, Any]) -> type[Message]:
    version = header.get("version")
    if type(version) is not int:
        raise ProtocolError(f"header needs an int 'version', got {_show(version)}")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersionError(f"message has protocol version {version} but this side speaks "
                                      f"{PROTOCOL_VERSION}; upgrade h5replay on the older side")
    kind = header.get("kind")
    if kind != Kind.REPLY.value:
        cls = _REQUEST_CLASSES.get(kind) if type(kind) is str else None
        if cls is None:
            raise ProtocolError(f"unknown message kind {_show(kind)}; known: {sorted(_REQUEST_CLASSES)}")
        return cls
    ok = header.get("ok")
    if type(ok) is not bool:
        raise ProtocolError(f"a reply needs a bool 'ok', got {_show(ok)}")
    if not ok:
        return ErrorReply
    answers = header.get("for")
    reply_cls = _REPLY_CLASSES.get(answers) if type(answers) is str else None
    if reply_cls is None:
        raise ProtocolError(f"reply 'for' must name a request kind, got {_show(answers)}")
    return reply_cls


def _decode_array(entry: Any, view: memoryview, limits: Limits) -> tuple[str, Array]:
    if type(entry) is not list or len(entry) != 3:
        raise ProtocolError(f"each 'arrays' entry must be [name, dtype, shape], got {_show(entry)}")
    name, dtype_text, shape = entry
    if type(name) is not str or not name:
        raise ProtocolError(f"array name must be a non-empty string, got {_show(name)}")
    dtype = _wire_dtype(dtype_text) if type(dtype_text) is str else None
    if dtype is None:
        raise ProtocolError(f"array {name!r} has dtype {_show(dtype_text)}, which the wire does not carry "
                            "(bool, int, uint, float and |S{k} only; never objects)")
    if type(shape) is not list or len(shape) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise ProtocolError(f"array {name!r} has shape {_show(shape)}; expected a list of at most "
                            f"{_MAX_NDIM} ints >= 0")
    # Bound the non-zero dimensions too: numpy refuses a (0, 2**40, 2**40) shape with ValueError.
    if 0 in shape and math.prod(max(d, 1) for d in shape) * dtype.itemsize > limits.max_message_bytes:
        raise ProtocolError(f"array {name!r} has an absurd shape {tuple(shape)}: it could not fit in "
                            f"max_message_bytes={limits.max_message_bytes} even with data")
    expected = math.prod(shape) * dtype.itemsize
    if expected != view.nbytes:
        raise ProtocolError(f"array {name!r} declares {dtype.str} {tuple(shape)} = {expected} bytes "
                            f"but its frame has {view.nbytes} bytes")
    arr = np.frombuffer(view, dtype=dtype).reshape(shape)
    arr.flags.writeable = False
    return name, arr


@overload
def decode(frames: Sequence[Any], limits: Limits = ...) -> Message: ...
@overload
def decode(frames: Sequence[Any], limits: Limits = ..., *, expect: type[M]) -> M: ...


def decode(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS, *, expect: type[Message] = Message) -> Message:
    """Check every byte of a received message and return it as a message dataclass.

    Arrays are read-only views of the frames (no copy); keep the frames alive while you use them.

    Args:
        frames: the message parts (bytes, memoryview, zmq.Frame: anything with the buffer protocol),
            without the ROUTER's routing frames.
        limits: what the message may not exceed.
        expect: the message class the caller can handle (Request on the server, Reply on a client).

    Raises:
        ProtocolError: the message is malformed; the text says what is wrong. Its subclasses
            UnsupportedVersionError and LimitExceededError say the version or a limit.
    """
    if len(frames) == 0:
        raise ProtocolError("empty message: expected a msgpack header frame")
    if len(frames) > limits.max_frames:
        raise LimitExceededError(f"message has {len(frames)} frames, over the limit max_frames={limits.max_frames}")
    views = [_as_view(f, i) for i, f in enumerate(frames)]
    _check_sizes([view.nbytes for view in views], limits)
    header = _unpack_header(views[0])
    cls = _message_class(header)
    if not issubclass(cls, expect):
        raise ProtocolError(f"expected a {expect.__name__} message, got {cls.__name__}")
    layout = _LAYOUTS[cls]
    if header.keys() != layout.header_keys:
        raise ProtocolError(f"header keys must be {sorted(layout.header_keys)}, got {sorted(map(str, header))}")

    request_id = header["id"]
    if not (request_id is None and cls is ErrorReply):
        _uint(request_id, "id", limits)
    wire_fields = header["fields"]
    if type(wire_fields) is not dict or not (
            layout.required <= wire_fields.keys() and wire_fields.keys() <= set(layout.scalars)):
        got = sorted(map(str, wire_fields)) if type(wire_fields) is dict else _show(wire_fields)
        optional = sorted(_OPTIONAL_SCALARS.intersection(layout.scalars))
        also = f" (optional: {optional})" if optional else ""
        raise ProtocolError(f"{cls.__name__} needs fields {sorted(layout.required)}{also}, got {got}")
    values = {name: _SCALAR_CHECKS[name](wire_fields[name], name, limits) for name in layout.scalars
              if name in wire_fields}  # an optional field left out takes the message's default

    entries = header["arrays"]
    if type(entries) is not list or len(entries) != len(views) - 1:
        declared = len(entries) if type(entries) is list else _show(entries)
        raise ProtocolError(f"header declares {declared} arrays but the message has {len(views) - 1} array frames")
    arrays = [_decode_array(entry, view, limits) for entry, view in zip(entries, views[1:])]
    present = [name for name in layout.array_fields
               if not _ARRAY_FIELDS[name].optional or any(entry == name for entry, _ in arrays[: len(layout.array_fields)])]
    num_fixed = len(present)
    if [name for name, _ in arrays[:num_fixed]] != present:
        raise ProtocolError(f"{cls.__name__} starts with arrays {list(layout.array_fields)} (those marked optional "
                            f"may be left out), got {[name for name, _ in arrays[:num_fixed]]}")
    for name in layout.array_fields:
        if name not in present:
            values[name] = _LEFT_OUT[name]  # empty, read-only like every decoded array
    for name, arr in arrays[:num_fixed]:
        spec = _ARRAY_FIELDS[name]
        if arr.dtype.newbyteorder("<") != spec.dtype or arr.ndim != spec.ndim or (
                spec.columns is not None and arr.shape[1] != spec.columns):
            shape = f"(n, {spec.columns})" if spec.columns else "(n,)"
            raise ProtocolError(f"array field {name!r} must be {spec.dtype} of shape {shape}, got {arr.dtype.str} {arr.shape}")
        values[name] = arr if arr.dtype.isnative else arr.astype(spec.dtype.newbyteorder("="))
    leaves = dict(arrays[num_fixed:])
    if len(leaves) != len(arrays) - num_fixed:
        raise ProtocolError(f"leaf array names must be unique, got {[name for name, _ in arrays[num_fixed:]]}")
    finals = {name[len(FINALS_PREFIX):]: arr for name, arr in leaves.items() if name.startswith(FINALS_PREFIX)}
    if finals:
        if not layout.has_finals:
            raise ProtocolError(f"{cls.__name__} carries no final observations, got {sorted(finals)}")
        leaves = {name: arr for name, arr in leaves.items() if not name.startswith(FINALS_PREFIX)}
    if layout.has_finals:
        values["finals"] = finals
    if layout.has_leaves:
        values["arrays"] = _packed_leaves(leaves) if issubclass(cls, Reply) else leaves
    elif leaves:
        raise ProtocolError(f"{cls.__name__} carries no leaf arrays, got {sorted(leaves)}")

    msg = cls(request_id, **values)
    msg._validate(limits)
    return msg


def peek_request_id(frames: Sequence[Any], limits: Limits = DEFAULT_LIMITS) -> int | None:
    """The request id of a message `decode` refused, if the header shows one; never raises."""
    try:
        view = _as_view(frames[0], 0)
        if view.nbytes > limits.max_header_bytes:
            return None
        request_id = msgpack.unpackb(view, raw=False, strict_map_key=True).get("id")
    except Exception:  # best effort on a message already known to be broken
        return None
    return request_id if type(request_id) is int and 0 <= request_id <= _U64_MAX else None
