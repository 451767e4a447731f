"""The wire protocol: every message, its bytes, PROTOCOL_VERSION and the error codes.

This module is the one place that knows the bytes. It is pure (msgpack and numpy only): it must not
import zmq, open files, or touch storage, and it never pickles anything.

A message is a list of frames. Frame 0 is a msgpack map, the header::

    {"version": 1, "kind": "append", "id": 7,
     "fields": {"segment_id": 3, "num_rows": 64},
     "arrays": [["obs/image", "|u1", [64, 84, 84, 3]], ["reward", "<f4", [64]]]}

Each array the header lists follows as its own raw frame (C order, exactly prod(shape) * itemsize
bytes). A message's own array fields (``indices``, ``row_ids``, ``episodes``: int64; ``episode_ids``:
uint64; ``probabilities``: float64) come first in the order below, then the leaf arrays keyed by leaf
path ('obs/image'; 'data' when the space is a single leaf), each in the leaf's storage dtype: bool,
int, uint, float, or fixed bytes ``S{k}`` for text.

Ids are global (see h5replay.records): a row id never changes while the row is held and is never
reused. Every read reply says which published state ("view") answered it: ``seq`` (the journal's
publish counter), ``generation`` (its clear counter) and the row ids ``begin`` (oldest held) and
``end`` (the next to be given). A learner sends the highest ``seq`` it has seen as ``min_seq``, and
a reader never answers from an older state, so a learner's view never goes back in time. The
``seq`` of an update_priorities reply is the publish that carried the update: the reply leaves
after it (at the end of the writer's pass, or up to the server's priority_publish_interval
later), so every ``seq`` a client knows names a publish the file already has.

A reply has kind "reply", ``"ok": true`` and ``"for": <the kind it answers>``. An error reply is
``{"version", "kind": "reply", "id", "ok": false, "fields": {"code", "message"}, "arrays": []}``;
that layout never changes between versions, so any client can read a refusal, and ``id`` is nil when
the request was too broken to read one.

=================  ===========  ===================================  =======================================
kind               sent by      request fields                       reply fields
=================  ===========  ===================================  =======================================
hello              any client   client_name, role                    space (JSON), capacity (int|None),
                                ('actor' | 'learner')                length, num_episodes, server_version,
                                                                     protocol_version, limits, read_endpoint,
                                                                     replay_id, instance_id, sampling
                                                                     ({name: scalar}: sampler, writer_samples)
open_segment       actor        -                                    segment_id
append             actor        segment_id, num_rows, priorities:    segment_length
                                float64 (0 or num_rows; NaN: the
                                default), leaf arrays
commit             actor        segment_id, timeout (s),             episode_id, first_row_id (nil when
                                idempotency_key (optional)           empty), length
abort              actor        segment_id                           -
push_episode       actor        num_rows, timeout, priorities, leaf  episode_id, first_row_id, length
                                arrays, idempotency_key (optional)
push_episodes      actor        num_rows, timeout, lengths: int64    episodes: int64 (k, 3) of (episode_id,
                                (k,), keys: uint8 (k, 16),           first_row_id, length), in the order sent
                                priorities, leaf arrays (the k
                                episodes' rows one after another)
update_priorities  any client   row_ids: int64 (n,), priorities:     ignored (ids no longer held), seq
                                float64 (n,)
get                learner      min_seq, indices: int64 (n,)         view, row_ids (n,), leaf arrays (n, ...)
                                (logical: 0 is the oldest row held)
get_rows           learner      min_seq, row_ids: int64 (n,)         view, leaf arrays (n, ...)
sample             learner      batch_size, seed (int|None),         view, row_ids (b,), episode_ids (b,),
                                min_seq, timeout                     probabilities (b,), leaf arrays (b, ...)
sample_sequences   learner      batch_size, length, seed, min_seq,   view, row_ids, episode_ids, probabilities
                                with_rows (bool), timeout            (of each window's first row), leaf
                                                                     arrays (b, length, ...) when with_rows
episodes           learner      min_seq, first_episode (optional),   view, episodes: int64 (n, 3) of
                                max_episodes (optional)              (episode_id, first_row_id, length)
info               any client   -                                    stats: {name: scalar}
heartbeat          any client   -                                    -
cancel             learner      request_ids: uint64 (n,) of its own  request_ids: uint64, those dropped (they
                                samples                              get no other reply)
reply              server       answers any request                  on error: code, message
=================  ===========  ===================================  =======================================

"view" is the four fields seq, generation, begin, end.

``idempotency_key`` (16 bytes, msgpack bin; left out of the fields when there is none, so messages
without it are those of earlier version 3 clients, which may leave out ``timeout`` too: 0): made by the client once per episode and sent
again with every retry of that commit or push. A server that already committed an episode with
that key (one of its last `idempotency_window` episodes, see h5replay/storage/replay/keys.py) answers
with that episode's receipt and commits nothing; a key whose episode has another length is
refused (``unknown_segment``).

``push_episodes`` commits k whole episodes in one message (short episodes, vectorized
environments): every episode has at least one row and its own key, no two the same; the server
checks them all before it writes any, commits each (a key it already has answers with that
episode's receipt) and answers once they are all published. Added within version 3: an older
version 3 server refuses it as an unknown kind (``bad_request``).

``episodes`` with ``first_episode`` / ``max_episodes`` (added within version 3) lists at most that
many episodes from that id on: a list longer than a message is read in pages. Without them the
whole list comes in one reply, or is refused when it would not fit one.

``cancel`` drops the client's own samples that still wait for the rate limit (a learner leaving a
``batches`` loop, or giving up on the rest of a split sample), so that no row is drawn for a
caller that no longer waits; the others are served as usual. Added within version 3.

``timeout`` (seconds, >= 0): how long the server may hold a commit, push_episode or sample back for
the rate limit before refusing it with ``rate_limited`` (0: refuse at once). When the hello's
``sampling.writer_samples`` is true (a rate limit, or rows removed as they are sampled), learners
send sample and sample_sequences to the writer's endpoint: only the writer may count them.

Every request gets exactly one reply with the same ``request_id``. A changed message bumps
PROTOCOL_VERSION and extends tests/property/test_protocol_roundtrip.py.
"""

from __future__ import annotations

import math
import re
import reprlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from enum import Enum
from functools import lru_cache
from typing import Any, Callable, ClassVar, TypeVar, overload

import msgpack
import numpy as np
from numpy.typing import NDArray

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

__all__ = [
    "PROTOCOL_VERSION", "IDEMPOTENCY_KEY_BYTES", "ROWS_MESSAGE_OVERHEAD", "ID_BYTES", "SAMPLE_INFO_BYTES", "ROLES", "Kind", "ErrorCode", "ERROR_CLASSES", "Limits", "DEFAULT_LIMITS",
    "Message", "Request", "Reply", "Hello", "OpenSegment", "Append", "Commit", "Abort", "PushEpisode",
    "PushEpisodes", "UpdatePriorities", "Get", "GetRows", "Sample", "SampleSequences", "Episodes", "Info", "Heartbeat", "Cancel",
    "HelloReply", "CancelReply",
    "OpenSegmentReply", "AppendReply", "CommitReply", "AbortReply", "PushEpisodeReply", "PushEpisodesReply",
    "UpdatePrioritiesReply",
    "GetReply",
    "GetRowsReply", "SampleReply", "SampleSequencesReply", "EpisodesReply", "InfoReply", "HeartbeatReply",
    "ErrorReply", "ReadReply",
    "encode", "decode", "peek_request_id", "error_to_exception", "exception_to_error",
]

PROTOCOL_VERSION = 3
ROLES = ("actor", "learner")

Array = NDArray[Any]
Arrays = Mapping[str, Array]


class Kind(str, Enum):
    """What a message asks for. A reply's header kind is REPLY; its ``for`` names the request kind."""

    HELLO = "hello"
    OPEN_SEGMENT = "open_segment"
    APPEND = "append"
    COMMIT = "commit"
    ABORT = "abort"
    PUSH_EPISODE = "push_episode"
    PUSH_EPISODES = "push_episodes"
    UPDATE_PRIORITIES = "update_priorities"
    GET = "get"
    GET_ROWS = "get_rows"
    SAMPLE = "sample"
    SAMPLE_SEQUENCES = "sample_sequences"
    EPISODES = "episodes"
    INFO = "info"
    HEARTBEAT = "heartbeat"
    CANCEL = "cancel"
    REPLY = "reply"


class ErrorCode(str, Enum):
    """Why the server refused a request. ERROR_CLASSES says what the client raises for each."""

    BAD_REQUEST = "bad_request"  # malformed message, unknown kind, bad field value
    UNSUPPORTED_VERSION = "unsupported_version"
    LIMIT_EXCEEDED = "limit_exceeded"  # the message names the limit
    SPACE_MISMATCH = "space_mismatch"  # arrays do not fit the space: missing/extra key, dtype, shape, text
    INDEX_OUT_OF_RANGE = "index_out_of_range"
    EVICTED = "evicted"  # a row id is no longer held
    NOT_ENOUGH_DATA = "not_enough_data"  # sampling before the buffer holds enough; retry later
    RATE_LIMITED = "rate_limited"  # the rate limit held the request back for its whole timeout
    UNKNOWN_SEGMENT = "unknown_segment"  # no open segment of that id for this client
    READ_ONLY = "read_only"  # a learner tried to write, or the store is read-only
    ACCESS_DENIED = "access_denied"  # the client's key was revoked, or its routing id is another key's
    STORAGE_ERROR = "storage_error"
    DISK_FULL = "disk_full"  # below the server's free-space reserve: nothing written; retry once space is freed
    BUSY = "busy"  # try again later
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"  # a server bug; the message has the exception type


# The one mapping from an error code to the exception the client raises. An unknown code (from a
# newer server) raises RemoteError with that code.
ERROR_CLASSES: Mapping[str, type[Exception]] = {
    ErrorCode.BAD_REQUEST.value: ProtocolError,
    ErrorCode.UNSUPPORTED_VERSION.value: UnsupportedVersionError,
    ErrorCode.LIMIT_EXCEEDED.value: LimitExceededError,
    ErrorCode.SPACE_MISMATCH.value: SpaceMismatchError,
    ErrorCode.INDEX_OUT_OF_RANGE.value: IndexError,
    ErrorCode.EVICTED.value: EvictedError,
    ErrorCode.NOT_ENOUGH_DATA.value: NotEnoughDataError,
    ErrorCode.RATE_LIMITED.value: RateLimitedError,
    ErrorCode.UNKNOWN_SEGMENT.value: SegmentStateError,
    ErrorCode.READ_ONLY.value: ReadOnlyError,
    ErrorCode.ACCESS_DENIED.value: AccessDeniedError,
    ErrorCode.STORAGE_ERROR.value: StorageError,
    ErrorCode.DISK_FULL.value: DiskFullError,
    ErrorCode.BUSY.value: ServerUnavailableError,
    ErrorCode.SHUTTING_DOWN.value: ServerUnavailableError,
    ErrorCode.INTERNAL.value: RemoteError,
}

# The reverse, for the server: most specific class first, so handlers never build codes by hand.
_CODE_OF_EXCEPTION: tuple[tuple[type[BaseException], ErrorCode], ...] = (
    (LimitExceededError, ErrorCode.LIMIT_EXCEEDED),
    (UnsupportedVersionError, ErrorCode.UNSUPPORTED_VERSION),
    (ProtocolError, ErrorCode.BAD_REQUEST),
    (ConfigError, ErrorCode.BAD_REQUEST),  # an argument the server cannot use (e.g. a bad seed)
    (SpaceMismatchError, ErrorCode.SPACE_MISMATCH),
    (EvictedError, ErrorCode.EVICTED),
    (IndexError, ErrorCode.INDEX_OUT_OF_RANGE),
    (NotEnoughDataError, ErrorCode.NOT_ENOUGH_DATA),
    (RateLimitedError, ErrorCode.RATE_LIMITED),
    (SegmentStateError, ErrorCode.UNKNOWN_SEGMENT),
    (ReadOnlyError, ErrorCode.READ_ONLY),
    (AccessDeniedError, ErrorCode.ACCESS_DENIED),
    (DiskFullError, ErrorCode.DISK_FULL),
    (StorageError, ErrorCode.STORAGE_ERROR),
    (ClosedError, ErrorCode.SHUTTING_DOWN),  # the server closed its storage on the way out
    (ServerUnavailableError, ErrorCode.BUSY),
)
_CODES = frozenset(code.value for code in ErrorCode)
_MAX_ERROR_CHARS = 4096


def error_to_exception(code: str, message: str) -> Exception:
    """The exception a client raises for an error reply (see ERROR_CLASSES)."""
    cls = ERROR_CLASSES.get(code, RemoteError)
    return RemoteError(message, code) if cls is RemoteError else cls(message)


def exception_to_error(exc: BaseException) -> tuple[ErrorCode, str]:
    """The (code, message) an error reply carries for an exception raised while serving a request."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, RemoteError) and exc.code in _CODES:
        return ErrorCode(exc.code), message
    for cls, code in _CODE_OF_EXCEPTION:
        if isinstance(exc, cls):
            return code, message
    return ErrorCode.INTERNAL, f"{type(exc).__name__}: {message}"


_MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one message or one client may not exceed; the server sends its limits in the hello reply.

    ``decode`` enforces the first four; the server enforces the rest. Set the socket's
    ZMQ_MAXMSGSIZE (which libzmq checks per frame, by disconnecting) no lower than
    ``max_message_bytes``, so that an oversized message gets an error reply instead.
    """

    max_message_bytes: int = 32 * _MiB
    # The hello reply carries the space's JSON, whose bounds may be per-element lists.
    max_header_bytes: int = 1 * _MiB
    max_frames: int = 1024
    # Rows in one append, push_episode, get or sample reply (batch_size * length for sequences).
    max_rows_per_message: int = 65_536
    max_rows_per_segment: int = 1_000_000
    max_open_segments_per_client: int = 16
    max_clients: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"Limits.{f.name} must be an int >= 1, got {value!r}")

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Limits:
        """Limits from a hello reply. Unknown names are ignored (a newer server may add limits).

        Raises:
            ProtocolError: not a map of names to ints >= 1.
        """
        if not isinstance(obj, dict):
            raise ProtocolError(f"field 'limits' must be a map, got {_show(obj)}")
        values = {}
        for f in fields(cls):
            if f.name in obj:
                value = obj[f.name]
                if type(value) is not int or value < 1:
                    raise ProtocolError(f"limit {f.name!r} must be an int >= 1, got {_show(value)}")
                values[f.name] = value
        return cls(**values)


DEFAULT_LIMITS = Limits()

#: Bytes to leave for the header when sizing a message that carries rows (append, reply to a read):
#: rows * row_bytes + ROWS_MESSAGE_OVERHEAD must stay within max_message_bytes.
ROWS_MESSAGE_OVERHEAD = 16 * 1024
#: Bytes a row id takes on the wire (get's indices and reply ids, get_rows' ids).
ID_BYTES = 8
#: Bytes a sample reply adds per sample: its row id, episode id and probability.
SAMPLE_INFO_BYTES = 24

# ---------------------------------------------------------------------------------------- messages


# Messages are frozen dataclasses without generated __eq__ / __repr__: equality of array fields is
# ambiguous anyway, and each generated method costs an exec at import (clients import this module).
@dataclass(frozen=True, eq=False, repr=False)
class Message:
    """Base of every message. `request_id` is chosen by the client and echoed in the reply."""

    request_id: int | None
    KIND: ClassVar[Kind]

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={_brief(getattr(self, f.name))}" for f in fields(self))
        return f"{type(self).__name__}({shown})"

    def _validate(self, limits: Limits) -> None:
        """Checks across fields, after each field has been checked on its own."""


@dataclass(frozen=True, eq=False, repr=False)
class Request(Message):
    """A message a client sends; the server answers it with exactly one Reply.

    What a kind is, the server dispatches on (never on a list of classes of its own):
    `READS`: answered from a published state of the file (a reader process may serve it);
    `WRITES`: changes rows (only an actor may send it); `DRAWS`: a draw, which a rate limit counts
    and which removes rows when the file's sampler does (the writer alone draws it then);
    `CARRIES_ROWS`: brings rows in its own arrays (a rate limit holding it back holds them)."""

    request_id: int
    READS: ClassVar[bool] = False
    WRITES: ClassVar[bool] = False
    DRAWS: ClassVar[bool] = False
    CARRIES_ROWS: ClassVar[bool] = False


@dataclass(frozen=True, eq=False, repr=False)
class Reply(Message):
    """A message the server sends back. KIND is the kind of request it answers.

    `ACKNOWLEDGES`: it acknowledges a change (a commit, a priority update), so it leaves only
    after the publish that carries the change; `DRAWN`: it answers a draw (leaving after the
    publish too when the draw changed the file's state)."""

    ok: ClassVar[bool] = True
    ACKNOWLEDGES: ClassVar[bool] = False
    DRAWN: ClassVar[bool] = False


@dataclass(frozen=True, eq=False, repr=False)
class Hello(Request):
    KIND = Kind.HELLO
    client_name: str
    role: str  # one of ROLES


@dataclass(frozen=True, eq=False, repr=False)
class OpenSegment(Request):
    KIND = Kind.OPEN_SEGMENT
    WRITES = True


_NO_PRIORITIES: Array = np.zeros(0, dtype=np.float64)
_NO_PRIORITIES.flags.writeable = False


def _check_priorities(priorities: Array, num_rows: int) -> None:
    if len(priorities) not in (0, num_rows):
        raise ProtocolError(f"priorities must be empty (none given) or one per row ({num_rows}), got {len(priorities)}")


@dataclass(frozen=True, eq=False, repr=False)
class Append(Request):
    KIND = Kind.APPEND
    WRITES = True
    CARRIES_ROWS = True
    segment_id: int
    num_rows: int
    arrays: Arrays
    priorities: Array = field(default_factory=lambda: _NO_PRIORITIES)  # one per row (NaN: the default), or none

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)
        _check_priorities(self.priorities, self.num_rows)


@dataclass(frozen=True, eq=False, repr=False)
class Commit(Request):
    KIND = Kind.COMMIT
    WRITES = True
    segment_id: int
    timeout: float = 0.0  # seconds the rate limit may hold the commit back
    idempotency_key: bytes | None = None  # 16 bytes, the same for every retry of this commit


@dataclass(frozen=True, eq=False, repr=False)
class Abort(Request):
    KIND = Kind.ABORT
    WRITES = True
    segment_id: int


@dataclass(frozen=True, eq=False, repr=False)
class PushEpisode(Request):
    KIND = Kind.PUSH_EPISODE
    WRITES = True
    CARRIES_ROWS = True
    num_rows: int
    arrays: Arrays
    timeout: float = 0.0
    priorities: Array = field(default_factory=lambda: _NO_PRIORITIES)
    idempotency_key: bytes | None = None

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)
        _check_priorities(self.priorities, self.num_rows)


@dataclass(frozen=True, eq=False, repr=False)
class PushEpisodes(Request):
    """k whole episodes in one message: `lengths` (k,) rows each, their rows one after another in
    `arrays` (num_rows in all), one idempotency key per episode (`keys`, k x 16 bytes)."""

    KIND = Kind.PUSH_EPISODES
    WRITES = True
    CARRIES_ROWS = True
    num_rows: int
    lengths: Array
    keys: Array
    arrays: Arrays
    timeout: float = 0.0
    priorities: Array = field(default_factory=lambda: _NO_PRIORITIES)

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)
        _check_priorities(self.priorities, self.num_rows)
        k = len(self.lengths)
        if k == 0:
            raise ProtocolError("push_episodes needs at least one episode")
        _check_rows_limit(k, "lengths (episodes)", limits)
        if int(np.min(self.lengths)) < 1:
            raise ProtocolError(f"every episode of push_episodes needs at least one row, got a length of "
                                f"{int(np.min(self.lengths))}")
        if int(np.sum(self.lengths)) != self.num_rows:
            raise ProtocolError(f"push_episodes lengths add up to {int(np.sum(self.lengths))} rows but the message "
                                f"has {self.num_rows}")
        if len(self.keys) != k:
            raise ProtocolError(f"push_episodes needs one idempotency key per episode, got {len(self.keys)} for {k}")
        if len({bytes(key) for key in self.keys}) != k:
            raise ProtocolError("push_episodes keys must differ: each episode has its own idempotency key")


@dataclass(frozen=True, eq=False, repr=False)
class UpdatePriorities(Request):
    KIND = Kind.UPDATE_PRIORITIES
    row_ids: Array
    priorities: Array

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        if len(self.priorities) != len(self.row_ids):
            raise ProtocolError(f"update_priorities needs one priority per row id, got {len(self.priorities)} for "
                                f"{len(self.row_ids)}")


@dataclass(frozen=True, eq=False, repr=False)
class Get(Request):
    KIND = Kind.GET
    READS = True
    min_seq: int
    indices: Array

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.indices), "indices", limits)


@dataclass(frozen=True, eq=False, repr=False)
class GetRows(Request):
    KIND = Kind.GET_ROWS
    READS = True
    min_seq: int
    row_ids: Array

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        if len(self.row_ids) and int(np.min(self.row_ids)) < 0:
            raise ProtocolError(f"row ids must be >= 0, got {int(np.min(self.row_ids))}")


@dataclass(frozen=True, eq=False, repr=False)
class Sample(Request):
    KIND = Kind.SAMPLE
    READS = True
    DRAWS = True
    batch_size: int
    seed: int | None = None
    min_seq: int = 0
    timeout: float = 0.0  # seconds the rate limit may hold the sample back (writer-side sampling)

    @property
    def num_drawn(self) -> int:
        """Rows the draw hands out (what a rate limit counts)."""
        return self.batch_size


@dataclass(frozen=True, eq=False, repr=False)
class SampleSequences(Request):
    KIND = Kind.SAMPLE_SEQUENCES
    READS = True
    DRAWS = True
    batch_size: int
    length: int
    seed: int | None = None
    min_seq: int = 0
    with_rows: bool = True  # False: only the windows' ids (the learner then fetches rows by id)
    timeout: float = 0.0

    @property
    def num_drawn(self) -> int:
        """Rows the draw hands out (what a rate limit counts): every row of every window."""
        return self.batch_size * self.length

    def _validate(self, limits: Limits) -> None:
        if self.length < 1:
            raise ProtocolError(f"field 'length' must be >= 1, got {self.length}")
        if self.length > limits.max_rows_per_segment:  # no episode the server takes is longer
            raise LimitExceededError(f"field 'length' is {self.length} rows, over the limit max_rows_per_segment="
                                     f"{limits.max_rows_per_segment}: no episode holds such a window")
        if self.with_rows:
            _check_rows_limit(self.batch_size * self.length, "batch_size * length", limits)


@dataclass(frozen=True, eq=False, repr=False)
class Episodes(Request):
    """The complete episodes held, oldest first; with `first_episode` / `max_episodes`, at most
    that many from that episode id on (a list too long for one message is read in pages)."""

    KIND = Kind.EPISODES
    READS = True
    min_seq: int = 0
    first_episode: int | None = None
    max_episodes: int | None = None


@dataclass(frozen=True, eq=False, repr=False)
class Info(Request):
    KIND = Kind.INFO


@dataclass(frozen=True, eq=False, repr=False)
class Cancel(Request):
    """Drop this client's own samples that still wait for the rate limit (a learner leaving a
    `batches` loop, or giving up on the rest of a split sample): their draws are never made."""

    KIND = Kind.CANCEL
    request_ids: Array

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.request_ids), "request_ids", limits)


@dataclass(frozen=True, eq=False, repr=False)
class Heartbeat(Request):
    KIND = Kind.HEARTBEAT


@dataclass(frozen=True, eq=False, repr=False)
class HelloReply(Reply):
    KIND = Kind.HELLO
    space: dict[str, Any]  # Space.to_json(); rebuild with space_from_json
    capacity: int | None  # None: the store grows without bound
    length: int
    num_episodes: int
    server_version: str
    protocol_version: int
    limits: Limits
    read_endpoint: str  # where learners send their reads (reader processes)
    replay_id: str  # the file's UUID: tells this replay from any other
    instance_id: str  # this server process's UUID: tells a restarted server from the same one
    # {name: scalar}: sampler, writer_samples (learners send samples to the writer), ...
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, eq=False, repr=False)
class OpenSegmentReply(Reply):
    KIND = Kind.OPEN_SEGMENT
    segment_id: int


@dataclass(frozen=True, eq=False, repr=False)
class AppendReply(Reply):
    KIND = Kind.APPEND
    segment_length: int  # rows in the segment so far


@dataclass(frozen=True, eq=False, repr=False)
class CommitReply(Reply):
    KIND = Kind.COMMIT
    ACKNOWLEDGES = True
    episode_id: int | None  # None: the segment was empty, nothing was recorded
    first_row_id: int | None
    length: int


@dataclass(frozen=True, eq=False, repr=False)
class AbortReply(Reply):
    KIND = Kind.ABORT


@dataclass(frozen=True, eq=False, repr=False)
class PushEpisodeReply(Reply):
    KIND = Kind.PUSH_EPISODE
    ACKNOWLEDGES = True
    episode_id: int | None
    first_row_id: int | None
    length: int


@dataclass(frozen=True, eq=False, repr=False)
class PushEpisodesReply(Reply):
    KIND = Kind.PUSH_EPISODES
    ACKNOWLEDGES = True
    episodes: Array  # int64 (k, 3): (episode_id, first_row_id, length) of each episode, in the order sent


@dataclass(frozen=True, eq=False, repr=False)
class UpdatePrioritiesReply(Reply):
    KIND = Kind.UPDATE_PRIORITIES
    ACKNOWLEDGES = True
    ignored: int  # ids no longer held (evicted, cleared or removed): ignored, as Reverb does
    seq: int  # the publish that makes the new priorities durable and visible to readers (may follow the reply)


@dataclass(frozen=True, eq=False, repr=False)
class ReadReply(Reply):
    """Base of the replies to reads: the published state ("view") that answered."""

    seq: int
    generation: int
    begin: int  # id of the oldest row held
    end: int  # id the next committed row gets


@dataclass(frozen=True, eq=False, repr=False)
class GetReply(ReadReply):
    KIND = Kind.GET
    row_ids: Array
    arrays: Arrays

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        _check_leading(self.arrays, len(self.row_ids))


@dataclass(frozen=True, eq=False, repr=False)
class GetRowsReply(ReadReply):
    KIND = Kind.GET_ROWS
    num_rows: int
    arrays: Arrays

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)


@dataclass(frozen=True, eq=False, repr=False)
class SampleReply(ReadReply):
    KIND = Kind.SAMPLE
    DRAWN = True
    row_ids: Array
    episode_ids: Array
    probabilities: Array
    arrays: Arrays

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        _check_info(self.row_ids, self.episode_ids, self.probabilities)
        _check_leading(self.arrays, len(self.row_ids))


@dataclass(frozen=True, eq=False, repr=False)
class SampleSequencesReply(ReadReply):
    KIND = Kind.SAMPLE_SEQUENCES
    DRAWN = True
    row_ids: Array  # of each window's first row
    episode_ids: Array
    probabilities: Array
    arrays: Arrays  # each (batch, length, ...); none when the request asked for ids only

    def _validate(self, limits: Limits) -> None:
        _check_info(self.row_ids, self.episode_ids, self.probabilities)
        _check_leading(self.arrays, len(self.row_ids))
        lengths = {np.shape(a)[1] if np.ndim(a) >= 2 else -1 for a in self.arrays.values()}
        if len(lengths) > 1 or -1 in lengths:
            shapes = {name: np.shape(a) for name, a in self.arrays.items()}
            raise ProtocolError(f"sequence arrays must all be (batch, length, ...), got shapes {shapes}")
        _check_rows_limit(len(self.row_ids) * max(lengths, default=0), "batch_size * length", limits)


@dataclass(frozen=True, eq=False, repr=False)
class EpisodesReply(ReadReply):
    KIND = Kind.EPISODES
    episodes: Array  # int64 (n, 3): (episode_id, first_row_id, length) per complete episode, oldest first


@dataclass(frozen=True, eq=False, repr=False)
class InfoReply(Reply):
    KIND = Kind.INFO
    # Scalars by name: length, capacity, num_episodes, open_segments, clients, rows_in, rows_out,
    # bytes_in, bytes_out, commits, aborts, file_bytes, uptime, rows_in_per_s, rows_out_per_s, ...
    stats: dict[str, int | float | str | bool | None]


@dataclass(frozen=True, eq=False, repr=False)
class HeartbeatReply(Reply):
    KIND = Kind.HEARTBEAT


@dataclass(frozen=True, eq=False, repr=False)
class CancelReply(Reply):
    KIND = Kind.CANCEL
    request_ids: Array  # those that were waiting and are dropped: they get no other reply


@dataclass(frozen=True, eq=False, repr=False)
class ErrorReply(Reply):
    """The server refused the request; `code` is an ErrorCode value (or a newer server's code)."""

    KIND = Kind.REPLY
    ok = False
    code: str
    message: str

    @classmethod
    def from_exception(cls, request_id: int | None, exc: BaseException) -> ErrorReply:
        code, message = exception_to_error(exc)
        return cls(request_id, code.value, message[:_MAX_ERROR_CHARS])

    def exception(self) -> Exception:
        """The exception the client raises for this reply."""
        return error_to_exception(self.code, self.message)


_REQUEST_CLASSES: dict[str, type[Request]] = {
    c.KIND.value: c
    for c in (Hello, OpenSegment, Append, Commit, Abort, PushEpisode, PushEpisodes, UpdatePriorities, Get, GetRows, Sample,
              SampleSequences, Episodes, Info, Heartbeat, Cancel)
}
_REPLY_CLASSES: dict[str, type[Reply]] = {
    c.KIND.value: c
    for c in (HelloReply, OpenSegmentReply, AppendReply, CommitReply, AbortReply, PushEpisodeReply, PushEpisodesReply,
              UpdatePrioritiesReply, GetReply, GetRowsReply, SampleReply, SampleSequencesReply, EpisodesReply, InfoReply, HeartbeatReply,
              CancelReply)
}

# --------------------------------------------------------------------------------- field checks
# A field name means the same thing, with the same type, in every message that has it.

_U64_MAX = (1 << 64) - 1
_MAX_NAME_CHARS = 256
_MAX_NDIM = 32


def _brief(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array({value.dtype}, {value.shape})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_brief(v)}" for k, v in value.items()) + "}"
    return reprlib.repr(value)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"  # reprlib: bounded, even for deep nesting


def _uint(value: Any, name: str, limits: Limits) -> int:
    if type(value) is not int or not 0 <= value <= _U64_MAX:  # `type is`: a bool is not an int here
        raise ProtocolError(f"field {name!r} must be an int >= 0, got {_show(value)}")
    return value


def _optional_uint(value: Any, name: str, limits: Limits) -> int | None:
    return None if value is None else _uint(value, name, limits)


def _check_rows_limit(num_rows: int, what: str, limits: Limits) -> None:
    if num_rows > limits.max_rows_per_message:
        raise LimitExceededError(
            f"{what} is {num_rows} rows, over the limit max_rows_per_message="
            f"{limits.max_rows_per_message}; send or ask for fewer rows per message"
        )


def _rows(value: Any, name: str, limits: Limits) -> int:
    _check_rows_limit(_uint(value, name, limits), f"field {name!r}", limits)
    return value  # type: ignore[no-any-return]


def _batch_size(value: Any, name: str, limits: Limits) -> int:
    if _rows(value, name, limits) < 1:
        raise ProtocolError(f"field {name!r} must be >= 1, got {value}")
    return value  # type: ignore[no-any-return]


def _text(value: Any, name: str, limits: Limits) -> str:
    if type(value) is not str:
        raise ProtocolError(f"field {name!r} must be a string, got {_show(value)}")
    return value


def _client_name(value: Any, name: str, limits: Limits) -> str:
    if not 1 <= len(_text(value, name, limits)) <= _MAX_NAME_CHARS:
        raise ProtocolError(f"field {name!r} must have 1 to {_MAX_NAME_CHARS} characters, got {len(value)}")
    return value  # type: ignore[no-any-return]


def _role(value: Any, name: str, limits: Limits) -> str:
    if value not in ROLES or type(value) is not str:
        raise ProtocolError(f"field {name!r} must be one of {ROLES}, got {_show(value)}")
    return value


def _is_json(obj: Any, depth: int = 0) -> bool:
    if obj is None or type(obj) in (bool, int, float, str):
        return True
    if depth >= _MAX_NDIM:
        return False
    if type(obj) is list:
        return all(_is_json(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return all(type(k) is str and _is_json(v, depth + 1) for k, v in obj.items())
    return False


def _json_map(value: Any, name: str, limits: Limits) -> dict[str, Any]:
    if type(value) is not dict or not _is_json(value):
        raise ProtocolError(f"field {name!r} must be a JSON-like map, got {_show(value)}")
    return value


def _stats(value: Any, name: str, limits: Limits) -> dict[str, Any]:
    if type(value) is not dict or not all(
        type(k) is str and (v is None or type(v) in (bool, int, float, str)) for k, v in value.items()
    ):
        raise ProtocolError(f"field {name!r} must map names to scalars, got {_show(value)}")
    return value


_MAX_TIMEOUT = 86_400.0  # a day: longer is a mistake, not a wait


def _seconds(value: Any, name: str, limits: Limits) -> float:
    if type(value) not in (int, float) or not 0 <= value <= _MAX_TIMEOUT:  # NaN fails both comparisons
        raise ProtocolError(f"field {name!r} must be seconds in [0, {_MAX_TIMEOUT:g}], got {_show(value)}")
    return float(value)


IDEMPOTENCY_KEY_BYTES = 16


def _key(value: Any, name: str, limits: Limits) -> bytes | None:
    if value is not None and (type(value) is not bytes or len(value) != IDEMPOTENCY_KEY_BYTES):
        raise ProtocolError(f"field {name!r} must be {IDEMPOTENCY_KEY_BYTES} bytes (msgpack bin), got {_show(value)}")
    return value


def _limits(value: Any, name: str, limits: Limits) -> Limits:
    return Limits.from_json(value)


def _bool(value: Any, name: str, limits: Limits) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"field {name!r} must be a bool, got {_show(value)}")
    return value


_SCALAR_CHECKS: dict[str, Callable[[Any, str, Limits], Any]] = {
    "client_name": _client_name, "role": _role, "segment_id": _uint, "num_rows": _rows,
    "batch_size": _batch_size, "length": _uint, "seed": _optional_uint, "first_row_id": _optional_uint,
    "episode_id": _optional_uint, "segment_length": _uint, "capacity": _optional_uint, "num_episodes": _uint,
    "server_version": _text, "protocol_version": _uint, "space": _json_map, "limits": _limits,
    "stats": _stats, "code": _text, "message": _text, "read_endpoint": _text, "replay_id": _text,
    "instance_id": _text, "min_seq": _uint, "seq": _uint, "generation": _uint, "begin": _uint, "end": _uint,
    "with_rows": _bool, "timeout": _seconds, "ignored": _uint, "sampling": _stats, "idempotency_key": _key,
    "first_episode": _optional_uint, "max_episodes": _optional_uint,
}
# Fields added within version 3, which earlier version 3 peers leave out: decoded as the message's
# default when absent. `encode` leaves one out only when it is None.
_OPTIONAL_SCALARS = frozenset({"idempotency_key", "timeout", "first_episode", "max_episodes"})


@dataclass(frozen=True)
class _ArrayField:
    dtype: np.dtype[Any]
    ndim: int
    columns: int | None = None  # the second axis of a 2-d field
    optional: bool = False  # left out of the message when empty (and then decoded as empty)


# A message's own arrays: one dtype and shape each, whatever message carries them.
_ARRAY_FIELDS: dict[str, _ArrayField] = {
    "indices": _ArrayField(np.dtype("<i8"), 1),
    "row_ids": _ArrayField(np.dtype("<i8"), 1),
    "episode_ids": _ArrayField(np.dtype("<u8"), 1),
    "probabilities": _ArrayField(np.dtype("<f8"), 1),
    "priorities": _ArrayField(np.dtype("<f8"), 1, optional=True),
    "episodes": _ArrayField(np.dtype("<i8"), 2, 3),
    "lengths": _ArrayField(np.dtype("<i8"), 1),
    "keys": _ArrayField(np.dtype("|u1"), 2, IDEMPOTENCY_KEY_BYTES),
    "request_ids": _ArrayField(np.dtype("<u8"), 1),
}


@dataclass(frozen=True)
class _Layout:
    scalars: tuple[str, ...]
    required: frozenset[str]  # the scalars a message must carry
    array_fields: tuple[str, ...]
    has_leaves: bool
    header_keys: frozenset[str]


def _layout(cls: type[Message]) -> _Layout:
    names = [f.name for f in fields(cls) if f.name != "request_id"]
    unknown = [n for n in names if n not in _SCALAR_CHECKS and n not in _ARRAY_FIELDS and n != "arrays"]
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
        header_keys=frozenset(header_keys),
    )


_LAYOUTS = {cls: _layout(cls) for cls in [*_REQUEST_CLASSES.values(), *_REPLY_CLASSES.values(), ErrorReply]}


def _check_info(row_ids: Array, episode_ids: Array, probabilities: Array) -> None:
    if not len(row_ids) == len(episode_ids) == len(probabilities):
        raise ProtocolError(f"row_ids, episode_ids and probabilities must have one entry per sample, got "
                            f"{len(row_ids)}, {len(episode_ids)} and {len(probabilities)}")


def _check_leading(arrays: Arrays, num_rows: int) -> None:
    for name, arr in arrays.items():
        shape = arr.shape if isinstance(arr, np.ndarray) else np.shape(arr)
        if not shape or shape[0] != num_rows:
            raise ProtocolError(
                f"array {name!r} has shape {shape} but the message has {num_rows} rows; "
                f"every leaf array needs a leading axis of {num_rows}"
            )


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
        arrays += [(name, _leaf_array(a, name)) for name, a in getattr(msg, "arrays").items()]  # noqa: B009
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


def _check_sizes(sizes: list[int], limits: Limits) -> None:
    """`sizes`: the byte size of each frame, header first."""
    if len(sizes) > limits.max_frames:
        raise LimitExceededError(f"message has {len(sizes)} frames, over the limit max_frames={limits.max_frames}")
    if sum(sizes) > limits.max_message_bytes:
        raise LimitExceededError(
            f"message has {sum(sizes)} bytes, over the limit max_message_bytes={limits.max_message_bytes}; "
            "send fewer rows per message"
        )
    if sizes[0] > limits.max_header_bytes:
        raise LimitExceededError(
            f"header frame has {sizes[0]} bytes, over the limit max_header_bytes={limits.max_header_bytes}"
        )


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
            values[name] = _NO_PRIORITIES  # the one optional own array (read-only, like every decoded one)
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
    if layout.has_leaves:
        values["arrays"] = leaves
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
