"""Several requests at once: reads kept within the in-flight window, consuming draws that never
drop a row they drew, and the leaves of several replies joined in order.

A draw that changes the server's state (a queue's removal, a rate limit's count) cannot be made
again: when a call sends several (a batch split over messages) and one fails, no more are sent,
those still waiting for the rate limit are cancelled (they are never drawn), and the others are
read: what they drew is returned with the failure, for the caller to keep (_kept.py). Pure
plans (see ops.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np

from h5replay import protocol as P
from h5replay.client._core.ops import (
    FlushPriorities,
    Forget,
    Plan,
    RequestFactory,
    Send,
    Target,
    Wait,
    checked,
)
from h5replay.client._core.state import LearnerState
from h5replay.client._kept import Part
from h5replay.client._reads import sample_info
from h5replay.errors import ClosedError, ProtocolError, ServerUnavailableError

__all__ = ["collect", "draw_all", "fresh", "joined", "read_many"]


def fresh(state: LearnerState) -> Plan[None]:
    """Before a read is built: the priority updates this client holds back are flushed first, so
    that the read sees them (its min_seq names their publish)."""
    if state.updates_pending():
        yield FlushPriorities()


def read_many(state: LearnerState, target: Target, factories: Sequence[RequestFactory],
              timeout: float | None = None) -> Plan[list[P.Reply]]:
    """The replies to several requests on `target`, in order, keeping up to `max_in_flight` of
    them travelling at once; every read reply moves the view. The first refusal (or failure) is
    raised, and the replies still travelling are forgotten."""
    window = state.config.max_in_flight
    replies: list[P.Reply] = []
    pending: deque[int] = deque()
    try:
        for factory in factories:
            if len(pending) >= window:
                replies.append(checked((yield Wait(target, pending.popleft(), timeout))))
            pending.append((yield Send(target, factory)))
        while pending:
            replies.append(checked((yield Wait(target, pending[0], timeout))))
            pending.popleft()
    except GeneratorExit:
        raise
    except BaseException:
        for request_id in pending:
            yield Forget(target, request_id)
        raise
    for reply in replies:
        if isinstance(reply, P.ReadReply):
            state.observe(reply)
    return replies


def draw_all(state: LearnerState, target: Target,
             factories: Sequence[RequestFactory]) -> Plan[tuple[list[Part], BaseException | None]]:
    """(parts, first failure) of draws that change the server's state, `max_in_flight` at a time.
    No reply is given up on: after the first failure no more parts are sent, those still waiting
    for the rate limit are cancelled, and the others are read (they were drawn)."""
    config = state.config
    timeout = config.timeout + config.rate_limit_timeout
    parts: list[Part] = []
    pending: list[int] = []
    error: BaseException | None = None
    try:
        for factory in factories:
            if len(pending) >= config.max_in_flight:
                drawn, error = yield from collect(state, target, pending[:1], cancel=False, timeout=timeout)
                del pending[:1]
                parts += drawn
                if error is not None:
                    break
            pending.append((yield Send(target, factory)))
    except (ServerUnavailableError, ProtocolError) as exc:  # a part that could not leave
        error = exc
    drawn, late = yield from collect(state, target, pending, cancel=error is not None, timeout=timeout)
    return parts + drawn, error or late


def collect(state: LearnerState, target: Target, request_ids: list[int], *, cancel: bool,
            timeout: float, parts: list[Part] | None = None) -> Plan[tuple[list[Part], BaseException | None]]:
    """(parts, first failure) of draws in flight, in order; with `cancel`, those still waiting
    for the rate limit are cancelled first (they are never drawn), and the others, served
    already, are waited for the client's timeout. Each id is taken off `request_ids` once its
    reply is read, and its part put in `parts` (given: the caller's): an interrupted collect
    (KeyboardInterrupt, a cancellation) leaves the caller what was drawn and what still travels."""
    cancelled: set[int] = set()
    if cancel and request_ids:
        ids = np.array(request_ids, np.uint64)
        try:
            cancel_id = yield Send(target, lambda rid: P.Cancel(rid, ids))
            reply = checked((yield Wait(target, cancel_id)))
            cancelled = {int(i) for i in reply.request_ids}
            timeout = state.config.timeout
        except (ServerUnavailableError, ProtocolError):
            pass  # an older server cannot cancel: wait for them all
    parts = [] if parts is None else parts
    error: BaseException | None = None
    while request_ids:
        request_id = request_ids[0]
        if request_id in cancelled:
            request_ids.pop(0)
            yield Forget(target, request_id)
            continue
        try:
            reply = checked((yield Wait(target, request_id, timeout)))
        except ClosedError:
            raise
        except Exception as exc:  # the server's refusal, or no answer: nothing of it was drawn here
            request_ids.pop(0)
            error = error or exc
            continue
        request_ids.pop(0)
        state.observe(reply)
        parts.append((state.rows_of(reply), sample_info([reply])))
    return parts, error


def joined(parts: list[Mapping[str, np.ndarray]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """The leaves `names` of several replies, one after another (one reply's as they came: no copy)."""
    if len(parts) == 1:
        return dict(parts[0])
    return {name: np.concatenate([p[name] for p in parts]) for name in names}
