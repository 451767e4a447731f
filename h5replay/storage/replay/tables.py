"""A buffer's tables: several ways of sampling one ring of rows, each with its own sampler, rate
limit and removals (Reverb's tables over one item store).

What the tables agree on, kept here:
  * which table a verb means (`pick`: by name, or the only one);
  * inserts: every row joins every table, and waits while any table's rate limit holds inserts
    back (an insert moves every table's balance);
  * priorities given with rows: a bare array goes to every prioritized table, a mapping of table
    name to array to the tables it names (checked against each table's bound);
  * removal: a row leaves the ring before the capacity pushes it out only when every table has
    removed it (so only when every table removes rows); a row one queue table removed stays
    sampleable by the others. No table's rows are released early while it may still sample them.
Pure numpy apart from the sampling datasets each table is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from h5replay.errors import ConfigError
from h5replay.priorities import check_by_table
from h5replay.sampling import Table
from h5replay.storage.replay.state import State
from h5replay.storage.replay.table import Sampling
from h5replay.storage.replay.table_file import SamplingFile

__all__ = ["Tables"]


class Tables:
    """The runtime of every table of one open buffer, by name, in the file's order."""

    def __init__(self, configs: Mapping[str, Table], capacity: int | None, stores: Mapping[str, SamplingFile],
                 writer: bool) -> None:
        self.by_name: dict[str, Sampling] = {
            name: Sampling(config, capacity, stores.get(name), writer, index, name)
            for index, (name, config) in enumerate(configs.items())
        }
        self.all = list(self.by_name.values())
        self.prioritized = [t for t in self.all if t.config.prioritized]
        self.samplers = {name: t.config.sampler for name, t in self.by_name.items()}
        self.removing = [t for t in self.all if t.config.removes]
        #: Rows leave the ring early only when every table removes them.
        self.all_remove = len(self.removing) == len(self.all)
        self.limited = [t for t in self.all if t.config.rate_limit.samples_per_insert is not None]

    @property
    def configs(self) -> dict[str, Table]:
        return {name: t.config for name, t in self.by_name.items()}

    def pick(self, table: str | None) -> Sampling:
        """The table a verb names (None: the only one).

        Raises:
            ConfigError: no such table, or None with several (the message names them).
        """
        if table is None:
            if len(self.all) == 1:
                return self.all[0]
            raise ConfigError(f"this buffer has {len(self.all)} tables ({', '.join(map(repr, self.by_name))}): name "
                              "one with table=")
        found = self.by_name.get(table) if isinstance(table, str) else None
        if found is None:
            raise ConfigError(f"no table {str(table)[:80]!r}: this buffer's tables are "
                              f"{', '.join(map(repr, self.by_name))}")
        return found

    # ------------------------------------------------------------------ priorities given with rows

    def split(self, priorities: Any, n: int, missing_ok: bool = False) -> dict[str, np.ndarray]:
        """Priorities given with `n` rows, by table: a bare array (or list) for every prioritized
        table, or a mapping of table name to array (None among its names: every prioritized table,
        the named ones overriding it where they give a value); each checked against its table's
        bound. Tables given nothing are left out (their rows take their default).

        Raises:
            ConfigError: a name that is not a table, a table that keeps no priorities, or a bad
                value (wrong count, negative, NaN, infinite, beyond the bound).
        """
        given = check_by_table(priorities, n, self.samplers, missing_ok=missing_ok)
        if not given:
            return {}
        every = given.get(None)  # (a buffer that keeps no priorities: checked, then unused)
        out = {t.name: every for t in self.prioritized} if every is not None else {}
        for name, values in given.items():
            if name is not None:  # a prioritized table's own: they win where given
                base = out.get(name)
                out[name] = values if base is None else np.where(np.isnan(values), base, values)
        return out

    # ------------------------------------------------------------------ rows coming and going

    def added(self, state: State, first: int, n: int, priorities: Mapping[str, np.ndarray]) -> None:
        """Rows [first, first + n) joined every table (`priorities` by table, NaN: none given)."""
        for t in self.all:
            t.added(state, first, n, priorities.get(t.name))

    def released(self, old_begin: int, new_begin: int, state: State) -> None:
        for t in self.all:
            t.released(old_begin, new_begin, state)

    def forget(self, first: int, stop: int, state: State) -> None:
        for t in self.all:
            t.forget(first, stop, state)

    def clear(self) -> None:
        for t in self.all:
            t.clear()

    def first_held(self, state: State) -> int:
        """Where `begin` may move: past the rows every table removed (no move unless every table
        removes rows)."""
        if not self.all_remove:
            return state.begin
        return min(t.first_held(state) for t in self.all)

    def release_limit(self, state: State) -> int | None:
        """The first row some table may still sample that the ring may not release early (None:
        no table removes rows, any may go early)."""
        if not self.removing:
            return None
        return min(t.first_held(state) for t in self.removing)

    # ------------------------------------------------------------------ rate limits

    def insert_blocker(self, rows: int, state: State) -> tuple[str | None, bool]:
        """Why inserting `rows` rows must wait (the first table that holds it back, named), and
        whether it would wait forever; (None, False) when every table lets it in."""
        waiting: str | None = None
        for t in self.limited:
            held, counters = t.sampleable(state), t.counters(state)
            never = t.limiter.never(rows, False, state.inserted, counters.sampled, held)
            if never is not None:
                return self.named(t, never), True
            reason = t.limiter.insert_blocker(rows, state.inserted, counters.sampled, held)
            if reason is not None and waiting is None:
                waiting = self.named(t, reason)
        return waiting, False

    def named(self, table: Sampling, reason: str) -> str:
        """`reason`, naming its table when there are several."""
        return reason if len(self.all) == 1 else f"table {table.name!r}: {reason}"

    def sample_blocker(self, table: Sampling, rows: int, state: State, capacity: int | None) -> tuple[str | None, bool]:
        """Why `table` must not hand out `rows` rows now, and whether it never could."""
        held, counters = table.sampleable(state), table.counters(state)
        never = table.limiter.never(rows, True, state.inserted, counters.sampled, held)
        if never is not None:
            return self.named(table, never), True
        config = table.config
        without_replacement = config.ordered or config.removes
        if capacity is not None and without_replacement and rows > capacity:
            return self.named(table, f"a sample of {rows} rows without replacement can never be served by a buffer "
                                      f"of capacity {capacity}: sample at most {capacity} rows at a time"), True
        reason = table.limiter.sample_blocker(rows, state.inserted, counters.sampled, held)
        if reason is None and without_replacement and rows > held:
            reason = f"only {held} rows may still be sampled; {rows} were asked for without replacement"
        return (None if reason is None else self.named(table, reason)), False

    # ------------------------------------------------------------------ the file

    def load(self, state: State, read_state: Callable[[], State] | None = None) -> None:
        for t in self.all:
            t.load(state, read_state)

    def sync(self, old: State, new: State, read_state: Callable[[], State]) -> None:
        for t in self.all:
            t.sync(old, new, read_state)

    def before_publish(self, seq: int) -> None:
        for t in self.all:
            t.before_publish(seq)

    def drop_log(self) -> None:
        for t in self.all:
            t.drop_log()
