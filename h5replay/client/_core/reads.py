"""Plans of the reads that draw nothing: the figures (`info`, `len`, `wait_for_size`), rows by
logical index or by id, the episode table, and priority updates waited for.

A read bigger than a message is split into several requests, sent together (within the
in-flight window) and put back together in order. Pure plans (see ops.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._core.exchange import fresh, joined, read_many
from h5replay.client._core.ops import READS, WRITER, Now, Plan, Send, Sleep, Wait, checked
from h5replay.client._core.state import LearnerState
from h5replay.client._reads import View, _chunks, _integer_array, _request
from h5replay.errors import ConfigError, NotEnoughDataError, ProtocolError
from h5replay.priorities import check_priorities

__all__ = [
    "check_update", "episode_table", "get", "get_rows", "hello", "info", "length", "rows_by_id", "send_update", "update_priorities",
    "update_requests", "wait_for_size",
]


def hello(name: str) -> Plan[P.HelloReply]:
    """Introduce this learner to the writer; its hello reply (space, limits, tables, read endpoint).

    Raises:
        ProtocolError: the answer is not a hello reply.
    """
    request_id = yield Send(WRITER, lambda rid: P.Hello(rid, name, "learner"))
    reply = checked((yield Wait(WRITER, request_id)))
    if not isinstance(reply, P.HelloReply):
        raise ProtocolError(f"expected a hello reply, got {type(reply).__name__}")
    return reply


def server_stats(target: Any) -> Plan[dict[str, Any]]:
    """The figures of an Info request to `target` (the writer, or a reader)."""
    request_id = yield Send(target, lambda rid: P.Info(rid))
    return dict(checked((yield Wait(target, request_id))).stats)


def info(state: LearnerState) -> Plan[dict[str, Any]]:
    """The server's figures, with the buffer's own as this client's view of the file shows them
    (from a reader when reads have a socket of their own)."""
    writer = yield from server_stats(WRITER)
    if not state.separate_reads:
        state.observe_stats(writer)
        return writer
    reads = yield from server_stats(READS)
    state.observe_stats(reads)
    return {**writer, **reads}


def length(state: LearnerState) -> Plan[int]:
    """Rows held, as a reader sees them."""
    stats = yield from server_stats(READS)
    state.observe_stats(stats)
    return int(stats["length"])


def wait_for_size(measure: Callable[[], Plan[int]], size: Any, timeout: Any) -> Plan[int]:
    """`measure()` (rows that may be sampled: `length`) polled until it is at least `size`: every
    10 ms at first, every 0.2 s at most.

    Raises:
        ConfigError: `size` is not an int >= 0, or `timeout` not a number >= 0 (or None).
        NotEnoughDataError: fewer rows after `timeout` (the message says how many).
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
        raise ConfigError(f"size must be an int >= 0, got {size!r}")
    wanted = int(size)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise ConfigError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    deadline = None if timeout is None else (yield Now()) + float(timeout)
    pause = 0.01
    while (held := (yield from measure())) < wanted:
        left = None if deadline is None else deadline - (yield Now())
        if left is not None and left <= 0:
            raise NotEnoughDataError(f"{held} rows may be sampled after {timeout} s of waiting, fewer than the "
                                     f"{wanted} asked for")
        yield Sleep(pause if left is None else min(pause, left))
        pause = min(pause * 2, 0.2)
    return held


def rows_by_id(state: LearnerState, ids: np.ndarray, min_seq: int = 0) -> Plan[dict[str, np.ndarray]]:
    """The leaves of rows by id (checked ints), in messages of `ids_per_message`, joined."""
    yield from fresh(state)
    parts = _chunks(ids.shape[0], state.ids_per_message) or [(0, 0)]
    seq = max(min_seq, state.min_seq)
    replies = yield from read_many(state, READS, [_request(P.GetRows, seq, ids[lo:hi], state.packed)
                                                  for lo, hi in parts])
    return joined([state.rows_of(r, ids[lo:hi]) for r, (lo, hi) in zip(replies, parts)], state.schema.names)


def get_rows(state: LearnerState, row_ids: Any) -> Plan[dict[str, np.ndarray]]:
    """Rows by global id (any order, duplicates kept), as leaves.

    Raises:
        IndexError: an id is negative (or, from the server, never committed).
        TypeError: the ids are not integers.
    """
    ids = _integer_array(row_ids, "row ids")
    if ids.size and int(ids.min()) < 0:
        raise IndexError(f"row id {int(ids.min())} is negative; row ids count from 0")
    return (yield from rows_by_id(state, ids))


def get(state: LearnerState, indices: Any) -> Plan[dict[str, np.ndarray]]:
    """Rows at logical indices, as leaves: the first message's worth by index, the rest by row id
    resolved against the view the first part came from."""
    idx = _integer_array(indices, "indices")
    per = state.ids_per_message
    yield from fresh(state)
    first = (yield from read_many(state, READS, [_request(P.Get, state.min_seq, idx[:per], state.packed)]))[0]
    if idx.shape[0] <= per:
        return state.rows_of(first)
    view = View(first.seq, first.generation, first.begin, first.end)  # type: ignore[attr-defined]
    rest = idx[per:].copy()
    rest[rest < 0] += view.length
    bad = (rest < 0) | (rest >= view.length)
    if bad.any():
        raise IndexError(f"index {int(idx[per:][np.argmax(bad)])} is out of range for {view.length} rows")
    more = yield from rows_by_id(state, rest + view.begin, view.seq)
    return joined([state.rows_of(first), more], state.schema.names)


def episode_table(state: LearnerState) -> Plan[tuple[np.ndarray, View]]:
    """(every complete episode as (episode_id, first_row_id, length) rows, the view of the last
    page): read in pages of what fits a message, each from the episode after the last one the
    previous page gave. Episodes the ring dropped before the last page came are left out."""
    per = state.episodes_per_page
    pages: list[np.ndarray] = []
    first = 0
    while True:
        yield from fresh(state)
        reply: Any = (yield from read_many(state, READS, [_request(P.Episodes, state.min_seq, first, per)]))[0]
        pages.append(reply.episodes)
        if len(reply.episodes) < per:
            break
        first = int(reply.episodes[-1, 0]) + 1
    view = View(reply.seq, reply.generation, reply.begin, reply.end)
    table = np.concatenate(pages) if len(pages) > 1 else pages[0]
    if len(pages) > 1:
        table = table[table[:, 1] >= view.begin]
    return table, view


def check_update(state: LearnerState, row_ids: Any, priorities: Any, table: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, priorities) of an update, checked before anything is sent.

    Raises:
        ConfigError: the table keeps no priorities (or is not the server's), a priority is
            negative, NaN or infinite, or the counts differ.
        IndexError: an id is negative.
    """
    ids = _integer_array(row_ids, "row ids")
    t = state.table(table)
    if t.keeps_priorities is False:
        raise ConfigError(f"table {t.name!r} samples by {state.table_figure(t, 'sampler')}, not by priority: only "
                          "a Prioritized sampler keeps priorities")
    values = check_priorities(priorities, ids.shape[0], sampler=t.sampler)
    if ids.size and int(ids.min()) < 0:
        raise IndexError(f"row id {int(ids.min())} is negative; row ids count from 0")
    return ids, values


def update_requests(ids: np.ndarray, values: np.ndarray, table: str | None,
                    ids_per_message: int) -> list[Any]:
    """Checked updates of `table` as requests that fit a message each (ids and priorities share
    it; one empty request for no ids)."""
    parts = _chunks(ids.shape[0], ids_per_message // 2) or [(0, 0)]
    return [_request(P.UpdatePriorities, ids[lo:hi], values[lo:hi], table) for lo, hi in parts]


def update_priorities(state: LearnerState, row_ids: Any, priorities: Any, table: str | None) -> Plan[int]:
    """Priority updates sent to the writer and waited for (each reply leaves after the publish
    carrying it); returns how many ids were ignored (no longer held)."""
    ids, values = check_update(state, row_ids, priorities, table)
    return (yield from send_update(state, ids, values, table))


def send_update(state: LearnerState, ids: np.ndarray, values: np.ndarray, table: str | None) -> Plan[int]:
    """`update_priorities` of updates already checked (`check_update`)."""
    requests = update_requests(ids, values, state.table(table).asked, state.ids_per_message)
    replies: Any = yield from read_many(state, WRITER, requests, state.update_timeout)
    state.seen_seq = max(state.seen_seq, *(int(r.seq) for r in replies))
    return sum(int(r.ignored) for r in replies)
