"""Dataset layout rules: contiguous vs whole-row chunks, explicit chunks, per-leaf options.

Most tests call the pure `_layout` helpers; the last few create small files and read the layout
back from HDF5.
"""

from __future__ import annotations

from typing import Any

import h5py
import numpy as np
import pytest

from h5replay.errors import ConfigError
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, Space, TextSpace
from h5replay.storage._layout import (
    SWMR_CONTIGUOUS_CHUNK_BYTES,
    dataset_kwargs,
    resolve_option,
    whole_row_chunk_rows,
)
from h5replay.storage.indexing import CHUNK_TARGET_BYTES


def kwargs_for(
    row_shape: tuple[int, ...] = (7,),
    dtype: Any = np.float32,
    capacity: int | None = None,
    *,
    path: str = "data",
    initial_rows: int = 0,
    compression: Any = None,
    compression_level: Any = None,
    chunks: Any = None,
    multiprocessing: bool = False,
) -> dict[str, Any]:
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return dataset_kwargs(
        path, row_shape, row_bytes, capacity, initial_rows,
        compression=compression, compression_level=compression_level,
        chunks=chunks, multiprocessing=multiprocessing,
    )


def test_chunk_target_is_64_kib() -> None:
    assert CHUNK_TARGET_BYTES == 64 * 1024


# ---------------------------------------------------------------- whole-row chunks


@pytest.mark.parametrize(
    "row_shape, dtype, chunks",
    [
        ((7,), np.float32, (2340, 7)),
        ((84, 84, 3), np.uint8, (3, 84, 84, 3)),
        ((128, 128, 3), np.uint8, (1, 128, 128, 3)),
        ((256, 256, 3), np.uint8, (1, 256, 256, 3)),  # a row larger than the target: one row
        ((), np.bool_, (65536,)),
        ((2,), np.int64, (4096, 2)),
    ],
)
def test_unbounded_gets_whole_row_chunks(row_shape: tuple[int, ...], dtype: Any, chunks: tuple[int, ...]) -> None:
    kw = kwargs_for(row_shape, dtype, capacity=None, initial_rows=5)
    assert kw["chunks"] == chunks
    assert kw["shape"] == (5, *row_shape)
    assert kw["maxshape"] == (None, *row_shape)
    assert "compression" not in kw


def test_text_rows_are_sized_at_four_bytes_per_character() -> None:
    # The reference sizes Text(16) at 16 bytes -> (4096,); we store up to 4 UTF-8 bytes per character.
    leaf = TextSpace(16)
    kw = dataset_kwargs("t", leaf.shape, leaf.row_bytes, None, 0, compression=None,
                        compression_level=None, chunks=None, multiprocessing=False)
    assert kw["chunks"] == (1024,)


def test_chunks_true_is_clamped_to_the_capacity() -> None:
    kw = kwargs_for((4, 4), np.uint8, capacity=1000, chunks=True)
    assert kw["chunks"] == (1000, 4, 4)
    assert kw["shape"] == kw["maxshape"] == (1000, 4, 4)


def test_compression_on_a_fixed_capacity_chunks_whole_rows_clamped() -> None:
    kw = kwargs_for((7,), np.float32, capacity=100, compression="gzip")
    assert kw["chunks"] == (100, 7)
    assert kw["compression"] == "gzip" and "compression_opts" not in kw
    assert kw["shape"] == kw["maxshape"] == (100, 7)


def test_compression_level_becomes_compression_opts() -> None:
    kw = kwargs_for(capacity=100, compression="gzip", compression_level=7)
    assert kw["compression"] == "gzip" and kw["compression_opts"] == 7


@pytest.mark.parametrize(
    "row_bytes, capacity, rows",
    [
        (28, None, 2340),
        (1, None, 65536),
        (CHUNK_TARGET_BYTES, None, 1),
        (CHUNK_TARGET_BYTES + 1, None, 1),  # never less than one row
        (10**9, None, 1),
        (0, None, CHUNK_TARGET_BYTES),  # an empty row counts as one byte
        (1, 1000, 1000),  # clamped to the capacity
        (28, 10**6, 2340),  # a large capacity does not raise it
        (1, 1, 1),
        (1, 0, 1),
    ],
)
def test_whole_row_chunk_rows(row_bytes: int, capacity: int | None, rows: int) -> None:
    assert whole_row_chunk_rows(row_bytes, capacity) == rows


def test_zero_sized_row_dimension_lets_hdf5_guess() -> None:
    kw = kwargs_for((0, 3), np.float32, capacity=None)
    assert kw["chunks"] is True and kw["maxshape"] == (None, 0, 3)


# ---------------------------------------------------------------- contiguous


def test_fixed_capacity_without_compression_is_contiguous() -> None:
    kw = kwargs_for((84, 84, 3), np.uint8, capacity=50)
    assert kw == {"shape": (50, 84, 84, 3)}  # no chunks, no maxshape: h5py makes it contiguous


def test_chunks_false_on_a_fixed_capacity_is_contiguous() -> None:
    assert kwargs_for(capacity=10, chunks=False) == {"shape": (10, 7)}


@pytest.mark.parametrize(
    "options, reason",
    [
        ({"capacity": None}, "an unbounded storage needs chunks"),
        ({"capacity": 10, "compression": "gzip"}, "compression needs chunks"),
        ({"capacity": 10, "compression": "lzf"}, "compression needs chunks"),
        ({"capacity": 10, "multiprocessing": True}, "SWMR readers of HDF5 1.14.4"),
    ],
)
def test_chunks_false_where_impossible(options: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError, match=rf"chunks=False \(contiguous\) is impossible for 'obs/v': {reason}"):
        kwargs_for(path="obs/v", chunks=False, **options)


def test_multiprocessing_forces_chunks() -> None:
    # Where a plain file would be contiguous, chunks of about 1 MiB (the nearest SWMR allows).
    kw = kwargs_for((84, 84, 3), np.uint8, capacity=500, multiprocessing=True)
    assert kw["chunks"] == (49, 84, 84, 3) and kw["maxshape"] == (500, 84, 84, 3)
    assert SWMR_CONTIGUOUS_CHUNK_BYTES == 1 << 20 and 49 * 84 * 84 * 3 <= 1 << 20 < 50 * 84 * 84 * 3
    small = kwargs_for((7,), np.float32, capacity=50, multiprocessing=True)
    assert small["chunks"] == (50, 7)
    big_ring = kwargs_for((7,), np.float32, capacity=10**6, multiprocessing=True)
    assert big_ring["chunks"] == (37449, 7)
    # Elsewhere the design's 64 KiB: unbounded, chunks=True, or compressed (not SWMR-refused).
    unbounded = kwargs_for((7,), np.float32, capacity=None, multiprocessing=True)
    assert unbounded["chunks"] == (2340, 7)
    asked = kwargs_for((84, 84, 3), np.uint8, capacity=500, chunks=True, multiprocessing=True)
    assert asked["chunks"] == (3, 84, 84, 3)
    packed = kwargs_for((84, 84, 3), np.uint8, capacity=None, compression="gzip", multiprocessing=True)
    assert packed["chunks"] == (3, 84, 84, 3)


def test_unbounded_initial_rows_set_the_starting_length() -> None:
    assert kwargs_for(capacity=None, initial_rows=0)["shape"] == (0, 7)
    assert kwargs_for(capacity=None, initial_rows=123)["shape"] == (123, 7)
    assert kwargs_for(capacity=40, initial_rows=0)["shape"] == (40, 7)  # capacity wins


# ---------------------------------------------------------------- explicit chunks


@pytest.mark.parametrize(
    "row_shape, given, expected",
    [
        ((84, 84, 3), (1,), (1, 84, 84, 3)),
        ((4, 4), [3], (3, 4, 4)),  # a list works too
        ((4, 4), (3, 2, 2), (3, 2, 2)),  # a full tuple is kept
        ((4, 4), (3, 2), (3, 2, 4)),  # padded with the remaining row dimensions
        ((), (100,), (100,)),
        ((7,), np.array([5]), (5, 7)),
    ],
)
def test_explicit_chunks_are_padded_with_the_row_shape(
    row_shape: tuple[int, ...], given: Any, expected: tuple[int, ...]
) -> None:
    unbounded = kwargs_for(row_shape, np.uint8, capacity=None, chunks=given)
    assert unbounded["chunks"] == expected and unbounded["maxshape"] == (None, *row_shape)
    fixed = kwargs_for(row_shape, np.uint8, capacity=100, chunks=given)  # explicit beats contiguous
    assert fixed["chunks"] == expected and fixed["maxshape"] == (100, *row_shape)


@pytest.mark.parametrize(
    "given, capacity, match",
    [
        ((), None, r"chunks \(\) for 'obs/img' do not fit rows of shape \(4, 4\)"),
        ((0,), None, r"do not fit rows"),
        ((-1,), None, r"do not fit rows"),
        ((1, 1, 1, 1), None, r"chunks \(1, 1, 1, 1\) for 'obs/img' do not fit rows of shape \(4, 4\)"),
        ((1, 8), None, r"chunks \(1, 8, 4\) for 'obs/img' are larger than a row of shape \(4, 4\)"),
        ((1, 4, 5), 10, r"larger than a row"),
        ((11,), 10, r"chunks \(11, 4, 4\) for 'obs/img' hold more rows than the capacity 10"),
        ("abc", None, r"chunks for 'obs/img' must be None, True, False or a tuple, got 'abc'"),
        (5, None, r"must be None, True, False or a tuple, got 5"),
        (1.5, None, r"must be None, True, False or a tuple"),
        ((None,), None, r"must be None, True, False or a tuple"),
    ],
)
def test_explicit_chunk_errors(given: Any, capacity: int | None, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        kwargs_for((4, 4), np.uint8, capacity=capacity, path="obs/img", chunks=given)


# ---------------------------------------------------------------- per-leaf options


def test_resolve_option_plain_values_apply_everywhere() -> None:
    for value in (None, "gzip", 4, (1,), True, False):
        assert resolve_option(value, "obs/image") == value


@pytest.mark.parametrize(
    "option, path, expected",
    [
        ({"obs/image": "lzf", "*": "gzip"}, "obs/image", "lzf"),  # full leaf path
        ({"obs/image": "lzf", "*": "gzip"}, "obs/state", "gzip"),  # '*' for the rest
        ({"obs": "lzf", "*": "gzip"}, "obs/image", "lzf"),  # a top-level key covers its subtree
        ({"obs": "lzf", "obs/image": None}, "obs/image", None),  # most specific wins, even None
        ({"obs": "lzf", "obs/image": None}, "obs/state", "lzf"),
        ({"reward": "lzf"}, "obs/image", None),  # absent and no '*'
        ({"a": None, "*": "gzip"}, "a", None),  # an explicit None beats '*'
        ({"obs": {"image": "lzf", "*": "gzip"}}, "obs/image", "lzf"),  # nested mappings
        ({"obs": {"image": "lzf", "*": "gzip"}}, "obs/state", "gzip"),
        ({"obs": {"image": "lzf"}}, "obs/state", None),
        ({"a": {"b": {"c": 9}}}, "a/b/c", 9),
        ({"*": (1,)}, "data", (1,)),  # a bare leaf is stored as 'data'
        ({"data": 3}, "data", 3),
        ({"ob": "lzf"}, "obs/image", None),  # keys match whole path parts only
    ],
)
def test_resolve_option_mappings(option: dict[str, Any], path: str, expected: Any) -> None:
    assert resolve_option(option, path) == expected


def test_star_applies_to_compression_and_level_too() -> None:
    """The reference ignored '*' for compression and compression_level; we must not."""
    compression = {"img": "lzf", "*": "gzip"}
    img = kwargs_for((8, 8), np.uint8, capacity=10, path="img", compression=compression)
    vec = kwargs_for((7,), np.float32, capacity=10, path="vec", compression=compression)
    assert img["compression"] == "lzf" and "compression_opts" not in img
    assert vec["compression"] == "gzip"

    level = {"*": 9}
    gz = kwargs_for(capacity=10, path="vec", compression="gzip", compression_level=level)
    assert gz["compression_opts"] == 9


def test_per_leaf_levels_and_uncompressed_leaves() -> None:
    compression = {"obs/image": "gzip", "obs/depth": "gzip"}
    levels = {"obs/image": 1, "obs/depth": 9}
    image = kwargs_for((8, 8), np.uint8, 10, path="obs/image", compression=compression, compression_level=levels)
    depth = kwargs_for((8, 8), np.uint8, 10, path="obs/depth", compression=compression, compression_level=levels)
    state = kwargs_for((7,), np.float32, 10, path="obs/state", compression=compression, compression_level=levels)
    assert (image["compression"], image["compression_opts"]) == ("gzip", 1)
    assert (depth["compression"], depth["compression_opts"]) == ("gzip", 9)
    assert state == {"shape": (10, 7)}  # no compression, no chunks: contiguous


def test_chunks_mapping_with_star() -> None:
    chunks = {"obs/image": (1,), "*": True}
    image = kwargs_for((84, 84, 3), np.uint8, 100, path="obs/image", chunks=chunks)
    state = kwargs_for((7,), np.float32, 100, path="obs/state", chunks=chunks)
    assert image["chunks"] == (1, 84, 84, 3)
    assert state["chunks"] == (100, 7)
    contiguous = kwargs_for((7,), np.float32, 100, path="reward", chunks={"obs": True})
    assert contiguous == {"shape": (100, 7)}


@pytest.mark.parametrize(
    "compression, level, match",
    [
        (None, 4, r"compression_level for 'obs/v' is set but no compression is chosen for it"),
        ({"other": "gzip"}, 4, r"compression_level for 'obs/v' is set but no compression"),
        ({"obs/v": None, "*": "gzip"}, {"*": 4}, r"compression_level for 'obs/v' is set"),
        ("lzf", 4, r"lzf compression for 'obs/v' takes no level, got 4"),
        ("gzip", 10, r"gzip level for 'obs/v' must be an int in 0\.\.9, got 10"),
        ("gzip", -1, r"gzip level for 'obs/v' must be an int in 0\.\.9"),
        ("gzip", "high", r"gzip level for 'obs/v' must be an int in 0\.\.9, got 'high'"),
        ("bz2", None, r"compression for 'obs/v' must be one of \['lz4', 'zstd', 'gzip', 'lzf', 'szip'\] or None, got 'bz2'"),
        ("zstd", 0, r"zstd level for 'obs/v' must be an int in 1\.\.22, got 0"),
        ("zstd", "high", r"zstd level for 'obs/v' must be an int in 1\.\.22, got 'high'"),
        ("lz4", 13, r"lz4 level for 'obs/v' must be an int in 1\.\.12 or None \(its fast mode\), got 13"),
        ({"*": "bz2"}, None, r"compression for 'obs/v' must be one of"),
    ],
)
def test_compression_errors(compression: Any, level: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        kwargs_for(capacity=10, path="obs/v", compression=compression, compression_level=level)


# ---------------------------------------------------------------- real files


def create(tmp_path: Any, space: Space, capacity: int | None, **options: Any) -> Any:
    from h5replay.storage.hdf5 import HDF5Storage

    return HDF5Storage.create(space, capacity, tmp_path / "f.h5", **options)


def is_contiguous(ds: Any) -> bool:
    return bool(ds.id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS)


FILE_SPACE = DictSpace(
    {
        "obs": {"image": BoxSpace(0, 255, (84, 84, 3), np.uint8), "state": BoxSpace(-1, 1, (7,))},
        "done": BinarySpace(),
        "note": TextSpace(16),
    }
)


def test_file_fixed_capacity_is_contiguous(tmp_path: Any) -> None:
    with create(tmp_path, FILE_SPACE, 20) as storage:
        for path in ("obs/image", "obs/state", "done", "note"):
            ds = storage.dataset(path)
            assert is_contiguous(ds), path
            assert ds.chunks is None and ds.compression is None
            assert ds.shape[0] == 20 and ds.maxshape == ds.shape


def test_file_unbounded_whole_row_chunks(tmp_path: Any) -> None:
    with create(tmp_path, FILE_SPACE, None) as storage:
        assert storage.dataset("obs/image").chunks == (3, 84, 84, 3)
        assert storage.dataset("obs/state").chunks == (2340, 7)
        assert storage.dataset("done").chunks == (65536,)
        assert storage.dataset("note").chunks == (1024,)
        for path in ("obs/image", "obs/state", "done", "note"):
            ds = storage.dataset(path)
            assert not is_contiguous(ds) and ds.maxshape[0] is None and ds.shape[0] == 0


def test_file_compression_mappings_with_star(tmp_path: Any) -> None:
    with create(
        tmp_path, FILE_SPACE, 100,
        compression={"obs/image": "lzf", "*": "gzip"},
        compression_level={"obs/image": None, "*": 9},  # lzf takes no level
        chunks={"obs/image": (1,)},
    ) as storage:
        image = storage.dataset("obs/image")
        assert image.compression == "lzf" and image.chunks == (1, 84, 84, 3)
        state = storage.dataset("obs/state")
        assert state.compression == "gzip" and state.compression_opts == 9 and state.chunks == (100, 7)
        done = storage.dataset("done")
        assert done.compression == "gzip" and done.compression_opts == 9 and done.chunks == (100,)


def test_file_bare_leaf_is_data_and_explicit_chunks(tmp_path: Any) -> None:
    with create(tmp_path, BoxSpace(0, 1, (4, 4), np.uint8), 1000, chunks=True) as storage:
        ds = storage.dataset("data")
        assert ds.chunks == (1000, 4, 4) and ds.maxshape == (1000, 4, 4) and not is_contiguous(ds)


def test_file_multiprocessing_chunks_everything(tmp_path: Any) -> None:
    with create(tmp_path, FILE_SPACE, 20, multiprocessing=True) as storage:
        for path in ("obs/image", "obs/state", "done", "note"):
            ds = storage.dataset(path)
            assert not is_contiguous(ds) and ds.chunks is not None, path
            assert ds.maxshape == ds.shape
        assert storage.dataset("obs/state").chunks == (20, 7)


def test_file_invalid_layout_is_refused_before_creating(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"chunks=False \(contiguous\) is impossible for 'obs/image'"):
        create(tmp_path, FILE_SPACE, None, chunks={"obs/image": False})
    with pytest.raises(ConfigError, match=r"compression_level for 'done' is set but no compression"):
        create(tmp_path, FILE_SPACE, 10, compression={"obs": "gzip"}, compression_level={"*": 3})
    assert list(tmp_path.iterdir()) == []  # nothing left behind, not even a temporary file


def chunk_cache_bytes(ds: Any) -> int:
    return int(ds.id.get_access_plist().get_chunk_cache()[1])


def test_a_writer_holds_unfiltered_chunked_datasets_without_the_chunk_cache(tmp_path: Any) -> None:
    """Unfiltered chunks are written and read straight to and from their place in the file; a
    compressed one keeps HDF5's cache, and so does a file whose h5py options chose one."""
    from h5replay.storage.hdf5 import HDF5Storage

    rows = {"obs": {"image": np.full((5, 84, 84, 3), 7, np.uint8), "state": np.zeros((5, 7), np.float32)},
            "done": np.ones(5, bool), "note": np.array(["a"] * 5)}
    path = tmp_path / "f.h5"
    with HDF5Storage.create(FILE_SPACE, None, path, compression={"note": "gzip"}) as storage:
        for leaf in ("obs/image", "obs/state", "done"):
            assert chunk_cache_bytes(storage.dataset(leaf)) == 0, leaf
        assert chunk_cache_bytes(storage.dataset("note")) > 0
        writer = storage.open_segment_writer()
        writer.extend(rows)
        staging = storage._staging
        assert staging is not None and chunk_cache_bytes(staging.datasets["obs/image"]) == 0
        writer.commit(0)
    with HDF5Storage.load_from(path, FILE_SPACE, read_only=True) as reader:
        assert chunk_cache_bytes(reader.dataset("obs/image")) > 0  # readers are left as opened
        np.testing.assert_array_equal(reader.get(slice(0, 5))["obs"]["image"], rows["obs"]["image"])
    with HDF5Storage.load_from(path, FILE_SPACE, read_only=False, rdcc_nbytes=3 << 20) as chosen:
        assert chunk_cache_bytes(chosen.dataset("obs/image")) == 3 << 20


def test_a_dataset_given_as_the_root_stays_the_callers(tmp_path: Any) -> None:
    """A storage over a caller's own dataset handle neither closes nor replaces it."""
    from h5replay.storage.hdf5 import HDF5Storage

    with h5py.File(tmp_path / "raw.h5", "w") as f:
        ds = f.create_dataset("data", (10, 4), np.float32, maxshape=(None, 4), chunks=(2, 4))
        storage = HDF5Storage(BoxSpace(-1, 1, (4,), np.float32), ds, capacity=None)
        storage.set(slice(0, 2), np.full((2, 4), 0.5, np.float32))
        assert ds.id.valid and ds.shape == (10, 4)
        np.testing.assert_array_equal(ds[:2], np.full((2, 4), 0.5, np.float32))
