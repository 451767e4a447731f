"""The sampling datasets of one table of a replay buffer's file: its settings, the priorities,
the priority log, and how often each row was sampled; and where the tables live. File I/O only;
the logic is in `table.py`.

Under `/_h5replay/replay/tables/<name>/` (layout 3; a file made before tables: the replay group
itself, for its one table "default"), made with the file, only those the settings need:
  * attributes `sampler`, `rate_limit` (JSON) and `max_times_sampled`: fixed at creation.
  * `priorities` (float64, one per physical row): the priority a row was committed with, and every
    update up to the last checkpoint. NaN: none recorded (the row takes the default).
  * `priority_log` ((LOG_ENTRIES, 2) int64 ring): one (row id, float64 bits) entry per priority
    update, at position `n % LOG_ENTRIES` for the n-th update (a file keeps the size it was made
    with). The state row says how far it is
    published (`plog`) and up to where `priorities` already holds it (`pckpt`). Readers apply
    the entries between the state they saw and the new one: O(updates), never O(capacity).
  * `times_sampled` (uint32, one per physical row), when `max_times_sampled` is set.
  * `priority_max` ((2, 3) int64): the running maximum priority (the default of a row committed
    without one, when `initial_priority` is None), as two entries (publish seq, float64 bits,
    CRC-32 of the two). A publish that changed it writes it, before its state row, into the entry
    that does not hold the newest one published: the maximum of a publish is the newest intact
    entry whose seq is at most its own. An entry of a publish never made (a crash before its state
    row) is ignored, and replaced by the next publish of that seq. Files made before it get it at
    their first writable open; until then the largest priority held stands in.

The writer keeps an update's entries in memory and writes them with the next publish (one write
per publish, not per update; nothing reads past the published `plog`). It checkpoints (publishes
every update applied, writes the updated priorities into `priorities`, then publishes `pckpt`)
before the ring would overwrite an entry at or after the published `pckpt`; so a reader that
re-reads the state after reading entries [a, b) and finds `pckpt <= a` read them intact, and
`priorities` never holds a value that no publish counts (a crash, or a reader's full load, would
take it for published).

Damage (a bad disk, a crafted file) is never applied to the sum tree: the settings and datasets
are checked when the file opens (StorageError naming what is wrong); a log entry or a stored
priority that is not a finite number >= 0 (NaN marks "none recorded" in `priorities`) is
dropped with a warning, and the row keeps the priority it had (or the default): priorities are
weights, and one damaged weight is no reason to refuse the rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zlib
from collections.abc import Mapping
from typing import Any

import h5py
import numpy as np

from h5replay.errors import ConfigError, StorageError
from h5replay.sampling import (
    DEFAULT_TABLE,
    MAX_TABLES,
    RateLimit,
    SamplingConfig,
    check_table_name,
    rate_limit_from_json,
    rate_limit_to_json,
    sampler_from_json,
    sampler_to_json,
)
from h5replay.storage._h5file import check_dataset, h5_errors, shown
from h5replay.storage._rowio import read_slice, write_points, write_rows

__all__ = ["SamplingFile", "LOG_ENTRIES", "read_config", "memory_problem", "layout_of", "table_names", "table_groups",
           "create_table_groups", "upgrade_layout"]

log = logging.getLogger("h5replay.storage")

LOG_ENTRIES = 1 << 20  # 16 MiB of log: a checkpoint once per half a million updated priorities
_MAX_LOG_ENTRIES = 1 << 24  # a log ring this long or shorter (a file keeps the size it was made with)
_PRIORITIES = "priorities"
_LOG = "priority_log"
_TIMES = "times_sampled"
_MAX = "priority_max"
_NO_ENTRY = (-1, 0.0)  # (seq, value) of an entry never written, or damaged
_CHUNK = 4096
_ATTR_SAMPLER = "sampler"
_ATTR_RATE_LIMIT = "rate_limit"
_ATTR_MAX_TIMES = "max_times_sampled"
_ATTR_TABLES = "tables"  # on the replay group: the JSON list of table names, in the journal's order
_TABLES = "tables"  # the group of the tables' groups
_TABLE_DATASETS = (_PRIORITIES, _LOG, _TIMES, _MAX)
_TABLE_ATTRS = (_ATTR_SAMPLER, _ATTR_RATE_LIMIT, _ATTR_MAX_TIMES)


def layout_of(group: h5py.Group) -> int:
    """The journal layout of a replay group: 3 (tables, each in a group of its own) or 2 (one
    table, its datasets in the replay group itself)."""
    return 3 if _ATTR_TABLES in group.attrs else 2


def table_names(group: h5py.Group) -> list[str]:
    """The names of a replay group's tables, in the journal's order.

    Raises:
        StorageError: the list is not a JSON list of distinct valid names (a damaged file).
    """
    if layout_of(group) == 2:
        return [DEFAULT_TABLE]
    where = repr(group.file.filename)
    try:
        names = json.loads(_text(group.attrs[_ATTR_TABLES], _ATTR_TABLES, "["))
        if not isinstance(names, list) or not 1 <= len(names) <= MAX_TABLES or len(set(names)) != len(names):
            raise ConfigError(f"not a list of 1 to {MAX_TABLES} distinct names: {str(names)[:200]}")
        return [check_table_name(name) for name in names]
    except (ConfigError, ValueError, RecursionError) as exc:
        raise StorageError(f"{where} has a damaged list of tables ({group.name}/{_ATTR_TABLES}): {exc}") from None


def table_groups(group: h5py.Group, where: str) -> dict[str, h5py.Group]:
    """Each table's group, by name, in the journal's order.

    Raises:
        StorageError: a listed table has no group.
    """
    if layout_of(group) == 2:
        return {DEFAULT_TABLE: group}
    out = {}
    for name in table_names(group):
        table = group.get(f"{_TABLES}/{name}")
        if not isinstance(table, h5py.Group):
            raise StorageError(f"{where} lists table {name!r} but has no group {group.name}/{_TABLES}/{name}: the file "
                               "is damaged")
        out[name] = table
    return out


def create_table_groups(group: h5py.Group, configs: Mapping[str, SamplingConfig], capacity: int | None) -> None:
    """Record the tables `configs` in a new file's replay group, each with the datasets it needs.

    Raises:
        ConfigError: this machine has too little memory for the tables' samplers over `capacity` rows.
    """
    problem = memory_problem(list(configs.values()), capacity)
    if problem is not None:
        raise ConfigError(problem)
    group.attrs[_ATTR_TABLES] = json.dumps(list(configs))
    for name, config in configs.items():
        SamplingFile.create_tables(group.require_group(f"{_TABLES}/{name}"), config, capacity)


def upgrade_layout(group: h5py.Group) -> None:
    """A replay group of layout 2 (or format 1) gets layout 3: its one table's settings and
    datasets move into the group of table "default" (datasets are moved, not copied)."""
    if layout_of(group) == 3:
        return
    table = group.require_group(f"{_TABLES}/{DEFAULT_TABLE}")
    for name in _TABLE_DATASETS:
        if name in group:
            group.move(name, f"{_TABLES}/{DEFAULT_TABLE}/{name}")
    for name in _TABLE_ATTRS:
        if name in group.attrs:
            table.attrs[name] = group.attrs[name]
            del group.attrs[name]
    group.attrs[_ATTR_TABLES] = json.dumps([DEFAULT_TABLE])


def _create_max(group: h5py.Group) -> None:
    # Chunked, as every dataset an SWMR reader refreshes must be (a contiguous one fails to).
    group.create_dataset(_MAX, shape=(2, 3), maxshape=(2, 3), chunks=(2, 3), dtype=np.int64)


def read_config(attrs: Mapping[str, Any]) -> SamplingConfig:
    """The sampling settings a replay group records (a file made before them: uniform, no limit).

    Raises:
        ConfigError: settings this version does not know, or attributes of the wrong type.
    """
    if _ATTR_SAMPLER not in attrs:
        return SamplingConfig()
    rate = attrs.get(_ATTR_RATE_LIMIT)
    max_times = attrs.get(_ATTR_MAX_TIMES, 0)
    if isinstance(max_times, np.ndarray) and max_times.shape == ():
        max_times = max_times[()]
    if isinstance(max_times, (bool, np.bool_)) or not isinstance(max_times, (int, np.integer)):
        raise ConfigError(f"attribute {_ATTR_MAX_TIMES!r} is {shown(max_times)}, not an integer")
    try:
        return SamplingConfig(
            sampler=sampler_from_json(_text(attrs[_ATTR_SAMPLER], _ATTR_SAMPLER)),
            rate_limit=rate_limit_from_json(_text(rate, _ATTR_RATE_LIMIT)) if rate is not None else RateLimit(),
            max_times_sampled=int(max_times),
        )
    except RecursionError:  # JSON nested too deep to parse
        raise ConfigError("a sampling attribute holds JSON nested too deep to read") from None


def memory_problem(configs: SamplingConfig | list[SamplingConfig], capacity: int | None) -> str | None:
    """Why a buffer of `capacity` rows with these tables cannot be opened here: their samplers'
    arrays (a sum tree of about 16 bytes a row, 8 more for priorities, 4 for sample counts)
    would need more memory than the machine has (None: they fit, or nothing is allocated).
    Checked before they are allocated: a crafted capacity of 2**40 would ask for TiBs."""
    tables = configs if isinstance(configs, list) else [configs]
    per_row = sum(16 + (8 if c.prioritized else 0) + (4 if c.removes else 0)
                  for c in tables if c.prioritized or c.removes)
    if capacity is None or not per_row:
        return None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system that says
        return None
    if capacity * per_row <= memory:
        return None
    return (f"a capacity of {capacity} rows with this sampler needs {capacity * per_row / 2**30:.1f} GiB of memory "
            f"({per_row} bytes a row), more than this machine's {memory / 2**30:.1f} GiB")


def _text(value: Any, name: str, opening: str = "{") -> str:
    """A JSON attribute's text, refused unless it is a string holding a JSON object (or with
    `opening` "[", a list): a number or list would reach the settings' constructors as
    something else."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    if not isinstance(value, str) or not value.lstrip().startswith(opening):
        raise ConfigError(f"attribute {name!r} is {shown(value)}, not a JSON {'object' if opening == '{' else 'list'}")
    return value


class SamplingFile:
    """The sampling datasets of one open buffer file."""

    def __init__(self, group: h5py.Group, reader: bool, capacity: int | None) -> None:
        """Raises:
            StorageError: the settings are unknown or damaged, or a dataset they need is missing
                or not of the dtype and shape h5replay makes (for `capacity` rows).
        """
        where = self._where = repr(group.file.filename)
        try:
            self.config = read_config(group.attrs)
        except ConfigError as exc:
            raise StorageError(f"{where} has sampling settings this h5replay cannot use ({group.name}): {exc}") from exc
        self._reader = reader
        with h5_errors("opening the sampling datasets"):
            self._priorities: h5py.Dataset | None = group.get(_PRIORITIES)
            self._log: h5py.Dataset | None = group.get(_LOG)
            self._times: h5py.Dataset | None = group.get(_TIMES)
            self._max: h5py.Dataset | None = group.get(_MAX)
        self._max_entries: list[tuple[int, float]] | None = None  # the writer's copy of them (read once)
        if self.config.prioritized and (self._priorities is None or self._log is None):
            raise StorageError(f"{where} records a prioritized sampler but has no priority datasets")
        if self.config.removes and self._times is None:
            raise StorageError(f"{where} records max_times_sampled but has no times_sampled dataset")
        problem = memory_problem(self.config, capacity)
        if problem is not None:
            raise StorageError(f"{where} cannot be opened here: {problem}")
        # One value per physical row: `capacity` of them, or any number of an unbounded buffer's.
        if self._priorities is not None:
            check_dataset(self._priorities, where, np.float64, (capacity,), (capacity,))
        if self._times is not None:
            check_dataset(self._times, where, np.uint32, (capacity,), (capacity,))
        if self._max is not None:
            check_dataset(self._max, where, np.int64, (2, 3), (2, 3))
        if self._log is not None:
            check_dataset(self._log, where, np.int64, (None, 2))
            if not 1 <= self._log.shape[0] <= _MAX_LOG_ENTRIES or self._log.maxshape != self._log.shape:
                raise StorageError(f"{where}: the priority log {self._log.name!r} has shape {self._log.shape} (at most "
                                   f"{self._log.maxshape}), not a fixed ring of 1 to {_MAX_LOG_ENTRIES} entries")
        #: Entries in the priority log ring.
        self.log_entries = int(self._log.shape[0]) if self._log is not None else LOG_ENTRIES

    @staticmethod
    def create_tables(group: h5py.Group, config: SamplingConfig, capacity: int | None) -> None:
        """Record `config` in a new file's replay group, with the datasets it needs.

        Raises:
            ConfigError: this machine has too little memory for the sampler over `capacity` rows.
        """
        problem = memory_problem(config, capacity)
        if problem is not None:
            raise ConfigError(problem)
        group.attrs[_ATTR_SAMPLER] = sampler_to_json(config.sampler)
        group.attrs[_ATTR_RATE_LIMIT] = rate_limit_to_json(config.rate_limit)
        group.attrs[_ATTR_MAX_TIMES] = config.max_times_sampled
        size = capacity if capacity is not None else 0
        chunk = min(_CHUNK, capacity) if capacity is not None else _CHUNK
        if config.prioritized:
            group.create_dataset(_PRIORITIES, shape=(size,), maxshape=(capacity,), chunks=(chunk,), dtype=np.float64,
                                 fillvalue=np.nan)
            group.create_dataset(_LOG, shape=(LOG_ENTRIES, 2), chunks=(min(_CHUNK, LOG_ENTRIES), 2), dtype=np.int64)
            _create_max(group)
        if config.removes:
            group.create_dataset(_TIMES, shape=(size,), maxshape=(capacity,), chunks=(chunk,), dtype=np.uint32)

    @staticmethod
    def upgrade(group: h5py.Group) -> None:
        """The writable-open hook for a file made before the running maximum was kept: a
        prioritized buffer's group gets its `priority_max` (before SWMR starts). Settings that
        cannot be read change nothing here: the open refuses the file (see `__init__`)."""
        if _MAX in group:
            return
        try:
            prioritized = read_config(group.attrs).prioritized
        except ConfigError:
            return
        if prioritized:
            _create_max(group)

    # ------------------------------------------------------------------ per-row arrays

    def _read(self, ds: h5py.Dataset | None, first: int, stop: int, fill: Any) -> np.ndarray:
        """ds[first:stop]; slots past the dataset's end (an unbounded buffer's) read as `fill`."""
        if ds is None:
            raise ConfigError("this buffer keeps no such per-row values")
        with h5_errors("reading sampling state"):
            if self._reader:
                ds.refresh()
            have = max(0, min(stop, ds.shape[0]) - first)
            out = np.full(stop - first, fill, dtype=ds.dtype)
            if have > 0:
                out[:have] = read_slice(ds, first, first + have)
            return out

    @staticmethod
    def _write(ds: h5py.Dataset | None, first: int, values: np.ndarray) -> None:
        if ds is None or values.shape[0] == 0:
            return
        with h5_errors("writing sampling state"):
            stop = first + values.shape[0]
            if ds.shape[0] < stop:
                ds.resize((max(stop, 2 * ds.shape[0]) if ds.maxshape[0] is None else max(stop, ds.shape[0]),))
            if not write_rows(ds, first, values):
                ds[first:stop] = values

    def read_priorities(self, first: int, stop: int) -> np.ndarray:
        """priorities[first:stop]: NaN where none is recorded, or where the value is damaged."""
        values = self._read(self._priorities, first, stop, np.nan)
        damaged = np.isinf(values) | (values < 0)
        if damaged.any():
            at = np.flatnonzero(damaged)
            log.warning("%s: %d damaged priorities (not finite and >= 0) in rows %s...: those rows take the default "
                        "priority", self._where, at.size, (at[:4] + first).tolist())
            values[damaged] = np.nan
        return values

    def write_priorities(self, first: int, values: np.ndarray) -> None:
        self._write(self._priorities, first, np.asarray(values, dtype=np.float64))

    def read_times(self, first: int, stop: int) -> np.ndarray:
        return self._read(self._times, first, stop, 0)

    def write_times(self, first: int, values: np.ndarray) -> None:
        self._write(self._times, first, np.asarray(values, dtype=np.uint32))

    def write_times_at(self, slots: np.ndarray, values: np.ndarray) -> None:
        """times_sampled[slots] = values (slots sorted, unique, within the dataset)."""
        if self._times is not None and slots.shape[0]:
            with h5_errors("writing times sampled"):
                write_points(self._times, slots, values)

    # ------------------------------------------------------------------ the priority log

    def write_log(self, position: int, row_ids: np.ndarray, values: np.ndarray) -> None:
        """Log entries for updates position, position + 1, ... (at most log_entries of them)."""
        if self._log is None or row_ids.shape[0] == 0:
            return
        entries = np.empty((row_ids.shape[0], 2), dtype=np.int64)
        entries[:, 0] = row_ids
        entries[:, 1] = np.asarray(values, dtype=np.float64).view(np.int64)
        first = position % self.log_entries
        head = min(entries.shape[0], self.log_entries - first)
        with h5_errors("writing the priority log"):
            for at, part in ((first, entries[:head]), (0, entries[head:])):
                if part.shape[0] and not write_rows(self._log, at, part):
                    self._log[at : at + part.shape[0]] = part

    def read_log(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, priorities) of updates [first, stop). A damaged entry (a priority not finite
        and >= 0, or a negative row id) comes back with row id -1, which no buffer holds: it is
        never applied.

        Raises:
            StorageError: more than `log_entries` updates asked for (the state that names them
                is damaged: the ring cannot hold them).
        """
        n = stop - first
        if self._log is None or n <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        if n > self.log_entries:
            raise StorageError(f"{self._where} names {n} priority updates to replay ([{first}, {stop})), more than its "
                               f"priority log holds ({self.log_entries}): its replay state is damaged")
        at = first % self.log_entries
        head = min(n, self.log_entries - at)
        with h5_errors("reading the priority log"):
            if self._reader:
                self._log.id.refresh()
            parts = [read_slice(self._log, at, at + head)]
            if head < n:
                parts.append(read_slice(self._log, 0, n - head))
        entries = parts[0] if len(parts) == 1 else np.concatenate(parts)
        ids, values = entries[:, 0].copy(), entries[:, 1].copy().view(np.float64)
        damaged = ~np.isfinite(values) | (values < 0) | (ids < 0)
        if damaged.any():
            where = np.flatnonzero(damaged)
            log.warning("%s: %d damaged priority log entries (updates %s...) were dropped", self._where, where.size,
                        (where[:4] + first).tolist())
            ids[damaged] = -1
        return ids, values

    # ------------------------------------------------------------------ the running maximum

    def _read_max_entries(self) -> list[tuple[int, float]]:
        """(publish seq, value) of both entries; _NO_ENTRY for one never written or damaged."""
        if self._max is None:
            return [_NO_ENTRY, _NO_ENTRY]
        with h5_errors("reading the running maximum priority"):
            if self._reader:
                self._max.id.refresh()
            rows = read_slice(self._max, 0, 2)
        entries = []
        for row in rows:
            intact = int(row[2]) == zlib.crc32(row[:2].tobytes()) and int(row[0]) >= 0
            entries.append((int(row[0]), float(row[1:2].view(np.float64)[0])) if intact else _NO_ENTRY)
        return entries

    def read_max(self, seq: int) -> float | None:
        """The running maximum priority as of publish `seq` (None: the file records none by then)."""
        entries = self._read_max_entries()
        if not self._reader:
            self._max_entries = entries
        published = [entry for entry in entries if 0 <= entry[0] <= seq]
        return max(published)[1] if published else None

    def write_max(self, seq: int, value: float) -> None:
        """Record `value` as the running maximum of publish `seq`, about to be made (see the
        module doc), unless the newest entry before it holds it already and none is of `seq` or
        later.

        Raises:
            StorageError: the file refused it (the publish must not happen).
        """
        if self._max is None:
            return
        entries = self._max_entries if self._max_entries is not None else self._read_max_entries()
        self._max_entries = entries
        before = [k for k in (0, 1) if 0 <= entries[k][0] < seq]
        newest = max(before, key=lambda k: entries[k][0]) if before else 1
        other = 1 - newest
        if before and entries[newest][1] == value and entries[other][0] < seq:
            return
        row = np.zeros((1, 3), dtype=np.int64)
        row[0, 0] = seq
        row[0, 1:2] = np.array([value], dtype=np.float64).view(np.int64)
        row[0, 2] = zlib.crc32(row[0, :2].tobytes())
        entries[other] = (seq, math.nan)  # unknown until the write succeeds: written again next time
        with h5_errors("writing the running maximum priority"):
            if not write_rows(self._max, other, row):
                self._max[other : other + 1] = row
        entries[other] = (seq, value)
