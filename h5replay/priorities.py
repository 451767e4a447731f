"""Priorities given with rows: checked, by table, kept one per row until the rows are committed.

An actor gives a priority per row for every prioritized table (a number or an array), or by table
name (`{"replay": p}`). Counts and values are checked where they are given (in the client, in a
segment writer), each table's bound by the buffer that knows the tables (`Tables.split`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from h5replay.errors import ConfigError
from h5replay.samplers import Sampler
from h5replay.samplers.prioritized import over_limit
from h5replay.sampling import check_table_name

__all__ = ["check_priorities", "check_priority_bound", "check_given_priorities", "one_row_priorities", "Given",
           "check_by_table", "PriorityColumns", "join_priorities"]

#: Priorities given with some rows, by table (None: every prioritized table), one per row, NaN
#: where a row was given none.
Given = dict[str | None, np.ndarray]


def check_priorities(values: object, n: int, *, missing_ok: bool = False, sampler: Sampler | None = None) -> np.ndarray:
    """Priorities as a float64 array of `n` finite values >= 0 (`missing_ok`: NaN too, for a
    row given no priority of its own), each within `sampler`'s `priority_limit` when it is
    `Prioritized` (None: the sampler is not known yet; the buffer checks again).

    Raises:
        ConfigError: wrong count, not numbers, negative, NaN, infinite, or a weight beyond
            MAX_WEIGHT (names the first bad one).
    """
    try:
        arr = np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"priorities must be numbers: {exc}") from exc
    if arr.shape[0] != n:
        raise ConfigError(f"got {arr.shape[0]} priorities for {n} rows")
    bad = (np.isinf(arr) | (arr < 0)) if missing_ok else (~np.isfinite(arr) | (arr < 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(f"priority {i} is {float(arr[i])!r}: priorities must be finite and >= 0")
    return check_priority_bound(arr, sampler)


def check_priority_bound(arr: np.ndarray, sampler: Sampler | None) -> np.ndarray:
    """`arr` (float64 priorities, NaN: none given) if each is within `sampler`'s
    `priority_limit` (a sampler that is not `Prioritized` has none).

    Raises:
        ConfigError: a priority beyond the bound (names the first).
    """
    part = sampler.prioritized_part if sampler is not None else None
    if part is not None:
        over = arr > part.priority_limit  # NaN (none given) compares False
        if over.any():
            i = int(np.argmax(over))
            raise ConfigError(f"priority {i} is {float(arr[i])!r}: {over_limit(part)}")
    return arr


def one_row_priorities(priority: object) -> object:
    """One row's priority (a number for every prioritized table, or {table: number}) as the
    priorities of one row that `check_given_priorities` takes."""
    if isinstance(priority, Mapping):
        return {table: [value] for table, value in priority.items()}
    return [priority]


def check_given_priorities(values: object, n: int, *, missing_ok: bool = False) -> dict[str | None, np.ndarray] | None:
    """Priorities given with `n` rows, by table: a bare array (or list) is for every prioritized
    table (the key None), a mapping names its tables (`{"replay": p}`; None among its keys: every
    prioritized table, the named ones taking their own values where given). Counts and values are
    checked here, each table's bound by the buffer that knows the tables. None: none given.

    Raises:
        ConfigError: a name that cannot be a table's, or a bad value (names the table).
    """
    if values is None:
        return None
    if not isinstance(values, Mapping):
        return {None: check_priorities(values, n, missing_ok=missing_ok)}
    out: dict[str | None, np.ndarray] = {}
    for name, given in values.items():
        key = None if name is None else check_table_name(name)
        try:
            out[key] = check_priorities(given, n, missing_ok=missing_ok)
        except ConfigError as exc:
            raise ConfigError(f"priorities for table {key!r}: {exc}" if key is not None else str(exc)) from None
    return out or None


def check_by_table(values: object, n: int, samplers: Mapping[str, Sampler], *, missing_ok: bool = False,
                   whose: str = "buffer") -> Given | None:
    """`check_given_priorities`, then against the tables (`samplers`: every table's sampler, by
    name): a name must be a prioritized table, each value within its table's bound, a bare one
    within every prioritized table's. `whose`: who has the tables, for the messages.

    Raises:
        ConfigError: a name that is not a table, a table that keeps no priorities, or a bad value.
    """
    given = check_given_priorities(values, n, missing_ok=missing_ok)
    if not given:
        return None
    for table, arr in given.items():
        if table is None:
            for each in samplers.values():
                check_priority_bound(arr, each)
            continue
        sampler = samplers.get(table)
        if sampler is None:
            raise ConfigError(f"no table {table!r}: this {whose}'s tables are {', '.join(map(repr, samplers))}")
        if sampler.prioritized_part is None:
            raise ConfigError(f"table {table!r} samples by {type(sampler).__name__}(), not by priority: give "
                              "priorities only to its prioritized tables")
        try:
            check_priority_bound(arr, sampler)
        except ConfigError as exc:
            raise ConfigError(f"priorities for table {table!r}: {exc}") from None
    return given


class PriorityColumns:
    """The priorities given with rows as they come, by table, one per row (NaN where a row was
    given none), in arrays that grow by doubling: what a segment keeps until it is sent or committed."""

    def __init__(self) -> None:
        self._columns: Given = {}
        self._rows = 0  # allocated in every column

    def put(self, first: int, n: int, given: Mapping[str | None, np.ndarray] | None) -> None:
        """Rows [first, first + n) were given `given` (None: nothing, NaN in every column)."""
        need = first + n
        if self._rows < need:
            size = max(need, 2 * self._rows, 64)
            for table, old in self._columns.items():
                grown = np.full(size, np.nan)
                grown[:first] = old[:first]
                self._columns[table] = grown
            self._rows = size
        for table in given or ():
            if table not in self._columns:
                self._columns[table] = np.full(self._rows, np.nan)
        for table, column in self._columns.items():
            column[first:need] = given[table] if given and table in given else np.nan

    def rows(self, stop: int) -> Given:
        """The priorities of rows [0, stop), by table (views: copy what must outlive a `put`)."""
        return {table: column[:stop] for table, column in self._columns.items()}


def join_priorities(parts: list[tuple[Mapping[str | None, np.ndarray] | None, int]]) -> Given | None:
    """The priorities of several runs of rows (each: given or None, its row count) one after
    another, NaN where a run gave none for a table; None when no run gave any."""
    tables = list(dict.fromkeys(table for given, _ in parts for table in (given or ())))
    if not tables:
        return None
    return {table: np.concatenate([given[table] if given and table in given else np.full(n, np.nan)
                                   for given, n in parts]) for table in tables}
