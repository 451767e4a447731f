"""The replay journal: what a ReplayBuffer keeps in its file besides the rows, and the order in
which it reaches the file, so that every reader and every restart sees an exact buffer.

In the file, under `/_h5replay/replay/`:
  * `journal`: one row of 16 int64, the published state (see `State`), ending in a CRC-32 of the
    rest, so a reader never acts on a torn or zero-filled row.
  * `episodes`: one (first row id, length) record per episode, in ring slots (episode id modulo
    the capacity; an unbounded buffer grows the table instead).
  * `commit_keys`: the idempotency keys of recent commits (`keys.py`), for the writer only.

Ids: a row's id is its position in the sequence of all rows ever committed to the file, an
episode's id its position among all episodes; both are global, never reused, and survive
wrap-around, `clear()` (which moves `begin` to `end`, and bumps the generation) and restarts.
A row of id `i` lives at physical row `i % capacity`, or `i - origin` for an unbounded buffer.
Every id and counter of the state stays below `MAX_ID` (2**62), so id arithmetic never
overflows int64: a file whose state passes it is refused, and so is a commit that would.

Publish order (`publish`): flush the rows and episode records (fsync them under `fsync=True`),
then write the state row, then flush it (and fsync). The published state therefore never names a
row that is not in the file, on the disk when asked.

Readers (`EpisodeTable.sync`) read only what changed since the state they last saw: the new
episode records, and nothing for evicted ones. A changed generation (a `clear()`) makes them drop
everything they cached, the storage's memory maps included.
"""

from __future__ import annotations

import re
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import h5py
import numpy as np

from h5replay.errors import ConfigError, StorageError
from h5replay.records import NO_EPISODE
from h5replay.sampling import SamplingConfig
from h5replay.spaces import named_leaves
from h5replay.storage._h5file import (
    ATTR_REPLAY_ID,
    INTERNAL_GROUP,
    MAX_ID,
    Prepare,
    check_dataset,
    data_end,
    h5_errors,
    published_beyond,
    read_header,
    replay_id,
    upgrade_header,
    verify_all_within,
)
from h5replay.storage._rowio import read_slice, write_rows, write_slots
from h5replay.storage.fastread import MappedChunk
from h5replay.storage.replay.keys import DEFAULT_KEY_WINDOW, KeyFile
from h5replay.storage.replay.table_file import SamplingFile

if TYPE_CHECKING:
    from h5replay.storage.hdf5 import HDF5Storage

__all__ = ["REPLAY_GROUP", "State", "Journal", "JournalStore", "EpisodeTable"]

REPLAY_GROUP = f"{INTERNAL_GROUP}/replay"
_JOURNAL = "journal"
_EPISODES = "episodes"
_LEGACY_STATE = "state"  # format 1: mark, begin, end, ep_begin, ep_end, open_start, seq, reserved
_LEGACY_ROW = 8
_MARK = 0x5245504C  # "REPL": tells a state row from zero fill
_LAYOUT = 2
_ROW = 16
_FIELDS = ("seq", "generation", "begin", "end", "ep_begin", "ep_end", "open_start", "origin", "ep_origin",
           "inserted", "sampled", "plog", "pckpt")
_FIELD_SET = frozenset(_FIELDS)
_EPISODE_CHUNK_ROWS = 4096
_TORN_RETRIES = 100  # a reader re-reads a torn state row this often (about 0.1 s) before calling it damaged


class RecordsMoved(Exception):
    """A reader read episode records whose slots the writer reused after the state it synced to
    (internal: ReplayBuffer.refresh syncs again to `latest`)."""

    def __init__(self, latest: State) -> None:
        super().__init__(f"the writer published seq {latest.seq} meanwhile")
        self.latest = latest


@dataclass(frozen=True)
class State:
    """The published state of a replay buffer (all ids global).

    Rows held: ids [begin, end). Episodes with a row held: ids [ep_begin, ep_end); the first of
    them may have lost its head to the ring (its first row id < begin). The open episode (rows
    added by `extend` and not yet ended) starts at row `open_start` (== end when there is none;
    below `begin` when the ring has overwritten its head, and then it is never recorded).
    `origin` / `ep_origin` (unbounded buffers) are the ids at physical row / table slot 0.
    `seq` counts publishes; `generation` counts `clear()`s.
    The rate limiter's counters: rows `inserted` and rows `sampled` since creation or `clear()`.
    The priority log (`table_file.py`): `plog` updates published, the first `pckpt` of them
    already in the priorities dataset.
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
    sampled: int = 0
    plog: int = 0
    pckpt: int = 0

    def replace(self, **changes: int) -> State:
        """A copy with `changes` (a few microseconds: dataclasses.replace re-runs the frozen
        __init__, and every commit makes several)."""
        unknown = changes.keys() - _FIELD_SET
        if unknown:
            raise TypeError(f"State has no field(s) {sorted(unknown)}")
        new = object.__new__(State)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    @property
    def length(self) -> int:
        return self.end - self.begin

    def to_row(self) -> np.ndarray:
        row = np.zeros(_ROW, dtype=np.int64)
        row[0], row[1] = _MARK, _LAYOUT
        row[2 : 2 + len(_FIELDS)] = [getattr(self, name) for name in _FIELDS]
        row[-1] = zlib.crc32(row[:-1].tobytes())
        return row

    @staticmethod
    def intact(row: np.ndarray) -> bool:
        """Whether a journal row is whole: its mark, layout and checksum agree."""
        return int(row[0]) == _MARK and int(row[1]) == _LAYOUT and int(row[-1]) == zlib.crc32(row[:-1].tobytes())

    @classmethod
    def from_row(cls, row: np.ndarray, where: str, capacity: int | None) -> State:
        """The state in a journal row, checked.

        Raises:
            StorageError: not a journal row (zero fill, torn, damaged) or impossible values.
        """
        if not cls.intact(row):
            raise StorageError(f"{where} has a damaged replay journal row: {row.tolist()}")
        state = cls(*row[2 : 2 + len(_FIELDS)].tolist())
        state.check(where, capacity)
        return state

    def check(self, where: str, capacity: int | None) -> None:
        """Raises:
            StorageError: the values are impossible, or an id or counter is not below MAX_ID.
        """
        past = [f"{name}={getattr(self, name)}" for name in _FIELDS if getattr(self, name) >= MAX_ID]
        if past:
            raise StorageError(f"{where} has a replay state with ids or counters past 2**62, the most a file records "
                               f"({', '.join(past)}): the file is damaged or was not written by h5replay")
        ok = (
            0 <= self.origin <= self.begin <= self.end and self.origin <= self.open_start <= self.end
            and 0 <= self.ep_origin <= self.ep_begin <= self.ep_end
            and self.ep_end - self.ep_begin <= self.end - self.begin
            and (capacity is None or self.end - self.begin <= capacity)
            and self.inserted >= 0 and self.sampled >= 0 and 0 <= self.pckpt <= self.plog
        )
        if not ok:
            raise StorageError(f"{where} has an inconsistent replay state: {self}")


class EpisodeTable:
    """The (first row id, length) of episodes [begin, end), in memory, in the file's ring slots.

    Pure numpy. Reads never walk the whole table: `find` and `complete` look at (at most) the two
    contiguous pieces the ring splits it into.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        size = min(capacity, _EPISODE_CHUNK_ROWS) if capacity is not None else _EPISODE_CHUNK_ROWS
        self._starts = np.zeros(size, dtype=np.int64)
        self._lengths = np.zeros(size, dtype=np.int64)
        self.begin = self.end = self.origin = 0
        self._ordered: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.end - self.begin

    def slot(self, episode_id: int) -> int:
        return episode_id % self.capacity if self.capacity is not None else episode_id - self.origin

    def _ensure(self, slots: int) -> None:
        if slots > self._starts.shape[0]:
            size = max(slots, 2 * self._starts.shape[0])
            if self.capacity is not None:
                size = min(size, self.capacity)
            self._starts = np.resize(self._starts, size)
            self._lengths = np.resize(self._lengths, size)

    def put(self, episode_id: int, start: int, length: int) -> tuple[int, int]:
        """Record an episode in its slot; returns what the slot held (to undo with `put`)."""
        slot = self.slot(episode_id)
        self._ensure(slot + 1)
        old = (int(self._starts[slot]), int(self._lengths[slot]))
        self._starts[slot], self._lengths[slot] = start, length
        self._ordered = None
        return old

    def put_many(self, first_id: int, records: np.ndarray) -> None:
        """Records (n, 2) for episodes first_id, first_id + 1, ... (at most one ring's worth)."""
        n = records.shape[0]
        if n == 0:
            return
        first = self.slot(first_id)
        size = first + n if self.capacity is None else self.capacity
        self._ensure(first + n if self.capacity is None else min(self.capacity, first + n))
        head = min(n, size - first)
        self._starts[first : first + head], self._lengths[first : first + head] = records[:head, 0], records[:head, 1]
        if head < n:
            self._starts[: n - head], self._lengths[: n - head] = records[head:, 0], records[head:, 1]
        self._ordered = None

    def set_range(self, begin: int, end: int) -> None:
        if (begin, end) != (self.begin, self.end):
            self.begin, self.end = begin, end
            self._ordered = None

    def start_of(self, episode_id: int) -> int:
        return int(self._starts[self.slot(episode_id)])

    def length_of(self, episode_id: int) -> int:
        return int(self._lengths[self.slot(episode_id)])

    def first_with_rows_from(self, row_begin: int) -> int:
        """The first episode id >= self.begin that still has a row at or after `row_begin`."""
        e = self.begin
        while e < self.end and self.start_of(e) + self.length_of(e) <= row_begin:
            e += 1
        return e

    def _pieces(self) -> list[tuple[int, int, int]]:
        """(first episode id, first slot, count) of the contiguous runs of [begin, end)."""
        n = self.end - self.begin
        if n <= 0:
            return []
        first = self.slot(self.begin)
        if self.capacity is None or first + n <= self.capacity:
            return [(self.begin, first, n)]
        head = self.capacity - first
        return [(self.begin, first, head), (self.begin + head, 0, n - head)]

    def ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(episode ids, first row ids, lengths) of [begin, end), oldest first (cached)."""
        if self._ordered is None:
            pieces = self._pieces()
            ids = np.arange(self.begin, self.end, dtype=np.int64)
            if len(pieces) <= 1:
                sl = slice(pieces[0][1], pieces[0][1] + pieces[0][2]) if pieces else slice(0, 0)
                starts, lengths = self._starts[sl].copy(), self._lengths[sl].copy()
            else:
                starts = np.concatenate([self._starts[s : s + c] for _, s, c in pieces])
                lengths = np.concatenate([self._lengths[s : s + c] for _, s, c in pieces])
            self._ordered = (ids, starts, lengths)
        return self._ordered

    def complete(self, row_begin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`ordered()` without a first episode that lost its head (first row id < row_begin)."""
        ids, starts, lengths = self.ordered()
        if starts.shape[0] and starts[0] < row_begin:
            return ids[1:], starts[1:], lengths[1:]
        return ids, starts, lengths

    def find(self, row_ids: np.ndarray) -> np.ndarray:
        """The episode id of each row (NO_EPISODE for rows outside every recorded episode)."""
        out = np.full(row_ids.shape, NO_EPISODE, dtype=np.uint64)
        rows = row_ids.astype(np.int64, copy=False)
        for first_id, slot, count in self._pieces():
            starts = self._starts[slot : slot + count]
            lengths = self._lengths[slot : slot + count]
            k = np.searchsorted(starts, rows, side="right") - 1
            inside = k >= 0
            kk = np.where(inside, k, 0)
            inside &= rows < starts[kk] + lengths[kk]
            out[inside] = (first_id + kk[inside]).astype(np.uint64)
        return out


def _datasets(group: h5py.Group, where: str, capacity: int | None) -> tuple[h5py.Dataset, h5py.Dataset]:
    """The state row's dataset and the episode table of a replay group, checked: (16,) int64
    (format 1: (8,)), and (n, 2) int64 of at most `capacity` rows.

    Raises:
        StorageError: either is missing, or of another dtype or shape.
    """
    if _JOURNAL in group:
        state = check_dataset(group[_JOURNAL], where, np.int64, (_ROW,))
    else:
        state = check_dataset(group.get(_LEGACY_STATE), where, np.int64, (_LEGACY_ROW,))
    episodes = check_dataset(group.get(_EPISODES), where, np.int64, (None, 2), (capacity, 2))
    return state, episodes


def _pieces(first: int, count: int, capacity: int | None) -> list[tuple[int, int]]:
    """The physical [first, stop) ranges of `count` slots from `first`, wrapped at `capacity`."""
    if count <= 0:
        return []
    if capacity is None:
        return [(first, first + count)]
    start = first % capacity
    count = min(count, capacity)
    if start + count <= capacity:
        return [(start, start + count)]
    return [(start, capacity), (0, start + count - capacity)]


class JournalStore(Protocol):
    """Where a ReplayBuffer keeps its state and episode records (the file's journal, or a test's
    memory): read and publish the state, write one episode record, fill a table."""

    replay_id: str
    #: The file's sampling datasets (None: the buffer keeps its sampling state in memory only).
    sampling: SamplingFile | None
    #: The file's idempotency key table (None: the buffer remembers keys in memory only).
    keys: KeyFile | None

    def read(self) -> State: ...
    def close(self) -> None: ...
    def publish(self, state: State, fsync: bool = False) -> None: ...
    def record(self, episode_id: int, slot: int, start: int, length: int) -> None: ...
    def load(self, table: EpisodeTable, state: State) -> None: ...
    def sync(self, table: EpisodeTable, old: State, new: State) -> None: ...


class Journal:
    """The journal datasets of one open buffer file: reads, writes and publishes its state."""

    def __init__(self, storage: HDF5Storage) -> None:
        """Raises:
            ConfigError: the file holds no journal (a plain storage file, or not h5replay's).
        """
        self.storage = storage
        self.capacity = storage.capacity
        self._where = repr(storage.filename)
        if REPLAY_GROUP not in storage.file:
            raise ConfigError(
                f"{storage.filename!r} is not a replay buffer file; "
                "open plain files with HDF5Storage.load_replay_buffer_from_raw_hdf5"
            )
        #: The file's UUID ('' for a format-1 file opened read-only).
        self.replay_id = replay_id(storage.file)
        with h5_errors("opening the replay journal"):
            group = storage.file[REPLAY_GROUP]
            self._state_ds, self._episodes_ds = _datasets(group, self._where, self.capacity)
            # Slots of the episode table, kept here: this writer alone resizes it, and h5py's
            # Dataset.shape costs ~15 us a call (once per commit, in `record`).
            self._episode_slots = int(self._episodes_ds.shape[0])
        self._legacy = self._state_ds.shape[0] == _LEGACY_ROW
        self._reader = storage.multiprocessing and not storage.is_mutable
        self.sampling: SamplingFile | None = SamplingFile(group, self._reader, self.capacity)
        self.keys = None if self._reader or not storage.is_mutable else KeyFile.of(group)
        self._row = np.empty(self._state_ds.shape[0], dtype=np.int64)  # reused for every state read
        # A reader reads the state row (checked by its CRC) through a memory map of its one chunk,
        # which never moves (no filters, never resized): one copy against ~100-300 µs for a
        # refresh and an HDF5 read, paid twice by every read request.
        self._state_map = MappedChunk.open(self._state_ds) if self._reader and not self._legacy else None
        self._last_raw, self._last_state = b"", State()  # the last row read, and its state
        self._records: dict[int, np.ndarray] = {}  # slot -> episode record, written by `publish`

    # ------------------------------------------------------------------ creating and upgrading

    @staticmethod
    def create_tables(
        capacity: int | None, initial: State | None = None, sampling: SamplingConfig | None = None,
        key_window: int = DEFAULT_KEY_WINDOW, replay_id: str | None = None,
    ) -> Prepare:
        """The `prepare` hook that adds an empty journal to a new file (its ids starting where
        `initial` says: an export that keeps the ids of what it copies), with the datasets its
        sampling settings need and an idempotency key table of `key_window` episodes. `replay_id`:
        the id the file takes instead of a new one (an export or compaction of that replay)."""
        state = initial or State()
        state.check("a new replay journal", capacity)
        KeyFile.check_window(key_window)
        if replay_id is not None and (not isinstance(replay_id, str) or not re.fullmatch(r"[0-9a-f]{32}", replay_id)):
            raise ConfigError(f"a replay id is 32 lowercase hex digits (a UUID's hex), got {replay_id!r}")

        def create(f: h5py.File) -> None:
            if replay_id is not None:
                f.attrs[ATTR_REPLAY_ID] = replay_id
            group = f.require_group(REPLAY_GROUP)
            SamplingFile.create_tables(group, sampling or SamplingConfig(), capacity)
            KeyFile.create_table(group, key_window)
            group.create_dataset(_JOURNAL, data=state.to_row(), maxshape=(_ROW,), chunks=(_ROW,))
            rows = _EPISODE_CHUNK_ROWS if capacity is None else min(_EPISODE_CHUNK_ROWS, capacity)
            group.create_dataset(_EPISODES, shape=(0, 2), maxshape=(capacity, 2), chunks=(rows, 2), dtype=np.int64)

        return create

    @staticmethod
    def upgrade(f: h5py.File) -> None:
        """The `prepare` hook for a writable open: turn a format 1 file's state row into a journal
        row (same ids, generation 0), and give a file made before idempotency keys its key
        table (and before the running maximum priority its dataset), before SWMR starts."""
        group = f.get(REPLAY_GROUP)
        if group is not None:
            KeyFile.create_table(group)
            SamplingFile.upgrade(group)
        if group is None or _JOURNAL in group:
            upgrade_header(f)
            return
        old = group[_LEGACY_STATE][...]
        if int(old[0]) != _MARK:
            raise StorageError(f"{f.filename!r} has a damaged replay state row: {old.tolist()}")
        begin, end, ep_begin, ep_end, open_start, seq = (int(x) for x in old[1:7])
        state = State(seq=seq, begin=begin, end=end, ep_begin=ep_begin, ep_end=ep_end, open_start=max(open_start, begin))
        group.create_dataset(_JOURNAL, data=state.to_row(), maxshape=(_ROW,), chunks=(_ROW,))
        del group[_LEGACY_STATE]
        upgrade_header(f)

    @staticmethod
    def verify(f: h5py.File, length: int) -> None:
        """The `Verify` hook of a writable open: refuse a file found `length` bytes long (shorter
        than its superblock records) when a published row, episode record or the state row lay
        in the missing part. Rows never published (a staging block, rows past the published end)
        may be missing: a write that failed on a full disk leaves such a file.

        Raises:
            StorageError: published data lay past `length` (the message says how much is missing).
        """
        space, capacity = read_header(f)
        group = f.get(REPLAY_GROUP)
        if space is None or group is None:
            verify_all_within(f, length)
            return
        state_ds, episodes = _datasets(group, repr(f.filename), capacity)
        end = data_end(state_ds, 0, state_ds.shape[0])
        if end > length:
            raise published_beyond(f.filename, length, end)
        row = state_ds[...]
        if _JOURNAL in group:
            state = State.from_row(row, repr(f.filename), capacity)
        else:
            begin, stop, ep_begin, ep_end, open_start, seq = (int(x) for x in row[1:7])
            state = State(seq=seq, begin=begin, end=stop, ep_begin=ep_begin, ep_end=ep_end, open_start=open_start)
        for first, stop in _pieces(state.begin - (state.origin if capacity is None else 0),
                                   state.end - state.begin, capacity):
            for path, _ in named_leaves(space):
                end = max(end, data_end(f[path], first, stop))
        for first, stop in _pieces(state.ep_begin - (state.ep_origin if capacity is None else 0),
                                   state.ep_end - state.ep_begin, capacity):
            end = max(end, data_end(episodes, first, min(stop, episodes.shape[0])))
        if end > length:
            raise published_beyond(f.filename, length, end)

    # ------------------------------------------------------------------ the state row

    def read(self) -> State:
        """The published state, as the file has it now.

        Raises:
            StorageError: the row is damaged or its values are impossible.
        """
        for attempt in range(_TORN_RETRIES):
            row = self._row  # both reads fill it
            if self._state_map is not None:
                np.copyto(row, self._state_map.values)
            else:
                with h5_errors("reading the replay journal"):
                    if self._reader:
                        self._state_ds.id.refresh()  # low-level: the row's shape never changes
                    read_slice(self._state_ds, 0, row.shape[0], out=row)
            if self._legacy or not self._reader or State.intact(row):
                break
            # A reader caught the writer rewriting the row (a torn read): the checksum says so.
            time.sleep(0 if attempt < 10 else 0.001)
        if self._legacy:
            if int(row[0]) != _MARK:
                raise StorageError(f"{self._where} has a damaged replay state row: {row.tolist()}")
            begin, end, ep_begin, ep_end, open_start, seq = (int(x) for x in row[1:7])
            state = State(seq=seq, begin=begin, end=end, ep_begin=ep_begin, ep_end=ep_end,
                          open_start=max(open_start, begin))
            state.check(self._where, self.capacity)
            return state
        raw = row.tobytes()
        if raw != self._last_raw:  # most reads find the row unchanged: skip decoding and checks
            self._last_state, self._last_raw = State.from_row(row, self._where, self.capacity), raw
        return self._last_state

    def close(self) -> None:
        """Release the state row's memory map (the file is the storage's to close)."""
        if self._state_map is not None:
            self._state_map.close()

    def publish(self, state: State, fsync: bool = False) -> None:
        """Make the rows and episode records durable, then point the state row at them.

        Raises:
            StorageError: HDF5 failed; the file's state is the previous one or this one, never a
                state naming rows that did not reach the file.
        """
        self.write_records()
        self.storage.flush(fsync=fsync)
        row = state.to_row()
        with h5_errors("publishing the replay journal"):
            if not write_rows(self._state_ds, 0, row):
                self._state_ds[...] = row
        self.storage.flush(fsync=fsync)

    # ------------------------------------------------------------------ episode records

    def record(self, episode_id: int, slot: int, start: int, length: int) -> None:
        """Record an episode (growing an unbounded table now): written to the file by the next
        `publish`, before its state, with the other records of the group in one write per run
        of slots (a later record for a slot replaces an earlier one not yet written)."""
        if slot >= self._episode_slots:
            with h5_errors("recording an episode"):
                ds = self._episodes_ds
                limit = ds.maxshape[0]
                grown = max(slot + 1, 2 * ds.shape[0], _EPISODE_CHUNK_ROWS)
                ds.resize(grown if limit is None else min(grown, limit), axis=0)
                self._episode_slots = int(ds.shape[0])
        self._records[slot] = np.array([[start, length]], dtype=np.int64)

    def write_records(self) -> None:
        """Write the episode records and idempotency keys made since the last publish."""
        records, self._records = self._records, {}
        with h5_errors("recording episodes"):
            write_slots(self._episodes_ds, records, (self._episode_slots, 2))
        if self.keys is not None:
            self.keys.write_pending()

    def read_records(self, table: EpisodeTable, first_id: int, stop_id: int) -> np.ndarray:
        """The file's records of episodes [first_id, stop_id) as an (n, 2) array."""
        n = stop_id - first_id
        if n <= 0:
            return np.zeros((0, 2), dtype=np.int64)
        with h5_errors("reading the episode table"):
            if self._reader:
                self._episodes_ds.refresh()
            size = self._episodes_ds.shape[0]
            first = table.slot(first_id)
            if first + n <= size:
                return read_slice(self._episodes_ds, first, first + n)
            head = size - first
            if self.capacity is None or head <= 0:
                raise StorageError(f"{self._where} has {size} episode records, too few for episodes "
                                   f"[{first_id}, {stop_id})")
            return np.concatenate([read_slice(self._episodes_ds, first, size),
                                   read_slice(self._episodes_ds, 0, n - head)])

    def load(self, table: EpisodeTable, state: State) -> None:
        """Fill `table` with every episode `state` holds (a full reload).

        Raises:
            StorageError: an episode record is impossible, or (a writer's or plain open of an
                unbounded buffer) the state names rows past the end of the datasets.
        """
        if self.capacity is None and not self._reader and state.end - state.origin > len(self.storage):
            # (An SWMR reader may see the datasets' length from before the state's growth.)
            raise StorageError(f"{self._where} publishes rows up to id {state.end}, but its datasets hold "
                               f"{len(self.storage)} rows from id {state.origin}: its replay state is damaged")
        table.origin = state.ep_origin
        records = self.read_records(table, state.ep_begin, state.ep_end)
        self._check_records(records, state, state.ep_begin, None)
        table.set_range(state.ep_begin, state.ep_begin)
        table.put_many(state.ep_begin, records)
        table.set_range(state.ep_begin, state.ep_end)

    def sync(self, table: EpisodeTable, old: State, new: State) -> None:
        """Bring `table` from `old` to `new` reading only the records that changed: O(change)."""
        if new.generation != old.generation or new.ep_origin != old.ep_origin or new.ep_begin > old.ep_end:
            self.load(table, new)
            return
        first = max(old.ep_end, new.ep_begin)
        if new.ep_end > first:
            records = self.read_records(table, first, new.ep_end)
            before = first - 1
            previous_end = table.start_of(before) + table.length_of(before) if before >= new.ep_begin else None
            self._check_records(records, new, first, previous_end)
            table.put_many(first, records)
        table.set_range(new.ep_begin, new.ep_end)

    def _check_records(self, records: np.ndarray, state: State, first_id: int, previous_end: int | None) -> None:
        """Records of episodes first_id, first_id + 1, ... must lie inside the rows held (each
        with a row at or after `begin`; only the first may have lost its head to the ring), in
        order, after `previous_end` (the end of the record before them): else the file is damaged.

        A reader may also have read them after the writer reused their slots (the table is a
        ring of `capacity` slots, and a reader can be descheduled while the writer commits that
        many episodes): a reused slot holds a newer episode, whose rows lie past `state.end`,
        so it fails here too. Then the published state has moved on: RecordsMoved, with it,
        tells the caller to sync again; only a state that did not move means a damaged file."""
        if not records.shape[0]:
            return
        s, n = records[:, 0], records[:, 1]
        bad = (n < 1) | (s < state.origin) | (s + n > state.end) | (s + n <= state.begin)  # each keeps a row
        bad[1:] |= s[1:] < s[:-1] + n[:-1]
        if previous_end is not None:
            bad[0] |= s[0] < previous_end
        if bad.any():
            if self._reader:
                latest = self.read()
                if latest.seq != state.seq:
                    raise RecordsMoved(latest)
            i = int(np.argmax(bad))
            raise StorageError(f"{self._where} has an impossible episode record {first_id + i}: "
                               f"rows [{int(s[i])}, {int(s[i] + n[i])}) in a buffer of rows "
                               f"[{state.begin}, {state.end})")
