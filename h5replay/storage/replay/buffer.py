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

This module holds the state and its writer side (publish, evict, roll back), the reads, info and
closing; the verbs that add rows are in `commits.py`, the sampling verbs in `draws.py`, mixins
`ReplayBuffer` inherits.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import h5py
import numpy as np

from h5replay.errors import ClosedError, ConfigError, ReadOnlyError, StorageError
from h5replay.records import Episode, Receipt
from h5replay.sampling import DEFAULT_TABLE, RateLimit, Sampler, Table, Uniform, check_tables
from h5replay.spaces import Schema, Space
from h5replay.storage import _h5file
from h5replay.storage._indices import normalize_index
from h5replay.storage.hdf5 import HDF5Storage
from h5replay.storage.replay.commits import Commits
from h5replay.storage.replay.draws import Draws
from h5replay.storage.replay.episodes import EpisodeTable
from h5replay.storage.replay.finals import FinalsFile
from h5replay.storage.replay.journal import REPLAY_GROUP, Journal, JournalStore, RecordsMoved
from h5replay.storage.replay.keys import DEFAULT_KEY_WINDOW, KeyTable
from h5replay.storage.replay.ring import Ring, as_row_ids, check_held
from h5replay.storage.replay.rows import RowStore
from h5replay.storage.replay.state import Counters, State
from h5replay.storage.replay.table import Sampling
from h5replay.storage.replay.tables import Tables
from h5replay.storage.replay.transition_draws import Transitions
from h5replay.transitions import TransitionKeys

__all__ = ["ReplayBuffer", "CommitInfo"]

#: What a commit returns: (episode_id, first_row_id, length); (-1, -1, 0) for an empty segment.
CommitInfo = Receipt
_EVICTION_FRACTION = 64  # publish an eviction once per capacity // 64 rows
_READ_RETRIES = 20
_T = TypeVar("_T")


def in_file(storage: RowStore) -> HDF5Storage:
    """`storage` as the HDF5Storage it is.

    Raises:
        ConfigError: it is another storage (the file's journal, exports, servers need a file).
    """
    if not isinstance(storage, HDF5Storage):
        raise ConfigError(f"this needs a buffer whose rows are in an HDF5 file, not in a {type(storage).__name__}")
    return storage


class ReplayBuffer(Commits, Draws, Transitions):
    """A ring buffer of rows over an HDF5Storage, with episodes, and sampling of rows and windows
    by the sampler its file records (uniform, prioritized, fifo, lifo), under its rate limit."""

    def __init__(
        self, storage: RowStore, *, raw: bool = False, journal: JournalStore | None = None,
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
            self._journal = journal if journal is not None else Journal(in_file(storage))
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
        #: The episodes' final observations (None: the file keeps none, or the rows are not in a file).
        self._finals: FinalsFile | None = None
        if isinstance(self._journal, Journal):
            file = in_file(storage)
            reader = file.multiprocessing and not file.is_mutable
            with _h5file.h5_errors("opening the final observations"):
                self._finals = FinalsFile.of(file.file[REPLAY_GROUP], storage.single_instance_space, storage.capacity,
                                             reader)
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
        observation_keys: Sequence[str] | None = None, reward_key: str = "reward", terminated_key: str = "terminated",
        truncated_key: str = "truncated", **storage_kwargs: Any,
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

        `observation_keys`: the keys of the space (a Dict space) that are the observation, so
        that each episode may keep its final observation (`commit_segment(final=)`,
        `end_episode(final=)`) and `sample_transitions` return n-step transitions; `reward_key`,
        `terminated_key` and `truncated_key` name the leaves it reads (see
        `h5replay.transitions`). Recorded in the file.

        Raises:
            ConfigError: an invalid setting (nothing is created).
        """
        keys = None if observation_keys is None else \
            TransitionKeys.checked(space, observation_keys, reward_key, terminated_key, truncated_key)
        if keys is None and (reward_key, terminated_key, truncated_key) != ("reward", "terminated", "truncated"):
            raise ConfigError("reward_key, terminated_key and truncated_key name transition leaves: give "
                              "observation_keys= too")
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
        journal = Journal.create_tables(capacity, initial, configs, idempotency_window, replay_id)

        def prepare(f: h5py.File) -> None:
            journal(f)
            if keys is not None:
                FinalsFile.create(f[REPLAY_GROUP], keys, space, capacity)

        storage = HDF5Storage.create(space, capacity, _h5file.file_path(cache_path), prepare=prepare, **storage_kwargs)
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
    def file_storage(self) -> HDF5Storage:
        """The HDF5Storage of this buffer's file: what only a file has (its datasets, its identity).

        Raises:
            ConfigError: this buffer's rows are not in an HDF5 file (the tests' in-memory backend).
        """
        return in_file(self.storage)

    def table_name(self, table: str | None) -> str:
        """The name of the table a verb's `table=` means (None: the only one).

        Raises:
            ConfigError: no such table, or None with several (the message names them).
        """
        return self._tables.pick(table).name

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

    def _record_episode(self, start: int, length: int, key: bytes | None = None,
                        final: dict[str, np.ndarray] | None = None) -> tuple[int, tuple[int, int]]:
        """Write an episode record (and its idempotency key, or that it has none; its final
        observation, encoded, or that it has none); returns its id and what its slot held before
        (for undo)."""
        journal = self._journal_or_raise
        episode_id = self._state.ep_end
        slot = self._episodes.slot(episode_id)
        if self._finals is not None:
            self._finals.write(slot, final)
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

    def get_at(self, index: Any, *, decode: bool | str = True) -> Any:
        """Rows by logical index (0 is the oldest held); same index kinds as `HDF5Storage.get`.
        `decode=False` gives {leaf path: stored array} (text as UTF-8 bytes), the wire form;
        `decode=PACKED` also keeps compressed leaves as stored (PackedRows), as readers send them."""
        return self.get_at_with_ids(index, decode=decode)[0]

    def get_at_with_ids(self, index: Any, *, decode: bool | str = True) -> tuple[Any, np.ndarray]:
        """(rows, their row ids as int64) for logical `index`."""

        def attempt(view: State) -> tuple[tuple[Any, np.ndarray], int]:
            kind, where = normalize_index(index, view.length)
            if kind == "int":
                g = view.begin + where
                one = np.array([g], np.int64)
                return (self.storage.read("int", int(self._phys(g, view)), decode, one), one), g
            if kind == "slice":
                where = np.arange(where[0], where[1], dtype=np.int64)
            if where.size == 0:
                return (self.storage.read("slice", (0, 0), decode), np.zeros(0, np.int64)), view.end
            g = where + view.begin
            return (self.storage.read("array", self._phys(g, view), decode, g), g), int(g.min())

        return self._consistent(attempt)

    def get_rows(self, row_ids: Any, *, decode: bool | str = True) -> Any:
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
            return self.storage.read("array", self._phys(ids, view), decode, ids), lowest

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

    # ------------------------------------------------------------------ info

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

