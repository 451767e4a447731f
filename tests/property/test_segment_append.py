"""SegmentWriter.append's two paths against a plain numpy model.

Samples of exactly the stored dtypes and shapes take a fast path (one row copy per leaf, its
writer's state folded into one bound); everything else takes the long way. Both must give the same
rows, refuse the same things, and copy what they are given. The storage model in
test_storage_model.py has a text leaf, which never takes the fast path: this one has only Boxes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h5replay.errors import SegmentStateError, SpaceMismatchError
from h5replay.spaces import BoxSpace, DictSpace
from h5replay.storage import HDF5Storage

pytestmark = pytest.mark.timeout(120)

DICT_SPACE = DictSpace({
    "obs": BoxSpace(-10.0, 10.0, (3,), np.float32),
    "act": BoxSpace(0, 5, (), np.int64),
})
BOX_SPACE = BoxSpace(0, 255, (2, 2), np.uint8)
CAPACITY = 4096

OPS = st.one_of(
    st.tuples(st.just("exact"), st.integers(0, 2**16)),
    st.tuples(st.just("converted"), st.integers(0, 2**16)),  # lists and other dtypes: the long way
    st.tuples(st.just("priority"), st.integers(0, 2**16)),
    st.tuples(st.just("extend"), st.integers(0, 2**16), st.integers(0, 9)),
    st.tuples(st.just("wrong_shape"), st.integers(0, 2**16)),
    st.tuples(st.just("wrong_key"), st.integers(0, 2**16)),
    st.tuples(st.just("finish"), st.just(0)),
)


def rows(space: Any, n: int, seed: int) -> dict[str, np.ndarray]:
    """n valid rows per leaf (a single Box: the key '')."""
    rng = np.random.default_rng(seed)
    if isinstance(space, BoxSpace):
        return {"": rng.integers(0, 256, (n, 2, 2), dtype=np.uint8)}
    return {"obs": rng.uniform(-10, 10, (n, 3)).astype(np.float32), "act": rng.integers(0, 6, n).astype(np.int64)}


def sample(space: Any, flat: dict[str, np.ndarray], i: int, convert: bool = False) -> Any:
    """Row i as a sample: exact ndarrays (0-d ones too), or (convert) nested lists of numpy
    scalars and Python numbers, which the long way converts."""
    def leaf(a: np.ndarray) -> Any:
        if not convert:
            return np.array(a[i])
        if a.dtype == np.uint8:
            return [[np.uint8(x) for x in r] for r in a[i]]
        return a[i].tolist()
    if isinstance(space, BoxSpace):
        return leaf(flat[""])
    return {k: leaf(v) for k, v in flat.items()}


def batch(space: Any, flat: dict[str, np.ndarray]) -> Any:
    return flat[""] if isinstance(space, BoxSpace) else dict(flat)


@settings(max_examples=60, deadline=None)
@given(
    single_box=st.booleans(),
    buffer_bytes=st.sampled_from([1, 40, 160, 4096]),
    ops=st.lists(OPS, max_size=40),
)
def test_append_paths_give_the_model_rows_and_copy_what_they_are_given(
    tmp_path_factory: pytest.TempPathFactory, single_box: bool, buffer_bytes: int, ops: list[tuple[Any, ...]]
) -> None:
    space = BOX_SPACE if single_box else DICT_SPACE
    path = tmp_path_factory.mktemp("append") / "s.h5"
    with HDF5Storage.create(space, CAPACITY, str(path), segment_buffer_bytes=buffer_bytes) as storage:
        writer = storage.open_segment_writer()
        model: dict[str, list[np.ndarray]] = {k: [] for k in rows(space, 1, 0)}
        priorities: list[float] = []
        finished = False
        for op, seed, *rest in ops:
            flat = rows(space, max(1, rest[0] if rest else 1), seed)
            before = len(writer)
            if op == "finish":
                writer.finish()
                finished = True
                continue
            if finished:
                with pytest.raises(SegmentStateError):
                    writer.append(sample(space, flat, 0))
                assert len(writer) == before
                continue
            if op in ("wrong_shape", "wrong_key"):
                bad = sample(space, flat, 0)
                if op == "wrong_shape":
                    bad = np.zeros((3, 2), np.uint8) if single_box else {**bad, "obs": np.zeros(4, np.float32)}
                elif not single_box:
                    bad = {**bad, "extra": np.zeros(1)}
                else:
                    bad = {"": bad}
                with pytest.raises(SpaceMismatchError):
                    writer.append(bad)
                assert len(writer) == before
                continue
            if op == "extend":
                n = rest[0]
                writer.extend(batch(space, flat) if n else {k: v[:0] for k, v in flat.items()} if not single_box
                              else flat[""][:0])
                for k, v in flat.items():
                    model[k].extend(v[:n])
                priorities.extend([np.nan] * n)
                continue
            given = sample(space, flat, 0, convert=(op == "converted"))
            if op == "priority":
                writer.append(given, priority=float(seed % 7))
                priorities.append(float(seed % 7))
            else:
                writer.append(given)
                priorities.append(np.nan)
            for k, v in flat.items():
                model[k].append(v[0])
            if op == "exact":  # the caller reuses its arrays: what was appended must not change
                for a in ([given] if single_box else given.values()):
                    a[...] = 1
            assert len(writer) == before + 1
        n = len(writer)
        assert n == len(priorities)
        if writer.priorities is not None:  # a writer of the storage: for every prioritized table
            np.testing.assert_array_equal(writer.priorities[None], np.array(priorities))
        else:
            assert all(np.isnan(priorities))
        writer.commit(0)
        if n:
            got = storage.get(slice(0, n))
            for k, want in model.items():
                np.testing.assert_array_equal(got if single_box else got[k], np.stack(want))
        with pytest.raises(SegmentStateError):
            writer.append(sample(space, rows(space, 1, 0), 0))


def test_a_writer_starts_with_the_block_the_last_one_grew_to_and_a_budget_frees_it(tmp_path: Any) -> None:
    """Blocks left by ended writers are kept for the next ones (no regrowth, no fresh pages), and
    count against the writers' memory budget, which frees them before it refuses a writer."""
    space = BoxSpace(0, 255, (1024,), np.uint8)  # 1 KiB rows; first block 64 rows
    with HDF5Storage.create(space, 10_000, str(tmp_path / "s.h5"), segment_buffer_bytes=1 << 20) as storage:
        row = np.zeros(1024, np.uint8)
        first = storage.open_segment_writer()
        for _ in range(300):  # grows 64 -> 128 -> 256 -> 512 rows
            first.append(row)
        first.commit(0)
        staging = storage._staging
        assert staging is not None
        kept = staging.in_memory
        assert kept >= 512 * 1024  # the grown block is kept
        second = storage.open_segment_writer()
        second.append(row)
        assert second._capacity == 512  # it starts there
        assert staging.in_memory == kept  # and nothing more was counted
        second.abort()


def test_spare_blocks_count_against_the_budget_and_are_freed_before_it_refuses(tmp_path: Any) -> None:
    space = BoxSpace(0, 255, (1024,), np.uint8)
    with HDF5Storage.create(space, 100, str(tmp_path / "s.h5"), segment_buffer_bytes=1 << 20) as storage:
        storage.open_segment_writer().append(np.zeros(1024, np.uint8))  # sets up the staging
        staging = storage._staging
        assert staging is not None
        staging.memory_bytes = 1 << 20
        base = staging.in_memory
        assert staging.reserve(512)
        staging.give_buffers(staging.take_buffers(512))
        assert staging.in_memory == base + 512 * 1024  # a spare, still counted
        assert staging.reserve(600)  # over the budget with the spare: the spare goes
        assert staging.in_memory == base + 600 * 1024
        assert staging.take_spare() is None
        assert not staging.reserve(1024)  # and with nothing left to free, a refusal
        assert staging.in_memory == base + 600 * 1024
