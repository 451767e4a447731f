"""HDF5Storage against a model of plain numpy arrays (hypothesis state machines).

Every step applies one operation to both the storage and the model; after every step the
storage's length and full content (read once by slice, once by a reversed int array, which may go
through the memory-map fast path) must equal the model. Covered: `get` / `set` with every index
kind (int, negative int, numpy int, 0-d array, slice with any step, list and int arrays with
duplicates and negatives, boolean mask, 2-D int array, Ellipsis), writes the space rejects (which
must change nothing), several streaming segment writers interleaved (spilling to the file's
staging area after a few rows), commits in any order at any start (ring wrap-around, segments
longer than the capacity), aborts, use of finished writers, extend/shrink/clear of an unbounded
storage, flush followed by reads, and close-and-reopen (open writers die).

Two machines: a fixed capacity (1..12) over several dataset layouts, and an unbounded storage.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from h5replay.errors import SegmentStateError, SpaceMismatchError
from h5replay.storage import BinarySpace, BoxSpace, DictSpace, HDF5Storage, TextSpace

SPACE = DictSpace(
    {
        "obs": {"img": BoxSpace(0, 255, (2, 3), np.uint8), "r": BoxSpace(-1e6, 1e6, (), np.float32)},
        "flag": BinarySpace((2,)),
        "note": TextSpace(3),
    }
)
# (path, row shape, dtype); 24 bytes a row as stored (6 + 4 + 2 + 12).
LEAVES: tuple[tuple[str, tuple[int, ...], Any], ...] = (
    ("obs/img", (2, 3), np.uint8),
    ("obs/r", (), np.float32),
    ("flag", (2,), np.bool_),
    ("note", (), object),
)
ALPHABET = "aZ éß中🙂"
MAX_OPEN_WRITERS = 4
# segment_buffer_bytes: 1 and 48 give one- and two-row staging blocks, 120 five rows, 512 twenty-one.
BUFFER_BYTES = st.sampled_from([1, 48, 120, 512])
SEEDS = st.integers(0, 2**32 - 1)

Flat = dict[str, np.ndarray]


# ---------------------------------------------------------------------- model helpers


def zero_rows(n: int) -> Flat:
    """What unwritten rows hold: HDF5's zero fill (empty text)."""
    out: Flat = {}
    for path, shape, dtype in LEAVES:
        out[path] = np.full(n, "", dtype=object) if dtype is object else np.zeros((n, *shape), dtype=dtype)
    return out


def random_rows(lead: tuple[int, ...], seed: int) -> Flat:
    """Valid rows with leading shape `lead` (one row per index position)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(lead, dtype=np.int64))
    notes = np.empty(n, dtype=object)
    for i in range(n):
        notes[i] = "".join(rng.choice(list(ALPHABET), size=int(rng.integers(0, 4))))
    return {
        "obs/img": rng.integers(0, 256, (*lead, 2, 3), dtype=np.uint8),
        "obs/r": rng.uniform(-1e6, 1e6, lead).astype(np.float32),
        "flag": rng.integers(0, 2, (*lead, 2)).astype(bool),
        "note": notes.reshape(lead),
    }


def concat(a: Flat, b: Flat) -> Flat:
    return {p: np.concatenate([a[p], b[p]]) for p, _, _ in LEAVES}


def nest(flat: Flat, single: bool = False) -> dict[str, Any]:
    """The nested value the storage API takes; `single` turns 0-d leaves into scalars / str."""

    def leaf(path: str) -> Any:
        arr = flat[path]
        if single and arr.ndim == 0:
            return arr.item() if path == "note" else arr[()]
        return arr

    out: dict[str, Any] = {"obs": {}}
    for path, _, _ in LEAVES:
        if path.startswith("obs/"):
            out["obs"][path[4:]] = leaf(path)
        else:
            out[path] = leaf(path)
    return out


def unnest(value: dict[str, Any]) -> dict[str, Any]:
    return {"obs/img": value["obs"]["img"], "obs/r": value["obs"]["r"], "flag": value["flag"], "note": value["note"]}


def as_numpy_index(index: Any) -> Any:
    """The same rows for numpy (an empty list must stay an integer index)."""
    if isinstance(index, list):
        return np.asarray(index, dtype=np.int64)
    return index


def positions_of(index: Any, length: int) -> np.ndarray:
    """Row numbers `index` selects, shaped like the result (0-d for a single row)."""
    return np.arange(length)[as_numpy_index(index)]


def select(model: Flat, index: Any) -> Flat:
    """numpy's `model[index]` per leaf; a single row keeps a 0-d array (text included)."""
    out: Flat = {}
    for path, _, _ in LEAVES:
        rows = model[path][as_numpy_index(index)]
        out[path] = np.asarray(rows, dtype=object) if path == "note" else np.asarray(rows)
    return out


def assert_rows_equal(got: Any, expected: Flat, where: str) -> None:
    flat = unnest(got)
    for path, _, dtype in LEAVES:
        exp = expected[path]
        if path == "note":
            if exp.ndim == 0:
                assert isinstance(flat[path], str), f"{where}: {path} is {type(flat[path])}, expected str"
                assert flat[path] == exp.item(), f"{where}: {path}"
            else:
                arr = np.asarray(flat[path])
                assert arr.dtype == object and arr.shape == exp.shape, f"{where}: {path} {arr.dtype} {arr.shape}"
                assert arr.tolist() == exp.tolist(), f"{where}: {path}"
            continue
        arr = np.asarray(flat[path])
        assert arr.dtype == dtype, f"{where}: {path} came back as {arr.dtype}, expected {np.dtype(dtype)}"
        assert arr.shape == exp.shape, f"{where}: {path} has shape {arr.shape}, expected {exp.shape}"
        np.testing.assert_array_equal(arr, exp, err_msg=f"{where}: {path}")


# ---------------------------------------------------------------------- strategies


def index_strategy(length: int) -> st.SearchStrategy[Any]:
    """Every kind of row index that is valid for `length` rows."""
    bound = st.none() | st.integers(-length - 2, length + 2)
    step = st.none() | st.sampled_from([1, 2, 3, -1, -2, -3])
    kinds: list[st.SearchStrategy[Any]] = [
        st.builds(slice, bound, bound, step),
        st.lists(st.booleans(), min_size=length, max_size=length).map(lambda m: np.array(m, dtype=bool)),
        st.just([]),
        st.just(Ellipsis),
    ]
    if length:
        one = st.integers(-length, length - 1)
        dtypes = st.sampled_from([np.int64, np.int32, np.intp])
        kinds += [
            one,
            st.builds(lambda i, dt: dt(i), one, dtypes),
            one.map(lambda i: np.array(i)),  # 0-d array: a single row
            st.lists(one, max_size=8),
            st.builds(lambda xs, dt: np.array(xs, dtype=dt), st.lists(one, max_size=8), dtypes),
            st.builds(  # 2-D: rows come back shaped like the index
                lambda a, b, xs: np.array(xs[: a * b], dtype=np.int64).reshape(a, b),
                st.integers(1, 3), st.integers(1, 3), st.lists(one, min_size=9, max_size=9),
            ),
        ]
    return st.one_of(kinds)


def bad_index_strategy(length: int) -> st.SearchStrategy[tuple[Any, type[Exception]]]:
    """(index, the error it must raise) for indices out of range or of the wrong type."""
    out = st.integers(length, length + 5) | st.integers(-length - 5, -length - 1)
    return st.one_of(
        out.map(lambda i: (i, IndexError)),
        st.lists(st.integers(-length, max(0, length - 1)), max_size=3).flatmap(
            lambda xs: out.map(lambda i: (xs + [i], IndexError))
        ),
        st.integers(0, 3).map(lambda k: (np.zeros(length + 1 + k, dtype=bool), IndexError)),
        st.sampled_from([(1.5, TypeError), (True, TypeError), (np.array([0.5]), TypeError), ("0", TypeError)]),
    )


# Ways to spoil a valid value; each must make the write raise SpaceMismatchError. The ones that
# change values (not structure) need at least one row to be spoilt.
STRUCTURAL = ["missing_key", "extra_key", "img_shape", "img_float", "r_shape", "rows"]
VALUED = ["img_range", "flag_two", "note_long", "note_nul", "note_bytes"]


def spoil(flat: Flat, lead: tuple[int, ...], how: str, single: bool) -> dict[str, Any]:
    bad = {p: np.array(a, copy=True) for p, a in flat.items()}
    if how == "img_shape":
        bad["obs/img"] = np.zeros((*lead, 3, 2), dtype=np.uint8)
    elif how == "img_float":
        bad["obs/img"] = bad["obs/img"].astype(np.float64)
    elif how == "r_shape":
        bad["obs/r"] = bad["obs/r"][..., None]
    elif how == "rows":
        more = (lead[0] + 1, *lead[1:]) if lead else (1,)
        bad = random_rows(more, 7)
    elif how == "img_range":
        bad["obs/img"] = np.full((*lead, 2, 3), 256, dtype=np.int64)
    elif how == "flag_two":
        bad["flag"] = np.full((*lead, 2), 2, dtype=np.int64)
    elif how in ("note_long", "note_nul", "note_bytes"):
        text: Any = {"note_long": "ab中d", "note_nul": "a\x00", "note_bytes": b"x"}[how]
        notes = np.array(bad["note"], dtype=object)
        notes.reshape(-1)[-1] = text
        bad["note"] = notes
    value = nest(bad, single=single and how != "rows")
    if how == "missing_key":
        del value["flag"]
    elif how == "extra_key":
        value["obs"]["extra"] = value["obs"]["r"]
    return value


# ---------------------------------------------------------------------- the machine


@dataclass
class WriterModel:
    writer: Any
    rows: Flat
    state: str = "open"  # open | committed | aborted | dead (its storage was closed)
    finished: bool = False


class StorageMachine(RuleBasedStateMachine):
    """Rules shared by both machines; subclasses open the storage in an @initialize rule."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="h5replay-model-")
        self.path = os.path.join(self.dir, "s.h5")
        self.storage: HDF5Storage | None = None
        self.model: Flat = zero_rows(0)
        self.capacity: int | None = None
        self.buffer_bytes = 1
        self.multiprocessing = False
        self.writers: list[WriterModel] = []

    def open(self, capacity: int | None, layout: dict[str, Any], buffer_bytes: int) -> None:
        self.capacity = capacity
        self.buffer_bytes = buffer_bytes
        self.multiprocessing = bool(layout.get("multiprocessing", False))
        self.storage = HDF5Storage.create(SPACE, capacity, self.path, segment_buffer_bytes=buffer_bytes, **layout)
        rows = capacity if capacity is not None else int(layout.get("initial_capacity") or 0)
        self.model = zero_rows(rows)

    def teardown(self) -> None:
        try:
            if self.storage is not None:
                self.storage.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def length(self) -> int:
        return int(self.model["note"].shape[0])

    @property
    def s(self) -> HDF5Storage:
        assert self.storage is not None
        return self.storage

    def open_writers(self) -> list[WriterModel]:
        return [w for w in self.writers if w.state == "open"]

    def model_write(self, index: Any, rows: Flat) -> None:
        """numpy's `model[index] = rows`, with the last of duplicate indices winning."""
        pos = positions_of(index, self.length)
        for path, _, _ in LEAVES:
            if pos.ndim == 0:
                self.model[path][int(pos)] = rows[path][()]  # [()]: the str, not a 0-d array
                continue
            flat_rows = rows[path].reshape((pos.size, *rows[path].shape[pos.ndim :]))
            for k, j in enumerate(pos.reshape(-1)):
                self.model[path][j] = flat_rows[k]

    def grow_model(self, new_length: int) -> None:
        if new_length > self.length:
            self.model = concat(self.model, zero_rows(new_length - self.length))

    def pick_writer(self, data: st.DataObject, writers: list[WriterModel]) -> WriterModel:
        return writers[data.draw(st.integers(0, len(writers) - 1), label="writer")]

    def writable_writers(self) -> list[WriterModel]:
        return [w for w in self.open_writers() if not w.finished]

    # Hypothesis lists rules by number of arguments (then name) and favours the first ones. The core
    # rules (get, set, writer_add, writer_commit) take one argument; the rest take more, so they
    # are picked less often: a reopen or clear every other step would leave no writer to commit.

    # ------------------------------------------------------------------ get / set

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        if data.draw(st.integers(0, 4), label="bad index?") == 0:
            index, error = data.draw(bad_index_strategy(self.length), label="bad index")
            with pytest.raises(error):
                self.s.get(index)
            return
        index = data.draw(index_strategy(self.length), label="index")
        assert_rows_equal(self.s.get(index), select(self.model, index), f"get({index!r})")

    @rule(data=st.data())
    def set(self, data: st.DataObject) -> None:
        index = data.draw(index_strategy(self.length), label="index")
        lead = positions_of(index, self.length).shape
        rows = random_rows(lead, data.draw(SEEDS, label="seed"))
        value = nest(rows, single=not lead)
        if len(lead) == 1 and data.draw(st.booleans(), label="text as list"):
            value["note"] = rows["note"].tolist()
        self.s.set(index, value)
        self.model_write(index, rows)
        if data.draw(st.booleans(), label="read back at once"):
            self.get(data)  # unflushed rows: the map reads them once their cached chunks are written out

    @rule(data=st.data(), seed=SEEDS)
    def rejected_write_changes_nothing(self, data: st.DataObject, seed: int) -> None:
        """A value the space refuses, or a bad index: SpaceMismatchError / IndexError / TypeError."""
        writers = self.writable_writers()
        target = data.draw(st.sampled_from(["set", "set_bad_index"] + (["writer"] if writers else [])), label="target")
        if target == "set_bad_index":
            index, error = data.draw(bad_index_strategy(self.length), label="bad index")
            with pytest.raises(error):
                self.s.set(index, nest(random_rows((1,), seed)))
            return
        if target == "set":
            index = data.draw(index_strategy(self.length), label="index")
            lead = positions_of(index, self.length).shape
            has_rows = int(np.prod(lead, dtype=np.int64)) > 0
            how = data.draw(st.sampled_from(STRUCTURAL + (VALUED if has_rows else [])), label="spoil")
            with pytest.raises(SpaceMismatchError):
                self.s.set(index, spoil(random_rows(lead, seed), lead, how, single=not lead))
            return
        w = self.pick_writer(data, writers)
        batched = data.draw(st.booleans(), label="extend?")
        lead = (data.draw(st.integers(1, 4), label="rows"),) if batched else ()
        # More rows is no error for extend: a writer takes batches of any length.
        how = data.draw(st.sampled_from([h for h in STRUCTURAL if not (batched and h == "rows")] + VALUED))
        before = len(w.writer)
        with pytest.raises(SpaceMismatchError):
            (w.writer.extend if batched else w.writer.append)(spoil(random_rows(lead, seed), lead, how, not batched))
        assert len(w.writer) == before

    # ------------------------------------------------------------------ flush and reads after it

    @rule(data=st.data(), fsync=st.booleans())
    def flush_then_read(self, data: st.DataObject, fsync: bool) -> None:
        """After a flush, reads of two or more rows may take the memory-map fast path."""
        self.s.flush(fsync=fsync)
        for _ in range(2):
            self.get(data)

    # ------------------------------------------------------------------ segment writers

    @precondition(lambda self: len(self.open_writers()) < MAX_OPEN_WRITERS)
    @rule()
    def open_writer(self) -> None:
        self.writers.append(WriterModel(self.s.open_segment_writer(), zero_rows(0)))
        if len(self.writers) > 12:  # forget the oldest used-up writer
            self.writers.remove(next(w for w in self.writers if w.state != "open"))

    @rule(data=st.data())
    def writer_add(self, data: st.DataObject) -> None:
        """append or extend (0..30 rows, often more than the capacity) on any open writer."""
        writers = self.writable_writers()
        if not writers or (len(self.open_writers()) < MAX_OPEN_WRITERS and data.draw(st.integers(0, 3)) == 0):
            self.open_writer()
            writers = self.writable_writers()
        w = self.pick_writer(data, writers)
        seed = data.draw(SEEDS, label="seed")
        n = data.draw(st.none() | st.integers(0, 30), label="rows (None: append)")
        if n is None:
            row = random_rows((), seed)
            w.writer.append(nest(row, single=True))
            w.rows = concat(w.rows, {p: a[None] for p, a in row.items()})
        else:
            rows = random_rows((n,), seed)
            w.writer.extend(nest(rows))
            w.rows = concat(w.rows, rows)

    @rule(data=st.data())
    def writer_add_then_commit(self, data: st.DataObject) -> None:
        """Rows for a writer, then a commit of any open writer (not always the same one)."""
        self.writer_add(data)
        self.writer_commit(data)

    @precondition(lambda self: bool(self.open_writers()))
    @rule(data=st.data())
    def writer_commit(self, data: st.DataObject) -> None:
        w = self.pick_writer(data, self.open_writers())
        n = int(w.rows["note"].shape[0])
        assert len(w.writer) == n
        if self.capacity is not None:
            start = data.draw(st.integers(-3 * self.capacity, 3 * self.capacity), label="start")
            w.writer.commit(start)
            for j in range(max(0, n - self.capacity), n):  # numpy's order: later rows win
                for path, _, _ in LEAVES:
                    self.model[path][(start + j) % self.capacity] = w.rows[path][j]
        else:
            start = data.draw(st.integers(0, self.length + 2), label="start")
            if start > self.length:  # a gap: refused, the writer stays open
                with pytest.raises(IndexError):
                    w.writer.commit(start)
                return
            w.writer.commit(start)
            self.grow_model(start + n)
            for path, _, _ in LEAVES:
                self.model[path][start : start + n] = w.rows[path]
        w.state = "committed"

    @precondition(lambda self: bool(self.open_writers()))
    @rule(data=st.data(), abort=st.booleans())
    def writer_abort_or_finish(self, data: st.DataObject, abort: bool) -> None:
        w = self.pick_writer(data, self.open_writers())
        if abort:
            w.writer.abort()
            w.writer.abort()  # idempotent
            w.state = "aborted"
            return
        w.writer.finish()
        w.writer.finish()  # idempotent; the writer can still be committed or aborted
        w.finished = True
        with pytest.raises(SegmentStateError):
            w.writer.append(nest(random_rows((), 0), single=True))
        with pytest.raises(SegmentStateError):
            w.writer.extend(nest(random_rows((1,), 0)))

    @precondition(lambda self: any(w.state != "open" for w in self.writers))
    @rule(data=st.data(), op=st.sampled_from(["append", "extend", "commit", "abort", "finish"]))
    def used_writer_raises(self, data: st.DataObject, op: str) -> None:
        w = self.pick_writer(data, [w for w in self.writers if w.state != "open"])
        if op == "finish":
            if w.state != "committed":  # after a commit, finish() is a documented no-op
                with pytest.raises(SegmentStateError):
                    w.writer.finish()
            return
        if op == "abort":
            if w.state == "committed":
                with pytest.raises(SegmentStateError):
                    w.writer.abort()
            else:
                w.writer.abort()  # idempotent on an aborted or dead writer
            return
        call = {
            "append": lambda: w.writer.append(nest(random_rows((), 0), single=True)),
            "extend": lambda: w.writer.extend(nest(random_rows((2,), 0))),
            "commit": lambda: w.writer.commit(0),
        }[op]
        with pytest.raises(SegmentStateError):
            call()

    # ------------------------------------------------------------------ length management

    @rule(data=st.data(), op=st.sampled_from(["extend_length", "shrink_length", "clear"]), n=st.integers(0, 6))
    def change_length(self, data: st.DataObject, op: str, n: int) -> None:
        """extend_length / shrink_length (unbounded only) and clear. Writers stay open."""
        if self.capacity is not None:
            op = "clear"
        if op == "extend_length":
            self.s.extend_length(n)
            self.grow_model(self.length + n)
        elif op == "shrink_length":
            n = data.draw(st.integers(0, self.length), label="shrink by")
            self.s.shrink_length(n)
            self.model = {p: a[: self.length - n] for p, a in self.model.items()}
        else:
            self.s.clear()  # a fixed-capacity storage keeps its rows
            if self.capacity is None:
                self.model = zero_rows(0)

    # ------------------------------------------------------------------ close and reopen

    @rule(flush_first=st.booleans(), check_closed=st.booleans(), reopen_again=st.booleans())
    def close_and_reopen(self, flush_first: bool, check_closed: bool, reopen_again: bool) -> None:
        if flush_first:
            self.s.flush()
        self.s.close()
        self.s.close()  # safe twice
        for w in self.writers:
            if w.state == "open":
                w.state = "dead"
        self.storage = HDF5Storage.load_from(
            self.path, None, read_only=False, multiprocessing=self.multiprocessing,
            segment_buffer_bytes=self.buffer_bytes,
        )
        assert self.s.single_instance_space == SPACE
        assert self.s.capacity == self.capacity
        if check_closed:  # the writers died with the old storage
            for w in self.writers:
                if w.state == "dead":
                    with pytest.raises(SegmentStateError):
                        w.writer.append(nest(random_rows((), 0), single=True))
        if reopen_again:  # a reopen without any write in between changes nothing either
            self.s.close()
            self.storage = HDF5Storage.load_from(
                self.path, None, read_only=False, multiprocessing=self.multiprocessing,
                segment_buffer_bytes=self.buffer_bytes,
            )

    # ------------------------------------------------------------------ invariants

    @invariant()
    def content_matches_model(self) -> None:
        if self.storage is None:
            return
        assert len(self.s) == self.length
        assert_rows_equal(self.s.get(slice(None)), self.model, "get(:)")
        # An int array of 2+ rows goes through the memory map (unflushed rows written out first).
        backwards = np.arange(self.length - 1, -1, -1)
        assert_rows_equal(self.s.get(backwards), select(self.model, backwards), "get(reversed)")
        for w in self.open_writers():
            assert len(w.writer) == w.rows["note"].shape[0]


FIXED_LAYOUTS = [
    {},  # contiguous
    {"chunks": True},
    {"chunks": {"obs": True, "*": None}},  # chunked 'obs/*', contiguous elsewhere
    {"compression": "gzip"},
    {"compression": "lzf", "chunks": True},
    {"multiprocessing": True},
]


class FixedCapacityStorageMachine(StorageMachine):
    @initialize(capacity=st.integers(1, 12), layout=st.sampled_from(FIXED_LAYOUTS), buffer_bytes=BUFFER_BYTES)
    def create(self, capacity: int, layout: dict[str, Any], buffer_bytes: int) -> None:
        self.open(capacity, layout, buffer_bytes)


UNBOUNDED_LAYOUTS = [
    {},
    {"initial_capacity": 3},
    {"compression": "gzip"},
    {"multiprocessing": True, "initial_capacity": 2},
]


class UnboundedStorageMachine(StorageMachine):
    @initialize(layout=st.sampled_from(UNBOUNDED_LAYOUTS), buffer_bytes=BUFFER_BYTES)
    def create(self, layout: dict[str, Any], buffer_bytes: int) -> None:
        self.open(None, layout, buffer_bytes)


# Inherit the loaded profile (tests/conftest.py); only the run length and deadline are set here.
MACHINE_SETTINGS = settings(stateful_step_count=30, deadline=None)

TestFixedCapacityStorage = FixedCapacityStorageMachine.TestCase
TestFixedCapacityStorage.settings = MACHINE_SETTINGS
TestUnboundedStorage = UnboundedStorageMachine.TestCase
TestUnboundedStorage.settings = MACHINE_SETTINGS


# ---------------------------------------------------------------------- regressions


def test_set_with_a_2d_index_writes_every_row(tmp_path: Any) -> None:
    """`set` with a 2-D int index once reshaped the already flattened rows by shape[idx.ndim:]:
    a ValueError after the leaves sorted before the failing one had been written."""
    space = DictSpace({"a": BoxSpace(0, 9, (), np.int64), "b": BoxSpace(0, 9, (2,), np.int64)})
    s = HDF5Storage.create(space, 4, tmp_path / "s.h5")
    try:
        index = np.array([[0, 1], [3, 2]])
        value = {"a": np.array([[1, 2], [3, 4]]), "b": np.arange(8).reshape(2, 2, 2)}
        s.set(index, value)
        got = s.get(index)
        np.testing.assert_array_equal(got["a"], value["a"])
        np.testing.assert_array_equal(got["b"], value["b"])
    finally:
        s.close()
