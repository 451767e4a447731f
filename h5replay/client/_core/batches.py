"""The plan of `batches`: batches without end, with requests kept in flight ahead of the caller.

Without a seed, from readers (no rate limit, no rows removed as sampled), one request carries
several batches (up to `prefetch // 2`, about 1 MiB at most; always two requests or more in
flight). When the caller leaves the loop the driver throws `LoopLeft` in: requests still
travelling are forgotten, except from a table whose draws change the server's state: there
those still waiting for the rate limit are cancelled and what was drawn is kept (`num_kept`),
so no row is drawn for nobody. Pure plans (see ops.py).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any

from h5replay.client._core.draws import sample, sample_requests, sample_sequences, window_requests
from h5replay.client._core.exchange import collect, fresh, joined
from h5replay.client._core.ops import READS, Deliver, Forget, Plan, RequestFactory, Send, Wait, checked
from h5replay.client._core.state import LearnerState
from h5replay.client._kept import Part, join_parts, kept_error
from h5replay.client._reads import TableDraws, _positive, _seed, sample_info
from h5replay.errors import ClosedError

__all__ = ["batches"]

_REQUEST_BYTES = 1 << 20  # rows one request of `batches` carries for several batches, at most


def batches(state: LearnerState, batch_size: Any, prefetch: Any, sequence_length: Any, with_info: bool,
            seed: int | None, table: str | None) -> Plan[None]:
    """The stream of `batches` (see LearnerClient.batches): its arguments and table are checked
    now, before the first batch is asked for.

    Raises:
        ConfigError: a size that is not a positive int, or no such table.
    """
    size = _positive(batch_size, "batch_size")
    steps = None if sequence_length is None else _positive(sequence_length, "sequence_length")
    ahead = _positive(prefetch, "prefetch")
    t = state.table(table)

    def one_batch(k: int) -> Plan[Any]:
        if steps is None:
            drawn = yield from sample(state, size, _seed(seed, k), with_info, table)
        else:
            drawn = yield from sample_sequences(state, size, steps, _seed(seed, k), with_info, table, False)
        return drawn.result()

    if steps is not None and t.rows_per_sample < steps:
        return _one_at_a_time(one_batch, 0)  # huge windows are read by id
    group = 1 if seed is not None else _batches_per_request(state, size * (steps or 1), ahead, t)

    def requests(batch_seed: int | None) -> list[RequestFactory]:
        if steps is None:
            return sample_requests(state, size * group, batch_seed, t)
        return window_requests(state, size * group, steps, batch_seed, t) or []

    parts = len(requests(None))
    kind = (("rows",) if steps is None else ("windows", steps)) + t.kind
    pipelined = _pipelined(state, lambda k: requests(_seed(seed, k * parts)), -(-ahead // group), with_info, t,
                           group, kind)
    if state.reads_locally(t):  # drawn from this client's view of the file: nothing to keep in flight
        return _while_local(state, t, one_batch, seed, parts, pipelined)
    if not t.consuming:
        return pipelined
    return _kept_first(state, kind, one_batch, pipelined)


def _while_local(state: LearnerState, t: TableDraws, one_batch: Callable[[int], Plan[Any]], seed: int | None,
                 parts: int, then: Plan[None]) -> Plan[None]:
    """Batches drawn one at a time from this client's own view of the file (as the pipelined ones
    would be: with a seed, the same parts and seeds), then, once the view is given up, `then`."""
    k = 0
    while state.reads_locally(t):
        yield Deliver((yield from one_batch(k * parts if seed is not None else k)))
        k += 1
    yield from then


def _one_at_a_time(one_batch: Callable[[int], Plan[Any]], start: int) -> Plan[None]:
    for k in itertools.count(start):
        yield Deliver((yield from one_batch(k)))
    return None  # never: the caller leaves the loop


def _kept_first(state: LearnerState, kind: Hashable, one_batch: Callable[[int], Plan[Any]],
                then: Plan[None]) -> Plan[None]:
    """Batches of the rows kept from a failed call first (each topped up by a fresh draw), then `then`."""
    k = 0
    while state.kept.count(kind):
        yield Deliver((yield from one_batch(k)))
        k += 1
    yield from then


def _batches_per_request(state: LearnerState, rows: int, ahead: int, t: TableDraws) -> int:
    """How many batches of `rows` rows one request may carry: 1 when the writer draws (a rate
    limit counts, or rows are removed, as each batch is asked for), else up to half of `ahead`
    (two requests or more stay in flight), within one message and 1 MiB."""
    if t.samples != READS:
        return 1
    fit = min(state.rows_per_message // rows, _REQUEST_BYTES // max(1, rows * int(state.schema.row_bytes)))
    return int(max(1, min(ahead // 2, fit)))


def _pipelined(state: LearnerState, group_requests: Callable[[int], list[RequestFactory]], ahead: int,
               with_info: bool, t: TableDraws, group: int, kind: Hashable) -> Plan[None]:
    """The batches the replies to `group_requests(k)` carry, `group` batches each, with `ahead`
    groups' requests in flight. From a table whose draws change the server's state, no reply is
    given up on: when one fails, or the loop is left, the requests still in flight are cancelled
    where they wait for the rate limit, and what was drawn is kept (`num_kept`)."""
    target = t.samples
    timeout = state.draw_timeout(t)
    in_flight: deque[list[int]] = deque()
    drawn: list[Part] = []  # parts of the oldest group read so far (an interrupted read keeps them)
    try:
        for k in itertools.count():
            while len(in_flight) < ahead:
                yield from fresh(state)
                sent = []
                for request in group_requests(k + len(in_flight)):
                    sent.append((yield Send(target, request)))
                in_flight.append(sent)
            if t.consuming:
                parts, error = yield from collect(state, target, in_flight[0], cancel=False,
                                                  timeout=timeout or state.config.timeout, parts=drawn)
                in_flight.popleft()
                drawn = []
                if error is not None:
                    state.kept.give_back(kind, parts)
                    raise kept_error(error, state.kept.count(kind))
                arrays, info = join_parts(parts, state.schema.names)
                batch = state.schema.decode(arrays)
                yield Deliver((batch, info) if with_info else batch)
                continue
            replies = []
            for request_id in in_flight.popleft():
                replies.append(checked((yield Wait(target, request_id, timeout))))
            for reply in replies:
                state.observe(reply)
            for batch in _split(state, replies, group, with_info):
                yield Deliver(batch)
    except GeneratorExit:
        raise
    except BaseException:
        if t.consuming and (in_flight or drawn):
            try:
                parts, _ = yield from collect(state, target, [rid for ids in in_flight for rid in ids], cancel=True,
                                              timeout=timeout or state.config.timeout)
                state.kept.put(kind, drawn + parts)
            except ClosedError:
                pass  # the client was closed under the loop: nothing can be read any more
        else:
            for request_ids in in_flight:
                for request_id in request_ids:
                    yield Forget(target, request_id)
        raise
    return None  # never: the loop ends by an exception (LoopLeft when the caller leaves)


def _split(state: LearnerState, replies: list[Any], group: int, with_info: bool) -> list[Any]:
    """The `group` batches of equal size that the replies of one request carry, in order."""
    arrays = joined([state.rows_of(r) for r in replies], state.schema.names)
    info = sample_info(replies) if with_info else None
    size = next(iter(arrays.values())).shape[0] // group
    out = []
    for lo in range(0, size * group, size):
        batch = state.schema.decode({name: a[lo : lo + size] for name, a in arrays.items()})
        out.append((batch, info.slice(lo, lo + size)) if info is not None else batch)
    return out
