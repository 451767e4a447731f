"""ReplayBuffer: a ring of rows with an episode table, kept in the same HDF5 file as the rows.

Rows get global numbers 0, 1, 2, ... in the order they are added; global row g lives in physical
row g % capacity (g for an unbounded buffer). The buffer holds globals [begin, end); logical index
0 is `begin`, the oldest row held. Episodes are (global start, length) records in a ring table.

What is in the file, and when (crash safety):
  * `/_h5replay/replay/state` is one small chunk: begin, end, episode range, open episode, seq.
    It is rewritten only by `_publish`: flush the rows and episode records, write the state, flush
    again. So the published state never points at rows that are not in the file.
  * Before rows overwrite slots the published state still shows, `_evict` publishes a state
    whose `begin` has moved past them (a little further, so this happens once per
    `capacity // 64` rows, not once per write). A crash therefore loses no published row to a
    torn overwrite. Once the ring has wrapped, len() runs up to `capacity // 64` rows below the
    capacity: those oldest rows were released early, for everyone alike.
  * `commit_segment` publishes before it returns: a committed episode survives a crash of this
    process. `append` / `extend` are published by the next `flush`, commit or `close`.
Readers in other processes (`load_from(path, read_only=True, multiprocessing=True)`) see only the
published state, and re-check it after each read so a row overwritten mid-read is never returned.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import h5py
import numpy as np

from h5replay.errors import (
    ClosedError,
    ConfigError,
    NotEnoughDataError,
    ReadOnlyError,
    SegmentStateError,
    StorageError,
)
from h5replay.storage.hdf5 import INTERNAL_GROUP, HDF5Storage, h5_errors, normalize_index
from h5replay.storage.indexing import read_slice, write_rows
from h5replay.storage.segment import SegmentWriter
from h5replay.storage.spaces import Space

__all__ = ["ReplayBuffer", "CommitInfo", "export_file", "compact_file"]

REPLAY_GROUP = f"{INTERNAL_GROUP}/replay"
_STATE_MARK = 0x5245504C  # "REPL": tells a state row from zero fill
_STATE_LEN = 8  # mark, begin, end, ep_begin, ep_end, open_start, seq, reserved
_EPISODE_CHUNK_ROWS = 4096
_EVICTION_FRACTION = 64  # publish an eviction once per capacity // 64 rows
_READ_RETRIES = 20
DEFAULT_FILENAME = "storage.hdf5"


class CommitInfo(NamedTuple):
    """Where a committed episode went: its id, logical start at commit time, and length."""

    episode_id: int
    start: int
    length: int


def _file_path(cache_path: str | os.PathLike[str]) -> str:
    """An existing directory means `<dir>/storage.hdf5` (as the reference did); else the file."""
    path = os.fspath(cache_path)
    return os.path.join(path, DEFAULT_FILENAME) if os.path.isdir(path) else path


def _create_tables(capacity: int | None) -> Any:
    def create(root: h5py.Group) -> None:
        group = root.require_group(REPLAY_GROUP)
        state = np.zeros(_STATE_LEN, dtype=np.int64)
        state[0] = _STATE_MARK
        group.create_dataset("state", data=state, maxshape=(_STATE_LEN,), chunks=(_STATE_LEN,))
        chunk_rows = _EPISODE_CHUNK_ROWS if capacity is None else min(_EPISODE_CHUNK_ROWS, capacity)
        group.create_dataset("episodes", shape=(0, 2), maxshape=(capacity, 2), chunks=(chunk_rows, 2), dtype=np.int64)

    return create


class ReplayBuffer:
    """A ring buffer of rows over an HDF5Storage, with episodes, uniform and sequence sampling."""

    def __init__(self, storage: HDF5Storage, *, raw: bool = False) -> None:
        self.storage = storage
        self._raw = raw
        self._closed = False
        self._episodes: collections.deque[tuple[int, int]] = collections.deque()
        self._episode_arrays: tuple[np.ndarray, np.ndarray] | None = None
        self._begin = self._end = self._ep_begin = self._ep_end = self._open_start = self._seq = 0
        self._published = (0, 0)  # (begin, end) as last written to the file
        self._state_row = np.empty(_STATE_LEN, dtype=np.int64)  # reused for every state read
        if raw:
            self._end = len(storage)
            return
        with h5_errors("opening the replay bookkeeping"):
            try:
                group = storage.file[REPLAY_GROUP]
            except KeyError as exc:
                raise ConfigError(
                    f"{storage.filename!r} is not a replay buffer file; "
                    "open plain files with HDF5Storage.load_replay_buffer_from_raw_hdf5"
                ) from exc
            self._state_ds: h5py.Dataset = group["state"]
            self._episodes_ds: h5py.Dataset = group["episodes"]
        self._load_state(force=True)

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(
        cls, space: Space, capacity: int | None, cache_path: str | os.PathLike[str], **storage_kwargs: Any
    ) -> ReplayBuffer:
        """A new, empty buffer in a new file (`cache_path`, or `<cache_path>/storage.hdf5` when it is
        a directory). `storage_kwargs` go to `HDF5Storage.create` (multiprocessing, chunks, ...)."""
        storage = HDF5Storage.create(
            space, capacity, _file_path(cache_path), before_swmr=_create_tables(capacity), **storage_kwargs
        )
        return cls(storage)

    @classmethod
    def load_from(cls, path: str | os.PathLike[str], read_only: bool = True, **storage_kwargs: Any) -> ReplayBuffer:
        """Reopen a buffer exactly as it was last published (closed, flushed or committed)."""
        storage = HDF5Storage.load_from(_file_path(path), None, read_only=read_only, **storage_kwargs)
        try:
            return cls(storage)
        except BaseException:
            storage.close()
            raise

    @classmethod
    def from_raw_hdf5(cls, path: str | os.PathLike[str]) -> ReplayBuffer:
        """A read-only buffer over a plain h5py file: every row held, no episodes."""
        return cls(HDF5Storage.load_from(path, None, read_only=True), raw=True)

    # ------------------------------------------------------------------ properties

    def __len__(self) -> int:
        if self._is_reader:
            self.refresh()
        return self._end - self._begin

    @property
    def capacity(self) -> int | None:
        return self.storage.capacity

    @property
    def space(self) -> Space:
        return self.storage.single_instance_space

    @property
    def num_episodes(self) -> int:
        """Complete episodes held."""
        if self._is_reader:
            self.refresh()
        return len(self._episodes)

    @property
    def is_mutable(self) -> bool:
        return self.storage.is_mutable and not self._raw

    @property
    def _is_reader(self) -> bool:
        return not self.storage.is_mutable and self.storage.multiprocessing and not self._raw

    def _require_writable(self, what: str) -> None:
        if self._closed:
            raise ClosedError("this replay buffer was closed")
        if not self.is_mutable:
            raise ReadOnlyError(f"cannot {what}: the replay buffer is open read-only")

    def _phys(self, g: Any) -> Any:
        return g if self.capacity is None else g % self.capacity

    # ------------------------------------------------------------------ the file's state row

    def _load_state(self, force: bool = False) -> bool:
        """Read the published state; reload episodes when it changed. True when it changed."""
        with h5_errors("reading the replay state"):
            if self._is_reader:
                # Low-level: a reader does this twice a request, and the row's shape never changes.
                self._state_ds.id.refresh()
            state = read_slice(self._state_ds, 0, _STATE_LEN, out=self._state_row)
        if int(state[0]) != _STATE_MARK:
            raise StorageError(f"{self.storage.filename!r} has a damaged replay state row: {state.tolist()}")
        if not force and int(state[6]) == self._seq:
            return False
        begin, end, ep_begin, ep_end, open_start, seq = (int(x) for x in state[1:7])
        if not (0 <= begin <= end and ep_begin <= ep_end and (self.capacity is None or end - begin <= self.capacity)):
            raise StorageError(f"{self.storage.filename!r} has an inconsistent replay state: {state.tolist()}")
        self._begin, self._end, self._ep_begin, self._ep_end = begin, end, ep_begin, ep_end
        self._open_start, self._seq = open_start, seq
        self._published = (begin, end)
        self._episodes.clear()
        if ep_end > ep_begin:
            with h5_errors("reading the episode table"):
                if self._is_reader:
                    self._episodes_ds.refresh()
                slots = self._episode_slot(np.arange(ep_begin, ep_end, dtype=np.int64))
                table = self._episodes_ds[...]
            for g0, length in table[slots]:
                if g0 >= begin:
                    self._episodes.append((int(g0), int(length)))
            self._ep_begin = ep_end - len(self._episodes)
        self._episode_arrays = None
        if self._is_reader:
            self.storage.refresh()
        return True

    def refresh(self) -> None:
        """Reader side: pick up what the writer published since the last call (cheap when nothing)."""
        if self._closed:
            raise ClosedError("this replay buffer was closed")
        if not self._raw and not self.storage.is_mutable:
            self._load_state()

    def _episode_slot(self, index: Any) -> Any:
        return index if self.capacity is None else index % self.capacity

    def _publish(self) -> None:
        """Make the current rows durable, then point the file's state at them (see module doc)."""
        begin, ep_begin = self._begin, self._ep_begin  # the deque holds exactly episodes [ep_begin, ep_end)
        self._seq += 1
        state = np.array(
            [_STATE_MARK, begin, self._end, ep_begin, self._ep_end, self._open_start, self._seq, 0], dtype=np.int64
        )
        self.storage.flush()
        with h5_errors("publishing the replay state"):
            if not write_rows(self._state_ds, 0, state):
                self._state_ds[...] = state
        self.storage.flush()
        self._published = (begin, self._end)

    def flush(self, fsync: bool = False) -> None:
        """Publish everything added so far: it survives a crash and readers see it. With `fsync`,
        also force it to the disk (survives power loss).

        Raises:
            StorageError: HDF5 failed; the buffer is reloaded as the file last published it.
        """
        self._require_writable("flush")
        try:
            self._publish()
            if fsync:
                self.storage.flush(fsync=True)
        except StorageError:
            with contextlib.suppress(Exception):
                self._load_state(force=True)
            raise

    def _evict(self, new_end: int) -> None:
        """Before rows [end, new_end) are written, unpublish every slot they overwrite.

        The oldest rows are released `capacity // 64` at a time, ahead of need, so this costs a
        publish once per that many rows rather than per write. The writer's own view moves with
        the file's, so logical indices mean the same rows to the writer and to every reader.
        """
        if self.capacity is None:
            return
        needed = new_end - self.capacity
        if needed <= self._published[0]:
            return
        ahead = needed + self.capacity // _EVICTION_FRACTION
        self._begin = max(self._begin, min(ahead, self._end))
        self._advance(0)
        self._publish()

    def _advance(self, n: int) -> list[tuple[int, int]]:
        """Move the tail by n rows; returns the episodes that fell off the head."""
        self._end += n
        if self.capacity is not None:
            self._begin = max(self._begin, self._end - self.capacity)
        dropped = []
        while self._episodes and self._episodes[0][0] < self._begin:
            dropped.append(self._episodes.popleft())
            self._ep_begin += 1
            self._episode_arrays = None
        return dropped

    def _record_episode(self, g0: int, length: int) -> int:
        episode_id = self._ep_end
        slot = int(self._episode_slot(episode_id))
        with h5_errors("recording an episode"):
            ds = self._episodes_ds
            if slot >= ds.shape[0]:
                limit = ds.maxshape[0]
                grown = max(slot + 1, 2 * ds.shape[0], _EPISODE_CHUNK_ROWS)
                ds.resize(grown if limit is None else min(grown, limit), axis=0)
            row = np.array([[g0, length]], dtype=np.int64)
            if not write_rows(ds, slot, row):
                ds[slot : slot + 1] = row
        self._episodes.append((g0, length))
        self._ep_end += 1
        self._episode_arrays = None
        return episode_id

    # ------------------------------------------------------------------ adding rows

    def append(self, sample: Any) -> None:
        """Add one row at the tail, to the open episode (ended by `end_episode`). Visible at once in
        this process; durable at the next `flush`, commit or `close`."""
        self._require_writable("append")
        self._write_tail(self.storage.encode_one(sample), 1)

    def extend(self, batch: Any) -> None:
        """Add a batch of rows at the tail, to the open episode. Validated before anything is written."""
        self._require_writable("extend")
        encoded, n = self.storage.encode_batch(batch)
        self._write_tail(encoded, n)

    def _write_tail(self, encoded: dict[str, np.ndarray], n: int) -> None:
        if n == 0:
            return
        self._evict(self._end + n)
        self.storage.write_ring(self._phys(self._end), encoded)
        self._advance(n)

    def end_episode(self, record: bool = True) -> None:
        """Close the episode built by `append` / `extend`; it joins `get_segments()` if whole.
        With `record=False` its rows stay but form no episode (e.g. a fragment)."""
        self._require_writable("end an episode")
        if record and self._open_start < self._end and self._open_start >= self._begin:
            self._record_episode(self._open_start, self._end - self._open_start)
        self._open_start = self._end

    mark_segment_end = end_episode

    def open_segment_writer(self) -> SegmentWriter:
        """A streaming writer for one episode; publish it with `commit_segment`."""
        self._require_writable("open a segment writer")
        return self.storage.open_segment_writer()

    def commit_segment(self, writer: SegmentWriter, publish: bool = True) -> CommitInfo | None:
        """Append the writer's rows at the tail as one episode, and publish it before returning.

        With `publish=False` the episode is in place but not yet durable nor visible to other
        processes: a later `flush()` publishes it with everything else (a group commit: one
        publish for many episodes). Returns None for an empty writer (aborted, nothing recorded).

        Raises:
            SegmentStateError: the writer belongs to another storage, was already committed or
                aborted, or is longer than the capacity (it is aborted).
            StorageError: HDF5 failed; nothing of the segment is visible.
        """
        self._require_writable("commit a segment")
        if writer.storage is not self.storage:
            raise SegmentStateError("this segment writer belongs to another storage")
        if writer.state != "open":
            raise SegmentStateError(f"cannot commit a segment writer that was {writer.state}")
        n = len(writer)
        if n == 0:
            writer.abort()
            return None
        if self.capacity is not None and n > self.capacity:
            writer.abort()
            raise SegmentStateError(f"cannot commit a {n}-row segment into a replay buffer of capacity {self.capacity}")
        if self._open_start < self._end:
            self.end_episode()
        start = self._end
        before = (self._begin, self._end, self._ep_begin, self._ep_end, self._open_start, self._seq)
        dropped: list[tuple[int, int]] = []
        try:
            self._evict(start + n)
            writer.commit(self._phys(start))
            dropped = self._advance(n)
            episode_id = self._record_episode(start, n)
            self._open_start = self._end
            if publish:
                self._publish()
        except BaseException:
            # Nothing new was published (or, at worst, the eviction ahead): put the ring back as the
            # file shows it, so the caller's error means "not committed" and a retry is exact.
            if len(self._episodes) and self._ep_end > before[3]:
                self._episodes.pop()
            self._episodes.extendleft(reversed(dropped))
            self._begin, self._end, self._ep_begin, self._ep_end, self._open_start, self._seq = before
            if self.capacity is not None:  # slots the failed write may have touched stay unpublished
                self._begin = max(self._begin, self._published[0])
                self._advance(0)
            self._episode_arrays = None
            if writer.state == "open":
                writer.abort()
            raise
        return CommitInfo(episode_id, start - self._begin, n)

    def clear(self) -> None:
        """Drop every row and episode (published at once)."""
        self._require_writable("clear")
        self.storage.clear()
        self._begin = self._end = self._ep_begin = self._ep_end = self._open_start = 0
        self._episodes.clear()
        self._episode_arrays = None
        self._publish()

    # ------------------------------------------------------------------ reading

    def get_at(self, index: Any) -> Any:
        """Rows by logical index (0 is the oldest held); same index kinds as `HDF5Storage.get`."""
        return self._read_logical(index, decode=True)

    def get_stored(self, index: Any) -> dict[str, np.ndarray]:
        """Like `get_at` but {leaf path: stored array} (text as UTF-8 bytes), for the wire."""
        return self._read_logical(index, decode=False)  # type: ignore[no-any-return]

    def _read_logical(self, index: Any, decode: bool) -> Any:
        def attempt() -> tuple[Any, int]:
            kind, where = normalize_index(index, self._end - self._begin)
            if kind == "int":
                g = self._begin + where
                return self.storage.read("int", int(self._phys(g)), decode), g
            if kind == "slice":
                where = np.arange(where[0], where[1], dtype=np.int64)
            if where.size == 0:
                return self.storage.read("slice", (0, 0), decode), self._end
            g = where + self._begin
            return self.storage.read("array", self._phys(g), decode), int(g.min())

        return self._consistent(attempt)

    def _consistent(self, attempt: Any) -> Any:
        """Run a read; a reader re-checks the published state and retries if rows it read may
        have been overwritten meanwhile (the writer unpublishes slots before overwriting them)."""
        self._check_open()
        if not self._is_reader:
            return attempt()[0]
        self.refresh()
        for _ in range(_READ_RETRIES):
            result, lowest = attempt()
            self._load_state()
            if lowest >= self._begin:
                return result
        raise StorageError("the writer overwrote the rows being read on every retry; read fewer or older rows")

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this replay buffer was closed")

    def sample(self, batch_size: int, rng: np.random.Generator | None = None) -> Any:
        """`batch_size` rows drawn uniformly, with replacement, from all rows held."""
        return self.sample_with_indices(batch_size, rng)[1]

    def sample_with_indices(
        self, batch_size: int, rng: np.random.Generator | None = None, decode: bool = True
    ) -> tuple[np.ndarray, Any]:
        """(logical indices, batch) for `batch_size` uniform rows."""
        size = _positive_int(batch_size, "batch_size")
        rng = rng if rng is not None else np.random.default_rng()

        def attempt() -> tuple[Any, int]:
            if self._end == self._begin:
                raise NotEnoughDataError("cannot sample from an empty replay buffer")
            g = rng.integers(self._begin, self._end, size=size, dtype=np.int64)
            return (g - self._begin, self.storage.read("array", self._phys(g), decode)), int(g.min())

        return self._consistent(attempt)  # type: ignore[no-any-return]

    def sample_sequences(self, batch_size: int, length: int, rng: np.random.Generator | None = None) -> Any:
        """`batch_size` windows of `length` consecutive rows, each inside one complete episode,
        uniform over all such windows. Leaves come back shaped (batch_size, length, ...)."""
        return self.sample_sequences_with_starts(batch_size, length, rng)[1]

    def sample_sequences_with_starts(
        self, batch_size: int, length: int, rng: np.random.Generator | None = None, decode: bool = True
    ) -> tuple[np.ndarray, Any]:
        """(logical start of each window, batch) for `sample_sequences`."""
        size = _positive_int(batch_size, "batch_size")
        steps = _positive_int(length, "length")
        rng = rng if rng is not None else np.random.default_rng()

        def attempt() -> tuple[Any, int]:
            starts, lengths = self._episode_table()
            windows = lengths - steps + 1
            ok = windows > 0
            if not ok.any():
                raise NotEnoughDataError(
                    f"no complete episode holds {steps} consecutive rows "
                    f"({len(lengths)} episodes, longest {int(lengths.max()) if len(lengths) else 0})"
                )
            weights = np.where(ok, windows, 0).astype(np.float64)
            chosen = rng.choice(len(starts), size=size, p=weights / weights.sum())
            offsets = (rng.random(size) * windows[chosen]).astype(np.int64)
            g0 = starts[chosen] + offsets
            g = g0[:, None] + np.arange(steps, dtype=np.int64)[None, :]
            return (g0 - self._begin, self.storage.read("array", self._phys(g), decode)), int(g0.min())

        return self._consistent(attempt)  # type: ignore[no-any-return]

    def _episode_table(self) -> tuple[np.ndarray, np.ndarray]:
        if self._episode_arrays is None:
            table = np.array(self._episodes, dtype=np.int64).reshape(-1, 2)
            self._episode_arrays = (table[:, 0].copy(), table[:, 1].copy())
        return self._episode_arrays

    def get_segments(self) -> list[tuple[int, int]]:
        """(logical start, length) of every complete episode held, oldest first."""
        self._check_open()
        if self._is_reader:
            self.refresh()
        return [(g0 - self._begin, n) for g0, n in self._episodes]

    def info(self) -> dict[str, Any]:
        """A snapshot of the buffer's figures."""
        if self._is_reader:
            self.refresh()
        return {
            "length": self._end - self._begin,
            "capacity": self.capacity,
            "num_episodes": len(self._episodes),
            "total_rows": self._end,
            "total_episodes": self._ep_end,
        }

    # ------------------------------------------------------------------ copying

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int | None | str = "same",
        overwrite: bool = False,
        progress: Callable[[int, int], None] | None = None,
        **storage_kwargs: Any,
    ) -> None:
        """Write the rows and episodes held to a new buffer file, oldest row first, e.g. with another
        layout or compression (`storage_kwargs` go to `HDF5Storage.create`). The copy is built
        under `<path>.partial` and renamed into place when complete.

        Raises:
            ConfigError: `path` exists (without overwrite) or `capacity` is below the rows held.
        """
        target = _file_path(path)
        if os.path.exists(target) and not overwrite:
            raise ConfigError(f"{target!r} already exists; pass overwrite=True to replace it")
        new_capacity = self.capacity if capacity == "same" else capacity
        total = len(self)
        if new_capacity is not None and int(new_capacity) < total:
            raise ConfigError(f"capacity {new_capacity} cannot hold the {total} rows this buffer holds")
        partial = target + ".partial"
        if os.path.exists(partial):
            os.unlink(partial)
        copy = ReplayBuffer.create(self.space, new_capacity, partial, **storage_kwargs)  # type: ignore[arg-type]
        try:
            row_bytes = sum(leaf.row_bytes for _, leaf in self.storage.leaves)
            block = max(1, (64 << 20) // max(1, row_bytes))
            done = 0

            def rows(first: int, stop: int, record: bool | None) -> None:
                nonlocal done
                for lo in range(first, stop, block):
                    hi = min(stop, lo + block)
                    copy.extend(self.get_at(slice(lo, hi)))
                    done += hi - lo
                    if progress is not None:
                        progress(done, total)
                if record is not None:
                    copy.end_episode(record=record)

            cursor = 0
            for start, length in self.get_segments():
                if start > cursor:
                    rows(cursor, start, record=False)  # rows of an episode partly overwritten
                rows(start, start + length, record=True)
                cursor = start + length
            open_start = max(cursor, self._open_start - self._begin)
            if cursor < open_start:
                rows(cursor, min(open_start, total), record=False)
            if open_start < total:
                rows(open_start, total, record=None if self._open_start >= self._begin else False)
            copy.close()
            os.replace(partial, target)
        except BaseException:
            copy.close()
            with contextlib.suppress(OSError):
                os.unlink(partial)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial + ".lock")

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Publish (when writable) and close the file. Safe to call twice."""
        if self._closed:
            return
        try:
            if self.is_mutable and not self.storage._closed:
                with contextlib.suppress(ClosedError):
                    self._publish()
        finally:
            self._closed = True
            self.storage.close()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _open_any(path: str, writable: bool) -> ReplayBuffer:
    """A buffer over a replay file, or over a plain h5py file (rows, no episodes)."""
    try:
        return ReplayBuffer.load_from(path, read_only=not writable)
    except ConfigError:
        return ReplayBuffer.from_raw_hdf5(path)


def export_file(source: str | os.PathLike[str], target: str | os.PathLike[str], **kwargs: Any) -> None:
    """Copy the buffer (or plain h5py file) at `source` into a new buffer file at `target`;
    keyword arguments as for `ReplayBuffer.export` (layout, compression, capacity, progress)."""
    with _open_any(os.fspath(source), writable=False) as buffer:
        buffer.export(target, **kwargs)


def compact_file(path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Rewrite a buffer file in place (dropping dead space, or changing its layout): exported to
    a temporary file, then renamed over the original while holding its writer lock."""
    path = _file_path(path)
    with ReplayBuffer.load_from(path, read_only=False) as buffer:  # the lock keeps servers out
        temporary = path + ".compact"
        buffer.export(temporary, overwrite=True, **kwargs)
        os.replace(temporary, path)
        buffer._closed = True  # its handle is on the old file: nothing more to publish there
        buffer.storage.close()
