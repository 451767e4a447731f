"""Every exception h5replay raises on purpose.

Callers catch one root, or one branch, and never parse messages::

    H5ReplayError
    ├── ConfigError                 (also ValueError)   a setting or argument is invalid
    ├── SpaceMismatchError          (also ValueError)   a value does not fit the space: names key and expectation
    ├── ReadOnlyError                                   a write on a storage opened read-only, or by a learner
    ├── AccessDeniedError           (also PermissionError) the client's key is no longer admitted, or its routing id is another's
    ├── StorageError                                    HDF5 failure or unusable file; the original is __cause__
    │   ├── FormatVersionError                          the file was written by an unknown h5replay format
    │   └── DiskFullError                               the disk is below the server's free-space reserve
    ├── SegmentStateError           (also RuntimeError) a segment writer used after commit/abort, or misused
    ├── NotEnoughDataError          (also ValueError)   sampling asks for more than the buffer holds
    ├── EvictedError                (also IndexError)   a row id is no longer held (the ring moved past it)
    ├── RateLimitedError            (also TimeoutError) the rate limit held a sample or an insert back too long
    ├── ProtocolError                                   malformed message, unknown kind, version mismatch
    │   ├── UnsupportedVersionError                     the peer speaks another protocol version
    │   └── LimitExceededError                          a request is over a limit; the message names it
    ├── ClosedError                 (also RuntimeError) *you* called close() on it
    ├── RemoteError                                     the server refused a request; `.code` says why
    └── ServerUnavailableError      (also TimeoutError) no reply within `timeout`, or the server went away
        └── CommitInDoubtError                          a shard went away with a commit's reply: kept, settled there later

An index out of range raises the built-in `IndexError`, as numpy and h5py do.
"""

from __future__ import annotations

__all__ = [
    "H5ReplayError",
    "ConfigError",
    "SpaceMismatchError",
    "ReadOnlyError",
    "AccessDeniedError",
    "StorageError",
    "FormatVersionError",
    "DiskFullError",
    "SegmentStateError",
    "NotEnoughDataError",
    "EvictedError",
    "RateLimitedError",
    "ProtocolError",
    "UnsupportedVersionError",
    "LimitExceededError",
    "ClosedError",
    "RemoteError",
    "ServerUnavailableError",
    "CommitInDoubtError",
]


class H5ReplayError(Exception):
    """Root of every error h5replay raises on purpose."""


class ConfigError(H5ReplayError, ValueError):
    """A setting or argument is invalid (capacity, chunks, compression, paths...)."""


class SpaceMismatchError(H5ReplayError, ValueError):
    """A value does not fit the space; the message names the key and what was expected.

    Attributes:
        row: for a value outside a Box's bounds (or NaN), the row it is in; else None.
    """

    row: int | None = None


class ReadOnlyError(H5ReplayError):
    """A write was attempted on a storage or buffer opened read-only."""


class AccessDeniedError(H5ReplayError, PermissionError):
    """The server refused a request for who sent it: the client's CURVE key was removed from the
    server's key directories, or its routing id is bound to another key."""


class StorageError(H5ReplayError):
    """The HDF5 layer failed or the file is unusable; the h5py error is kept as __cause__."""


class FormatVersionError(StorageError):
    """The file records an h5replay format version this code does not know."""


class DiskFullError(StorageError):
    """The disk holding the file has less free space than the server keeps in reserve
    (`--min-free-bytes`): new rows are refused before anything is written, reads go on, and
    writes resume by themselves once space is freed. Nothing was written."""


class SegmentStateError(H5ReplayError, RuntimeError):
    """A segment writer was used after commit or abort, or committed where it cannot go."""


class NotEnoughDataError(H5ReplayError, ValueError):
    """Sampling from an empty buffer, or asking for sequences longer than every episode held."""


class EvictedError(H5ReplayError, IndexError):
    """A row id asked for is no longer held: the ring overwrote it, or `clear()` dropped it."""


class RateLimitedError(H5ReplayError, TimeoutError):
    """The rate limit kept a sample or an insert waiting past its timeout; the message says which
    side is ahead, and by how much."""


class ProtocolError(H5ReplayError):
    """A wire message is malformed, of an unknown kind, or of another protocol version."""


class UnsupportedVersionError(ProtocolError):
    """The peer speaks a protocol version this code does not; upgrade one side."""


class LimitExceededError(ProtocolError):
    """A message or request is over a limit (size, frames, rows, open segments, clients)."""


class ClosedError(H5ReplayError, RuntimeError):
    """The object was closed by its owner and cannot be used any more."""


class RemoteError(H5ReplayError):
    """The server answered a request with an error; `code` is a protocol error code."""

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class ServerUnavailableError(H5ReplayError, TimeoutError):
    """The server did not answer within the timeout, or went away."""


class CommitInDoubtError(ServerUnavailableError):
    """A shard stopped answering after a commit of the episode was sent to it, so it may hold it.

    The actor keeps the episode (in memory) and settles it on that shard, with its idempotency
    key, when the shard answers again: the original receipt if it had applied it, a first commit
    if not. Never push the episode again yourself: it would be held twice. `ActorClient.in_doubt`
    lists it until then, with its receipt after; `ActorClient.settle()` waits for it.

    Attributes:
        key: the episode's idempotency key.
        shard: the shard it is settled on (its index in `endpoints`).
        length: its number of rows.
    """

    def __init__(self, message: str, key: bytes, shard: int, length: int) -> None:
        super().__init__(message)
        self.key, self.shard, self.length = key, shard, length

    def __reduce__(self) -> tuple[type[CommitInDoubtError], tuple[str, bytes, int, int]]:
        return type(self), (str(self), self.key, self.shard, self.length)  # picklable (processes, Ray)
