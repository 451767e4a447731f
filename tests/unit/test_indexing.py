"""h5replay.storage.indexing: index helpers, and row I/O compared with numpy on real files."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5replay.storage import _rowio
from h5replay.storage.indexing import (
    CHUNK_TARGET_BYTES,
    fancy_indexing_to_supported_indexing,
    fancy_indexing_to_supported_set_indexing,
    io_reduced_indexing,
    is_fancy_index,
    read_slice,
    read_sorted_unique_rows,
    write_rows,
    write_sorted_unique_rows,
)

# The module's `store` file serves every case: one xdist worker builds it once.
pytestmark = pytest.mark.xdist_group("test_indexing")

STRING = h5py.string_dtype("utf-8", length=8)

# (dtype name, row shape); every one is stored in each layout below.
KINDS: list[tuple[str, tuple[int, ...]]] = [
    ("float16", (7,)),
    ("float32", ()),
    ("float32", (7,)),
    ("float64", (7,)),
    ("int8", (7,)),
    ("int16", (7,)),
    ("int32", ()),
    ("int64", (7,)),
    ("uint8", (7,)),
    ("uint16", (7,)),
    ("uint32", (7,)),
    ("uint64", ()),
    ("complex64", (3,)),
    ("bool", ()),
    ("bool", (7,)),
    ("str8", ()),
    ("uint8", (84, 84, 3)),
    ("float32", (84, 84, 3)),
    ("bool", (84, 84, 3)),
]
LAYOUTS = ["contiguous", "chunked", "gzip", "lzf", "resizable", "subrow"]
NUM_ROWS = 60
NUM_IMAGE_ROWS = 14


def file_dtype(name: str) -> Any:
    return STRING if name == "str8" else np.dtype(name)


def make_rows(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random rows of every kind; strings are UTF-8 bytes (up to 8) in numpy S8."""
    if name == "str8":
        words = ["", "a", "é", "aé", "中文", "xyz", "🙂", "abcdefgh", "ü ß"]
        picked = rng.choice(len(words), size=shape)
        return np.array([words[i].encode() for i in picked.reshape(-1)], dtype="S8").reshape(shape)
    dtype = np.dtype(name)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def create(group: h5py.Group, key: str, name: str, row: tuple[int, ...], layout: str,
           data: np.ndarray) -> h5py.Dataset:
    """A dataset holding `data` in `layout`; data goes in raw (h5py cannot write S into UTF-8)."""
    n = data.shape[0]
    kw: dict[str, Any] = {}
    whole = (max(1, 4 if row == (84, 84, 3) else 16), *row)
    if layout == "chunked":
        kw["chunks"] = whole
    elif layout == "gzip":
        kw.update(chunks=whole, compression="gzip")
    elif layout == "lzf":
        kw.update(chunks=whole, compression="lzf")
    elif layout == "resizable":
        kw.update(chunks=whole, maxshape=(None, *row))
    elif layout == "subrow":
        kw["chunks"] = (5, *[max(1, d // 2) for d in row])
    ds = group.create_dataset(key, shape=(n, *row), dtype=file_dtype(name), **kw)
    ds.id.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(data), mtype=ds.id.get_type())
    return ds


CASES = [(name, row, layout) for name, row in KINDS for layout in LAYOUTS]


def case_id(case: tuple[str, tuple[int, ...], str]) -> str:
    name, row, layout = case
    return f"{name}-{'x'.join(map(str, row)) or 'scalar'}-{layout}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[h5py.Dataset, np.ndarray]]]:
    """One file with a dataset per case, and the numpy copy of its data."""
    path = tmp_path_factory.mktemp("indexing") / "cases.h5"
    rng = np.random.default_rng(7)
    with h5py.File(path, "w", libver="latest") as f:
        out: dict[str, tuple[h5py.Dataset, np.ndarray]] = {}
        for case in CASES:
            name, row, layout = case
            n = NUM_IMAGE_ROWS if row == (84, 84, 3) else NUM_ROWS
            data = make_rows(name, (n, *row), rng)
            out[case_id(case)] = (create(f, case_id(case), name, row, layout, data), data)
        yield out


@pytest.fixture
def h5(tmp_path: Path) -> Iterator[h5py.File]:
    with h5py.File(tmp_path / "t.h5", "w", libver="latest") as f:
        yield f


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal shape, dtype and bytes (so NaN and -0.0 compare as stored)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ---- index helpers ---------------------------------------------------------------------------


def test_chunk_target_is_64_kib() -> None:
    assert CHUNK_TARGET_BYTES == 65536


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (np.array([1, 2]), True),
        (np.array([3]), True),  # unlike the reference, shape (1,) is fancy too
        (np.array([], dtype=np.int64), True),
        (np.array([[1, 2], [3, 4]]), True),
        (np.array([1, 2], dtype=np.uint8), True),
        (np.array(3), False),
        (3, False),
        (np.int64(3), False),
        (slice(0, 2), False),
        ([1, 2], False),
        ((1, 2), False),
        (np.array([True, False]), False),
        (np.array([1.0, 2.0]), False),
        (Ellipsis, False),
    ],
)
def test_is_fancy_index(index: Any, expected: bool) -> None:
    assert is_fancy_index(index) is expected


def test_supported_indexing_example() -> None:
    unique, inverse = fancy_indexing_to_supported_indexing(np.array([5, 1, 5, 9, 0]))
    assert unique.tolist() == [0, 1, 5, 9]
    assert inverse.tolist() == [2, 1, 2, 3, 0]


def test_supported_indexing_keeps_shape_and_negatives() -> None:
    index = np.array([[4, -1], [3, 4]])
    unique, inverse = fancy_indexing_to_supported_indexing(index)
    assert unique.tolist() == [-1, 3, 4]
    assert inverse.shape == (2, 2)
    assert (unique[inverse] == index).all()


@given(st.lists(st.integers(0, 40), max_size=60))
def test_supported_indexing_roundtrip(values: list[int]) -> None:
    index = np.array(values, dtype=np.int64)
    unique, inverse = fancy_indexing_to_supported_indexing(index)
    assert (np.diff(unique) > 0).all()
    assert (unique[inverse] == index).all()


def test_set_indexing_example_keeps_last_occurrence() -> None:
    unique, positions = fancy_indexing_to_supported_set_indexing(np.array([5, 1, 5, 9, 0]))
    assert unique.tolist() == [0, 1, 5, 9]
    assert positions.tolist() == [4, 1, 2, 3]


def test_set_indexing_empty() -> None:
    unique, positions = fancy_indexing_to_supported_set_indexing(np.array([], dtype=np.int64))
    assert unique.size == 0 and positions.size == 0


@given(st.lists(st.integers(0, 20), max_size=50))
def test_set_indexing_matches_numpy_assignment(values: list[int]) -> None:
    index = np.array(values, dtype=np.int64).reshape(-1)
    value = np.arange(index.size) + 100
    expected = np.zeros(21, dtype=np.int64)
    for i, v in zip(index.tolist(), value.tolist(), strict=True):  # numpy's rule, spelled out: last wins
        expected[i] = v
    got = np.zeros(21, dtype=np.int64)
    unique, positions = fancy_indexing_to_supported_set_indexing(index)
    got[unique] = value[positions]
    assert (got == expected).all()


def test_set_indexing_flattens_nd() -> None:
    unique, positions = fancy_indexing_to_supported_set_indexing(np.array([[2, 1], [2, 0]]))
    assert unique.tolist() == [0, 1, 2]
    assert positions.tolist() == [3, 1, 2]


@pytest.mark.parametrize(
    ("index", "kwargs", "expected"),
    [
        ([0, 2, 4, 5, 6, 20, 40, 41, 100], {},
         [slice(0, 6, 2), slice(5, 7, 1), 20, slice(40, 42, 1), 100]),
        ([0, 9, 18, 27], {}, [np.array([0, 9, 18, 27])]),
        ([0, 8, 16, 17], {}, [slice(0, 24, 8), 17]),
        ([5], {}, [5]),
        ([0, 1, 2], {"max_gap_size": 0}, [np.array([0, 1, 2])]),
        ([], {}, []),
        ([0, 20, 40, 41], {}, [np.array([0, 20]), slice(40, 42, 1)]),
    ],
)
def test_io_reduced_indexing_examples(index: list[int], kwargs: dict[str, int], expected: list[Any]) -> None:
    got = io_reduced_indexing(np.array(index, dtype=np.int64), **kwargs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        if isinstance(e, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == np.int64 and g.tolist() == e.tolist()
        else:
            assert type(g) is type(e) and g == e


def test_io_reduced_indexing_keeps_dtype() -> None:
    got = io_reduced_indexing(np.array([0, 50, 100], dtype=np.uint32))
    assert isinstance(got[0], np.ndarray) and got[0].dtype == np.uint32


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (np.array([[0, 1]]), "1-D"),
        (np.array([1, 1]), "strictly increasing"),
        (np.array([3, 2]), "strictly increasing"),
        (np.array([0, 5, 4, 9]), r"index\[1\]=5"),
    ],
)
def test_io_reduced_indexing_errors(index: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        io_reduced_indexing(index)


@given(st.sets(st.integers(0, 300), max_size=80), st.integers(0, 10))
def test_io_reduced_indexing_covers_index(values: set[int], gap: int) -> None:
    index = np.array(sorted(values), dtype=np.int64)
    pieces = io_reduced_indexing(index, max_gap_size=gap)
    expanded: list[int] = []
    for piece in pieces:
        if isinstance(piece, slice):
            span = list(range(piece.start, piece.stop, piece.step))
            assert len(span) >= 2 and 1 <= piece.step <= gap
            expanded += span
        elif isinstance(piece, np.ndarray):
            assert piece.size >= 2
            expanded += piece.tolist()
        else:
            assert isinstance(piece, int)
            expanded.append(piece)
    assert expanded == index.tolist()


# ---- reads against numpy, every kind and layout -----------------------------------------------


@pytest.mark.parametrize("method", ["auto", "span", "points", "runs", "union"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_read_sorted_unique_rows_matches_numpy(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]],
    case: tuple[str, tuple[int, ...], str],
    method: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ds, data = store[case_id(case)]
    if method == "union" and data.dtype.kind not in "biuf":
        pytest.skip("the union read is only chosen for numbers and bools")
    if method != "auto":
        monkeypatch.setattr(_rowio._RowIO, "choose", lambda self, n, runs, span: method)
    n = len(data)
    for index in ([0, 2, 3, 4, n - 1], [1], list(range(5, 12)), [0, n // 2, n - 2],
                  list(range(0, n, 3))):
        rows = np.array(index, dtype=np.int64)
        got = read_sorted_unique_rows(ds, rows)
        assert same(got, data[rows]), (case, method, index)
        assert got.dtype == data.dtype  # S8 for strings, bool for bools


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_read_slice_matches_numpy(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]], case: tuple[str, tuple[int, ...], str]
) -> None:
    ds, data = store[case_id(case)]
    n = len(data)
    for start, stop in ((0, n), (3, 9), (n - 1, n), (4, 4), (0, 0), (n, n)):
        assert same(read_slice(ds, start, stop), data[start:stop])


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), picks=st.sets(st.integers(0, NUM_ROWS - 1), max_size=NUM_ROWS))
def test_read_sorted_unique_rows_property(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]],
    case: tuple[str, tuple[int, ...], str],
    picks: set[int],
) -> None:
    ds, data = store[case_id(case)]
    rows = np.array(sorted(p for p in picks if p < len(data)), dtype=np.int64)
    assert same(read_sorted_unique_rows(ds, rows), data[rows])


def test_read_into_out(store: dict[str, tuple[h5py.Dataset, np.ndarray]]) -> None:
    ds, data = store["float32-7-chunked"]
    rows = np.array([1, 5, 6, 30])
    out = np.empty((4, 7), dtype=np.float32)
    assert read_sorted_unique_rows(ds, rows, out=out) is out
    assert same(out, data[rows])
    out = np.empty((3, 7), dtype=np.float32)
    assert read_slice(ds, 2, 5, out=out) is out
    assert same(out, data[2:5])


def test_read_empty_index(store: dict[str, tuple[h5py.Dataset, np.ndarray]]) -> None:
    ds, data = store["uint8-84x84x3-chunked"]
    for empty in (np.array([], dtype=np.int64), np.array([], dtype=np.uint32), np.array([])):
        got = read_sorted_unique_rows(ds, empty)
        assert got.shape == (0, 84, 84, 3) and got.dtype == np.uint8
    ds, _ = store["str8-scalar-contiguous"]
    assert read_sorted_unique_rows(ds, []).dtype == np.dtype("S8")


def test_read_unsigned_and_list_indices(store: dict[str, tuple[h5py.Dataset, np.ndarray]]) -> None:
    ds, data = store["int64-7-contiguous"]
    assert same(read_sorted_unique_rows(ds, np.array([2, 9], dtype=np.uint16)), data[[2, 9]])
    assert same(read_sorted_unique_rows(ds, [2, 9]), data[[2, 9]])


def test_variable_length_strings_fall_back_to_h5py(h5: h5py.File) -> None:
    ds = h5.create_dataset("v", shape=(5,), dtype=h5py.string_dtype())
    ds[...] = ["a", "bb", "", "dddd", "é"]
    expected = ds[...]
    assert read_sorted_unique_rows(ds, np.array([0, 3, 4])).tolist() == expected[[0, 3, 4]].tolist()
    assert read_sorted_unique_rows(ds, np.array([1, 2])).tolist() == expected[1:3].tolist()
    assert read_slice(ds, 1, 4).tolist() == expected[1:4].tolist()
    assert write_rows(ds, 0, np.array(["x"], dtype=object)) is False
    write_sorted_unique_rows(ds, np.array([0, 2]), ["x", "yy"])
    assert ds.asstr()[...].tolist() == ["x", "bb", "yy", "dddd", "é"]


def test_point_reads_split_into_bounded_selections(
    h5: h5py.File, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = np.arange(400 * 7, dtype=np.float32).reshape(400, 7)
    ds = h5.create_dataset("d", data=data)
    monkeypatch.setattr(_rowio, "_MAX_POINTS_PER_READ", 20)  # 2 rows of 7 per selection
    monkeypatch.setattr(_rowio._RowIO, "choose", lambda self, n, runs, span: "points")
    rows = np.arange(0, 400, 9)
    assert same(read_sorted_unique_rows(ds, rows), data[rows])


def test_strategy_choice_follows_the_measurements(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]],
) -> None:
    small = _rowio._row_io(store["float32-7-contiguous"][0])
    image = _rowio._row_io(store["uint8-84x84x3-contiguous"][0])
    image_chunked = _rowio._row_io(store["uint8-84x84x3-chunked"][0])
    # 256 scattered rows of 1M: small rows use one point selection, images one read per run.
    assert small.choose(256, 256, 1_000_000) == "points"
    assert image.choose(256, 256, 20_000) == "runs"
    assert image_chunked.choose(256, 256, 20_000) == "runs"
    # Dense requests read the bounding slice once.
    assert small.choose(256, 200, 600) == "span"


# ---- read errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("index", "error", "message"),
    [
        (np.array([1.0, 2.0]), TypeError, "integer array, got dtype float64"),
        (np.array([True, False]), TypeError, "dtype bool"),
        (np.array([[1, 2]]), ValueError, r"1-D, got shape \(1, 2\)"),
        (np.array([3, 1]), ValueError, r"index\[0\]=3 is followed by 1"),
        (np.array([1, 1]), ValueError, "strictly increasing"),
        (np.array([-2, -1]), IndexError, "row -2 is negative"),
        (np.array([0, 60]), IndexError, "row 60 is out of range for a dataset of 60 rows"),
        (np.array([2**63 + 5], dtype=np.uint64), IndexError, "out of range"),
    ],
)
def test_read_rejects_bad_index(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]], index: np.ndarray, error: type[Exception],
    message: str,
) -> None:
    ds, _ = store["float32-7-contiguous"]
    with pytest.raises(error, match=message):
        read_sorted_unique_rows(ds, index)
    with pytest.raises(error, match=message):
        write_sorted_unique_rows(ds, index, np.zeros((index.reshape(-1).size, 7), np.float32))


@pytest.mark.parametrize(
    ("out", "error", "message"),
    [
        (np.empty((3, 7), np.float32), ValueError, r"shape \(3, 7\), expected \(2, 7\)"),
        (np.empty((2, 7), np.float64), TypeError, "dtype float64"),
        (np.empty((7, 2), np.float32).T, ValueError, "C-contiguous"),
        ([[0.0] * 7] * 2, TypeError, "numpy array"),
    ],
)
def test_read_rejects_bad_out(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]], out: Any, error: type[Exception], message: str
) -> None:
    ds, _ = store["float32-7-contiguous"]
    with pytest.raises(error, match=message):
        read_sorted_unique_rows(ds, np.array([1, 4]), out=out)
    with pytest.raises(error, match=message):
        read_slice(ds, 1, 3, out=out)


@pytest.mark.parametrize(
    ("start", "stop", "error", "message"),
    [
        (-1, 2, IndexError, r"rows \[-1, 2\) are out of range for a dataset of 60 rows"),
        (5, 3, IndexError, "out of range"),
        (0, 61, IndexError, "out of range"),
        (1.0, 2, TypeError, "start must be an integer row number, got 1.0"),
        (0, "2", TypeError, "stop must be an integer"),
        (True, 2, TypeError, "start must be an integer"),
    ],
)
def test_read_slice_errors(
    store: dict[str, tuple[h5py.Dataset, np.ndarray]], start: Any, stop: Any,
    error: type[Exception], message: str,
) -> None:
    ds, _ = store["float32-7-contiguous"]
    with pytest.raises(error, match=message):
        read_slice(ds, start, stop)


def test_rejects_non_datasets_and_scalar_datasets(h5: h5py.File) -> None:
    with pytest.raises(TypeError, match="expected an h5py.Dataset, got ndarray"):
        read_slice(np.zeros(3), 0, 1)  # type: ignore[arg-type]
    scalar = h5.create_dataset("s", data=3.0)
    with pytest.raises(TypeError, match="at least one axis"):
        read_sorted_unique_rows(scalar, np.array([0]))


# ---- writes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_write_sorted_unique_rows_matches_numpy(
    tmp_path: Path, case: tuple[str, tuple[int, ...], str]
) -> None:
    name, row, layout = case
    rng = np.random.default_rng(11)
    n = NUM_IMAGE_ROWS if row == (84, 84, 3) else 30
    data = make_rows(name, (n, *row), rng)
    with h5py.File(tmp_path / "w.h5", "w", libver="latest") as f:
        ds = create(f, "d", name, row, layout, data)
        expected = data.copy()
        for index in ([0, 1, 2, 7, n - 1], [4], [3, 5, 6, 9]):
            rows = np.array(index)
            value = make_rows(name, (rows.size, *row), rng)
            write_sorted_unique_rows(ds, rows, value)
            expected[rows] = value
            assert same(read_slice(ds, 0, n), expected)
        value = make_rows(name, (3, *row), rng)
        assert write_rows(ds, n - 3, value) is True
        expected[n - 3 :] = value
        assert same(read_slice(ds, 0, n), expected)
        # Independent check through h5py's own reader.
        assert same(np.asarray(ds[...]).astype(expected.dtype), expected)


@settings(max_examples=40, deadline=None)
@given(
    case=st.sampled_from([c for c in CASES if c[2] in ("contiguous", "resizable", "gzip")]),
    picks=st.sets(st.integers(0, 19), max_size=20),
    seed=st.integers(0, 2**32 - 1),
)
def test_write_sorted_unique_rows_property(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[str, tuple[int, ...], str],
    picks: set[int],
    seed: int,
) -> None:
    name, row, layout = case
    rng = np.random.default_rng(seed)
    n = NUM_IMAGE_ROWS if row == (84, 84, 3) else 20
    data = make_rows(name, (n, *row), rng)
    rows = np.array(sorted(p for p in picks if p < n), dtype=np.int64)
    value = make_rows(name, (rows.size, *row), rng)
    path = tmp_path_factory.mktemp("prop") / "p.h5"
    with h5py.File(path, "w") as f:
        ds = create(f, "d", name, row, layout, data)
        write_sorted_unique_rows(ds, rows, value)
        data[rows] = value
        assert same(read_slice(ds, 0, n), data)


def test_write_rows_fast_path_rules(h5: h5py.File) -> None:
    ds = h5.create_dataset("d", shape=(10, 3), dtype=np.float32)
    base = np.arange(30, dtype=np.float32).reshape(10, 3)
    ds[...] = base

    def unchanged() -> bool:
        return same(ds[...], base)

    # Refused: nothing written.
    assert write_rows(ds, 0, np.ones((2, 3), np.float64)) is False  # float64 -> float32 unsafe
    assert write_rows(ds, 0, np.ones((2, 4), np.float32)) is False  # row shape
    assert write_rows(ds, 0, np.ones(3, np.float32)) is False  # not a batch of rows
    assert write_rows(ds, 0, np.ones((0, 3), np.float32)) is False  # n = 0
    assert write_rows(ds, 0, np.ones((2, 3), np.float32), num_rows=3) is False
    assert write_rows(ds, -1, np.ones((2, 3), np.float32)) is False
    assert write_rows(ds, 9, np.ones((2, 3), np.float32)) is False  # past the end
    assert write_rows(ds, 0, [[1.0, 2.0, 3.0]]) is False  # not an array
    assert write_rows(ds, 0, np.ma.masked_array(np.ones((1, 3), np.float32))) is False
    assert unchanged()
    with pytest.raises(TypeError, match="start must be an integer"):
        write_rows(ds, 1.5, np.ones((1, 3), np.float32))
    # Accepted.
    assert write_rows(ds, 8, np.full((2, 3), 7, np.int16)) is True  # safe cast
    base[8:] = 7
    assert write_rows(ds, np.int64(0), np.ones((1, 3), np.float32), num_rows=1) is True
    base[0] = 1
    view = np.arange(12, dtype=np.float32).reshape(3, 4)[:, :3]  # not contiguous
    assert write_rows(ds, 4, view) is True
    base[4:7] = view
    assert unchanged()


def test_write_rows_strings_raw_utf8(h5: h5py.File) -> None:
    ds = h5.create_dataset("s", shape=(4,), dtype=STRING)
    assert write_rows(ds, 0, np.array(["aé".encode(), "中文".encode()], dtype="S8")) is True
    assert write_rows(ds, 2, np.array([b"ab"], dtype="S2")) is True  # S2 -> S8 is a safe cast
    assert write_rows(ds, 3, np.array(["u"])) is False  # numpy U is not bytes
    assert write_rows(ds, 3, np.array([b"123456789"])) is False  # S9 does not fit in S8
    assert ds.asstr()[:3].tolist() == ["aé", "中文", "ab"]
    assert read_slice(ds, 0, 3).tolist() == ["aé".encode(), "中文".encode(), b"ab"]
    assert read_slice(ds, 0, 3).dtype == np.dtype("S8")


def test_write_rows_bools(h5: h5py.File) -> None:
    ds = h5.create_dataset("b", shape=(4, 2), dtype=bool)
    assert write_rows(ds, 1, np.array([[True, False], [False, True]])) is True
    assert write_rows(ds, 0, np.array([[1, 0]], dtype=np.int8)) is False  # int8 -> bool unsafe
    assert ds[...].tolist() == [[False, False], [True, False], [False, True], [False, False]]
    assert read_sorted_unique_rows(ds, np.array([1, 2])).dtype == np.bool_


def test_write_sorted_unique_rows_broadcasts_and_falls_back(h5: h5py.File) -> None:
    ds = h5.create_dataset("d", shape=(8, 2), dtype=np.float32)
    write_sorted_unique_rows(ds, np.array([1, 2, 5]), np.array([3.0, 4.0], np.float32))
    write_sorted_unique_rows(ds, np.array([6]), 9.0)  # a Python scalar broadcasts
    # float64 is not a safe cast: h5py's slice assignment converts instead.
    write_sorted_unique_rows(ds, np.array([0, 7]), np.array([[0.5, 1.5], [2.5, 1e40]]))
    got = ds[...]
    assert got[[1, 2, 5]].tolist() == [[3.0, 4.0]] * 3
    assert got[6].tolist() == [9.0, 9.0]
    assert got[0].tolist() == [0.5, 1.5] and got[7, 0] == 2.5 and np.isinf(got[7, 1])
    write_sorted_unique_rows(ds, np.array([], dtype=np.int64), np.zeros((0, 2)))


def test_write_sorted_unique_rows_rejects_misfit_value(h5: h5py.File) -> None:
    ds = h5.create_dataset("d", shape=(8, 2), dtype=np.float32)
    with pytest.raises(ValueError, match=r"shape \(3, 2\) cannot be written to 2 rows of shape \(2,\)"):
        write_sorted_unique_rows(ds, np.array([1, 2]), np.zeros((3, 2), np.float32))


def test_writes_and_reads_follow_resizes(h5: h5py.File) -> None:
    ds = h5.create_dataset("d", shape=(0, 3), maxshape=(None, 3), chunks=(4, 3), dtype=np.int32)
    expected = np.zeros((0, 3), np.int32)
    for step in range(5):
        block = np.full((3, 3), step, np.int32)
        ds.resize(len(ds) + 3, axis=0)
        assert write_rows(ds, len(ds) - 3, block) is True
        expected = np.concatenate([expected, block])
        assert same(read_slice(ds, 0, len(ds)), expected)
        rows = np.arange(0, len(ds), 2)
        assert same(read_sorted_unique_rows(ds, rows), expected[rows])
    with pytest.raises(IndexError, match="out of range"):
        read_slice(ds, 0, len(ds) + 1)


def test_swmr_writer_and_reader(tmp_path: Path) -> None:
    path = tmp_path / "swmr.h5"
    with h5py.File(path, "w", libver="latest") as w:
        ds = w.create_dataset("d", shape=(0, 7), maxshape=(None, 7), chunks=(16, 7), dtype=np.float32)
        w.swmr_mode = True
        data = np.arange(40 * 7, dtype=np.float32).reshape(40, 7)
        ds.resize(40, axis=0)
        assert write_rows(ds, 0, data) is True
        w.flush()
        with h5py.File(path, "r", swmr=True) as r:
            rds = r["d"]
            rows = np.array([0, 3, 17, 39])
            assert same(read_sorted_unique_rows(rds, rows), data[rows])
            assert same(read_slice(rds, 10, 20), data[10:20])


def test_cache_is_per_dataset_object(h5: h5py.File) -> None:
    data = np.arange(10, dtype=np.int16)
    h5.create_dataset("d", data=data)
    for _ in range(3):  # a fresh Dataset (and DatasetID) each time
        assert same(read_slice(h5["d"], 2, 5), data[2:5])
    gc.collect()
    live = [ref() for ref, _ in _rowio._ROW_IO.values()]
    assert all(x is not None for x in live)  # entries of dead ids were dropped


@settings(max_examples=40, deadline=None)
@given(slots=st.dictionaries(st.integers(0, 39), st.integers(-(2**40), 2**40), max_size=25))
def test_write_slots_writes_each_row_to_its_slot_in_runs(tmp_path_factory: Any, slots: dict[int, int]) -> None:
    """The records of a group commit, written at its publish: every slot gets its row, whatever
    the order the dict holds them in and the gaps between runs; other slots are untouched."""
    path = tmp_path_factory.mktemp("slots") / "s.h5"
    with h5py.File(path, "w", libver="latest") as f:
        ds = f.create_dataset("t", shape=(40, 2), maxshape=(None, 2), chunks=(8, 2), dtype=np.int64)
        ds[...] = -1
        rows = {slot: np.array([[value, slot]], np.int64) for slot, value in slots.items()}
        calls: list[int] = []
        original = _rowio._RowIO.write_rows

        def counting(self: Any, *args: Any, **kwargs: Any) -> bool:
            calls.append(args[2])
            return original(self, *args, **kwargs)

        _rowio._RowIO.write_rows = counting  # type: ignore[method-assign]
        try:
            _rowio.write_slots(ds, rows, (40, 2))
        finally:
            _rowio._RowIO.write_rows = original  # type: ignore[method-assign]
        expected = np.full((40, 2), -1, np.int64)
        for slot, value in slots.items():
            expected[slot] = (value, slot)
        assert np.array_equal(ds[...], expected)
        runs = sum(1 for s in sorted(slots) if s - 1 not in slots)
        assert len(calls) == runs  # one write per run of consecutive slots
