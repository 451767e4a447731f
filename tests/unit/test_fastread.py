"""h5replay.storage.fastread.MappedRows: map-gathered rows compared with numpy on real files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5replay.errors import ClosedError
from h5replay.storage import fastread
from h5replay.storage.fastread import MappedRows

# The module's `store` file serves every case: one xdist worker builds it once.
pytestmark = pytest.mark.xdist_group("test_fastread")

STRING = h5py.string_dtype("utf-8", length=8)

KINDS: list[tuple[str, tuple[int, ...]]] = [
    ("float16", (7,)),
    ("float32", ()),
    ("float32", (7,)),
    ("float64", (7,)),
    ("int8", (7,)),
    ("int16", ()),
    ("int32", (7,)),
    ("int64", (7,)),
    ("uint8", (7,)),
    ("uint16", (7,)),
    ("uint32", ()),
    ("uint64", (7,)),
    ("complex64", (3,)),
    ("bool", ()),
    ("bool", (7,)),
    ("str8", ()),
    ("uint8", (84, 84, 3)),
    ("float32", (84, 84, 3)),
]
LAYOUTS = ["contiguous", "chunked", "resizable"]
NUM_ROWS = 50
NUM_IMAGE_ROWS = 10


def make_rows(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name == "str8":
        words = ["", "a", "é", "aé", "中文", "xyz", "🙂", "abcdefgh"]
        picked = rng.choice(len(words), size=shape).reshape(-1)
        return np.array([words[i].encode() for i in picked], dtype="S8").reshape(shape)
    dtype = np.dtype(name)
    if dtype.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return (rng.standard_normal(shape) * 100).astype(dtype)


def write_raw(ds: h5py.Dataset, data: np.ndarray, start: int = 0) -> None:
    """Write rows as raw bytes (h5py's own assignment cannot write S8 into UTF-8 strings)."""
    fspace = ds.id.get_space()
    fspace.select_hyperslab((start, *[0] * (ds.ndim - 1)), data.shape)
    mspace = h5py.h5s.create_simple(data.shape)
    ds.id.write(mspace, fspace, np.ascontiguousarray(data), mtype=ds.id.get_type())


def create(f: h5py.File, key: str, name: str, row: tuple[int, ...], layout: str,
           data: np.ndarray) -> h5py.Dataset:
    chunk_rows = 3 if row == (84, 84, 3) else 8
    kw: dict[str, Any] = {}
    if layout == "chunked":
        kw["chunks"] = (chunk_rows, *row)
    elif layout == "resizable":
        kw.update(chunks=(chunk_rows, *row), maxshape=(None, *row))
    dtype = STRING if name == "str8" else np.dtype(name)
    ds = f.create_dataset(key, shape=data.shape, dtype=dtype, **kw)
    write_raw(ds, data)
    return ds


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


CASES = [(name, row, layout) for name, row in KINDS for layout in LAYOUTS]


def case_id(case: tuple[str, tuple[int, ...], str]) -> str:
    name, row, layout = case
    return f"{name}-{'x'.join(map(str, row)) or 'scalar'}-{layout}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[MappedRows, np.ndarray]]]:
    """One flushed file with a dataset per case; other datasets' chunks interleave with each one's."""
    path = tmp_path_factory.mktemp("fastread") / "cases.h5"
    rng = np.random.default_rng(5)
    with h5py.File(path, "w", libver="latest") as f:
        datasets = {}
        for case in CASES:
            name, row, layout = case
            n = NUM_IMAGE_ROWS if row == (84, 84, 3) else NUM_ROWS
            datasets[case_id(case)] = (create(f, case_id(case), name, row, layout,
                                              make_rows(name, (n, *row), rng)), None)
        f.flush()
        maps = {}
        for key, (ds, _) in datasets.items():
            mapped = MappedRows.open(ds)
            assert mapped is not None, key
            maps[key] = (mapped, np.asarray(ds[...]))
        yield maps
        for mapped, _ in maps.values():
            mapped.close()


@pytest.fixture
def h5(tmp_path: Path) -> Iterator[h5py.File]:
    with h5py.File(tmp_path / "t.h5", "w", libver="latest") as f:
        yield f


# ---- reads against numpy ---------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_read_matches_numpy(
    store: dict[str, tuple[MappedRows, np.ndarray]], case: tuple[str, tuple[int, ...], str]
) -> None:
    mapped, data = store[case_id(case)]
    n = len(data)
    for index in ([0], [n - 1, 0, n - 1, 3], list(range(n)), [5, 5, 5], [n // 2, 1, n - 2, 2]):
        rows = np.array(index, dtype=np.int64)
        got = mapped.read(rows)
        assert got is not None
        assert same(got, data[rows]), (case, index)
        assert got.flags.writeable  # an owned copy: a view of the read-only map would not be
    assert mapped.dtype == data.dtype


@settings(max_examples=80, deadline=None)
@given(
    case=st.sampled_from(CASES),
    picks=st.lists(st.integers(0, NUM_ROWS - 1), max_size=80),
    dtype=st.sampled_from([np.int64, np.int32, np.uint32, np.uint64, np.intp]),
)
def test_read_property(
    store: dict[str, tuple[MappedRows, np.ndarray]],
    case: tuple[str, tuple[int, ...], str],
    picks: list[int],
    dtype: Any,
) -> None:
    mapped, data = store[case_id(case)]
    rows = np.array([p % len(data) for p in picks], dtype=dtype)
    got = mapped.read(rows)
    assert got is not None and same(got, data[rows])


def test_read_keeps_index_shape_and_fills_out(store: dict[str, tuple[MappedRows, np.ndarray]]) -> None:
    for key in ("float32-7-contiguous", "float32-7-chunked", "uint8-84x84x3-chunked"):
        mapped, data = store[key]
        rows = np.array([[3, 1], [1, 4], [0, 2]])
        got = mapped.read(rows)
        assert got is not None and same(got, data[rows])
        out = np.empty((3, 2, *data.shape[1:]), dtype=data.dtype)
        assert mapped.read(rows, out=out) is out
        assert same(out, data[rows])


def test_read_empty(store: dict[str, tuple[MappedRows, np.ndarray]]) -> None:
    mapped, _ = store["str8-scalar-chunked"]
    got = mapped.read(np.array([], dtype=np.int64))
    assert got is not None and got.shape == (0,) and got.dtype == np.dtype("S8")
    mapped, _ = store["uint8-84x84x3-contiguous"]
    got = mapped.read(np.zeros((0, 2), dtype=np.int64))
    assert got is not None and got.shape == (0, 2, 84, 84, 3)


def test_copies_do_not_alias_the_map(store: dict[str, tuple[MappedRows, np.ndarray]]) -> None:
    for key in ("int32-7-contiguous", "int32-7-chunked"):
        mapped, data = store[key]
        first = mapped.read(np.array([2, 3]))
        assert first is not None
        first[...] = 0
        again = mapped.read(np.array([2, 3]))
        assert again is not None and same(again, data[[2, 3]])


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["float32-7-contiguous", "float32-7-chunked"])
def test_read_errors(store: dict[str, tuple[MappedRows, np.ndarray]], key: str) -> None:
    mapped, data = store[key]
    with pytest.raises(TypeError, match="integer array, got dtype float64"):
        mapped.read(np.array([1.0]))
    with pytest.raises(IndexError, match="row -1 is negative"):
        mapped.read(np.array([3, -1]))
    with pytest.raises(ValueError, match=r"out has shape \(3, 7\), expected \(2, 7\)"):
        mapped.read(np.array([0, 1]), out=np.empty((3, 7), np.float32))
    with pytest.raises(TypeError, match="out has dtype float64"):
        mapped.read(np.array([0, 1]), out=np.empty((2, 7), np.float64))
    with pytest.raises(ValueError, match="C-contiguous"):
        mapped.read(np.array([0, 1]), out=np.empty((7, 2), np.float32).T)
    with pytest.raises(TypeError, match="numpy array"):
        mapped.read(np.array([0, 1]), out=[[0.0] * 7] * 2)  # type: ignore[arg-type]


def test_negative_rows_with_one_row_chunks(h5: h5py.File) -> None:
    ds = h5.create_dataset("d", data=np.arange(12.0).reshape(6, 2), chunks=(1, 2))
    h5.flush()
    with MappedRows(ds) as mapped:
        got = mapped.read(np.array([5, 0]))
        assert got is not None and got.tolist() == [[10.0, 11.0], [0.0, 1.0]]
        with pytest.raises(IndexError, match="row -6 is negative"):
            mapped.read(np.array([1, -6]))


def test_contiguous_rows_past_the_end(store: dict[str, tuple[MappedRows, np.ndarray]]) -> None:
    mapped, data = store["float32-7-contiguous"]
    with pytest.raises(IndexError, match=f"row {len(data)} is out of range for a dataset of 50"):
        mapped.read(np.array([0, len(data)]))


def test_close_is_idempotent_and_final(h5: h5py.File) -> None:
    ds = h5.create_dataset("d", data=np.arange(10.0))
    h5.flush()
    with MappedRows.open(ds) as mapped:  # type: ignore[union-attr]
        got = mapped.read(np.array([4]))
        assert got is not None and got.tolist() == [4.0]
        assert "contiguous" in repr(mapped)
    mapped.close()
    assert "closed" in repr(mapped)
    for call in (lambda: mapped.read(np.array([1])), mapped.refresh, mapped.invalidate):
        with pytest.raises(ClosedError, match="closed"):
            call()


# ---- when the fast path does not apply ---------------------------------------------------------


def unmappable(f: h5py.File) -> dict[str, Any]:
    """Datasets MappedRows must refuse, by reason."""
    rows = np.arange(40, dtype=np.float32).reshape(20, 2)
    made: dict[str, Any] = {
        "gzip": f.create_dataset("gzip", data=rows, chunks=(4, 2), compression="gzip"),
        "lzf": f.create_dataset("lzf", data=rows, chunks=(4, 2), compression="lzf"),
        "shuffle": f.create_dataset("shuffle", data=rows, chunks=(4, 2), shuffle=True),
        "fletcher32": f.create_dataset("fletcher32", data=rows, chunks=(4, 2), fletcher32=True),
        "big-endian": f.create_dataset("be", data=rows.astype(">f4")),
        "vlen": f.create_dataset("vlen", data=["a", "bb"], dtype=h5py.string_dtype()),
        "compound": f.create_dataset("cmp", data=np.zeros(3, dtype=[("a", "i4"), ("b", "f8")])),
        "sub-row chunks": f.create_dataset("subrow", data=rows, chunks=(4, 1)),
        "scalar": f.create_dataset("scalar", data=1.0),
        "empty rows": f.create_dataset("empty", shape=(5, 0), dtype=np.float32),
        "not a dataset": f,
    }
    tid = h5py.h5t.C_S1.copy()
    tid.set_size(4)
    tid.set_strpad(h5py.h5t.STR_SPACEPAD)
    space = h5py.h5s.create_simple((3,))
    made["space-padded strings"] = h5py.Dataset(h5py.h5d.create(f.id, b"spacepad", tid, space))
    made["compact"] = _compact(f)
    return made


def _compact(f: h5py.File) -> h5py.Dataset:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    tid = h5py.h5t.py_create(np.dtype(np.float32))
    space = h5py.h5s.create_simple((4, 2))
    ds = h5py.Dataset(h5py.h5d.create(f.id, b"compact", tid, space, dcpl=dcpl))
    ds[...] = 1.0
    return ds


def test_open_returns_none_when_the_bytes_are_not_rows(h5: h5py.File) -> None:
    for reason, ds in unmappable(h5).items():
        assert MappedRows.open(ds) is None, reason
        with pytest.raises(ValueError):
            MappedRows(ds)


def test_refusal_messages_say_why(h5: h5py.File) -> None:
    made = unmappable(h5)
    expect = {
        "gzip": "filters", "shuffle": "filters", "big-endian": "not a native",
        "vlen": "not a native", "sub-row chunks": "whole rows", "compact": "neither",
        "scalar": "no rows", "not a dataset": "expected an h5py.Dataset",
        "space-padded strings": "not a native", "empty rows": "empty rows",
    }
    for key, words in expect.items():
        with pytest.raises(ValueError, match=words):
            MappedRows(made[key])


def test_open_returns_none_for_other_drivers(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "core.h5", "w", driver="core") as f:
        ds = f.create_dataset("d", data=np.arange(4.0))
        assert MappedRows.open(ds) is None
    with open(tmp_path / "fileobj.h5", "w+b") as raw, h5py.File(raw, "w") as f:
        ds = f.create_dataset("d", data=np.arange(4.0))
        assert MappedRows.open(ds) is None


def test_open_refuses_external_storage(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        ds = f.create_dataset("d", shape=(4,), dtype=np.float64,
                              external=[(str(tmp_path / "raw.bin"), 0, 32)])
        assert MappedRows.open(ds) is None


def test_none_for_unallocated_storage(h5: h5py.File) -> None:
    contiguous = h5.create_dataset("c", shape=(10, 3), dtype=np.float32)
    chunked = h5.create_dataset("k", shape=(40, 3), maxshape=(None, 3), chunks=(8, 3),
                                dtype=np.float32)
    chunked[0:8] = 1.0  # only chunk 0 exists
    h5.flush()
    with MappedRows(contiguous) as c, MappedRows(chunked) as k:
        assert c.read(np.array([0, 1])) is None
        got = k.read(np.array([0, 7]))
        assert got is not None and got.tolist() == [[1.0] * 3] * 2
        assert k.read(np.array([0, 8])) is None
        assert k.read(np.array([39])) is None
        # Once written and flushed, refresh() lets them through.
        contiguous[...] = 2.0
        chunked[8:16] = 3.0
        h5.flush()
        assert k.read(np.array([8])) is None  # still known missing until refresh()
        c.refresh()
        k.refresh()
        got_c = c.read(np.array([9, 0]))
        got_k = k.read(np.array([15, 0]))
        assert got_c is not None and got_c.tolist() == [[2.0] * 3] * 2
        assert got_k is not None and got_k.tolist() == [[3.0] * 3, [1.0] * 3]
        assert k.read(np.array([16])) is None


# ---- chunk tables ------------------------------------------------------------------------------


@pytest.mark.parametrize("lookups", [0, 16])
@pytest.mark.parametrize("chunk_iter", [True, False])
def test_many_chunks_scan_and_lookup(
    h5: h5py.File, monkeypatch: pytest.MonkeyPatch, lookups: int, chunk_iter: bool
) -> None:
    monkeypatch.setattr(fastread, "_MAX_CHUNK_LOOKUPS", lookups)
    monkeypatch.setattr(fastread, "_CHUNK_ITER_USABLE", chunk_iter and fastread._CHUNK_ITER_USABLE)
    rng = np.random.default_rng(1)
    a = h5.create_dataset("a", shape=(0, 7), maxshape=(None, 7), chunks=(5, 7), dtype=np.float32)
    b = h5.create_dataset("b", shape=(0, 3), maxshape=(None, 3), chunks=(2, 3), dtype=np.int8)
    data = np.zeros((0, 7), np.float32)
    for _ in range(30):  # interleave chunk allocations of two datasets and flushes
        block = rng.standard_normal((7, 7)).astype(np.float32)
        a.resize(len(a) + 7, axis=0)
        a[-7:] = block
        b.resize(len(b) + 3, axis=0)
        b[-3:] = 1
        data = np.concatenate([data, block])
        h5.flush()
    with MappedRows(a) as mapped:
        for _ in range(5):
            rows = rng.integers(0, len(data), 100)
            got = mapped.read(rows)
            assert got is not None and same(got, data[rows])
        mapped.invalidate()
        got = mapped.read(np.arange(len(data))[::-1])
        assert got is not None and same(got, data[::-1])


def test_userblock_offsets(tmp_path: Path) -> None:
    path = tmp_path / "ub.h5"
    rng = np.random.default_rng(2)
    data = rng.standard_normal((30, 7)).astype(np.float32)
    with h5py.File(path, "w", userblock_size=1024, libver="latest") as f:
        contiguous = f.create_dataset("c", data=data)
        chunked = f.create_dataset("k", data=data, chunks=(4, 7), maxshape=(None, 7))
        unallocated = f.create_dataset("u", shape=(5, 7), dtype=np.float32)
        f.flush()
        for ds in (contiguous, chunked):
            with MappedRows(ds) as mapped:
                rows = rng.integers(0, 30, 50)
                got = mapped.read(rows)
                assert got is not None and same(got, data[rows])
        with MappedRows(unallocated) as mapped:
            # get_offset() says 1023 here, not None: HADDR_UNDEF + the user block wraps around.
            assert mapped.read(np.array([0])) is None


def test_file_growth_remaps(tmp_path: Path) -> None:
    path = tmp_path / "grow.h5"
    with h5py.File(path, "w", libver="latest") as f:
        ds = f.create_dataset("d", shape=(0, 84, 84, 3), maxshape=(None, 84, 84, 3),
                              chunks=(3, 84, 84, 3), dtype=np.uint8)
        rng = np.random.default_rng(3)
        data = np.zeros((0, 84, 84, 3), np.uint8)
        mapped = MappedRows(ds)
        for step in range(4):
            block = rng.integers(0, 256, (9, 84, 84, 3), dtype=np.uint8)
            ds.resize(len(ds) + 9, axis=0)
            ds[-9:] = block
            data = np.concatenate([data, block])
            f.flush()
            mapped.refresh()
            rows = np.array([len(data) - 1, 0, len(data) // 2])
            got = mapped.read(rows)
            assert got is not None and same(got, data[rows]), step
        mapped.close()


# ---- SWMR: rows flushed by another handle -------------------------------------------------------


@pytest.mark.parametrize("row", [(7,), (84, 84, 3), ()])
def test_swmr_reader_sees_flushed_rows_after_refresh(tmp_path: Path, row: tuple[int, ...]) -> None:
    path = tmp_path / "swmr.h5"
    rng = np.random.default_rng(4)
    chunk = (3 if row == (84, 84, 3) else 16, *row)
    with h5py.File(path, "w", libver="latest") as w:
        wds = w.create_dataset("d", shape=(0, *row), maxshape=(None, *row), chunks=chunk,
                               dtype=np.float32)
        w.swmr_mode = True
        data = np.zeros((0, *row), np.float32)

        def append(k: int) -> None:
            nonlocal data
            block = rng.standard_normal((k, *row)).astype(np.float32)
            wds.resize(len(wds) + k, axis=0)
            wds[-k:] = block
            data = np.concatenate([data, block])
            w.flush()

        append(5)
        with h5py.File(path, "r", swmr=True) as r:
            rds = r["d"]
            mapped = MappedRows.open(rds)
            assert mapped is not None
            got = mapped.read(np.array([4, 0]))
            assert got is not None and same(got, data[[4, 0]])
            for k in (7, 1, 40):
                append(k)
                rds.refresh()
                mapped.refresh()
                rows = rng.integers(0, len(data), 30)
                assert len(rds) == len(data)
                got = mapped.read(rows)
                assert got is not None and same(got, data[rows])
            mapped.close()


WRITER = textwrap.dedent(
    """
    import sys
    import h5py, numpy as np
    path = sys.argv[1]
    with h5py.File(path, "w", libver="latest") as f:
        ds = f.create_dataset("d", shape=(0, 7), maxshape=(None, 7), chunks=(16, 7), dtype="f4")
        f.swmr_mode = True
        print("READY", flush=True)
        for line in sys.stdin:
            k = int(line)
            if k == 0:
                break
            n = len(ds)
            ds.resize(n + k, axis=0)
            ds[n:] = np.arange(n * 7, (n + k) * 7, dtype="f4").reshape(k, 7)
            f.flush()
            print("FLUSHED", n + k, flush=True)
    """
)


def test_swmr_reader_in_another_process(tmp_path: Path) -> None:
    """A real SWMR pair: in one process HDF5 shares one file object between both handles."""
    path = tmp_path / "xproc.h5"
    with subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as writer:
        try:
            _drive_writer(writer, path)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait(timeout=30)


def _drive_writer(writer: subprocess.Popen[str], path: Path) -> None:
    stdin, stdout = writer.stdin, writer.stdout
    assert stdin is not None and stdout is not None
    assert stdout.readline().strip() == "READY"  # the writer signals instead of us sleeping

    def append(k: int) -> int:
        stdin.write(f"{k}\n")
        stdin.flush()
        words = stdout.readline().split()
        assert words and words[0] == "FLUSHED", words
        return int(words[1])

    total = append(20)
    with h5py.File(path, "r", swmr=True) as r:
        rds = r["d"]
        with MappedRows(rds) as mapped:
            for k in (5, 30, 1):
                expected = np.arange(total * 7, dtype=np.float32).reshape(total, 7)
                got = mapped.read(np.array([total - 1, 0]))
                assert got is not None and same(got, expected[[total - 1, 0]])
                total = append(k)
                rds.refresh()
                mapped.refresh()
                expected = np.arange(total * 7, dtype=np.float32).reshape(total, 7)
                rows = np.arange(total)[::-1]
                got = mapped.read(rows)
                assert got is not None and same(got, expected[rows])
    stdin.write("0\n")
    stdin.flush()
    assert writer.wait(timeout=30) == 0


# ------------------------------------------------------------------------------------ MappedChunk


def test_mapped_chunk_follows_rewrites_in_place(tmp_path: Path) -> None:
    """The journal's state row: one chunk, rewritten in place by the writer, read through a map."""
    path = tmp_path / "row.h5"
    with h5py.File(path, "w", libver="latest", locking=False) as f:
        f.create_dataset("row", data=np.arange(16, dtype=np.int64), maxshape=(16,), chunks=(16,))
        f.swmr_mode = True
        with h5py.File(path, "r", swmr=True, locking=False) as reader:
            mapped = fastread.MappedChunk.open(reader["row"])
            assert mapped is not None
            for k in range(1, 50):
                f["row"][...] = np.arange(16, dtype=np.int64) * k
                f.flush()
                np.testing.assert_array_equal(mapped.values, np.arange(16) * k)
            mapped.close()
            mapped.close()
            assert mapped.values.size == 0


@pytest.mark.parametrize("make", [
    lambda f: f.create_dataset("d", data=np.zeros(16), maxshape=(None,), chunks=(16,)),  # may grow
    lambda f: f.create_dataset("d", data=np.zeros(16), chunks=(8,)),  # two chunks
    lambda f: f.create_dataset("d", data=np.zeros(16), chunks=(16,), compression="gzip"),
    lambda f: f.create_dataset("d", shape=(16,), chunks=(16,), dtype=np.float64),  # not allocated
    lambda f: f.create_dataset("d", data=np.zeros((4, 4))),  # 2-D, contiguous
])
def test_mapped_chunk_is_none_unless_one_fixed_unfiltered_chunk(tmp_path: Path, make: Any) -> None:
    with h5py.File(tmp_path / "x.h5", "w") as f:
        assert fastread.MappedChunk.open(make(f)) is None


def test_mapped_chunk_with_a_userblock(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "u.h5", "w", userblock_size=4096) as f:
        f.create_dataset("row", data=np.arange(16, dtype=np.int64) + 7, maxshape=(16,), chunks=(16,))
        f.flush()
        mapped = fastread.MappedChunk.open(f["row"])
        assert mapped is not None
        np.testing.assert_array_equal(mapped.values, np.arange(16) + 7)
        mapped.close()
