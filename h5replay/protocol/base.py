"""What every message is: its kind, the Message / Request / Reply bases, and the error reply.

A class says what its message is (a read, a write, a draw; a reply that acknowledges a change),
so the server dispatches on that, never on lists of classes of its own. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import ClassVar

from h5replay.protocol.checks import Limits, _brief
from h5replay.protocol.codes import _MAX_ERROR_CHARS, error_to_exception, exception_to_error

__all__ = ["Kind", "Message", "Request", "Reply", "ErrorReply"]


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
    SAMPLE_TRANSITIONS = "sample_transitions"
    EPISODES = "episodes"
    INFO = "info"
    HEARTBEAT = "heartbeat"
    CANCEL = "cancel"
    REPLY = "reply"


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
