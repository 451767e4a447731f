"""SWMR: a reader process reads while the writer process appends, and sees only published rows."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import time

import numpy as np
import pytest

from h5replay.storage import BoxSpace, DictSpace, HDF5Storage, ReplayBuffer

SPACE = DictSpace({"episode": BoxSpace(0, 1e9, (), np.int64), "step": BoxSpace(0, 1e9, (), np.int64),
                   "image": BoxSpace(0, 255, (8, 8), np.uint8)})
EPISODES = 60


def episode(e: int) -> dict:
    n = 5 + (e * 7) % 23
    return {
        "episode": np.full(n, e, np.int64),
        "step": np.arange(n, dtype=np.int64),
        "image": np.full((n, 8, 8), e % 251, np.uint8),
    }


def reader(path: str, ready, done, out, first_batch) -> None:
    """Samples while the writer commits; every row must belong to a whole committed episode."""
    rb = ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)
    ready.set()
    rng = np.random.default_rng(1)
    seen_lengths, problems, batches = set(), [], 0
    while not done.is_set() or batches < 5:
        if rb.num_episodes == 0:
            time.sleep(0.01)  # nothing yet: leave the core to the writer
            continue
        got = rb.sample(32, rng)
        batches += 1
        first_batch.set()
        for e, s, img in zip(got["episode"], got["step"], got["image"]):
            if s >= len(episode(int(e))["step"]) or np.any(img != e % 251):
                problems.append((int(e), int(s)))
        seen_lengths.add(len(rb))
        # windows of consecutive steps never cross an episode boundary, torn or aborted rows never show
        seqs = rb.sample_sequences(8, 5, rng)
        for eps, steps in zip(seqs["episode"], seqs["step"]):
            if not (np.all(eps == eps[0]) and np.all(np.diff(steps) == 1)):
                problems.append(("window", eps.tolist(), steps.tolist()))
    out.put((problems, len(seen_lengths), batches, len(rb)))
    rb.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("capacity", [400, None])  # a ring that wraps; a file that grows under the reader
def test_reader_process_sees_only_committed_episodes(tmp_path, capacity):
    path = str(tmp_path / "rb.h5")
    rb = ReplayBuffer.create(SPACE, capacity, path, multiprocessing=True)
    ctx = mp.get_context("spawn")
    ready, done, out, first_batch = ctx.Event(), ctx.Event(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=reader, args=(path, ready, done, out, first_batch))
    proc.start()
    try:
        assert ready.wait(20)
        for e in range(EPISODES):
            w = rb.open_segment_writer()
            data = episode(e)
            for i in range(len(data["step"])):
                w.append({k: v[i] for k, v in data.items()})
            rb.commit_segment(w)
            if e == 10:  # let the reader start sampling while the buffer still grows
                assert first_batch.wait(20)
            time.sleep(0.002)
            # an aborted episode in between must never be seen
            junk = rb.open_segment_writer()
            junk.extend({"episode": np.full(3, 10**6, np.int64), "step": np.zeros(3, np.int64),
                         "image": np.zeros((3, 8, 8), np.uint8)})
            junk.abort()
        done.set()
        problems, distinct_lengths, batches, final_len = out.get(timeout=30)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    assert problems == []
    assert batches >= 5 and distinct_lengths >= 2  # it read while the buffer grew
    assert final_len == len(rb)
    rb.close()


def _read_len(storage_bytes: bytes, q) -> None:
    storage = pickle.loads(storage_bytes)
    q.put(int(storage.get(np.array([0, 1]))[1]))


@pytest.mark.timeout(60)
def test_pickled_swmr_storage_reads_in_another_process(tmp_path):
    path = tmp_path / "s.h5"
    s = HDF5Storage.create(BoxSpace(0, 100, (), np.int64), 4, path, multiprocessing=True)
    s.set(slice(None), np.array([5, 6, 7, 8]))
    s.flush()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_read_len, args=(pickle.dumps(s), q))
    p.start()
    assert q.get(timeout=30) == 6
    p.join(10)
    s.close()


def _sample_after_growth(path: str, grown, sampled, out) -> None:
    rb = ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)
    rng = np.random.default_rng(0)
    first = rb.sample(8, rng)  # maps the file while it holds one chunk's worth of rows
    sampled.set()
    grown.wait(30)
    later = rb.sample(256, rng)  # most rows now live in chunks the reader never saw
    out.put((first.tolist(), later.tolist(), len(rb)))
    rb.close()


@pytest.mark.timeout(60)
def test_reader_samples_rows_in_chunks_written_after_it_opened(tmp_path):
    path = str(tmp_path / "grow.h5")
    space = BoxSpace(0, 1e9, (), np.int64)  # 8-byte rows: 8192 rows a chunk
    rb = ReplayBuffer.create(space, None, path, multiprocessing=True)
    w = rb.open_segment_writer()
    w.extend(np.zeros(10, np.int64))
    rb.commit_segment(w)
    ctx = mp.get_context("spawn")
    grown, sampled, out = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_sample_after_growth, args=(path, grown, sampled, out))
    proc.start()
    try:
        assert sampled.wait(30)
        w = rb.open_segment_writer()
        w.extend(np.arange(1, 50_001, dtype=np.int64))
        rb.commit_segment(w)
        grown.set()
        first, later, length = out.get(timeout=30)
        proc.join(10)
    finally:
        if proc.is_alive():
            proc.kill()
    assert first == [0] * 8 and length == 50_010
    assert max(later) > 8192 and all(0 <= v <= 50_000 for v in later)
    rb.close()
