"""How each leaf is laid out in HDF5: contiguous or whole-row chunks, compression per leaf.

Pure code: turns the `create()` arguments into per-dataset h5py keyword arguments, so the rules of
the design document live in one place and are testable without a file. (`register_filters` only
imports hdf5plugin, whose import registers its HDF5 filters.)

Rules (per leaf):
  * fixed capacity, no compression, chunks None, not multiprocessing -> contiguous;
  * chunks None/True with compression, or an unbounded storage -> whole-row chunks of about
    CHUNK_TARGET_BYTES, never less than one row, clamped to a fixed capacity;
  * multiprocessing, where the rules above would give contiguous storage (fixed capacity, no
    compression, chunks None) -> whole-row chunks of about SWMR_CONTIGUOUS_CHUNK_BYTES (1 MiB),
    the nearest to contiguous an SWMR file can be: an SWMR reader of HDF5 1.14.4 and later 1.14
    releases cannot open a contiguous dataset ("invalid dataset size", HDFGroup/hdf5#5251, open);
    HDF5 2.0.0 can, but h5py wheels ship either, and a file outlives the library that wrote it.
    Without compression a row read or write touches only its own bytes of a chunk, so big
    chunks cost random reads nothing, and they make fewer chunks to index and write: 100-row
    image episodes were written 1.3-1.7x faster than in 64 KiB chunks;
  * an explicit tuple is padded with the row shape;
  * chunks=False asks for contiguous storage and is refused where it cannot be honoured;
  * "zstd" and "lz4" (fixed capacity only) store the leaf as h5replay's own records, one per row
    in a fixed slot with a spill area (storage/packed.py): no HDF5 filter, so it stays bounded
    under SWMR; `compression_slot` sizes the slot;
  * an HDF5 filter (gzip, lzf, szip, or a plugin's by its filter id: `PLAIN_FILTERS`, what
    `export --plain` makes of zstd and lz4 leaves) with a fixed capacity and multiprocessing
    (SWMR) is refused: the file would grow without bound (HDF5 never reuses file space under SWMR).
`compression`, `compression_level`, `compression_slot` and `chunks` may be mappings keyed by leaf path ("obs/image"),
by a top-level key ("obs"), or "*" for the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from h5replay.codecs import CODECS
from h5replay.errors import ConfigError
from h5replay.storage.indexing import CHUNK_TARGET_BYTES
from h5replay.storage.packed import PackedLayout

_COMPRESSIONS = ("gzip", "lzf", "szip")
#: The standard HDF5 filter (hdf5plugin's, by filter id) each codec of a compressed leaf becomes in
#: a plain copy (`h5replay export --plain`), which h5py reads with hdf5plugin imported, without h5replay.
PLAIN_FILTERS = {"zstd": 32015, "lz4": 32004}


def plain_filter(codec: str, level: int | None) -> tuple[int, int | None]:
    """(filter id, level) of the HDF5 filter a leaf compressed by `codec` at `level` becomes in a
    plain copy: hdf5plugin's Zstd at the same level, or its LZ4 (which takes no level)."""
    return PLAIN_FILTERS[codec], level if codec == "zstd" else None


def register_filters(what: str) -> None:
    """Register hdf5plugin's HDF5 filters (Zstd, LZ4, ...) in this process: importing it does.
    h5py can neither write nor read a dataset through a filter HDF5 does not know.

    Raises:
        ConfigError: hdf5plugin is not installed; the message says `what` needed it.
    """
    try:
        import hdf5plugin  # noqa: F401  (imported for its side effect)
    except ImportError as exc:
        raise ConfigError(f"{what} needs the 'hdf5plugin' package (standard HDF5 filters), which this process lacks: "
                          "pip install 'h5replay[compression]' (or pip install hdf5plugin)") from exc


def resolve_option(option: Any, path: str) -> Any:
    """The value of a per-leaf option for `path`: the most specific mapping key, then '*'."""
    if not isinstance(option, Mapping):
        return option
    parts = path.split("/")
    for depth in range(len(parts), 0, -1):
        key = "/".join(parts[:depth])
        if key in option:
            value = option[key]
            return resolve_option(value, "/".join(parts[depth:])) if isinstance(value, Mapping) else value
    return option.get("*")


def swmr_compressed_ring(path: str, compression: Any) -> str:
    """Why a compressed fixed-capacity dataset cannot be written in SWMR mode (the one message)."""
    return (
        f"dataset '{path}' is compressed ({compression}) and has a fixed capacity: under SWMR, HDF5 never reuses "
        "file space, so every rewrite of a compressed chunk of the ring grows the file without bound. Store it "
        "with compression 'zstd' or 'lz4' (h5replay's own records, which stay bounded under SWMR), uncompressed "
        "(h5replay compact FILE --compression none), or without multiprocessing"
    )


SWMR_CONTIGUOUS_CHUNK_BYTES = 1 << 20
"""Chunk size of a multiprocessing file's leaves that would otherwise be contiguous (see above)."""


def whole_row_chunk_rows(row_bytes: int, capacity: int | None, target: int = CHUNK_TARGET_BYTES) -> int:
    """Rows per chunk so one chunk holds about `target` bytes of whole rows (at least one)."""
    rows = max(1, target // max(1, row_bytes))
    if capacity is not None:
        rows = min(rows, max(1, capacity))
    return rows


def dataset_kwargs(
    path: str,
    row_shape: tuple[int, ...],
    row_bytes: int,
    capacity: int | None,
    initial_rows: int,
    *,
    compression: Any,
    compression_level: Any,
    chunks: Any,
    multiprocessing: bool,
    compression_slot: Any = None,
) -> dict[str, Any]:
    """h5py `create_dataset` keyword arguments (shape, maxshape, chunks, compression) for one leaf,
    or {"packed": PackedLayout} for a leaf stored as h5replay's own records."""
    comp = resolve_option(compression, path)
    level = resolve_option(compression_level, path)
    chunk = resolve_option(chunks, path)
    slot = resolve_option(compression_slot, path)
    if comp in CODECS:
        if capacity is None:
            raise ConfigError(f"compression {comp!r} for '{path}' needs a fixed capacity (a ring: rows stored as "
                              "records in fixed slots); a growing storage can use gzip or lzf")
        if chunk not in (None, True):
            raise ConfigError(f"chunks for '{path}' cannot be chosen: {comp!r} stores rows as records, not HDF5 chunks")
        return {"packed": PackedLayout.of(path, row_bytes, comp, level, slot)}
    if slot is not None and isinstance(compression_slot, Mapping) and path in compression_slot:
        raise ConfigError(f"compression_slot for '{path}' is set but its compression is {comp!r}, not one of "
                          f"{sorted(CODECS)}")
    if comp is not None and comp not in _COMPRESSIONS and not isinstance(comp, int):
        raise ConfigError(f"compression for '{path}' must be one of {sorted(CODECS) + list(_COMPRESSIONS)} or None, "
                          f"got {comp!r}")
    if level is not None and comp is None:
        raise ConfigError(f"compression_level for '{path}' is set but no compression is chosen for it")
    if comp == "lzf" and level is not None:
        raise ConfigError(f"lzf compression for '{path}' takes no level, got {level!r}")
    if comp == "gzip" and level is not None and (not isinstance(level, int) or not 0 <= level <= 9):
        raise ConfigError(f"gzip level for '{path}' must be an int in 0..9, got {level!r}")

    if comp is not None and multiprocessing and capacity is not None:
        raise ConfigError(swmr_compressed_ring(path, comp))
    shape = (capacity if capacity is not None else initial_rows, *row_shape)
    kwargs: dict[str, Any] = {"shape": shape}
    contiguous_possible = capacity is not None and comp is None and not multiprocessing
    if chunk is False:
        if not contiguous_possible:
            reason = (
                "compression needs chunks" if comp is not None
                else "an unbounded storage needs chunks" if capacity is None
                else "SWMR readers of HDF5 1.14.4+ cannot open contiguous datasets (HDFGroup/hdf5#5251)"
            )
            raise ConfigError(f"chunks=False (contiguous) is impossible for '{path}': {reason}")
        return kwargs
    if chunk is None and contiguous_possible:
        return kwargs
    if chunk is None or chunk is True:
        contiguous_wanted = chunk is None and capacity is not None and comp is None
        target = SWMR_CONTIGUOUS_CHUNK_BYTES if contiguous_wanted else CHUNK_TARGET_BYTES
        chunk_shape: tuple[int, ...] = (whole_row_chunk_rows(row_bytes, capacity, target), *row_shape)
    else:
        try:
            given = tuple(int(c) for c in chunk)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"chunks for '{path}' must be None, True, False or a tuple, got {chunk!r}") from exc
        if not given or len(given) > 1 + len(row_shape) or any(c < 1 for c in given):
            raise ConfigError(f"chunks {given} for '{path}' do not fit rows of shape {row_shape}")
        chunk_shape = given + row_shape[len(given) - 1 :]
        if any(0 < r < c for c, r in zip(chunk_shape[1:], row_shape)):
            raise ConfigError(f"chunks {chunk_shape} for '{path}' are larger than a row of shape {row_shape}")
        if capacity is not None and chunk_shape[0] > capacity:
            raise ConfigError(f"chunks {chunk_shape} for '{path}' hold more rows than the capacity {capacity}")
    # A zero-sized row dimension cannot be chunked by whole rows; let HDF5 guess.
    kwargs["chunks"] = True if 0 in chunk_shape[1:] else tuple(max(1, c) for c in chunk_shape)
    kwargs["maxshape"] = (capacity, *row_shape)
    if comp is not None:
        kwargs["compression"] = comp
        if level is not None:
            # A filter given by its id takes its options as a tuple (h5py passes them to H5Pset_filter).
            kwargs["compression_opts"] = (level,) if isinstance(comp, int) and isinstance(level, int) else level
    return kwargs
