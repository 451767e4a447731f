"""The published state of a replay buffer and its encoding as journal rows. Pure: ints and numpy.

The state has the ring's part (which rows and episodes are held, publish and clear counters,
rows inserted) and one `Counters` per table (rows it sampled, its priority log). It reaches the
file as one array of int64 rows of 16, in one HDF5 chunk, written at once:

  * layout 3: a ring row (mark, 3, seq, generation, begin, end, ep_begin, ep_end, open_start,
    origin, ep_origin, inserted, number of tables, 0, 0, CRC-32) then a row per table, in the
    order the file lists its tables (mark, 3, seq, index, sampled, plog, pckpt, 0..., CRC-32).
  * layout 2 (files made before tables; read, and upgraded by a writable open): one row (mark,
    2, seq ... inserted, sampled, plog, pckpt, CRC-32), its one table's counters inline.

Every row carries its own CRC, and every table row the ring row's seq: a reader that catches the
writer mid-write (a torn read) sees a row that does not check, or rows of two publishes, and
reads again; it never acts on a mix.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from h5replay.errors import StorageError
from h5replay.storage._h5file import MAX_ID

__all__ = ["State", "Counters", "ROW", "MARK", "LAYOUT", "decode", "encode", "intact", "rows_for"]

MARK = 0x5245504C  # "REPL": tells a state row from zero fill
LAYOUT = 3
ROW = 16
_RING = ("seq", "generation", "begin", "end", "ep_begin", "ep_end", "open_start", "origin", "ep_origin", "inserted")
_RING_SET = frozenset((*_RING, "tables"))
_COUNTERS = ("sampled", "plog", "pckpt")


@dataclass(frozen=True)
class Counters:
    """One table's published counters: rows `sampled` since creation or `clear()` (its rate
    limit's), and its priority log (`table_file.py`): `plog` updates published, the first
    `pckpt` of them already in its priorities dataset."""

    sampled: int = 0
    plog: int = 0
    pckpt: int = 0


@dataclass(frozen=True)
class State:
    """The published state of a replay buffer (all ids global).

    Rows held: ids [begin, end). Episodes with a row held: ids [ep_begin, ep_end); the first of
    them may have lost its head to the ring (its first row id < begin). The open episode (rows
    added by `extend` and not yet ended) starts at row `open_start` (== end when there is none;
    below `begin` when the ring has overwritten its head, and then it is never recorded).
    `origin` / `ep_origin` (unbounded buffers) are the ids at physical row / table slot 0.
    `seq` counts publishes; `generation` counts `clear()`s; `inserted` counts rows inserted
    since creation or `clear()` (every table's rate limit counts the same inserts). `tables`:
    each table's counters, in the file's order of tables.
    """

    seq: int = 0
    generation: int = 0
    begin: int = 0
    end: int = 0
    ep_begin: int = 0
    ep_end: int = 0
    open_start: int = 0
    origin: int = 0
    ep_origin: int = 0
    inserted: int = 0
    tables: tuple[Counters, ...] = (Counters(),)

    def replace(self, **changes: object) -> State:
        """A copy with `changes` (a few microseconds: dataclasses.replace re-runs the frozen
        __init__, and every commit makes several)."""
        unknown = changes.keys() - _RING_SET
        if unknown:
            raise TypeError(f"State has no field(s) {sorted(unknown)}")
        new = object.__new__(State)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def with_table(self, index: int, **changes: int) -> State:
        """A copy with table `index`'s counters changed."""
        old = self.tables[index]
        counters = Counters(**{name: changes.get(name, getattr(old, name)) for name in _COUNTERS})
        return self.replace(tables=(*self.tables[:index], counters, *self.tables[index + 1:]))

    @property
    def length(self) -> int:
        return self.end - self.begin

    def check(self, where: str, capacity: int | None) -> None:
        """Raises:
            StorageError: the values are impossible, or an id or counter is not below MAX_ID.
        """
        values = [(name, getattr(self, name)) for name in _RING]
        values += [(f"{name}[{i}]", getattr(c, name)) for i, c in enumerate(self.tables) for name in _COUNTERS]
        past = [f"{name}={value}" for name, value in values if value >= MAX_ID]
        if past:
            raise StorageError(f"{where} has a replay state with ids or counters past 2**62, the most a file records "
                               f"({', '.join(past)}): the file is damaged or was not written by h5replay")
        ok = (
            0 <= self.origin <= self.begin <= self.end and self.origin <= self.open_start <= self.end
            and 0 <= self.ep_origin <= self.ep_begin <= self.ep_end
            and self.ep_end - self.ep_begin <= self.end - self.begin
            and (capacity is None or self.end - self.begin <= capacity)
            and self.inserted >= 0 and bool(self.tables)
            and all(c.sampled >= 0 and 0 <= c.pckpt <= c.plog for c in self.tables)
        )
        if not ok:
            raise StorageError(f"{where} has an inconsistent replay state: {self}")


def rows_for(tables: int) -> int:
    """The int64 values of a layout-3 journal of `tables` tables."""
    return ROW * (1 + tables)


def _sealed(row: np.ndarray) -> np.ndarray:
    row[0], row[1] = MARK, LAYOUT
    row[-1] = zlib.crc32(row[:-1].tobytes())
    return row


def _row_ok(row: np.ndarray, layout: int) -> bool:
    return int(row[0]) == MARK and int(row[1]) == layout and int(row[-1]) == zlib.crc32(row[:-1].tobytes())


def encode(state: State) -> np.ndarray:
    """The layout-3 journal of `state`."""
    out = np.zeros(rows_for(len(state.tables)), dtype=np.int64)
    ring = out[:ROW]
    ring[2 : 2 + len(_RING)] = [getattr(state, name) for name in _RING]
    ring[2 + len(_RING)] = len(state.tables)
    _sealed(ring)
    for i, counters in enumerate(state.tables):
        row = out[ROW * (i + 1) : ROW * (i + 2)]
        row[2], row[3] = state.seq, i
        row[4 : 4 + len(_COUNTERS)] = [getattr(counters, name) for name in _COUNTERS]
        _sealed(row)
    return out


def intact(values: np.ndarray) -> bool:
    """Whether a journal (layout 2 or 3) is whole: every row's mark, layout and checksum agree,
    and (layout 3) every table row is of the ring row's publish, in its place."""
    if values.shape[0] == ROW and _row_ok(values, 2):
        return True
    if values.shape[0] < 2 * ROW or values.shape[0] % ROW or not _row_ok(values[:ROW], LAYOUT):
        return False
    tables = values.shape[0] // ROW - 1
    if int(values[2 + len(_RING)]) != tables:
        return False
    seq = int(values[2])
    for i in range(tables):
        row = values[ROW * (i + 1) : ROW * (i + 2)]
        if not _row_ok(row, LAYOUT) or int(row[2]) != seq or int(row[3]) != i:
            return False
    return True


def decode(values: np.ndarray, where: str, capacity: int | None) -> State:
    """The state in a journal (layout 2 or 3), checked.

    Raises:
        StorageError: not a journal (zero fill, torn, damaged) or impossible values.
    """
    if not intact(values):
        raise StorageError(f"{where} has a damaged replay journal row: {values[:ROW].tolist()}")
    ring = [int(x) for x in values[2 : 2 + len(_RING)]]
    if values.shape[0] == ROW:  # layout 2: one table's counters inline
        inline = [int(x) for x in values[2 + len(_RING) : 2 + len(_RING) + len(_COUNTERS)]]
        state = State(**dict(zip(_RING, ring)), tables=(Counters(*inline),))
    else:
        tables = tuple(Counters(*(int(x) for x in values[ROW * (i + 1) + 4 : ROW * (i + 1) + 4 + len(_COUNTERS)]))
                       for i in range(values.shape[0] // ROW - 1))
        state = State(**dict(zip(_RING, ring)), tables=tables)
    state.check(where, capacity)
    return state
