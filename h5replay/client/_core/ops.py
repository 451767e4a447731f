"""The operations a plan yields to its driver, and what a reply means.

A plan (a generator) yields one operation at a time and is sent its result: `Send` -> the
request id the driver gave the request; `Wait` -> the reply (an `ErrorReply` too: `checked`
turns it into the exception); `Forget`, `Sleep`, `FlushPriorities` -> None; `Now` -> a
monotonic clock in seconds; `Deliver` (only in a stream, `batches`) -> None once the caller asked
for the next value. A failure of the operation itself (no reply within the timeout:
ServerUnavailableError; a closed client: ClosedError; KeyboardInterrupt, cancellation) is
thrown into the plan at its `yield`, so the plan decides what to keep. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from h5replay import protocol as P

__all__ = [
    "READS", "WRITER", "Deliver", "FlushPriorities", "Forget", "LoopLeft", "Now", "Op", "Plan", "Send", "Sleep",
    "Target", "Wait", "checked", "finished",
]

#: Which connection an operation uses: the writer's endpoint, or the readers' (the same socket
#: when the server has no reader processes).
Target = Literal["writer", "reads"]
WRITER: Target = "writer"
READS: Target = "reads"

RequestFactory = Callable[[int], P.Request]  # request id -> the request (the driver picks the id)


@dataclass(frozen=True)
class Send:
    """Send `request(request_id)` on `target`; the result is the request id. `timeout`: seconds
    to wait for room or a connected server (None: the client's), then ServerUnavailableError."""

    target: Target
    request: RequestFactory
    timeout: float | None = None


@dataclass(frozen=True)
class Wait:
    """The reply to `request_id` on `target`, within `timeout` seconds (None: the client's)."""

    target: Target
    request_id: int
    timeout: float | None = None


@dataclass(frozen=True)
class Forget:
    """Drop the reply of a request the plan gave up on (when it comes, it is not kept)."""

    target: Target
    request_id: int


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class Now:
    """The driver's monotonic clock, in seconds."""


@dataclass(frozen=True)
class FlushPriorities:
    """Send the priority updates this client holds back (sent with wait=False) and read their
    replies, so that the read built next sees them. A driver without such updates does nothing."""


@dataclass(frozen=True)
class Deliver:
    """Hand `value` to the caller of a stream (a batch of `batches`); resumed when the next is asked for."""

    value: Any


Op = Send | Wait | Forget | Sleep | Now | FlushPriorities | Deliver
T = TypeVar("T")
#: A plan: yields operations, is sent their results, returns the verb's result.
Plan = Generator[Op, Any, T]


class LoopLeft(Exception):
    """Thrown into a stream's plan when its caller leaves the loop: the plan cleans up (forgets,
    or cancels and keeps what was drawn) and re-raises it."""


def finished(value: T) -> Plan[T]:
    """A plan of no operation that returns `value` (a figure a caller already has)."""
    return value
    yield  # a generator all the same


def checked(reply: P.Reply) -> Any:
    """`reply`, or its exception raised when it is the server's refusal (an error code travels, never text)."""
    if isinstance(reply, P.ErrorReply):
        raise reply.exception()
    return reply
