"""Copying a buffer into a new file: `export` (another layout, compression or capacity) and
`compact` (the same, in place). Row and episode ids are kept, and so is the replay's identity
(its id, publish and clear counters), unless the copy is asked to be a new replay.

The copy is built under `<path>.partial` and renamed into place only when complete, so a crash
or an error never leaves a half-made file at the target.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from h5replay.codecs import META_COLUMNS
from h5replay.errors import ConfigError, StorageError
from h5replay.records import Receipt
from h5replay.storage import _h5file, _layout
from h5replay.storage.replay.buffer import ReplayBuffer
from h5replay.storage.replay.ring import Ring

__all__ = ["export_buffer", "export_file", "compact_file"]

_BLOCK_BYTES = 64 << 20  # rows are copied in blocks of about this size
log = logging.getLogger("h5replay.storage")


def export_buffer(
    buffer: ReplayBuffer,
    path: str | os.PathLike[str],
    *,
    capacity: int | None | str = "same",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    new_replay: bool = False,
    plain: bool = False,
    **storage_kwargs: Any,
) -> None:
    """Write the rows and episodes `buffer` holds to a new buffer file, oldest row first, keeping
    their ids, priorities, idempotency keys (and their window), sampling settings, rate-limit
    counters and how often each row was sampled (rows `max_times_sampled` removed stay removed);
    `storage_kwargs` go to `HDF5Storage.create`.

    The copy is the same replay: it keeps the replay id, and its publishes and clears count on
    from the source's, so a client that knew the source (its shards check the replay id, its
    learners never read an older publish than they saw) goes on with the copy served in its
    place. `new_replay=True` makes it a new replay instead (a new id, counters from 0): for a copy
    served beside its source, or whose rows will diverge from it.

    Without layout arguments the copy keeps the source's: compressed leaves (zstd, lz4) stay
    compressed with the same codec, level and slot size, the others keep their chunks.
    `plain=True` writes each compressed leaf as an ordinary dataset through the standard HDF5
    filter of its codec instead (hdf5plugin's Zstd at the same level, or its LZ4), which plain
    h5py reads after `import hdf5plugin`, without h5replay; such a copy cannot be served with
    multiprocessing (a filtered ring grows without bound under SWMR).

    A file cut short (see `ReplayBuffer.load_from`) is copied from the newest row back to the
    newest row that lies in its missing part, left out with everything older (a warning says how
    many rows): ids stay consecutive, and nothing that was lost is made up.

    Raises:
        ConfigError: `path` exists (without overwrite), `capacity` is below the rows held, the
            copy is unbounded but would keep compressed leaves as records, or `plain=True` is
            given a compression or without hdf5plugin installed.
        EvictedError: a writer overwrote rows of a live buffer while they were being copied.
    """
    target = _h5file.file_path(path)
    if os.path.exists(target) and not overwrite:
        raise ConfigError(f"{target!r} already exists; pass --overwrite (overwrite=True) to replace it")
    spans = _spans(buffer)
    view = buffer.last_view  # the state the episode table came from
    lo, hi = _readable_run(buffer, spans)
    if (lo, hi) != (0, len(spans)):
        kept = sum(stop - first for first, stop, _, _ in spans[lo:hi])
        log.warning("%s is cut short: the copy keeps the longest run of whole episodes lying outside the missing part, "
                    "%d of the %d rows held (ids %s); the rest is left out", buffer.storage.filename, kept, view.length,
                    f"{spans[lo][0]}..{spans[hi - 1][1] - 1}" if hi > lo else "none")
        spans = spans[lo:hi]
    first_row = spans[0][0] if spans else view.end
    total = sum(stop - first for first, stop, _, _ in spans)
    new_capacity = buffer.capacity if capacity == "same" else None if capacity is None else int(capacity)
    if new_capacity is not None and int(new_capacity) < total:
        raise ConfigError(f"capacity {new_capacity} cannot hold the {total} rows this buffer holds")
    partial = target + ".partial"
    if os.path.exists(partial):
        os.unlink(partial)
    episode_ids = [episode for _, _, _, episode in spans if episode is not None]
    # Episodes keep their idempotency keys (and the window stays): a commit retried after a
    # compaction is answered with its receipt, not stored a second time.
    keys = {receipt: key for key, receipt in buffer.idempotency_keys()}
    tables = buffer.tables
    prioritized = [name for name, t in tables.items() if t.prioritized]
    removing = [name for name, t in tables.items() if t.removes]
    storage_kwargs = {**_same_layout(buffer, new_capacity, storage_kwargs, plain), **storage_kwargs}
    copy = type(buffer).create(
        buffer.space, new_capacity, partial, first_row_id=first_row,
        first_episode_id=episode_ids[0] if episode_ids else view.ep_end, tables=tables,
        idempotency_window=buffer.idempotency_window, check_bounds=False,  # copy what is held
        replay_id=None if new_replay or not buffer.replay_id else buffer.replay_id, **_transition_keys(buffer),
        **storage_kwargs,
    )
    same = {} if new_replay else {"seq": view.seq, "generation": view.generation}
    sampled = {name: counters.sampled for name, counters in zip(tables, view.tables)}
    info = buffer.info()
    maxima = {name: info[f"table.{name}.max_priority"] for name in prioritized if f"table.{name}.max_priority" in info}
    copy.carry_over(inserted=view.inserted, sampled=sampled, limit_inserts=False, max_priority=maxima, **same)
    try:
        block = max(1, _BLOCK_BYTES // max(1, buffer.storage.row_bytes))
        done = 0
        for first, stop, record, episode in spans:
            for lo in range(first, stop, block):
                hi = min(stop, lo + block)
                ids = np.arange(lo, hi, dtype=np.int64)
                priorities = {name: buffer.priorities(ids, table=name) for name in prioritized}
                copy.extend(buffer.get_rows(ids), priorities=priorities or None)
                for name in removing:
                    copy.carry_sample_counts(lo, buffer.sample_counts(lo, hi, table=name), table=name)
                done += hi - lo
                if progress is not None:
                    progress(done, total)
            if record is not None:
                key = keys.get(Receipt(episode, first, stop - first)) if episode is not None else None
                final = buffer.final_observation(episode) if episode is not None else None
                copy.end_episode(record=record, idempotency_key=key, final=final)
        copy.carry_over(inserted=view.inserted, sampled=sampled, limit_inserts=True, **same)
        copy.close()
        os.replace(partial, target)
    except BaseException:
        copy.close()
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _transition_keys(buffer: ReplayBuffer) -> dict[str, Any]:
    """The `create` arguments that keep the source's observation keys (its finals go along)."""
    keys = buffer.transition_keys
    if keys is None:
        return {}
    return {"observation_keys": keys.observation, "reward_key": keys.reward, "terminated_key": keys.terminated,
            "truncated_key": keys.truncated}


_LAYOUT_ARGS = ("chunks", "compression", "compression_level")


def _same_layout(buffer: ReplayBuffer, capacity: int | None, asked: dict[str, Any], plain: bool) -> dict[str, Any]:
    """The source's layout, as far as the caller asks none of its own. Compressed leaves keep
    their codec, level and slot size unless chunks, a compression or a level are asked (even
    None: a copy must not grow many times over unasked). The other leaves keep the source's
    chunks unless chunks, a compression or a level other than None are asked: a copy of a served
    file (whose leaves SWMR keeps chunked) must stay servable, which a contiguous copy is not
    (SWMR readers of HDF5 1.14.4+ cannot open it, HDFGroup/hdf5#5251; those of 2.0 fail to
    refresh it once it grows). A contiguous source stays contiguous; a compressed leaf stored
    raw at the caller's `compression=None` is chunked when the source's other leaves are.

    `plain`: each compressed leaf becomes an ordinary dataset through hdf5plugin's filter of its
    codec instead (_layout.PLAIN_FILTERS); the others as above."""
    storage = buffer.file_storage
    compressed = storage.compressed_leaves
    if plain:
        given = [name for name in ("compression", "compression_level", "compression_slot") if name in asked]
        if given:
            raise ConfigError(f"plain=True (--plain) writes each compressed leaf through the standard HDF5 filter of "
                              f"its own codec; it takes no {', '.join(given)}")
        if compressed:
            _layout.register_filters("plain=True (--plain)")  # h5py refuses to write through a filter HDF5 lacks
    records = plain or not any(name in asked for name in _LAYOUT_ARGS)
    chunked = not any(asked.get(name) is not None for name in _LAYOUT_ARGS)
    if compressed and records and capacity is None and not plain:
        leaves = ", ".join(f"'{path}' ({codec})" for path, codec in compressed.items())
        raise ConfigError(f"an unbounded copy cannot keep {leaves} compressed as h5replay's records, which need a "
                          "fixed capacity: keep a capacity, choose the copy's compression (gzip, lzf, none), or write "
                          "it plain (--plain)")
    filters: dict[str, Any] = {}
    levels: dict[str, Any] = {}
    slots: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    for path, _ in storage.leaves:
        if path in compressed:
            if records:
                column = storage.compressed_leaf(path)
                filters[path], level = (_layout.plain_filter(column.codec_name, column.level) if plain
                                        else (column.codec_name, column.level))
                if level is not None:
                    levels[path] = level
                if not plain:
                    slots[path] = column.slot_bytes
            continue
        chunks = storage.dataset(path).chunks
        if chunks is not None and capacity is not None:
            chunks = (min(chunks[0], capacity), *chunks[1:])
        shapes[path] = chunks
    out: dict[str, Any] = {"compression": filters, "compression_level": levels, "compression_slot": slots}
    if chunked and any(c is not None for c in shapes.values()):
        out["chunks"] = {**shapes, **{path: True for path in compressed if not records}}
    return {name: value for name, value in out.items() if value}


Span = tuple[int, int, "bool | None", "int | None"]


def _spans(buffer: ReplayBuffer) -> list[Span]:
    """(first row id, stop, record, episode id) of the runs of rows held, oldest first: complete
    episodes (record True), rows of no complete episode (False), the open episode (None)."""
    table = buffer.episode_table()
    view = buffer.last_view  # the state the table came from
    spans: list[Span] = []
    cursor = view.begin
    for episode, start, length in table.tolist():
        if start > cursor:
            spans.append((cursor, start, False, None))  # rows of no complete episode
        spans.append((start, start + length, True, int(episode)))
        cursor = start + length
    open_start = view.open_start if view.open_start >= max(cursor, view.begin) else view.end
    if cursor < open_start:
        spans.append((cursor, open_start, False, None))
    if open_start < view.end:
        spans.append((open_start, view.end, None, None))  # the open episode stays open in the copy
    return spans


def _readable_run(buffer: ReplayBuffer, spans: list[Span]) -> tuple[int, int]:
    """The [lo, hi) of the longest run of consecutive spans whose rows all lie within the file,
    for a file cut short (the newest run of the longest length); all spans for a whole file."""
    storage = buffer.file_storage
    path = storage.filename
    if path is None or not storage.multiprocessing:
        return 0, len(spans)  # a plain open of a cut file fails; only an SWMR reader sees it at all
    length = os.path.getsize(path)
    if _h5file.missing_bytes(path, length) == 0:
        return 0, len(spans)
    capacity, origin = buffer.capacity, buffer.last_view.origin

    compressed = storage.compressed_leaves

    def within(leaf: str, a: int, b: int) -> bool:
        if leaf not in compressed:
            return _h5file.data_end(storage.dataset(leaf), a, b) <= length
        # A compressed leaf's rows: their slots and meta (at the same row positions), and the spill
        # slots the meta names.
        slots, meta, spill = storage.compressed_leaf(leaf).datasets()
        if max(_h5file.data_end(slots, a, b), _h5file.data_end(meta, a, b)) > length:
            return False
        named = np.unique(np.asarray(meta[a:b, META_COLUMNS], np.int64)) - 1  # each spill slot + 1 (0: none)
        named = named[(named >= 0) & (named < spill.shape[0])]
        return all(_h5file.data_end(spill, int(j), int(j) + 1) <= length for j in named)

    def readable(first: int, stop: int) -> bool:
        pieces = Ring(capacity).pieces(first, stop, origin)
        return all(within(leaf, a, b) for leaf, _ in storage.leaves for a, b, _ in pieces)

    best, start = (0, 0), 0
    for k, (first, stop, _, _) in enumerate(spans):
        if not readable(first, stop):
            start = k + 1
            continue
        rows = spans[k][1] - spans[start][0]
        if rows >= (spans[best[1] - 1][1] - spans[best[0]][0] if best[1] > best[0] else 0):
            best = (start, k + 1)
    return best


def _open_any(path: str, writable: bool) -> ReplayBuffer:
    """A buffer over a replay file, or over a plain h5py file (rows, no episodes). A file cut
    short (which HDF5 refuses to open plainly) is read as an SWMR reader, which does not check
    the file's length: `export_buffer` then leaves out what lay in the missing part."""
    try:
        return ReplayBuffer.load_from(path, read_only=not writable)
    except ConfigError:
        return ReplayBuffer.from_raw_hdf5(path)
    except StorageError:
        if writable or not os.path.isfile(path) or _h5file.missing_bytes(path, os.path.getsize(path)) == 0:
            raise
        return ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)


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
