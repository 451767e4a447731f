"""What a replay file holds, for `h5replay info`: space tree, length, episodes, layout, bytes."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import h5py

from h5replay.errors import ConfigError, StorageError
from h5replay.sampling import described_tables, table_description
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, LeafSpace, Space, TextSpace
from h5replay.storage._h5file import DEFAULT_OPEN_TIMEOUT, opening
from h5replay.storage._layout import PLAIN_FILTERS
from h5replay.storage.hdf5 import HDF5Storage
from h5replay.storage.replay.buffer import ReplayBuffer
from h5replay.storage.replay.journal import REPLAY_GROUP

__all__ = ["describe_file", "format_description", "space_tree"]


def _open(path: str, open_timeout: float | None) -> HDF5Storage:
    try:
        return HDF5Storage.load_from(path, None, read_only=True, open_timeout=open_timeout)
    except StorageError:
        # A running server holds the file in SWMR write mode: read it as an SWMR reader.
        return HDF5Storage.load_from(path, None, read_only=True, multiprocessing=True, open_timeout=open_timeout)


def describe_file(path: str, open_timeout: float | None = DEFAULT_OPEN_TIMEOUT) -> dict[str, Any]:
    """A JSON-ready description of the file at `path`. Gives up after `open_timeout` seconds
    (a damaged file), or at SIGTERM / SIGINT, with a StorageError.
    """
    with opening(path, open_timeout):
        return _describe(path, open_timeout)


def _describe(path: str, open_timeout: float | None) -> dict[str, Any]:
    storage = _open(path, open_timeout)
    try:
        description: dict[str, Any] = {
            "path": os.path.abspath(path),
            "file_bytes": os.path.getsize(path),
            "space": storage.single_instance_space.to_json(),
            "capacity": storage.capacity,
            "rows_allocated": len(storage),
            "swmr_reader": storage.multiprocessing,
        }
        if REPLAY_GROUP in storage.file:
            buffer = ReplayBuffer(storage)
            description["replay"] = buffer.info()
            segments = buffer.get_segments()
            lengths = [n for _, n in segments]
            description["replay"]["episode_length_min"] = min(lengths, default=0)
            description["replay"]["episode_length_max"] = max(lengths, default=0)
        compressed = storage.compressed_leaves
        description["datasets"] = [_compressed_leaf(storage, path, leaf) if path in compressed
                                   else _dataset(path, storage.dataset(path)) for path, leaf in storage.leaves]
    finally:
        with contextlib.suppress(Exception):
            storage.close()
    return description


def _dataset(path: str, ds: h5py.Dataset) -> dict[str, Any]:
    dcpl = ds.id.get_create_plist()
    compression, opts, filter_id = ds.compression, ds.compression_opts, None
    if compression not in (None, "gzip", "lzf", "szip"):  # a plugin's filter: an `export --plain` copy's zstd, lz4?
        names = {code: name for name, code in PLAIN_FILTERS.items()}
        filters = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]
        known = [(code, values) for code, _, values, _ in filters if code in names]
        if known:
            filter_id, values = known[0]
            compression = names[filter_id]
            opts = int(values[0]) if len(values) == 1 else [int(v) for v in values] or None
        else:
            compression = f"HDF5 filters {[code for code, *_ in filters]}"
    return {
        "path": path,
        "dtype": str(ds.dtype),
        "shape": list(ds.shape),
        "maxshape": [None if m is None else int(m) for m in ds.maxshape],
        "layout": {h5py.h5d.CONTIGUOUS: "contiguous", h5py.h5d.CHUNKED: "chunked"}.get(dcpl.get_layout(), "compact"),
        "chunks": list(ds.chunks) if ds.chunks else None,
        "compression": compression,
        "compression_opts": opts,
        "filter_id": filter_id,
        "bytes_on_disk": int(ds.id.get_storage_size()),
    }


def _compressed_leaf(storage: HDF5Storage, path: str, leaf: LeafSpace) -> dict[str, Any]:
    """A leaf stored as h5replay's records (storage/packed.py): codec, level, slot and spill area."""
    column = storage.compressed_leaf(path)
    return {
        "path": path,
        "dtype": str(leaf.storage_dtype),
        "shape": [column.capacity, *leaf.shape],
        "maxshape": [column.capacity, *leaf.shape],
        "layout": "records",
        "chunks": None,
        "compression": column.codec_name,
        "compression_opts": column.level,
        "slot_bytes": column.slot_bytes,
        "spill_slots": column.spill_slots(),
        "bytes_on_disk": sum(int(ds.id.get_storage_size()) for ds in column.datasets()),
    }


def space_tree(space: Space, indent: str = "") -> list[str]:
    """Lines drawing a space as a tree."""
    if isinstance(space, DictSpace):
        lines = []
        for key, sub in space.spaces.items():
            if isinstance(sub, DictSpace):
                lines.append(f"{indent}{key}/")
                lines += space_tree(sub, indent + "  ")
            else:
                lines.append(f"{indent}{key}: {_leaf_text(sub)}")
        return lines
    return [f"{indent}{_leaf_text(space)}"]


def _leaf_text(space: Space) -> str:
    if isinstance(space, BoxSpace):
        return f"Box{space.shape} {space.dtype}"
    if isinstance(space, BinarySpace):
        return f"Binary{space.shape}"
    if isinstance(space, TextSpace):
        return f"Text(max {space.max_length} chars)"
    raise ConfigError(f"unknown space {space!r}")


def _sampling_lines(r: dict[str, Any]) -> list[str]:
    """Each table's sampler, priorities and rate limiter's counters, from `ReplayBuffer.info()`."""
    names = described_tables(r)
    if len(names) > 1:
        lines = []
        for name in names:
            lines += [f"table     {name}", *(f"  {line}" for line in _table_lines(table_description(r, name)))]
        return lines
    return _table_lines(r)


def _table_lines(r: dict[str, Any]) -> list[str]:
    if "sampler" not in r:
        return []
    sampler = r["sampler"]
    if sampler in ("recency", "mixture"):
        sampler += f" {r['sampler_settings']}"
    if r["sampler"] == "prioritized":
        initial = r["initial_priority"] if r["initial_priority"] is not None else "the largest seen"
        sampler += (f" (exponent {r['priority_exponent']}, new rows get {initial}), priority sum "
                    f"{r['priority_sum']:.6g}, {r['priority_updates']} updates")
    if r["max_times_sampled"]:
        sampler += f", a row is removed after {r['max_times_sampled']} samples"
    lines = [f"sampling  {sampler}"]
    if r["min_size_to_sample"] > 1 or r["samples_per_insert"]:  # (1: the default, no limit)
        ratio = (f", {r['samples_per_insert']} samples per insert within +-{r['error_buffer']}"
                 if r["samples_per_insert"] else "")
        lines.append(f"limit     at least {r['min_size_to_sample']} rows to sample{ratio}; "
                     f"{r['inserted']} rows inserted, {r['sampled']} sampled")
    return lines


def format_description(d: dict[str, Any]) -> str:
    from h5replay.spaces import space_from_json

    lines = [f"file      {d['path']} ({d['file_bytes'] / 1e6:.1f} MB)", "space"]
    lines += space_tree(space_from_json(d["space"]), "  ")
    lines.append(f"capacity  {d['capacity'] if d['capacity'] is not None else 'unbounded'}")
    if "replay" in d:
        r = d["replay"]
        lines.append(f"rows      {r['length']} held ({r['total_rows']} added in all)")
        lines.append(
            f"episodes  {r['num_episodes']} complete held ({r['total_episodes']} in all), "
            f"length {r['episode_length_min']}..{r['episode_length_max']}"
        )
        lines += _sampling_lines(r)
    else:
        lines.append(f"rows      {d['rows_allocated']} (not a replay buffer file: no episode table)")
    lines.append("datasets")
    for ds in d["datasets"]:
        if ds["layout"] == "records":
            level = f" level {ds['compression_opts']}" if ds["compression_opts"] is not None else ""
            lines.append(
                f"  {ds['path']}: {ds['dtype']} {tuple(ds['shape'])} records, compression {ds['compression']}{level}, "
                f"{ds['slot_bytes']}-byte slots, {ds['spill_slots']} spill slots, {ds['bytes_on_disk'] / 1e6:.2f} MB"
            )
            continue
        comp = ds["compression"] or "none"
        if ds["compression_opts"] is not None:
            comp += f"({ds['compression_opts']})"
        if ds.get("filter_id") is not None:
            comp += f" (HDF5 filter {ds['filter_id']})"
        chunks = f" chunks {tuple(ds['chunks'])}" if ds["chunks"] else ""
        lines.append(
            f"  {ds['path']}: {ds['dtype']} {tuple(ds['shape'])} {ds['layout']}{chunks}, "
            f"compression {comp}, {ds['bytes_on_disk'] / 1e6:.2f} MB"
        )
    return "\n".join(lines)
