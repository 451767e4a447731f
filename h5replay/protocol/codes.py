"""Why the server refused a request: the error codes, and the exception each one stands for.

The one mapping both ways: a client raises ERROR_CLASSES[code] for an error reply; the server
finds the code of the exception a request raised (`exception_to_error`), so handlers never build
codes by hand. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

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

__all__ = ["ErrorCode", "ERROR_CLASSES", "error_to_exception", "exception_to_error"]


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
