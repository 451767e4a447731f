"""Lossless codecs of compressed leaves, and the records they make: one per row, self-describing.

A compressed leaf ("obs/image") stores each row as one record: the row's bytes encoded by the
leaf's codec, or the raw bytes when encoding would not save anything. A record travels with three
numbers (`PackedRows.meta`): its size, its kind (which codec made it) and the CRC-32 of its bytes,
so whoever holds a record (the local buffer, a learner across the wire) can check and decode it
without asking which codec the leaf uses, and a damaged record is found before it is returned.

Codecs: "zstd" (the `zstandard` package, levels 1-22, default 3) and "lz4" (the `lz4` package's
block format; level None is its fast mode, 1-12 its high-compression mode). Both are optional
(`pip install h5replay[compression]`); a process that meets a record it lacks the package for
gets a ConfigError naming the leaf and the package. Measured on real Atari frames
(benchmarks/frames.py): zstd 3 stores an 84x84x4 Pong stack in 1/70 of its bytes and encodes and
decodes it at 1.5-2 GB/s; LZ4 in 1/42 at 4-4.7 GB/s; Blosc2's zstd and LZ4 compress rows this
small 2-4x slower than the codecs' own packages, so those are what is used.

Pure: numpy and zlib, the codec packages imported when first needed.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from h5replay.errors import ConfigError, StorageError

__all__ = ["CODECS", "Codec", "DamagedRecordError", "PackedRows", "codec", "decode_rows", "encode_rows"]

#: Record kinds (the second number of a record's meta).
EMPTY, RAW, ZSTD, LZ4 = 0, 1, 2, 3
_KIND_NAMES = {EMPTY: "empty", RAW: "raw", ZSTD: "zstd", LZ4: "lz4"}
#: Codec name -> (record kind, the package it needs, default level, allowed levels).
CODECS: dict[str, tuple[int, str, int | None, range]] = {
    "zstd": (ZSTD, "zstandard", 3, range(1, 23)),
    "lz4": (LZ4, "lz4", None, range(1, 13)),
}
#: Columns of a record's meta: bytes stored, kind, CRC-32 of the stored bytes.
META_COLUMNS = 3


class DamagedRecordError(StorageError):
    """A stored record does not check (CRC) or does not decode: the file is damaged there."""


@dataclass(frozen=True, eq=False)
class PackedRows:
    """Records of rows of one compressed leaf, as stored: `blob` holds them one after another,
    `meta` ((*lead, 3) int64) each one's (bytes, kind, crc32). `shape` is the rows' leading shape."""

    blob: np.ndarray  # uint8, 1-d
    meta: np.ndarray  # int64, (*lead, META_COLUMNS)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.meta.shape[:-1])

    @property
    def ndim(self) -> int:
        return self.meta.ndim - 1

    def __len__(self) -> int:
        return int(self.meta.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.blob.nbytes + self.meta.nbytes)


def _missing(package: str, what: str, reading: bool = False) -> ConfigError:
    also = "; a learner may instead ask its server for raw rows: ClientConfig(raw_rows=True)" if reading else ""
    return ConfigError(f"{what} needs the '{package}' package, which this process lacks: "
                       f"pip install 'h5replay[compression]' (or pip install {package}){also}")


_local = threading.local()  # codec contexts are not safe to share between threads


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def _lz4_block() -> Any:
    try:
        import lz4.block
    except ImportError:
        return None
    return lz4.block


@dataclass(frozen=True)
class Codec:
    """One leaf's codec: `encode` a row's bytes (returns None when the record would not be smaller)."""

    name: str
    level: int | None
    kind: int

    def encode(self, data: memoryview) -> bytes | None:
        if self.kind == ZSTD:
            contexts = getattr(_local, "zstd_c", None)
            if contexts is None:
                contexts = _local.zstd_c = {}
            ctx = contexts.get(self.level)
            if ctx is None:
                ctx = contexts[self.level] = _zstd().ZstdCompressor(level=self.level, write_content_size=True)
            out: bytes = ctx.compress(data)
        elif self.level is None:
            out = _lz4_block().compress(data, store_size=False)
        else:
            out = _lz4_block().compress(data, mode="high_compression", compression=self.level, store_size=False)
        return out if len(out) < data.nbytes else None


def codec(name: Any, level: Any, where: str) -> Codec:
    """The codec `name` at `level` (None: its default) for the leaf at `where`.

    Raises:
        ConfigError: an unknown codec or level, or the codec's package is not installed.
    """
    if not isinstance(name, str) or name not in CODECS:
        raise ConfigError(f"compression for '{where}' must be one of {sorted(CODECS)} (or gzip, lzf for a growing "
                          f"storage), got {name!r}")
    kind, package, default, levels = CODECS[name]
    if level is not None and (isinstance(level, bool) or not isinstance(level, (int, np.integer))
                              or int(level) not in levels):
        raise ConfigError(f"{name} level for '{where}' must be an int in {levels.start}..{levels.stop - 1}"
                          f"{' or None (its fast mode)' if default is None else ''}, got {level!r}")
    if (_zstd() if kind == ZSTD else _lz4_block()) is None:
        raise _missing(package, f"compression {name!r} of leaf '{where}'")
    return Codec(name, default if level is None else int(level), kind)


def encode_rows(rows: np.ndarray, chosen: Codec) -> list[tuple[bytes | memoryview, int]]:
    """(record bytes, kind) of each row of `rows` ((n, *row_shape), C-contiguous): encoded, or the
    raw bytes where encoding saves nothing."""
    flat = np.ascontiguousarray(rows).reshape(rows.shape[0], -1).view(np.uint8)
    out: list[tuple[bytes | memoryview, int]] = []
    for i in range(flat.shape[0]):
        raw = flat[i].data
        encoded = chosen.encode(raw)
        out.append((raw, RAW) if encoded is None else (encoded, chosen.kind))
    return out


def _decoder(kind: int, where: str) -> Callable[[memoryview, int], bytes]:
    """A function that decodes one record of a row of `row_bytes` (refusing, before it allocates,
    a record that says it holds anything else) and returns the row's bytes."""
    if kind == ZSTD:
        zstandard = _zstd()
        if zstandard is None:
            raise _missing("zstandard", f"reading the zstd records of leaf '{where}'", reading=True)
        ctx = getattr(_local, "zstd_d", None)
        if ctx is None:
            ctx = _local.zstd_d = zstandard.ZstdDecompressor()
        content_size = zstandard.frame_content_size

        def zstd(data: memoryview, row_bytes: int) -> bytes:
            size = content_size(data)
            if size != row_bytes:  # a frame that claims more (or does not say): never allocated
                raise ValueError(f"its frame holds {size} bytes")
            out: bytes = ctx.decompress(data)
            return out
        return zstd
    if kind == LZ4:
        block = _lz4_block()
        if block is None:
            raise _missing("lz4", f"reading the lz4 records of leaf '{where}'", reading=True)

        def lz4(data: memoryview, row_bytes: int) -> bytes:
            out: bytes = block.decompress(data, uncompressed_size=row_bytes)
            return out
        return lz4
    raise DamagedRecordError(f"leaf '{where}': unknown record kind {kind}")


def decode_rows(packed: PackedRows, dtype: np.dtype[Any], row_shape: tuple[int, ...], where: str,
                row_ids: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """The rows of `packed`, decoded and checked: shape `packed.shape + row_shape`.

    Raises:
        DamagedRecordError: a record's CRC, size or kind is wrong, or it does not decode; the
            message names the leaf, the codec and the row (its id when `row_ids` is given).
        ConfigError: the codec's package is not installed here.
    """
    meta = packed.meta.reshape(-1, META_COLUMNS)
    sizes = meta[:, 0]
    blob = packed.blob
    if meta.shape[0] and (int(sizes.min()) < 0 or int(sizes.sum()) != blob.shape[0]):
        raise DamagedRecordError(f"leaf '{where}': records declare {int(sizes.sum())} bytes, the data has "
                                 f"{blob.shape[0]}")
    ends = np.cumsum(sizes).tolist()
    view = blob.data
    records = [view[end - size : end] for end, size in zip(ends, sizes.tolist())]
    return decode_records(records, meta, dtype, row_shape, where, row_ids).reshape(*packed.shape, *row_shape)


def decode_records(records: Sequence[Any], meta: np.ndarray, dtype: np.dtype[Any], row_shape: tuple[int, ...],
                   where: str, row_ids: Sequence[int] | np.ndarray | None = None) -> np.ndarray:
    """Rows (n, *row_shape) from `records` (n buffers, each exactly one record) and their meta
    ((n, 3): size, kind, crc32), each checked before it is decoded (see decode_rows)."""
    n = meta.shape[0]
    out = np.empty((n, *row_shape), dtype=dtype)  # every row is written below (an empty one with zeros)
    row_bytes = out[0].nbytes if n else 0
    target = out.reshape(n, -1).view(np.uint8) if row_bytes else out.reshape(n, 0).view(np.uint8)
    decoders: dict[int, Callable[[memoryview, int], bytes]] = {}
    crc32 = zlib.crc32
    for i, (size, kind, crc) in enumerate(meta.tolist()):
        if kind == EMPTY:
            target[i] = 0  # a row never written reads as zeros, as in an uncompressed leaf
            continue
        record = records[i]
        if crc32(record) != crc or len(record) != size:
            raise DamagedRecordError(f"leaf '{where}' ({_KIND_NAMES.get(kind, f'kind {kind}')}): the stored record "
                                     f"of {_row(i, row_ids)} is damaged (its CRC-32 does not match); it is not "
                                     "returned")
        if kind == RAW:
            if size != row_bytes:
                raise DamagedRecordError(f"leaf '{where}': the raw record of {_row(i, row_ids)} has {size} bytes, "
                                         f"not {row_bytes}")
            target[i] = np.frombuffer(record, np.uint8)
            continue
        decode = decoders.get(kind)
        if decode is None:
            decode = decoders[kind] = _decoder(kind, where)
        try:
            data = decode(record, row_bytes)
        except Exception as exc:  # each package raises its own error type
            raise DamagedRecordError(f"leaf '{where}' ({_KIND_NAMES[kind]}): the record of {_row(i, row_ids)} does "
                                     f"not decode: {exc}") from exc
        if len(data) != row_bytes:
            raise DamagedRecordError(f"leaf '{where}' ({_KIND_NAMES[kind]}): the record of {_row(i, row_ids)} does "
                                     f"not decode to a row of {row_bytes} bytes")
        target[i] = np.frombuffer(data, np.uint8)
    return out


def _row(i: int, row_ids: Sequence[int] | np.ndarray | None) -> str:
    return f"row {int(row_ids[i])}" if row_ids is not None else f"record {i}"


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data)
