"""Copying a buffer into a new file: `export` (another layout, compression or capacity) and
`compact` (the same, in place). Row and episode ids are kept; the copy gets a new replay id.

The copy is built under `<path>.partial` and renamed into place only when complete, so a crash
or an error never leaves a half-made file at the target.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from h5replay.errors import ConfigError
from h5replay.storage import _h5file
from h5replay.storage.replay_buffer import ReplayBuffer

__all__ = ["export_buffer", "export_file", "compact_file"]

_BLOCK_BYTES = 64 << 20  # rows are copied in blocks of about this size


def export_buffer(
    buffer: ReplayBuffer,
    path: str | os.PathLike[str],
    *,
    capacity: int | None | str = "same",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    **storage_kwargs: Any,
) -> None:
    """Write the rows and episodes `buffer` holds to a new buffer file, oldest row first, keeping
    their ids, priorities, sampling settings and rate-limit counters (not how often each row was
    sampled: the copy starts those at 0); `storage_kwargs` go to `HDF5Storage.create`.

    Raises:
        ConfigError: `path` exists (without overwrite) or `capacity` is below the rows held.
        EvictedError: a writer overwrote rows of a live buffer while they were being copied.
    """
    target = _h5file.file_path(path)
    if os.path.exists(target) and not overwrite:
        raise ConfigError(f"{target!r} already exists; pass --overwrite (overwrite=True) to replace it")
    new_capacity = buffer.capacity if capacity == "same" else capacity
    table = buffer.episode_table()  # (episode id, first row id, length) of complete episodes
    view = buffer.last_view
    total = view.length
    if new_capacity is not None and int(new_capacity) < total:
        raise ConfigError(f"capacity {new_capacity} cannot hold the {total} rows this buffer holds")
    partial = target + ".partial"
    if os.path.exists(partial):
        os.unlink(partial)
    first_episode = int(table[0, 0]) if len(table) else view.ep_end
    sampling = buffer.sampling
    copy = type(buffer).create(
        buffer.space, new_capacity, partial, first_row_id=view.begin,  # type: ignore[arg-type]
        first_episode_id=first_episode, sampler=sampling.sampler, rate_limit=sampling.rate_limit,
        max_times_sampled=sampling.max_times_sampled, check_bounds=False, **storage_kwargs,  # copy what is held
    )
    copy.carry_over(inserted=view.inserted, sampled=view.sampled, limit_inserts=False)
    try:
        block = max(1, _BLOCK_BYTES // max(1, buffer.storage.row_bytes))
        done = 0

        def rows(first: int, stop: int, record: bool | None) -> None:
            nonlocal done
            for lo in range(first, stop, block):
                hi = min(stop, lo + block)
                ids = np.arange(lo, hi, dtype=np.int64)
                copy.extend(buffer.get_rows(ids), priorities=buffer.priorities(ids) if sampling.prioritized else None)
                done += hi - lo
                if progress is not None:
                    progress(done, total)
            if record is not None:
                copy.end_episode(record=record)

        cursor = view.begin
        for _, start, length in table.tolist():
            if start > cursor:
                rows(cursor, start, record=False)  # rows of no complete episode
            rows(start, start + length, record=True)
            cursor = start + length
        open_start = view.open_start if view.open_start >= max(cursor, view.begin) else view.end
        if cursor < open_start:
            rows(cursor, open_start, record=False)
        if open_start < view.end:
            rows(open_start, view.end, record=None)  # the open episode stays open in the copy
        copy.carry_over(inserted=view.inserted, sampled=view.sampled, limit_inserts=True)
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


def _open_any(path: str, writable: bool) -> ReplayBuffer:
    """A buffer over a replay file, or over a plain h5py file (rows, no episodes)."""
    try:
        return ReplayBuffer.load_from(path, read_only=not writable)
    except ConfigError:
        return ReplayBuffer.from_raw_hdf5(path)


def export_file(source: str | os.PathLike[str], target: str | os.PathLike[str], **kwargs: Any) -> None:
    """Copy the buffer (or plain h5py file) at `source` into a new buffer file at `target`;
    keyword arguments as for `export_buffer` (layout, compression, capacity, progress)."""
    with _open_any(os.fspath(source), writable=False) as buffer:
        export_buffer(buffer, target, **kwargs)


def compact_file(path: str | os.PathLike[str], **kwargs: Any) -> None:
    """Rewrite a buffer file in place (dropping dead space, or changing its layout): exported to
    a temporary file, then renamed over the original while holding its writer lock."""
    path = _h5file.file_path(path)
    with ReplayBuffer.load_from(path, read_only=False) as buffer:  # the lock keeps servers out
        temporary = path + ".compact"
        export_buffer(buffer, temporary, overwrite=True, **kwargs)
        os.replace(temporary, path)  # closing `buffer` now only touches the replaced file
