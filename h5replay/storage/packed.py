"""A compressed leaf of a fixed-capacity ring: one record per row in a fixed slot, and a spill area.

HDF5 never reuses file space under SWMR, and a chunk that a filter compressed takes new space each
time it is rewritten, so a compressed ring written in SWMR mode would grow without bound. Here
no HDF5 filter is used: rows are compressed one by one (h5replay.codecs) into records, and every
dataset is an unfiltered chunked dataset, rewritten in place. Under the leaf's path::

    slots   (capacity, slot_bytes) uint8   row i's record, when it fits (a prefix of the slot)
    meta    (capacity, 4) int64            row i's record: bytes, kind, CRC-32, spill slot + 1 (0: none)
    spill   (n, row_bytes) uint8, growing  records that do not fit a slot (at most a raw row)

Spill slots are reused once no row refers to them any more, so the spill area grows only to the
most records that were too big at one time, and the file stops growing once the ring has wrapped.
A row's three parts are written together, like an uncompressed row's bytes: the replay buffer
unpublishes a slot before it rewrites it, and only its publish (a flush) makes rows visible, so a
crash or a reader meets a record only whole. A spill slot still named by any row of the file is
never given to another, so no write touches a record the last publish shows. Every record is
checked against its CRC-32 before it is decoded: a damaged one is never returned as data.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from h5replay import codecs
from h5replay.codecs import META_COLUMNS, Codec, DamagedRecordError, PackedRows
from h5replay.errors import ConfigError

__all__ = ["PackedLayout", "PackedColumn", "CODEC_ATTR", "PARTS", "is_packed"]

CODEC_ATTR = "h5replay_codec"
LEVEL_ATTR = "h5replay_codec_level"
PARTS = ("slots", "meta", "spill")
_META_WIDTH = META_COLUMNS + 1  # + the spill slot
_CHUNK_BYTES = 1 << 20
#: Default slot size, as a fraction of a raw row: 1/8 holds every ALE Pong and Breakout frame and
#: frame stack zstd or LZ4 made in benchmarks/frames.py with room to spare (the largest was 1/16).
DEFAULT_SLOT_FRACTION = 0.125
_SPILL_GROWTH = 16  # spill slots added at a time (at most; fewer for a small ring)


@dataclass(frozen=True)
class PackedLayout:
    """How a compressed leaf is laid out: its codec and the size of a row's slot."""

    codec: Codec
    slot_bytes: int

    @staticmethod
    def of(path: str, row_bytes: int, compression: Any, level: Any, slot: Any) -> PackedLayout:
        """The layout for compression `compression` at `level` with slots of `slot` (a fraction of
        `row_bytes` in (0, 1], or bytes as an int; None: DEFAULT_SLOT_FRACTION).

        Raises:
            ConfigError: an unknown codec or level, a missing package, or a slot of no size.
        """
        chosen = codecs.codec(compression, level, path)
        if slot is None:
            slot = DEFAULT_SLOT_FRACTION
        if isinstance(slot, bool) or not isinstance(slot, (int, float, np.integer, np.floating)):
            raise ConfigError(f"compression_slot for '{path}' must be a fraction of a row in (0, 1] or a number of "
                              f"bytes, got {slot!r}")
        if isinstance(slot, (float, np.floating)):
            if not 0.0 < float(slot) <= 1.0:
                raise ConfigError(f"compression_slot for '{path}' must be a fraction in (0, 1], got {slot!r}")
            size = int(np.ceil(row_bytes * float(slot)))
        else:
            size = int(slot)
            if not 1 <= size <= row_bytes:
                raise ConfigError(f"compression_slot for '{path}' must be 1..{row_bytes} bytes (a raw row), got {slot!r}")
        return PackedLayout(chosen, max(1, (size + 7) // 8 * 8) if size < row_bytes else row_bytes)


def is_packed(node: Any) -> bool:
    """Whether an HDF5 object is a compressed leaf's group."""
    return isinstance(node, h5py.Group) and CODEC_ATTR in node.attrs


def create(parent: h5py.Group, path: str, row_bytes: int, capacity: int, layout: PackedLayout) -> None:
    """Make the (empty) datasets of a compressed leaf at `path`."""
    group = parent.create_group(path)
    group.attrs[CODEC_ATTR] = layout.codec.name
    group.attrs[LEVEL_ATTR] = -1 if layout.codec.level is None else layout.codec.level
    slot = layout.slot_bytes
    group.create_dataset("slots", shape=(capacity, slot), dtype=np.uint8,
                         chunks=(max(1, min(capacity, _CHUNK_BYTES // slot)), slot))
    group.create_dataset("meta", shape=(capacity, _META_WIDTH), dtype=np.int64,
                         chunks=(max(1, min(capacity, (64 << 10) // (8 * _META_WIDTH))), _META_WIDTH))
    group.create_dataset("spill", shape=(0, max(1, row_bytes)), maxshape=(None, max(1, row_bytes)), dtype=np.uint8,
                         chunks=(1, max(1, row_bytes)))


def codec_of(group: h5py.Group, where: str) -> tuple[str, int | None]:
    """(codec name, level) recorded on a compressed leaf's group."""
    name = group.attrs[CODEC_ATTR]
    name = name.decode() if isinstance(name, bytes) else str(name)
    level = int(group.attrs.get(LEVEL_ATTR, -1))
    return name, None if level < 0 else level


Gather = Callable[[str, np.ndarray], np.ndarray]


class PackedColumn:
    """One compressed leaf of an open storage: records read, written and decoded by row.

    `gather(key, flat)` reads rows of one of the leaf's datasets (key: "<path>/slots", ...)
    through the storage's read engine (memory map, SWMR refresh); `datasets` are those datasets."""

    def __init__(self, path: str, group: h5py.Group, datasets: dict[str, h5py.Dataset], dtype: np.dtype[Any],
                 row_shape: tuple[int, ...], gather: Gather) -> None:
        self.path = path
        self.dtype = dtype
        self.row_shape = row_shape
        self.row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize
        self.codec_name, self.level = codec_of(group, path)
        self._slots, self._meta, self._spill = (datasets[f"{path}/{part}"] for part in PARTS)
        self.slot_bytes = int(self._slots.shape[1])
        self.capacity = int(self._slots.shape[0])
        self._gather = gather
        self._codec: Codec | None = None
        self._spill_of: np.ndarray | None = None  # the writer's copy of each row's spill slot + 1
        self._refs: np.ndarray | None = None  # rows naming each spill slot
        self._free: list[int] = []

    @property
    def keys(self) -> list[str]:
        return [f"{self.path}/{part}" for part in PARTS]

    def _check(self, meta: np.ndarray) -> None:
        if meta.shape[-1] != _META_WIDTH:
            raise DamagedRecordError(f"leaf '{self.path}': its record table has {meta.shape[-1]} columns")

    # ------------------------------------------------------------------ reading

    def records(self, flat: np.ndarray, row_ids: np.ndarray | None = None) -> PackedRows:
        """The stored records of physical rows `flat` (1-d, in range), in that order."""
        pieces, meta = self._pieces(flat, row_ids)
        blob = np.concatenate(pieces) if pieces else np.zeros(0, np.uint8)
        return PackedRows(blob, np.ascontiguousarray(meta[:, :META_COLUMNS]))

    def read(self, flat: np.ndarray, row_ids: np.ndarray | None = None) -> np.ndarray:
        """Rows `flat`, decoded: (n, *row_shape)."""
        pieces, meta = self._pieces(flat, row_ids)
        return codecs.decode_records([p.data for p in pieces], meta[:, :META_COLUMNS], self.dtype, self.row_shape, self.path, row_ids)

    def _pieces(self, flat: np.ndarray, row_ids: np.ndarray | None) -> tuple[list[np.ndarray], np.ndarray]:
        """(each row's record, as a view of the rows read; the rows' meta), checked for sizes and
        spill slots the file cannot hold (a damaged record table)."""
        meta = self._gather(f"{self.path}/meta", flat)
        self._check(meta)
        sizes, spilled = meta[:, 0], meta[:, 3]
        bad = (sizes < 0) | (sizes > self.row_bytes) | ((spilled == 0) & (sizes > self.slot_bytes)) | (spilled < 0)
        if bad.any():
            i = int(np.argmax(bad))
            row = f"row {int(row_ids[i])}" if row_ids is not None else f"row {int(flat[i])} of the ring"
            raise DamagedRecordError(f"leaf '{self.path}' ({self.codec_name}): the record table entry of {row} is "
                                     f"damaged ({int(sizes[i])} bytes, spill slot {int(spilled[i]) - 1})")
        slots = self._gather(f"{self.path}/slots", flat)
        lengths = sizes.tolist()
        if not spilled.any():
            return [slots[i, :size] for i, size in enumerate(lengths)], meta
        away = np.flatnonzero(spilled)
        spill_rows = self._spill_rows(spilled[away] - 1, flat[away], row_ids, away)
        where = dict(zip(away.tolist(), range(away.shape[0])))
        pieces = []
        for i, size in enumerate(lengths):
            k = where.get(i)
            pieces.append(slots[i, :size] if k is None else spill_rows[k, :size])
        return pieces, meta

    def _spill_rows(self, slots: np.ndarray, flat: np.ndarray, row_ids: np.ndarray | None,
                    which: np.ndarray) -> np.ndarray:
        known = int(self._spill.shape[0])
        if slots.size and int(slots.max()) >= known:
            with contextlib.suppress(Exception):  # an SWMR reader may not know of slots added since
                self._spill.refresh()
            known = int(self._spill.shape[0])
        beyond = slots >= known
        if beyond.any():
            i = int(np.argmax(beyond))
            row = f"row {int(row_ids[which[i]])}" if row_ids is not None else f"row {int(flat[i])} of the ring"
            raise DamagedRecordError(f"leaf '{self.path}' ({self.codec_name}): the record of {row} names spill slot "
                                     f"{int(slots[i])}, beyond the {known} the file holds")
        return self._gather(f"{self.path}/spill", slots)

    # ------------------------------------------------------------------ writing

    def datasets(self) -> list[h5py.Dataset]:
        return [self._slots, self._meta, self._spill]

    def _codec_for_writing(self) -> Codec:
        if self._codec is None:
            self._codec = codecs.codec(self.codec_name, self.level, self.path)
        return self._codec

    def _spill_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._spill_of is not None and self._refs is not None:
            return self._spill_of, self._refs
        column = np.asarray(self._meta[:, 3], dtype=np.int64)
        known = int(self._spill.shape[0])
        column[(column < 0) | (column > known)] = 0  # rows never published may name anything
        self._spill_of = column
        self._refs = np.bincount(column[column > 0] - 1, minlength=known).astype(np.int64)
        self._free = np.flatnonzero(self._refs == 0).tolist()
        heapq.heapify(self._free)
        return self._spill_of, self._refs

    def encode(self, rows: np.ndarray) -> list[tuple[bytes | memoryview, int]]:
        """The records of `rows` (compressing is the costly part: done before any write)."""
        return codecs.encode_rows(rows, self._codec_for_writing())

    def write(self, positions: np.ndarray, records: list[tuple[bytes | memoryview, int]],
              write: Callable[[h5py.Dataset, np.ndarray, np.ndarray], None]) -> None:
        """Store `records` at rows `positions` (1-d, unique, sorted) with `write(dataset, rows,
        values)` (the storage's row writer for consecutive or sorted rows)."""
        try:
            self._write(positions, records, write)
        except BaseException:
            self._spill_of = self._refs = None  # read afresh from the file by the next write
            raise

    def _write(self, positions: np.ndarray, records: list[tuple[bytes | memoryview, int]],
               write: Callable[[h5py.Dataset, np.ndarray, np.ndarray], None]) -> None:
        spill_of, refs = self._spill_table()
        n = positions.shape[0]
        meta = np.zeros((n, _META_WIDTH), np.int64)
        slots = np.zeros((n, self.slot_bytes), np.uint8)
        old = spill_of[positions]
        for j in old[old > 0] - 1:
            refs[j] -= 1
            if refs[j] == 0:
                heapq.heappush(self._free, int(j))
        away: list[tuple[int, bytes | memoryview]] = []
        for i, (record, kind) in enumerate(records):
            size = len(record) if isinstance(record, bytes) else record.nbytes
            meta[i, 0], meta[i, 1], meta[i, 2] = size, kind, codecs.crc32(record)
            if size <= self.slot_bytes:
                slots[i, :size] = np.frombuffer(record, np.uint8)
            else:
                j = self._take_spill_slot()
                meta[i, 3] = j + 1
                away.append((j, record))
        if away:
            order = sorted(away, key=lambda item: item[0])
            spill_rows = np.zeros((len(order), self._spill.shape[1]), np.uint8)
            for k, (_, record) in enumerate(order):
                spill_rows[k, : len(record)] = np.frombuffer(record, np.uint8)
            write(self._spill, np.array([j for j, _ in order], np.int64), spill_rows)
        write(self._slots, positions, slots)
        write(self._meta, positions, meta)
        spill_of[positions] = meta[:, 3]

    def _take_spill_slot(self) -> int:
        """A spill slot no row names (the lowest), growing the spill area when there is none."""
        _, refs = self._spill_table()
        while self._free:
            j = heapq.heappop(self._free)
            if refs[j] == 0:
                refs[j] = 1
                return int(j)
        known = int(self._spill.shape[0])
        growth = max(1, min(_SPILL_GROWTH, self.capacity // 64))
        self._spill.resize(known + growth, axis=0)
        self._refs = refs = np.concatenate([refs, np.zeros(growth, np.int64)])
        for j in range(known + 1, known + growth):
            heapq.heappush(self._free, j)
        refs[known] = 1
        return known

    def spill_slots(self) -> int:
        """Spill slots the file holds (each one raw row)."""
        return int(self._spill.shape[0])
