"""Commits: the buffer's verbs that add rows, and drop them all (`clear`).

Rows come one at a time or as a batch at the tail (`append`, `extend`, ended by `end_episode`), or
as whole episodes from a segment writer (`commit_segment`, `commit_episodes`), checked against the
file's ids, the rate limit and the idempotency keys before anything is written. A mixin of
`ReplayBuffer`: it owns no state, and changes the file only through the buffer's writer side
(`_evict`, `_advance_end`, `_record_episode`, `_publish`, `_roll_back`), so the crash-safety
order of `buffer.py` holds for every commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from h5replay.errors import ConfigError, LimitExceededError, RateLimitedError, SegmentStateError
from h5replay.priorities import one_row_priorities
from h5replay.records import Receipt
from h5replay.storage import _h5file
from h5replay.storage.replay.episodes import EpisodeTable
from h5replay.storage.replay.journal import JournalStore
from h5replay.storage.replay.keys import KeyFile, KeyTable, check_key
from h5replay.storage.replay.rows import RowStore
from h5replay.storage.replay.state import Counters, State
from h5replay.storage.replay.tables import Tables
from h5replay.storage.segment import SegmentWriter

__all__ = ["Commits"]


class Commits:
    """ReplayBuffer's verbs that add rows: append / extend / end_episode, segment writers and
    their commits, idempotency keys, and clear."""

    # What this mixin uses of ReplayBuffer (set in its __init__, defined in buffer.py).
    storage: RowStore
    _raw: bool
    _state: State
    _published: State
    _episodes: EpisodeTable
    _keys: KeyTable
    _tables: Tables
    _limit_inserts: bool
    _journal: JournalStore | None

    if TYPE_CHECKING:

        @property
        def capacity(self) -> int | None: ...
        @property
        def _is_reader(self) -> bool: ...
        def _check_open(self) -> None: ...
        def _require_writable(self, what: str) -> None: ...
        def _phys(self, ids: Any, view: State) -> Any: ...
        def _evict(self, new_end: int) -> None: ...
        def _advance_end(self, n: int) -> None: ...
        def _record_episode(self, start: int, length: int, key: bytes | None = None,
                            final: dict[str, np.ndarray] | None = None) -> tuple[int, tuple[int, int]]: ...
        def _publish(self, fsync: bool = False) -> None: ...
        def _roll_back(self, before: State, undo: list[tuple[int, int]] | None) -> None: ...

        def _encode_final(self, final: Any) -> dict[str, np.ndarray] | None: ...

    @property
    def _own_target(self) -> object:
        """This buffer's storage, as a segment writer names the storage it streams into."""
        return self.storage

    def append(self, sample: Any, priority: Any = None) -> None:
        """Add one row at the tail, to the open episode (ended by `end_episode`), with its
        `priority` for the prioritized tables (a number for all of them, or {table: number}).
        Visible at once in this process; durable at the next `flush`, commit or `close`.

        Raises:
            RateLimitedError: a table's rate limit holds inserts back until more rows are sampled.
            ConfigError: a bad priority, or one for a table that is not prioritized or not there.
        """
        self._require_writable("append")
        priorities = self._tables.split(None if priority is None else one_row_priorities(priority), 1)
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

    def end_episode(self, record: bool = True, idempotency_key: bytes | None = None, *, final: Any = None) -> None:
        """Close the episode built by `append` / `extend`; it joins `episodes()` if whole.
        With `record=False` its rows stay but form no episode (e.g. a fragment).
        `idempotency_key`: the episode's key, as `commit_segment` records it (export keeps the
        keys of the episodes it copies this way). `final`: the observation after its last step
        (a sample of the observation part of the space; see `create(observation_keys=)`).

        Raises:
            ConfigError: the key is not 16 bytes; a final for a buffer without observation keys.
            SpaceMismatchError: the final does not fit the observation part of the space.
        """
        self._require_writable("end an episode")
        key = check_key(idempotency_key)
        encoded = self._encode_final(final)
        s = self._state
        if record and s.begin <= s.open_start < s.end:
            self._record_episode(s.open_start, s.end - s.open_start, key, encoded)
        self._state = self._state.replace(open_start=self._state.end)

    mark_segment_end = end_episode

    def open_segment_writer(self) -> SegmentWriter:
        """A streaming writer for one episode; publish it with `commit_segment`. It checks the
        priorities it is given against this buffer's tables as they come (a bare one for every
        prioritized table, or by table name: `{"replay": p}`)."""
        self._require_writable("open a segment writer")
        writer = self.storage.open_segment_writer()
        writer.split_priorities = self._tables.split
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
        if self.storage.is_mutable or self._raw or self._is_reader or self._journal is None:
            return None
        return self._journal.read_only_keys()

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
        self, writer: SegmentWriter, publish: bool = True, idempotency_key: bytes | None = None, *, final: Any = None,
    ) -> Receipt:
        """Append the writer's rows at the tail as one episode, and publish it before returning.

        With `publish=False` the episode is in place but not yet durable nor visible to other
        processes: a later `flush()` publishes it with everything else (a group commit: one
        publish for many episodes). An empty writer is aborted and gives Receipt(-1, -1, 0).

        `idempotency_key` (16 bytes, made once per episode, e.g. `os.urandom(16)`): when one of the
        last `idempotency_window` episodes was committed with it, the writer is aborted and that
        episode's receipt returned: nothing is committed twice. The key is recorded in the file
        with the episode, so a reopen remembers it once the episode is published.

        `final`: the observation after the episode's last step (see `create(observation_keys=)`),
        kept with the episode, as durable as it and evicted with it.

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
        if writer.storage is not self._own_target:
            raise SegmentStateError("this segment writer belongs to another storage")
        key = check_key(idempotency_key)
        known = None if key is None else self._keys.find(key, len(writer), self._state.ep_end)
        if known is not None:
            if writer.state == "open":
                writer.abort()
            return known
        if writer.state != "open":
            raise SegmentStateError(f"cannot commit a segment writer that was {writer.state}")
        encoded = self._encode_final(final)
        n = len(writer)
        if n == 0:
            writer.abort()
            return Receipt(-1, -1, 0)
        if self.capacity is not None and n > self.capacity:
            writer.abort()
            raise SegmentStateError(f"cannot commit a {n}-row segment into a replay buffer of capacity {self.capacity}")
        return self._place(writer, [n], [key], publish, [encoded])[0]

    def commit_episodes(
        self, writer: SegmentWriter, lengths: Sequence[int], idempotency_keys: Sequence[bytes | None] | None = None,
        publish: bool = True, *, finals: Sequence[Any] | None = None,
    ) -> list[Receipt]:
        """Commit the writer's rows as several episodes, one after another: `lengths[i]` rows
        each (every one >= 1, adding up to the writer's length), with their keys. One write places
        them all, which is what makes many short episodes cheap; each gets its own record, id and
        key, as `commit_segment` would give it. Published before returning, or with
        `publish=False` by the next `flush()` (see `commit_segment`). `finals`: each episode's
        final observation or None.

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
        if writer.storage is not self._own_target:
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
        if finals is not None and len(finals) != len(sizes):
            raise ConfigError(f"got {len(finals)} finals for {len(sizes)} episodes: give one per episode (or None)")
        encoded: list[dict[str, np.ndarray] | None] = [self._encode_final(f) for f in finals] \
            if finals is not None else [None] * len(sizes)
        given = [k for k in keys if k is not None]
        if len(set(given)) != len(given):
            raise ConfigError("two episodes of one commit have the same idempotency key")
        for key, n in zip(keys, sizes):
            if key is not None and self._keys.find(key, n, self._state.ep_end) is not None:
                raise SegmentStateError(f"idempotency key {key.hex()} is already an episode's: look keys up with "
                                        "receipt_for and leave those episodes out")
        return self._place(writer, sizes, keys, publish, encoded)

    def _place(self, writer: SegmentWriter, lengths: list[int], keys: list[bytes | None], publish: bool,
               finals: list[dict[str, np.ndarray] | None]) -> list[Receipt]:
        """Write the writer's rows at the tail (one write) and record them as episodes of
        `lengths` rows with `keys` and `finals` (all checked); on failure, nothing of them stays."""
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
            for length, key, final in zip(lengths, keys, finals):
                episode_id, held = self._record_episode(first, length, key, final)
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
