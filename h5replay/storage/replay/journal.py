"""The replay journal: what a ReplayBuffer keeps in its file besides the rows, and the order in
which it reaches the file, so that every reader and every restart sees an exact buffer.

In the file, under `/_h5replay/replay/`:
  * `journal`: the published state (`state.py`): a row of 16 int64 for the ring and one per
    table, in one chunk written at once, each row ending in a CRC-32 of the rest and each table
    row naming the ring row's publish, so a reader never acts on a torn or zero-filled state.
  * attribute `tables`: the tables' names, in the journal's order; each table's settings and
    datasets in `tables/<name>/` (`table_file.py`). A file made before tables keeps its one
    table's in the replay group itself, with a journal of one row (layout 2): read as it is, as
    the table "default", and upgraded by the first writable open.
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
from typing import TYPE_CHECKING, Protocol

import h5py
import numpy as np

from h5replay.errors import ConfigError, StorageError
from h5replay.sampling import DEFAULT_TABLE, Table, check_tables
from h5replay.spaces import named_leaves
from h5replay.storage._h5file import (
    ATTR_REPLAY_ID,
    INTERNAL_GROUP,
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
from h5replay.storage.replay.episodes import EPISODE_CHUNK_ROWS, EpisodeTable
from h5replay.storage.replay.keys import DEFAULT_KEY_WINDOW, KeyFile
from h5replay.storage.replay.ring import Ring
from h5replay.storage.replay.state import MARK, ROW, Counters, State, decode, encode, intact, rows_for
from h5replay.storage.replay.table_file import (
    SamplingFile,
    create_table_groups,
    layout_of,
    table_groups,
    table_names,
    upgrade_layout,
)

if TYPE_CHECKING:
    from h5replay.storage.hdf5 import HDF5Storage

__all__ = ["REPLAY_GROUP", "State", "Counters", "Journal", "JournalStore", "EpisodeTable", "RecordsMoved"]

REPLAY_GROUP = f"{INTERNAL_GROUP}/replay"
_JOURNAL = "journal"
_EPISODES = "episodes"
_LEGACY_STATE = "state"  # format 1: mark, begin, end, ep_begin, ep_end, open_start, seq, reserved
_LEGACY_ROW = 8
_TORN_RETRIES = 100  # a reader re-reads a torn state row this often (about 0.1 s) before calling it damaged


class RecordsMoved(Exception):
    """A reader read episode records whose slots the writer reused after the state it synced to
    (internal: ReplayBuffer.refresh syncs again to `latest`)."""

    def __init__(self, latest: State) -> None:
        super().__init__(f"the writer published seq {latest.seq} meanwhile")
        self.latest = latest


def _datasets(group: h5py.Group, where: str, capacity: int | None) -> tuple[h5py.Dataset, h5py.Dataset]:
    """The journal's dataset and the episode table of a replay group, checked: int64 of one row
    of 16 per table and one more (layout 3), of one row (layout 2) or of 8 (format 1); and
    (n, 2) int64 of at most `capacity` rows.

    Raises:
        StorageError: either is missing, or of another dtype or shape.
    """
    if _JOURNAL in group:
        rows = ROW if layout_of(group) == 2 else rows_for(len(table_names(group)))
        journal = check_dataset(group[_JOURNAL], where, np.int64, (rows,), (rows,))
    else:
        journal = check_dataset(group.get(_LEGACY_STATE), where, np.int64, (_LEGACY_ROW,))
    episodes = check_dataset(group.get(_EPISODES), where, np.int64, (None, 2), (capacity, 2))
    return journal, episodes


def _legacy_state(row: np.ndarray, where: str) -> State:
    """The state in a format-1 state row."""
    if int(row[0]) != MARK:
        raise StorageError(f"{where} has a damaged replay state row: {row.tolist()}")
    begin, end, ep_begin, ep_end, open_start, seq = (int(x) for x in row[1:7])
    return State(seq=seq, begin=begin, end=end, ep_begin=ep_begin, ep_end=ep_end, open_start=max(open_start, begin))


class JournalStore(Protocol):
    """Where a ReplayBuffer keeps its state and episode records (the file's journal, or a test's
    memory): read and publish the state, write one episode record, fill a table."""

    replay_id: str
    #: The tables' settings, by name, in the file's order (a journal that keeps none: empty, and
    #: the buffer is given them).
    configs: dict[str, Table]
    #: The tables' sampling datasets by name (empty: the buffer keeps its sampling state in memory only).
    tables: dict[str, SamplingFile]
    #: The file's idempotency key table (None: the buffer remembers keys in memory only).
    keys: KeyFile | None

    def read(self) -> State: ...
    def close(self) -> None: ...
    def publish(self, state: State, fsync: bool = False) -> None: ...
    def record(self, episode_id: int, slot: int, start: int, length: int) -> None: ...
    def load(self, table: EpisodeTable, state: State) -> None: ...
    def sync(self, table: EpisodeTable, old: State, new: State) -> None: ...
    def read_only_keys(self) -> KeyFile | None: ...  # the key table, opened for a read-only buffer


def _check_replay_id(replay_id: str | None) -> None:
    if replay_id is not None and (not isinstance(replay_id, str) or not re.fullmatch(r"[0-9a-f]{32}", replay_id)):
        raise ConfigError(f"a replay id is 32 lowercase hex digits (a UUID's hex), got {replay_id!r}")


def _write_journal(group: h5py.Group, state: State) -> None:
    """A new journal dataset for `state` (one chunk: written at once, mapped by readers)."""
    values = encode(state)
    if _JOURNAL in group:
        del group[_JOURNAL]
    group.create_dataset(_JOURNAL, data=values, maxshape=values.shape, chunks=values.shape)


class Journal:
    """The journal datasets of one open buffer file: reads, writes and publishes its state."""

    def __init__(self, storage: HDF5Storage) -> None:
        """Raises:
            ConfigError: the file holds no journal (a plain storage file, or not h5replay's).
            StorageError: its datasets or tables are damaged.
        """
        self.storage = storage
        self.capacity = storage.capacity
        self._where = repr(storage.filename)
        if REPLAY_GROUP not in storage.file:
            raise ConfigError(
                f"{storage.filename!r} is not a replay buffer file; "
                "open plain files with ReplayBuffer.from_raw_hdf5"
            )
        #: The file's UUID ('' for a format-1 file opened read-only).
        self.replay_id = replay_id(storage.file)
        self._reader = storage.multiprocessing and not storage.is_mutable
        with h5_errors("opening the replay journal"):
            group = storage.file[REPLAY_GROUP]
            self._state_ds, self._episodes_ds = _datasets(group, self._where, self.capacity)
            # Slots of the episode table, kept here: this writer alone resizes it, and h5py's
            # Dataset.shape costs ~15 us a call (once per commit, in `record`).
            self._episode_slots = int(self._episodes_ds.shape[0])
            self.tables = {name: SamplingFile(g, self._reader, self.capacity)
                           for name, g in table_groups(group, self._where).items()}
        self.configs = {name: file.config for name, file in self.tables.items()}
        self._legacy = self._state_ds.shape[0] == _LEGACY_ROW
        self.keys = None if self._reader or not storage.is_mutable else KeyFile.of(group)
        self._row = np.empty(self._state_ds.shape[0], dtype=np.int64)  # reused for every state read
        # A reader reads the journal (checked by its CRCs) through a memory map of its one chunk,
        # which never moves (no filters, never resized): one copy against ~100-300 µs for a
        # refresh and an HDF5 read, paid twice by every read request.
        self._state_map = MappedChunk.open(self._state_ds) if self._reader and not self._legacy else None
        self._last_raw, self._last_state = b"", State()  # the last row read, and its state
        self._records: dict[int, np.ndarray] = {}  # slot -> episode record, written by `publish`

    # ------------------------------------------------------------------ creating and upgrading

    @staticmethod
    def create_tables(
        capacity: int | None, initial: State | None = None, tables: Table | dict[str, Table] | None = None,
        key_window: int = DEFAULT_KEY_WINDOW, replay_id: str | None = None,
    ) -> Prepare:
        """The `prepare` hook that adds an empty journal to a new file (its ids starting where
        `initial` says: an export that keeps the ids of what it copies), with the datasets its
        tables need (a bare `Table`: one, named "default") and an idempotency key table of
        `key_window` episodes. `replay_id`: the id the file takes instead of a new one (an export
        or compaction of that replay)."""
        configs = check_tables({DEFAULT_TABLE: tables or Table()} if not isinstance(tables, dict) else tables)
        state = initial or State()
        if len(state.tables) != len(configs):
            state = state.replace(tables=tuple(Counters() for _ in configs))
        state.check("a new replay journal", capacity)
        KeyFile.check_window(key_window)
        _check_replay_id(replay_id)

        def create(f: h5py.File) -> None:
            if replay_id is not None:
                f.attrs[ATTR_REPLAY_ID] = replay_id
            group = f.require_group(REPLAY_GROUP)
            create_table_groups(group, configs, capacity)
            KeyFile.create_table(group, key_window)
            _write_journal(group, state)
            rows = EPISODE_CHUNK_ROWS if capacity is None else min(EPISODE_CHUNK_ROWS, capacity)
            group.create_dataset(_EPISODES, shape=(0, 2), maxshape=(capacity, 2), chunks=(rows, 2), dtype=np.int64)

        return create

    @staticmethod
    def upgrade(f: h5py.File) -> None:
        """The `prepare` hook for a writable open, before SWMR starts: a format-1 file's state row
        becomes a journal (same ids, generation 0); a file made before tables gets its one table,
        "default", in a group of its own and a layout-3 journal; a file made before idempotency
        keys gets its key table (and before the running maximum priority its dataset)."""
        group = f.get(REPLAY_GROUP)
        if group is None:
            upgrade_header(f)
            return
        KeyFile.create_table(group)
        where = repr(f.filename)
        capacity = read_header(f)[1]
        if _JOURNAL not in group:
            _datasets(group, where, capacity)
            state = _legacy_state(group[_LEGACY_STATE][...], where)
            upgrade_layout(group)
            _write_journal(group, state)
            del group[_LEGACY_STATE]
        elif layout_of(group) == 2:
            journal, _ = _datasets(group, where, capacity)
            state = decode(journal[...], where, capacity)
            upgrade_layout(group)
            _write_journal(group, state)
        for table in table_groups(group, where).values():
            SamplingFile.upgrade(table)
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
        where = repr(f.filename)
        state_ds, episodes = _datasets(group, where, capacity)
        end = data_end(state_ds, 0, state_ds.shape[0])
        if end > length:
            raise published_beyond(f.filename, length, end)
        row = state_ds[...]
        state = decode(row, where, capacity) if _JOURNAL in group else _legacy_state(row, where)
        ring = Ring(capacity)
        for first, stop, _ in ring.pieces(state.begin, state.end, state.origin):
            for path, _ in named_leaves(space):
                end = max(end, data_end(f[path], first, stop))
        for first, stop, _ in ring.pieces(state.ep_begin, state.ep_end, state.ep_origin):
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
            if self._legacy or not self._reader or intact(row):
                break
            # A reader caught the writer rewriting the journal (a torn read): the checksums say so.
            time.sleep(0 if attempt < 10 else 0.001)
        if self._legacy:
            state = _legacy_state(row, self._where)
            state.check(self._where, self.capacity)
            return state
        raw = row.tobytes()
        if raw != self._last_raw:  # most reads find the row unchanged: skip decoding and checks
            state = decode(row, self._where, self.capacity)
            if len(state.tables) != len(self.tables):
                raise StorageError(f"{self._where} has a replay journal of {len(state.tables)} tables, but lists "
                                   f"{len(self.tables)}: the file is damaged")
            self._last_state, self._last_raw = state, raw
        return self._last_state

    def read_only_keys(self) -> KeyFile | None:
        """The file's idempotency key table, opened for a buffer opened read-only."""
        with h5_errors("opening the idempotency key table"):
            return KeyFile.of(self.storage.file[REPLAY_GROUP])

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
        row = encode(state)
        if row.shape[0] != self._row.shape[0]:  # a bug, never a user's input: refuse to write it
            raise StorageError(f"a state of {len(state.tables)} tables cannot be published to {self._where}, "
                               f"whose journal has room for {self._row.shape[0] // ROW - 1}")
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
                grown = max(slot + 1, 2 * ds.shape[0], EPISODE_CHUNK_ROWS)
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
