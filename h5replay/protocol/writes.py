"""The messages that change the file: segments, commits, pushes of whole episodes, priorities."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from h5replay.errors import ProtocolError
from h5replay.protocol.base import Kind, Reply, Request
from h5replay.protocol.checks import (
    _NO_FLAGS,
    _NO_PRIORITIES,
    _NO_TABLE_PRIORITIES,
    Array,
    Arrays,
    Limits,
    _check_finals,
    _check_leading,
    _check_priorities,
    _check_rows_limit,
)

__all__ = [
    "priorities_to_wire", "priorities_from_wire", "OpenSegment", "Append", "Commit", "Abort", "PushEpisode", "PushEpisodes", "UpdatePriorities",
    "OpenSegmentReply", "AppendReply", "CommitReply", "AbortReply", "PushEpisodeReply", "PushEpisodesReply",
    "UpdatePrioritiesReply",
]


@dataclass(frozen=True, eq=False, repr=False)
class OpenSegment(Request):
    KIND = Kind.OPEN_SEGMENT
    WRITES = True


@dataclass(frozen=True, eq=False, repr=False)
class Append(Request):
    KIND = Kind.APPEND
    WRITES = True
    CARRIES_ROWS = True
    segment_id: int
    num_rows: int
    arrays: Arrays
    priorities: Array = field(default_factory=lambda: _NO_PRIORITIES)  # one per row (NaN: the default), or none
    # Priorities by table: one row of `table_priorities` for each table of `priority_tables`
    # (NaN: none given), beside `priorities` for every prioritized table.
    priority_tables: tuple[str, ...] | None = None
    table_priorities: Array = field(default_factory=lambda: _NO_TABLE_PRIORITIES)

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)
        _check_priorities(self.priorities, self.num_rows, self.priority_tables, self.table_priorities)


@dataclass(frozen=True, eq=False, repr=False)
class Commit(Request):
    KIND = Kind.COMMIT
    WRITES = True
    segment_id: int
    timeout: float = 0.0  # seconds the rate limit may hold the commit back
    idempotency_key: bytes | None = None  # 16 bytes, the same for every retry of this commit
    finals: Arrays = field(default_factory=dict)  # the episode's final observation (one row a leaf), or none

    def _validate(self, limits: Limits) -> None:
        _check_finals(self.finals, 1)


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
    # Priorities by table: one row of `table_priorities` for each table of `priority_tables`
    # (NaN: none given), beside `priorities` for every prioritized table.
    priority_tables: tuple[str, ...] | None = None
    table_priorities: Array = field(default_factory=lambda: _NO_TABLE_PRIORITIES)
    finals: Arrays = field(default_factory=dict)  # the episode's final observation (one row a leaf), or none

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)
        _check_priorities(self.priorities, self.num_rows, self.priority_tables, self.table_priorities)
        _check_finals(self.finals, 1)


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
    # Priorities by table: one row of `table_priorities` for each table of `priority_tables`
    # (NaN: none given), beside `priorities` for every prioritized table.
    priority_tables: tuple[str, ...] | None = None
    table_priorities: Array = field(default_factory=lambda: _NO_TABLE_PRIORITIES)
    # The episodes' final observations: `has_final` (k,) says which have one (empty: none do),
    # `finals` holds theirs, in order (one row a leaf each).
    has_final: Array = field(default_factory=lambda: _NO_FLAGS)
    finals: Arrays = field(default_factory=dict)

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)
        _check_priorities(self.priorities, self.num_rows, self.priority_tables, self.table_priorities)
        if len(self.has_final) not in (0, len(self.lengths)):
            raise ProtocolError(f"has_final must be empty or one per episode ({len(self.lengths)}), got "
                                f"{len(self.has_final)}")
        _check_finals(self.finals, int(np.count_nonzero(self.has_final)))
        if bool(self.finals) != bool(np.count_nonzero(self.has_final)):
            raise ProtocolError("finals and has_final go together: has_final says which episodes have finals")
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
    table: str | None = None  # the prioritized table (None: the server's only table)

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        if len(self.priorities) != len(self.row_ids):
            raise ProtocolError(f"update_priorities needs one priority per row id, got {len(self.priorities)} for "
                                f"{len(self.row_ids)}")


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


# ------------------------------------------------------------------ priorities given with rows

#: The fields that carry the priorities given with rows: (priorities, priority_tables, table_priorities).
PriorityFields = tuple[Array, "tuple[str, ...] | None", Array]


def priorities_to_wire(given: Mapping[str | None, np.ndarray] | None) -> PriorityFields:
    """Priorities given with a message's rows, by table (None: every prioritized table, one value
    per row, NaN where none was given), as the message's fields."""
    if not given:
        return _NO_PRIORITIES, None, _NO_TABLE_PRIORITIES
    every = given.get(None)
    named = tuple(table for table in given if table is not None)
    by_table = np.stack([np.asarray(given[table], dtype=np.float64) for table in named]) if named \
        else _NO_TABLE_PRIORITIES
    return (_NO_PRIORITIES if every is None else every), (named or None), by_table


def priorities_from_wire(msg: Any) -> dict[str | None, np.ndarray] | None:
    """The priorities an append or push carries, by table (None: every prioritized table); None
    when it carries none. The inverse of `priorities_to_wire`."""
    given: dict[str | None, np.ndarray] = {}
    if len(msg.priorities):
        given[None] = msg.priorities
    if msg.priority_tables:
        given.update(zip(msg.priority_tables, msg.table_priorities))
    return given or None
