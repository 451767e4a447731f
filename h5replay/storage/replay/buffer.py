"""ReplayBuffer: a ring of rows with an episode table, kept in the same HDF5 file as the rows.

Every row committed to the file gets a global id (0, 1, 2, ...: its place among all rows ever
committed); every episode too. The buffer holds row ids [begin, end); logical index 0 is `begin`,
the oldest row held. Ids never move and are never reused: wrap-around drops the oldest ids,
`clear()` moves `begin` to `end` (and bumps the generation), a restart continues where the last
publish left. The journal (`journal.py`) keeps the state and the episode records in the file.

Crash safety:
  * Only `_publish` changes what the file shows (rows flushed, then the state row, then flushed).
  * Before rows overwrite slots the published state still shows, `_evict` publishes a state
    whose `begin` has moved past them (a little further, so this happens once per
    `capacity // 64` rows, not once per write). A crash therefore loses no published row to a
    torn overwrite. Once the ring has wrapped, len() runs up to `capacity // 64` rows below the
    capacity: those oldest rows were released early, for everyone alike.
  * `commit_segment` publishes before it returns: a committed episode survives a crash of this
    process. `append` / `extend` are published by the next `flush`, commit or `close`. A commit
    that fails leaves the buffer as it was before it (minus what an eviction published).
Readers in other processes (`load_from(path, read_only=True, multiprocessing=True)`) see only the
published state, read only what changed since their last look, and re-check the state after each
read: a row overwritten (or cleared) mid-read is never returned, and no batch mixes generations.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from h5replay.errors import (
    ClosedError,
    ConfigError,
    LimitExceededError,
    NotEnoughDataError,
    RateLimitedError,
    ReadOnlyError,
    SegmentStateError,
    StorageError,
)
from h5replay.records import Episode, Receipt, SampleInfo
from h5replay.sampling import DEFAULT_TABLE, RateLimit, Sampler, Table, Uniform, check_priorities, check_tables
from h5replay.spaces import Schema, Space
from h5replay.storage import _h5file
from h5replay.storage._indices import normalize_index
from h5replay.storage.hdf5 import HDF5Storage
from h5replay.storage.replay.episodes import EpisodeTable
from h5replay.storage.replay.journal import REPLAY_GROUP, Journal, JournalStore, RecordsMoved
from h5replay.storage.replay.keys import DEFAULT_KEY_WINDOW, KeyFile, KeyTable, check_key
from h5replay.storage.replay.ring import Ring, as_row_ids, check_held
from h5replay.storage.replay.state import Counters, State
from h5replay.storage.replay.table import Sampling
from h5replay.storage.replay.tables import Tables
from h5replay.storage.segment import SegmentWriter

__all__ = ["ReplayBuffer", "CommitInfo"]

#: What a commit returns: (episode_id, first_row_id, length); (-1, -1, 0) for an empty segment.
CommitInfo = Receipt
_EVICTION_FRACTION = 64  # publish an eviction once per capacity // 64 rows
_READ_RETRIES = 20
_T = TypeVar("_T")


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class ReplayBuffer:
    """A ring buffer of rows over an HDF5Storage, with episodes, and sampling of rows and windows
    by the sampler its file records (uniform, prioritized, fifo, lifo), under its rate limit."""

    def __init__(
        self, storage: HDF5Storage, *, raw: bool = False, journal: JournalStore | None = None,
        sampling: Table | None = None, tables: dict[str, Table] | None = None,
    ) -> None:
        """A buffer over `storage` whose bookkeeping is `journal` (by default the journal in the
        storage's own file). `raw=True`: a read-only view of every row, with no journal.
        `tables` (or `sampling`, one table) apply to a journal that keeps no settings of its own
        (a file's are its own).

        Raises:
            ConfigError: the file holds no replay journal (open plain files with `from_raw_hdf5`).
        """
        self.storage = storage
        self._raw = raw
        self._closed = False
        self._episodes = EpisodeTable(storage.capacity)
        self._journal: JournalStore | None = None
        if raw:
            end = len(storage)
            self._state = self._published = State(end=end, open_start=end)
        else:
            self._journal = journal if journal is not None else Journal(storage)
            self._state = self._published = self._load_episodes(self._journal)
        key_file = self._journal.keys if self._journal is not None else None
        self._keys = KeyTable(key_file.window if key_file is not None else DEFAULT_KEY_WINDOW, key_file)
        if storage.is_mutable and not raw:
            self._keys.load(self._state.ep_end)
        configs = self._journal.configs if self._journal is not None else {}
        if not configs:
            configs = check_tables(tables) if tables is not None else {DEFAULT_TABLE: sampling or Table()}
        if len(configs) != len(self._state.tables):
            raise StorageError(f"{storage.filename!r} has {len(configs)} tables but its journal counts "
                               f"{len(self._state.tables)}: the file is damaged")
        stores = self._journal.tables if self._journal is not None else {}
        self._tables = Tables(configs, storage.capacity, stores, writer=storage.is_mutable and not raw)
        if not raw:
            journal_read = self._journal.read if self._journal is not None else None
            self._tables.load(self._state, None if storage.is_mutable else journal_read)
        self._ring = Ring(storage.capacity)
        self._limit_inserts = True
        #: The state the last read was answered from (readers: a published one).
        self.last_view: State = self._state

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls, space: Space, capacity: int | None, cache_path: str | os.PathLike[str], *, first_row_id: int = 0,
        first_episode_id: int = 0, sampler: Sampler | None = None, rate_limit: RateLimit | None = None,
        max_times_sampled: int | None = None, tables: dict[str, Table] | None = None,
        idempotency_window: int = DEFAULT_KEY_WINDOW, check_bounds: bool = True, replay_id: str | None = None,
        **storage_kwargs: Any,
    ) -> ReplayBuffer:
        """A new, empty buffer in a new file (`cache_path`, or `<cache_path>/storage.hdf5` when it is
        a directory). `storage_kwargs` go to `HDF5Storage.create` (multiprocessing, chunks, ...).
        The first row and episode get the ids `first_row_id` and `first_episode_id` (an export
        keeps the ids of what it copies).

        Sampling, recorded in the file (reopening restores it): `tables`, a mapping of names to
        `Table(sampler, rate_limit=, max_times_sampled=)`, each a way of drawing from the same
        rows; or, for one table named "default", `sampler` (`Uniform()` by default,
        `Prioritized(exponent, initial_priority)`, `Fifo()`, `Lifo()`), `rate_limit` (Reverb's
        MinSize / SampleToInsertRatio, in rows) and `max_times_sampled` (a row sampled that often
        leaves that table; 0 or None: never). See `h5replay.sampling`.

        `idempotency_window`: how many of the latest episodes keep the idempotency key they were
        committed with (see `commit_segment`), recorded in the file. `replay_id`: the file's id
        (32 hex digits) instead of a new one: an export or compaction is the same replay. `check_bounds`: refuse Box
        values outside the space's bounds, and NaN (`SpaceMismatchError`), as gymnasium's
        `contains` would; a setting of this open buffer (`buffer.storage.check_bounds`).

        Raises:
            ConfigError: an invalid setting (nothing is created).
        """
        if tables is not None and (sampler is not None or rate_limit is not None or max_times_sampled is not None):
            raise ConfigError("give either tables= or sampler= / rate_limit= / max_times_sampled= (one table), not both")
        configs = check_tables(tables) if tables is not None else {
            DEFAULT_TABLE: Table(sampler if sampler is not None else Uniform(), rate_limit, max_times_sampled)}
        for name, config in configs.items():
            if capacity is not None and config.rate_limit.min_size_to_sample > capacity:
                raise ConfigError(f"table {name!r}: min_size_to_sample={config.rate_limit.min_size_to_sample} is more "
                                  f"than the capacity {capacity}: the buffer could never hold enough rows to sample")
        first_row, first_episode = int(first_row_id), int(first_episode_id)
        if not (0 <= first_row < _h5file.MAX_ID and 0 <= first_episode < _h5file.MAX_ID):
            raise ConfigError(f"first ids must be >= 0 and below 2**62, got row {first_row_id!r} and episode "
                              f"{first_episode_id!r}")
        initial = State(
            begin=first_row, end=first_row, open_start=first_row, ep_begin=first_episode, ep_end=first_episode,
            origin=first_row if capacity is None else 0, ep_origin=first_episode if capacity is None else 0,
            tables=tuple(Counters() for _ in configs),
        )
        storage = HDF5Storage.create(
            space, capacity, _h5file.file_path(cache_path), prepare=Journal.create_tables(capacity, initial, configs, idempotency_window, replay_id),
            **storage_kwargs,
        )
        return cls._around(storage, check_bounds)

    @classmethod
    def _around(cls, storage: HDF5Storage, check_bounds: bool) -> ReplayBuffer:
        """A buffer over a storage just created or opened (closed again if that fails)."""
        storage.check_bounds = check_bounds
        try:
            return cls(storage)
        except BaseException:
            storage.close()
            raise

    @classmethod
    def load_from(
        cls, path: str | os.PathLike[str], read_only: bool = True, *, check_bounds: bool = True, **storage_kwargs: Any,
    ) -> ReplayBuffer:
        """Reopen a buffer exactly as it was last published (closed, flushed or committed). A file
        of an older format is upgraded in place when opened for writing. `check_bounds` as in
        `create`. Opening gives up after `open_timeout` seconds (default 30; a storage keyword),
        or at SIGTERM / SIGINT.

        Raises:
            StorageError: the file is damaged, did not open in time, is written by another
                process, or lost published rows (a file cut short: export what is readable).
        """
        file = _h5file.file_path(path)
        with _h5file.opening(file, storage_kwargs.get("open_timeout", _h5file.DEFAULT_OPEN_TIMEOUT)):
            storage = HDF5Storage.load_from(
                file, None, read_only=read_only, prepare=None if read_only else Journal.upgrade,
                verify=None if read_only else Journal.verify, **storage_kwargs,
            )
            return cls._around(storage, check_bounds)

    @classmethod
    def from_raw_hdf5(cls, path: str | os.PathLike[str]) -> ReplayBuffer:
        """A read-only buffer over a plain h5py file: every row held, no episodes."""
        return cls(HDF5Storage.load_from(path, None, read_only=True), raw=True)

    # ------------------------------------------------------------------ properties

    def __len__(self) -> int:
        if self._is_reader:
            self.refresh()
        return self._state.length

    @property
    def capacity(self) -> int | None:
        return self.storage.capacity

    @property
    def space(self) -> Space:
        return self.storage.single_instance_space

    @property
    def schema(self) -> Schema:
        """Flatten / validate / encode / decode of this buffer's rows."""
        return self.storage.schema

    @property
    def replay_id(self) -> str:
        """A UUID made when the file was created: tells this buffer's file from any other."""
        return self._journal.replay_id if self._journal is not None else ""

    @property
    def sampling(self) -> Table:
        """The sampler, rate limit and max_times_sampled of this buffer's only table.

        Raises:
            ConfigError: the buffer has several tables (see `tables`)."""
        return self._tables.pick(None).config

    @property
    def tables(self) -> dict[str, Table]:
        """Each table's settings by name, as the file records them, in its order."""
        return self._tables.configs

    @property
    def _sampling(self) -> Sampling:
        """The only table's runtime (tests look inside it)."""
        return self._tables.pick(None)

    @property
    def view(self) -> State:
        """The state this buffer currently shows (a reader: the last one it read from the file)."""
        return self._state

    @property
    def published(self) -> State:
        """The state the file shows (what survives a crash and what other processes see)."""
        return self._published

    @property
    def num_episodes(self) -> int:
        """Complete episodes held."""
        if self._is_reader:
            self.refresh()
        return int(self._episodes.complete(self._state.begin)[0].shape[0])

    @property
    def is_mutable(self) -> bool:
        return self.storage.is_mutable and not self._raw

    @property
    def _is_reader(self) -> bool:
        return not self.storage.is_mutable and self.storage.multiprocessing and not self._raw

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this replay buffer was closed")

    def _require_writable(self, what: str) -> None:
        self._check_open()
        if not self.is_mutable:
            raise ReadOnlyError(f"cannot {what}: the replay buffer is open read-only")

    def _phys(self, ids: Any, view: State) -> Any:
        """Physical rows of row ids."""
        return self._ring.slots(ids, view.origin)

    @property
    def _journal_or_raise(self) -> JournalStore:
        if self._journal is None:
            raise ReadOnlyError("a buffer over a plain h5py file has no journal to write")
        return self._journal

    # ------------------------------------------------------------------ the state (writer side)

    def _move_begin(self, begin: int) -> None:
        """Release rows below `begin` and the episodes left without a row."""
        table = self._episodes
        table.set_range(self._state.ep_begin, self._state.ep_end)
        ep_begin = table.first_with_rows_from(begin)
        table.set_range(ep_begin, self._state.ep_end)
        self._tables.released(self._state.begin, begin, self._state)
        self._state = self._state.replace(begin=begin, ep_begin=ep_begin)

    def _advance_end(self, n: int) -> None:
        """Rows [end, end + n) were written: hold them, releasing what the ring overwrote."""
        end = self._state.end + n
        self._state = self._state.replace(end=end, inserted=self._state.inserted + n)
        cap = self.capacity
        if cap is not None and end - self._state.begin > cap:
            self._move_begin(end - cap)

    def _record_episode(self, start: int, length: int, key: bytes | None = None) -> tuple[int, tuple[int, int]]:
        """Write an episode record (and its idempotency key, or that it has none); returns its id
        and what its slot held before (for undo)."""
        journal = self._journal_or_raise
        episode_id = self._state.ep_end
        slot = self._episodes.slot(episode_id)
        journal.record(episode_id, slot, start, length)
        self._keys.put(key, Receipt(episode_id, start, length))
        undo = self._episodes.put(episode_id, start, length)
        self._state = self._state.replace(ep_end=episode_id + 1)
        self._episodes.set_range(self._state.ep_begin, episode_id + 1)
        return episode_id, undo

    def _publish(self, fsync: bool = False) -> None:
        """Make the current rows durable, then point the file's state at them (see module doc)."""
        state = self._state.replace(seq=max(self._state.seq, self._published.seq) + 1)
        journal = self._journal_or_raise
        self._tables.before_publish(state.seq)  # the priority log entries it counts, the running maxima
        journal.publish(state, fsync=fsync)
        self._state = self._published = state

    def _evict(self, new_end: int) -> None:
        """Before rows [end, new_end) are written, unpublish every slot they overwrite.

        The oldest rows are released `capacity // 64` at a time, ahead of need, so this costs a
        publish once per that many rows rather than per write. The writer's own view moves with
        the file's, so logical indices mean the same rows to the writer and to every reader.
        """
        cap = self.capacity
        if cap is None:
            return
        needed = new_end - cap
        if needed <= self._published.begin:
            return
        ahead = needed + cap // _EVICTION_FRACTION
        limit = self._tables.release_limit(self._state)
        if limit is not None:  # never release early a row a table may still sample
            ahead = max(needed, min(ahead, limit))
        self._move_begin(max(self._state.begin, min(ahead, self._state.end)))
        self._publish()

    def _roll_back(self, before: State, undo: list[tuple[int, int]] | None) -> None:
        """Put the buffer back as it was before a failed change, less what an eviction published
        (`undo`: what the slots of the episodes recorded since held before, in order)."""
        for offset, held in reversed(list(enumerate(undo or ()))):
            self._episodes.put(before.ep_end + offset, *held)
        self._tables.forget(before.end, self._state.end, self._state)
        self._state = before.replace(seq=max(before.seq, self._published.seq))
        self._episodes.set_range(before.ep_begin, before.ep_end)
        if self._published.begin > before.begin:
            self._move_begin(self._published.begin)

    def flush(self, fsync: bool = False) -> None:
        """Publish everything added so far: it survives a crash and readers see it. With `fsync`,
        rows and state are also forced to the disk (survives power loss), rows first.

        Raises:
            StorageError: HDF5 failed; the buffer goes back to what the file last published.
        """
        self._require_writable("flush")
        try:
            self._publish(fsync=fsync)
        except StorageError:
            self._keys.forget_from(self._published.ep_end)
            self._tables.drop_log()
            self._state = self._published
            self._episodes.set_range(self._published.ep_begin, self._published.ep_end)
            raise

    # ------------------------------------------------------------------ adding rows

    def append(self, sample: Any, priority: Any = None) -> None:
        """Add one row at the tail, to the open episode (ended by `end_episode`), with its
        `priority` for the prioritized tables (a number for all of them, or {table: number}).
        Visible at once in this process; durable at the next `flush`, commit or `close`.

        Raises:
            RateLimitedError: a table's rate limit holds inserts back until more rows are sampled.
            ConfigError: a bad priority, or one for a table that is not prioritized or not there.
        """
        self._require_writable("append")
        given = priority if priority is None or not isinstance(priority, dict) else \
            {name: [value] for name, value in priority.items()}
        priorities = self._tables.split(given if isinstance(given, dict) or given is None else [given], 1)
        self._write_tail(self.storage.encode_one(sample), 1, priorities)

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of rows at the tail, to the open episode, with one priority per row if
        given (an array for every prioritized table, or {table: array}). Validated before
        anything is written.

        Raises:
            RateLimitedError: a table's rate limit holds inserts back until more rows are sampled.
            ConfigError: a bad priority, or one for a table that is not prioritized or not there.
        """
        self._require_writable("extend")
        encoded, n = self.storage.encode_batch(batch)
        self._write_tail(encoded, n, self._tables.split(priorities, n))

    def _write_tail(self, encoded: dict[str, np.ndarray], n: int, priorities: dict[str, np.ndarray]) -> None:
        if n == 0:
            return
        self._check_ids(n, 1)  # the open episode these rows join becomes one episode
        self._check_insert(n)
        before = self._state
        self._evict(self._state.end + n)
        start = self._state.end
        self.storage.write_ring(self._phys(start, self._state), encoded)
        try:
            self._advance_end(n)
            self._tables.added(self._state, start, n, priorities)
        except BaseException:
            self._roll_back(before, None)
            raise

    def end_episode(self, record: bool = True, idempotency_key: bytes | None = None) -> None:
        """Close the episode built by `append` / `extend`; it joins `episodes()` if whole.
        With `record=False` its rows stay but form no episode (e.g. a fragment).
        `idempotency_key`: the episode's key, as `commit_segment` records it (export keeps the
        keys of the episodes it copies this way).

        Raises:
            ConfigError: the key is not 16 bytes.
        """
        self._require_writable("end an episode")
        key = check_key(idempotency_key)
        s = self._state
        if record and s.begin <= s.open_start < s.end:
            self._record_episode(s.open_start, s.end - s.open_start, key)
        self._state = self._state.replace(open_start=self._state.end)

    mark_segment_end = end_episode

    def open_segment_writer(self) -> SegmentWriter:
        """A streaming writer for one episode; publish it with `commit_segment`. It checks the
        priorities it is given against this buffer's sampler as they come."""
        self._require_writable("open a segment writer")
        writer = self.storage.open_segment_writer()
        writer.sampler = self._tables.strictest()
        return writer

    @property
    def idempotency_window(self) -> int:
        """How many of the latest episodes keep their idempotency keys (fixed when the file was made)."""
        file = self._read_only_keys()
        return file.window if file is not None else self._keys.window

    def idempotency_keys(self) -> list[tuple[bytes, Receipt]]:
        """(key, receipt) of the episodes in the key window that were committed with a key, as
        published (`export` carries them to the copy, so a retry after a compaction is still
        answered with its receipt). A writer's from memory; a read-only buffer's read from the
        file; none for an SWMR reader (it never opens the table) or a raw or pre-key file."""
        self._check_open()
        ep_end = self._published.ep_end
        file = self._read_only_keys()
        if file is None:
            return self._keys.held(ep_end)
        table = KeyTable(file.window, file)
        table.load(ep_end)
        return table.held(ep_end)

    def _read_only_keys(self) -> KeyFile | None:
        """The key table of a file opened read-only (not as an SWMR reader, which leaves it to
        the writer), opened on demand; None otherwise."""
        if self.storage.is_mutable or self._raw or self._is_reader:
            return None
        with _h5file.h5_errors("opening the idempotency key table"):
            return KeyFile.of(self.storage.file[REPLAY_GROUP])

    def receipt_for(self, idempotency_key: bytes | None, length: int | None = None) -> Receipt | None:
        """The receipt of the episode committed with `idempotency_key`, if it is one of the last
        `idempotency_window` episodes placed (None: unknown key, or no key).

        Raises:
            ConfigError: the key is not 16 bytes.
            SegmentStateError: that episode has another length than `length` (when given).
        """
        self._require_writable("look up an idempotency key")
        key = check_key(idempotency_key)
        return None if key is None else self._keys.find(key, length, self._state.ep_end)

    def commit_segment(
        self, writer: SegmentWriter, publish: bool = True, idempotency_key: bytes | None = None,
    ) -> Receipt:
        """Append the writer's rows at the tail as one episode, and publish it before returning.

        With `publish=False` the episode is in place but not yet durable nor visible to other
        processes: a later `flush()` publishes it with everything else (a group commit: one
        publish for many episodes). An empty writer is aborted and gives Receipt(-1, -1, 0).

        `idempotency_key` (16 bytes, made once per episode, e.g. `os.urandom(16)`): when one of the
        last `idempotency_window` episodes was committed with it, the writer is aborted and that
        episode's receipt returned: nothing is committed twice. The key is recorded in the file
        with the episode, so a reopen remembers it once the episode is published.

        Raises:
            SegmentStateError: the writer belongs to another storage, was already committed or
                aborted, or is longer than the capacity (it is aborted); or the key is already
                the key of an episode of another length (the writer is left as it was).
            ConfigError: the key is not 16 bytes, or a priority is beyond the sampler's
                `priority_limit` (the writer is left open).
            LimitExceededError: the file's row or episode ids would reach 2**62 (the writer is left open).
            StorageError: HDF5 failed; nothing of the segment is visible.
        """
        self._require_writable("commit a segment")
        if writer.storage is not self.storage:
            raise SegmentStateError("this segment writer belongs to another storage")
        key = check_key(idempotency_key)
        known = None if key is None else self._keys.find(key, len(writer), self._state.ep_end)
        if known is not None:
            if writer.state == "open":
                writer.abort()
            return known
        if writer.state != "open":
            raise SegmentStateError(f"cannot commit a segment writer that was {writer.state}")
        n = len(writer)
        if n == 0:
            writer.abort()
            return Receipt(-1, -1, 0)
        if self.capacity is not None and n > self.capacity:
            writer.abort()
            raise SegmentStateError(f"cannot commit a {n}-row segment into a replay buffer of capacity {self.capacity}")
        return self._place(writer, [n], [key], publish)[0]

    def commit_episodes(
        self, writer: SegmentWriter, lengths: Sequence[int], idempotency_keys: Sequence[bytes | None] | None = None,
        publish: bool = True,
    ) -> list[Receipt]:
        """Commit the writer's rows as several episodes, one after another: `lengths[i]` rows
        each (every one >= 1, adding up to the writer's length), with their keys. One write places
        them all, which is what makes many short episodes cheap; each gets its own record, id and
        key, as `commit_segment` would give it. Published before returning, or with
        `publish=False` by the next `flush()` (see `commit_segment`).

        Raises:
            SegmentStateError: the writer belongs to another storage or is not open; the lengths do
                not add up, one is < 1, or they exceed the capacity; or a key is one an episode
                already has (look keys up with `receipt_for` first). The writer is left open.
            ConfigError: a key is not 16 bytes, or two are the same, or a priority is beyond
                the sampler's `priority_limit`.
            LimitExceededError: the file's row or episode ids would reach 2**62 (the writer is left open).
            StorageError: HDF5 failed; nothing of the episodes is visible.
        """
        self._require_writable("commit episodes")
        if writer.storage is not self.storage:
            raise SegmentStateError("this segment writer belongs to another storage")
        if writer.state != "open":
            raise SegmentStateError(f"cannot commit a segment writer that was {writer.state}")
        sizes = [int(n) for n in lengths]
        keys: list[bytes | None] = [check_key(k) for k in idempotency_keys] if idempotency_keys is not None \
            else [None] * len(sizes)
        if len(keys) != len(sizes):
            raise SegmentStateError(f"got {len(keys)} idempotency keys for {len(sizes)} episodes")
        if not sizes or min(sizes) < 1 or sum(sizes) != len(writer):
            raise SegmentStateError(f"episode lengths {sizes[:8]}{'...' if len(sizes) > 8 else ''} must each be >= 1 "
                                    f"and add up to the writer's {len(writer)} rows")
        if self.capacity is not None and sum(sizes) > self.capacity:
            raise SegmentStateError(f"cannot commit {sum(sizes)} rows at once into a replay buffer of capacity "
                                    f"{self.capacity}")
        given = [k for k in keys if k is not None]
        if len(set(given)) != len(given):
            raise ConfigError("two episodes of one commit have the same idempotency key")
        for key, n in zip(keys, sizes):
            if key is not None and self._keys.find(key, n, self._state.ep_end) is not None:
                raise SegmentStateError(f"idempotency key {key.hex()} is already an episode's: look keys up with "
                                        "receipt_for and leave those episodes out")
        return self._place(writer, sizes, keys, publish)

    def _place(self, writer: SegmentWriter, lengths: list[int], keys: list[bytes | None], publish: bool) -> list[Receipt]:
        """Write the writer's rows at the tail (one write) and record them as episodes of
        `lengths` rows with `keys` (all checked); on failure, nothing of them stays."""
        n = sum(lengths)
        # (A writer opened on the storage itself has not checked them against the tables.)
        priorities = self._tables.split(writer.priorities, n, missing_ok=True)
        self._check_ids(n, len(lengths) + 1)  # + 1: an open episode is ended first
        self._check_insert(n)
        if self._state.open_start < self._state.end:
            self.end_episode()
        before = self._state
        start = before.end
        undo: list[tuple[int, int]] = []
        receipts = []
        try:
            self._evict(start + n)
            writer.commit(self._phys(start, self._state))
            self._advance_end(n)
            self._tables.added(self._state, start, n, priorities)
            first = start
            for length, key in zip(lengths, keys):
                episode_id, held = self._record_episode(first, length, key)
                undo.append(held)
                receipts.append(Receipt(episode_id, first, length))
                first += length
            self._state = self._state.replace(open_start=self._state.end)
            if publish:
                self._publish()
        except BaseException:
            self._keys.forget_from(before.ep_end)
            self._roll_back(before, undo)
            if writer.state == "open":
                writer.abort()
            raise
        return receipts

    def clear(self) -> None:
        """Drop every row and episode, published at once. Ids continue: the next row gets the id
        the next row would have had. Readers see a new generation and drop what they cached."""
        self._require_writable("clear")
        s = self._state
        unbounded = self.capacity is None
        self._state = s.replace(
            generation=s.generation + 1, begin=s.end, open_start=s.end, ep_begin=s.ep_end,
            origin=s.end if unbounded else s.origin, ep_origin=s.ep_end if unbounded else s.ep_origin,
            inserted=0, tables=tuple(Counters(0, c.plog, c.pckpt) for c in s.tables),
        )
        self._tables.clear()
        self._episodes.origin = self._state.ep_origin
        self._episodes.set_range(s.ep_end, s.ep_end)
        self._publish()
        # Only now give the space back: a crash before this point leaves a file whose published
        # state holds no row of the space being dropped.
        self.storage.clear()
        self.storage.flush()

    # ------------------------------------------------------------------ reading

    def _load_episodes(self, journal: JournalStore) -> State:
        """Read the published state and every episode record it holds."""
        return self._follow(journal.read(), lambda state: journal.load(self._episodes, state))

    def _follow(self, state: State, take: Callable[[State], None]) -> State:
        """`take(state)`, again with the newer state when the writer reused episode record slots
        meanwhile (see Journal._check_records); returns the state taken."""
        for _ in range(_READ_RETRIES):
            try:
                take(state)
                return state
            except RecordsMoved as moved:
                state = moved.latest
        raise StorageError(f"the episode table of {self.storage.filename!r} kept changing under this reader "
                           f"({_READ_RETRIES} tries); the writer commits faster than a reader can follow")

    def refresh(self) -> None:
        """Reader side: pick up what the writer published since the last call. Reads only what
        changed (new episode records); a new generation drops every cache, memory maps included."""
        self._check_open()
        if self._raw or self.storage.is_mutable or self._journal is None:
            return
        new = self._journal.read()
        old = self._state
        if new == old:
            return
        journal = self._journal

        def take(new: State) -> None:
            if new.generation != old.generation or new.origin != old.origin:
                self.storage.invalidate_maps()
                self.storage.refresh()
            else:
                self.storage.mark_stale()
            journal.sync(self._episodes, old, new)

        new = self._follow(new, take)
        self._tables.sync(old, new, journal.read)
        self._state = self._published = new

    def _consistent(self, attempt: Callable[[State], tuple[_T, int]]) -> _T:
        """Run a read against one state. A reader re-reads the published state after it and
        retries when a row it read may have been overwritten or cleared meanwhile (the writer
        unpublishes slots before overwriting them), so every row returned was held throughout."""
        self._check_open()
        if not self._is_reader:
            result, _ = attempt(self._state)
            self.last_view = self._state
            return result
        self.refresh()
        failure: Exception | None = None
        for _ in range(_READ_RETRIES):
            view = self._state
            try:
                result, lowest = attempt(view)
            except (IndexError, StorageError) as exc:
                # The writer may have cleared or shrunk what this view still showed: look again.
                self.refresh()
                if self._state == view:
                    raise
                failure = exc
                continue
            self.refresh()
            if self._state.generation == view.generation and lowest >= self._state.begin:
                self.last_view = view
                return result
        if failure is not None:
            raise failure
        raise StorageError("the writer overwrote the rows being read on every retry; read fewer or newer rows")

    def get_at(self, index: Any, *, decode: bool = True) -> Any:
        """Rows by logical index (0 is the oldest held); same index kinds as `HDF5Storage.get`.
        `decode=False` gives {leaf path: stored array} (text as UTF-8 bytes), the wire form."""
        return self.get_at_with_ids(index, decode=decode)[0]

    def get_at_with_ids(self, index: Any, *, decode: bool = True) -> tuple[Any, np.ndarray]:
        """(rows, their row ids as int64) for logical `index`."""

        def attempt(view: State) -> tuple[tuple[Any, np.ndarray], int]:
            kind, where = normalize_index(index, view.length)
            if kind == "int":
                g = view.begin + where
                return (self.storage.read("int", int(self._phys(g, view)), decode), np.array([g], np.int64)), g
            if kind == "slice":
                where = np.arange(where[0], where[1], dtype=np.int64)
            if where.size == 0:
                return (self.storage.read("slice", (0, 0), decode), np.zeros(0, np.int64)), view.end
            g = where + view.begin
            return (self.storage.read("array", self._phys(g, view), decode), g), int(g.min())

        return self._consistent(attempt)

    def get_rows(self, row_ids: Any, *, decode: bool = True) -> Any:
        """Rows by global row id (any order, duplicates kept), whatever has been added since.

        Raises:
            EvictedError: an id is no longer held (the message names the first such id).
            IndexError: an id was never committed, or is negative.
            TypeError: the ids are not integers.
        """
        ids = as_row_ids(row_ids)

        def attempt(view: State) -> tuple[Any, int]:
            if ids.size == 0:
                return self.storage.read("slice", (0, 0), decode), view.end
            lowest = check_held(ids, view)  # before any read: an id not held names itself
            return self.storage.read("array", self._phys(ids, view), decode), lowest

        return self._consistent(attempt)

    def priorities(self, row_ids: Any, *, table: str | None = None) -> np.ndarray:
        """The current priorities (float64) of rows by id in a prioritized `table` (None: the only one).

        Raises:
            ConfigError: no such table, or it keeps no priorities.
            EvictedError / IndexError / TypeError: as `get_rows`.
        """
        ids = as_row_ids(row_ids)
        sampling = self._tables.pick(table)

        def attempt(view: State) -> tuple[np.ndarray, int]:
            if ids.size == 0:
                return sampling.priorities_of(ids, view), view.end
            lowest = check_held(ids, view)
            return sampling.priorities_of(ids, view), lowest

        return self._consistent(attempt)

    # ------------------------------------------------------------------ sampling

    def _check_sampler(self, sampling: Sampling) -> None:
        """Readers may sample only when sampling changes nothing (see Table.writer_only)."""
        why = sampling.config.writer_only
        if why is not None and not self.is_mutable:
            raise ReadOnlyError(f"cannot sample from a read-only buffer: {self._tables._named(sampling, why)}, so only "
                                "the writer samples (through the server, learners' samples go to it)")

    def rate_limit_blocker(self, rows: int, *, sampling: bool, table: str | None = None) -> tuple[str | None, bool]:
        """Writer: why a sample from `table` (or an insert, into every table) of `rows` rows must
        wait now, and whether it would wait forever (too big for a limiter's window); (None,
        False) when it may go ahead."""
        if sampling:
            return self._tables.sample_blocker(self._tables.pick(table), rows, self._state, self.capacity)
        return self._tables.insert_blocker(rows, self._state)

    def carry_over(self, *, inserted: int, sampled: int | dict[str, int], limit_inserts: bool,
                   max_priority: float | dict[str, float] | None = None, seq: int | None = None,
                   generation: int | None = None) -> None:
        """Writer: take the rate limiters' counters of the buffer this one copies (an export):
        rows inserted, and rows each table sampled (an int: the only table's); whether inserts
        are limited meanwhile (rows copied were inserted once already); each prioritized table's
        running maximum priority, the default of rows committed without one; with `seq` and
        `generation`, its publish and clear counters too, so the copy's publishes follow the
        source's (a learner's view of the replay never goes back).

        Raises:
            ConfigError: a table that is not this buffer's, or a bad maximum priority.
        """
        self._require_writable("carry counters over")
        counts = sampled if isinstance(sampled, dict) else {self._tables.pick(None).name: sampled}
        maxima = max_priority if isinstance(max_priority, dict) or max_priority is None else \
            {self._tables.pick(None).name: max_priority}
        state = self._state.replace(inserted=int(inserted))
        for name, count in counts.items():
            state = state.with_table(self._tables.pick(name).index, sampled=int(count))
        for name, value in (maxima or {}).items():
            t = self._tables.pick(name)
            if t.config.prioritized:
                bound = check_priorities([value], 1, sampler=t.config.sampler)[0]
                t.max_priority = max(t.max_priority, float(bound))
        if seq is not None:
            state = state.replace(seq=max(state.seq, int(seq)))
        if generation is not None:
            state = state.replace(generation=int(generation))
        self._state = state
        self._limit_inserts = limit_inserts

    def sample_counts(self, first: int, stop: int, *, table: str | None = None) -> np.ndarray:
        """How often each row of ids [first, stop) (held) was sampled by `table`, as uint32:
        what its `max_times_sampled` counts (zeros for a table without it)."""
        self._check_open()
        return self._tables.pick(table).counts(first, stop, self._state)

    def carry_sample_counts(self, first: int, counts: np.ndarray, *, table: str | None = None) -> None:
        """Writer: `table`'s sample counts of rows [first, first + len(counts)) (just copied by
        an export): rows it sampled `max_times_sampled` times stay removed from it in the copy."""
        self._require_writable("carry sample counts over")
        self._tables.pick(table).set_counts(first, np.asarray(counts, np.uint32), self._state)
        head = self._tables.first_held(self._state)
        if head > self._state.begin:
            self._move_begin(head)

    def _check_ids(self, rows: int, episodes: int) -> None:
        """Refuse, before anything is written, rows or episodes whose ids would reach MAX_ID
        (2**62): the file could not record them (see `journal.py`).

        Raises:
            LimitExceededError: this file has no ids left for them.
        """
        s = self._state
        if max(s.end, s.inserted) + rows >= _h5file.MAX_ID or s.ep_end + episodes >= _h5file.MAX_ID:
            raise LimitExceededError(
                f"{self.storage.filename!r} cannot take {rows} more rows: its row or episode ids would reach 2**62, the "
                f"most a file records (next row id {s.end}, next episode id {s.ep_end})")

    def _check_insert(self, rows: int) -> None:
        if self._limit_inserts and self._tables.limited:
            reason, _ = self._tables.insert_blocker(rows, self._state)
            if reason is not None:
                raise RateLimitedError(reason)

    def _check_sample(self, sampling: Sampling, rows: int) -> None:
        if self.is_mutable and sampling.config.rate_limit.active:
            reason, _ = self._tables.sample_blocker(sampling, rows, self._state, self.capacity)
            if reason is not None:
                raise RateLimitedError(reason)

    def _count_sampled(self, sampling: Sampling, row_ids: np.ndarray, rows: int) -> None:
        """Writer: `sampling`'s table handed out `rows` rows (ids: the rows themselves, or
        windows' first rows when nothing is removed). Rows sampled max_times_sampled times leave
        that table, and `begin` moves past a head of rows every table removed."""
        if not self.is_mutable:
            return
        counters = sampling.counters(self._state)
        self._state = self._state.with_table(sampling.index, sampled=counters.sampled + rows)
        if sampling.config.removes:
            sampling.mark_sampled(row_ids, self._state)
            first = self._tables.first_held(self._state)
            if first > self._state.begin:
                self._move_begin(first)

    def sample(
        self, batch_size: int, rng: np.random.Generator | None = None, *, with_info: bool = False, decode: bool = True,
        table: str | None = None,
    ) -> Any:
        """`batch_size` rows drawn by `table`'s sampler (None: the only table): uniformly or by
        priority, with replacement; or (fifo / lifo, or when rows are removed) without. With
        `with_info=True` returns (batch, SampleInfo) with each row's id, episode and draw
        probability.

        Raises:
            ConfigError: no such table, or none named where there are several.
            NotEnoughDataError: nothing to sample (or too few rows for a draw without replacement).
            RateLimitedError: (writer) the rate limit holds samples back until more rows are inserted.
            ReadOnlyError: a reader of a table whose sampling only the writer may do.
        """
        size = _positive_int(batch_size, "batch_size")
        sampling = self._tables.pick(table)
        rng = rng if rng is not None else np.random.default_rng()
        self._check_sampler(sampling)
        self._check_sample(sampling, size)

        def attempt(view: State) -> tuple[tuple[Any, np.ndarray, np.ndarray], int]:
            g, probabilities = sampling.draw(view, size, rng)
            return (self.storage.read("array", self._phys(g, view), decode), g, probabilities), int(g.min())

        batch, g, probabilities = self._consistent(attempt)
        self._count_sampled(sampling, g, size)
        if not with_info:
            return batch
        return batch, SampleInfo(g.astype(np.uint64), self._episodes.find(g), probabilities)

    def sample_sequences(
        self, batch_size: int, length: int, rng: np.random.Generator | None = None, *, with_info: bool = False,
        decode: bool = True, rows: bool = True, table: str | None = None,
    ) -> Any:
        """`batch_size` windows of `length` consecutive rows, each inside one complete episode,
        uniform over all such windows (prioritized: by the priority of the window's first row),
        drawn by `table` (None: the only one). Leaves come back shaped (batch_size, length, ...).
        With `with_info=True` returns (batch, SampleInfo) (ids of each window's first row).
        `rows=False` draws the windows without reading them (batch is None). Counts
        batch_size * length rows sampled."""
        size = _positive_int(batch_size, "batch_size")
        steps = _positive_int(length, "length")
        sampling = self._tables.pick(table)
        rng = rng if rng is not None else np.random.default_rng()
        self._check_sampler(sampling)
        self._check_sample(sampling, size * steps)

        def attempt(view: State) -> tuple[tuple[Any, SampleInfo], int]:
            if steps > view.length:
                raise NotEnoughDataError(f"no window of {steps} rows fits in the {view.length} rows held")
            ids, starts, lengths = self._episodes.complete(view.begin)
            g0, k, probabilities = sampling.draw_windows(view, starts, lengths, steps, size, rng)
            info = SampleInfo(g0.astype(np.uint64), ids[k].astype(np.uint64), probabilities)
            if not rows:
                return (None, info), int(g0.min())
            g = g0[:, None] + np.arange(steps, dtype=np.int64)[None, :]
            return (self.storage.read("array", self._phys(g, view), decode), info), int(g0.min())

        batch, info = self._consistent(attempt)
        self._count_sampled(sampling, info.row_ids.astype(np.int64), size * steps)
        return (batch, info) if with_info else batch

    def update_priorities(self, row_ids: Any, priorities: Any, *, table: str | None = None) -> int:
        """Set the priorities of rows by id in a prioritized `table` (None: the only one). Ids no
        longer held (evicted, cleared, or removed by that table's max_times_sampled) are ignored
        and counted in `info()`; a later id for the same row wins. Durable at the next flush,
        commit or close.

        Returns:
            How many ids were ignored.

        Raises:
            ConfigError: no such table, or it keeps no priorities, or a priority is negative,
                NaN, infinite or beyond the sampler's `priority_limit`, or there are not as many
                priorities as ids (nothing is changed).
            IndexError: an id was never committed (nothing is changed).
        """
        self._require_writable("update priorities")
        sampling = self._tables.pick(table)
        ids = as_row_ids(row_ids)
        if not sampling.config.prioritized:
            raise ConfigError(f"table {sampling.name!r} samples by {type(sampling.config.sampler).__name__}(): only "
                              "a Prioritized sampler keeps priorities (choose it when the file is created)")
        values = check_priorities(priorities, ids.shape[0], sampler=sampling.config.sampler)
        if ids.size and int(ids.max()) >= self._state.end:
            raise IndexError(f"row id {int(ids.max())} was never committed: the next row id is {self._state.end}")
        ignored = 0
        log_entries = sampling.log_entries
        step = log_entries // 2
        for first in range(0, max(ids.shape[0], 1), step):
            part_ids, part_values = ids[first : first + step], values[first : first + step]
            if sampling.counters(self._state).plog + part_ids.shape[0] - log_entries > \
                    sampling.counters(self._published).pckpt:
                self._checkpoint_priorities(sampling)
            logged, skipped = sampling.update(part_ids, part_values, self._state)
            plog = sampling.counters(self._state).plog + logged
            self._state = self._state.with_table(sampling.index, plog=plog)
            ignored += skipped
        return ignored

    def _checkpoint_priorities(self, sampling: Sampling) -> None:
        """Write a table's updated priorities into its dataset and publish that, so its log's
        older entries may be overwritten. Every update applied is published first: the dataset
        never holds a priority no publish counts, which a crash would recover and a reader's full
        load would read (both load the dataset, then the log from `pckpt`)."""
        self._publish()
        sampling.checkpoint()
        self._state = self._state.with_table(sampling.index, pckpt=sampling.counters(self._state).plog)
        self._publish()

    def episodes(self) -> list[Episode]:
        """Every complete episode held, oldest first: Episode(episode_id, first_row_id, length)."""
        self._check_open()
        if self._is_reader:
            self.refresh()
        ids, starts, lengths = self._episodes.complete(self._state.begin)
        return [Episode(*t) for t in zip(ids.tolist(), starts.tolist(), lengths.tolist())]

    def episode_table(self, first_episode: int = 0, max_episodes: int | None = None) -> np.ndarray:
        """`episodes()` as an int64 array of (episode_id, first_row_id, length) rows; with
        `first_episode` / `max_episodes`, at most that many from that episode id on (a page)."""
        self._check_open()
        if self._is_reader:
            self.refresh()
        ids, starts, lengths = self._episodes.complete(self._state.begin)
        self.last_view = self._state
        lo = int(np.searchsorted(ids, first_episode)) if first_episode > 0 else 0
        hi = ids.shape[0] if max_episodes is None else min(ids.shape[0], lo + max(0, int(max_episodes)))
        if hi <= lo:
            return np.zeros((0, 3), dtype=np.int64)
        return np.stack([ids[lo:hi], starts[lo:hi], lengths[lo:hi]], axis=1)

    def get_segments(self) -> list[tuple[int, int]]:
        """(logical start, length) of every complete episode held, oldest first."""
        begin = self._state.begin
        return [(e.first_row_id - begin, e.length) for e in self.episodes()]

    def info(self) -> dict[str, Any]:
        """A snapshot of the buffer's figures."""
        self._check_open()
        if self._is_reader:
            self.refresh()
        s = self._state
        return {
            "length": s.length,
            "capacity": self.capacity,
            "num_episodes": int(self._episodes.complete(s.begin)[0].shape[0]),
            "total_rows": s.end,
            "total_episodes": s.ep_end,
            "oldest_row_id": s.begin,
            "seq": s.seq,
            "generation": s.generation,
            "replay_id": self.replay_id,
            **self._sampling_info(s),
        }

    def _sampling_info(self, s: State) -> dict[str, Any]:
        """Each table's figures as "table.<name>.<figure>" (scalars, as the wire and metrics take
        them); a buffer of one table also shows its figures by their plain names. Those only the
        writer keeps (what it ignored or removed) only there."""
        tables = {t.name: self._table_info(t, s) for t in self._tables.all}
        out: dict[str, Any] = dict(next(iter(tables.values()))) if len(tables) == 1 else {"inserted": s.inserted}
        out["tables"] = ",".join(tables)
        for name, figures in tables.items():
            out.update({f"table.{name}.{key}": value for key, value in figures.items()})
        return out

    def _table_info(self, sampling: Sampling, s: State) -> dict[str, Any]:
        counters = sampling.counters(s)
        out: dict[str, Any] = {
            **sampling.config.describe(),
            "inserted": s.inserted,
            "sampled": counters.sampled,
            "priority_updates": counters.plog,
        }
        if self.is_mutable:
            out["sampleable"] = sampling.sampleable(s)
            out["priority_updates_ignored"] = sampling.ignored_updates
        if sampling.config.prioritized:
            out["priority_sum"] = sampling.tree.total  # sum of priority ** exponent: what draws divide by
            if not self._is_reader:  # as of the publish opened (a reader would have to follow it)
                out["max_priority"] = sampling.max_priority
        return out

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Publish (when writable) and close the file. Safe to call twice.

        Raises:
            StorageError: the final publish or flush failed (the file keeps its last publish).
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self.is_mutable and not self.storage.closed:
                self._publish()
        finally:
            try:
                if self._journal is not None:
                    self._journal.close()
            finally:
                self.storage.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

