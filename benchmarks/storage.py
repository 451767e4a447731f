"""Storage benchmarks: h5replay against raw h5py and a numpy memmap, measured side by side.

Run from the repository root (not collected by pytest, whose testpaths is `tests`)::

    .venv/bin/python benchmarks/storage.py            # full run, a few minutes
    .venv/bin/python benchmarks/storage.py --quick    # small sizes, < 30 s: a smoke test
    .venv/bin/python benchmarks/storage.py --only reads --repeat 3 --json /tmp/bench.json

What it measures (every figure is also printed as a ratio against a baseline from the same run;
targets are informational: PASS/MISS never changes the exit code):

1. ingest: 200k rows of 7 x float32 and 5k rows of 84x84x3 uint8 (--quick: 20k / 1k) written
   row by row and in batches of 64. Baselines: raw h5py into a contiguous dataset
   (`ds[i] = row`, `ds[i:i+64] = batch`). h5replay: `HDF5Storage.create` + `open_segment_writer`
   + `append` / `extend` + `commit(start)`, in segments of 1,000 (small) / 200 (image) rows; and
   `ReplayBuffer.commit_segment`, which flushes twice per segment (compared with raw h5py that
   also flushes twice per segment). Every case ends with one file flush, inside the timing;
   creating and closing the file are outside it. Target: >= 0.8x raw batched h5py. And per-row
   `append` against unienv's buffered segment writer, rebuilt here (it keeps a reference to each
   appended row, no copy and no check, then `np.stack`s them into one h5py write at commit).
   Target: `append` (which checks every row: keys, dtypes and shapes per row, bounds per block)
   >= 1x that writer.
2. reads: 200 batches of 256 random indices (`default_rng(0).integers(0, n, 256)`, unsorted, with
   duplicates) from 1,000,000 small rows and 20,000 images, in contiguous, chunked (whole-row
   ~64 KiB chunks) and gzip-chunked files reopened read-only. `storage.get(idx)` against h5py
   fancy selection (`ds[np.unique(idx)]` plus the inverse to restore order, counted) and against
   `np.take` over a `np.memmap` of the contiguous file's bytes (the same rows). Also
   `read_sorted_unique_rows` alone (unique + inverse counted): the path `get` falls back to when
   the file cannot be memory-mapped (gzip). Targets: get >= 10x h5py fancy, and within 3x of the
   memmap (>= 0.33x), on the uncompressed layouts. Methods are interleaved batch by batch; each is
   warmed up and checked against the memmap's rows first (untimed).
3. rss: in a spawned child, stream one 2 GB segment (200 MB with --quick) of images through a
   segment writer into an unbounded storage in batches of 64, then commit it. Reports VmRSS
   before, the peak during streaming and commit (VmHWM, reset first), and the growth. Target:
   grows by < 100 MB. Needs about 2x the segment on disk (staging + final rows: ~4 GB); skipped
   with a message when less than 3x (6 GB) is free.

Ratios compare median batch (or segment) times: on a busy shared host a preempted batch lands in
p99 rather than shifting the ratio. Throughput ratios (totals) are in the JSON as `*_total`.
Files live in a temporary directory that is deleted at the end. Data sits in the page cache and
nothing is fsync'd: this is CPU and memory work, not disk speed. The machine is noisy: use
--repeat to take the median of several runs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import h5py
import numpy as np

try:
    import h5replay  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h5replay.storage import BoxSpace, HDF5Storage, ReplayBuffer, read_sorted_unique_rows

SMALL, IMAGE = "7xf32", "84x84x3u8"
ROW = {SMALL: ((7,), np.dtype(np.float32)), IMAGE: ((84, 84, 3), np.dtype(np.uint8))}
LIBVER = ("v110", "v114")  # the bounds HDF5Storage.create uses, so both sides write the same format
perf = time.perf_counter


@dataclass(frozen=True)
class Sizes:
    ingest_rows: dict[str, int]
    segment_rows: dict[str, int]
    read_rows: dict[str, int]
    num_batches: int  # read batches per method (at most)
    budget: float  # seconds per read loop (at most)
    rss_bytes: int


FULL = Sizes({SMALL: 200_000, IMAGE: 5_000}, {SMALL: 1_000, IMAGE: 200},
             {SMALL: 1_000_000, IMAGE: 20_000}, 200, 10.0, 2 * 10**9)
QUICK = Sizes({SMALL: 20_000, IMAGE: 1_000}, {SMALL: 1_000, IMAGE: 200},
              {SMALL: 100_000, IMAGE: 2_000}, 30, 0.5, 200 * 10**6)
BATCH_ROWS, WRITE_BATCH = 256, 64


def space_of(kind: str) -> BoxSpace:
    shape, dtype = ROW[kind]
    return BoxSpace(0, 255, shape, dtype) if kind == IMAGE else BoxSpace(-np.inf, np.inf, shape, dtype)


def row_bytes(kind: str) -> int:
    shape, dtype = ROW[kind]
    return int(np.prod(shape)) * dtype.itemsize


def make_rows(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == SMALL:
        return rng.standard_normal((n, 7), dtype=np.float32)
    # Blocky images (21x21 upsampled by 4) so gzip has something to compress, as real frames do.
    low = rng.integers(0, 256, (n, 21, 21, 3), dtype=np.uint8)
    return np.ascontiguousarray(low.repeat(4, axis=1).repeat(4, axis=2))


def summarize(times: list[float], total: float, rows: int, nbytes: int) -> dict[str, float]:
    """Throughput over `total` seconds and latency percentiles of the per-unit `times`."""
    t = np.asarray(times)
    return {"rows_per_s": rows / total, "mb_per_s": nbytes / total / 1e6, "units_per_s": len(times) / total,
            "p50_ms": float(np.percentile(t, 50)) * 1e3, "p99_ms": float(np.percentile(t, 99)) * 1e3,
            "count": len(times), "seconds": total}


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def fmt(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def ratios(case: dict[str, float], base: dict[str, float]) -> tuple[float, float]:
    """How many times faster `case` is than `base`: by median batch (or segment) time, which a busy
    shared host disturbs far less than totals do, and by total throughput (kept in the JSON)."""
    return base["p50_ms"] / case["p50_ms"], case["rows_per_s"] / base["rows_per_s"]


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio >= target else "MISS"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    if title:
        print(f"\n{title}")
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))
    print(line + "\n" + "-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))


# ------------------------------------------------------------------------------------------ 1. ingest


def _segments(n: int, seg: int) -> list[tuple[int, int]]:
    return [(a, min(a + seg, n)) for a in range(0, n, seg)]


def _pieces(a: int, b: int, batch: int) -> list[tuple[int, int]]:
    return [(j, min(j + batch, b)) for j in range(a, b, batch)]


def ingest_raw(path: str, data: np.ndarray, seg: int, batch: int, flushes: int = 0,
               buffered: bool = False) -> dict[str, float]:
    """Raw h5py into a contiguous dataset of the same shape (HDF5Storage's fixed-capacity layout).

    `buffered`: unienv's BufferedSegmentWriter, as its behaviour is documented: `append` keeps a
    reference to each row (no copy, no validation); the segment's end stacks them and writes the
    slice with one h5py call."""
    times = []
    with h5py.File(path, "w", libver=LIBVER) as f:
        ds = f.create_dataset("data", shape=data.shape, dtype=data.dtype)
        t0 = perf()
        for a, b in _segments(len(data), seg):
            ts = perf()
            if buffered:
                rows: list[np.ndarray] = []
                for i in range(a, b):
                    rows.append(data[i])
                ds[a:b] = np.stack(rows)
            elif batch == 1:
                for i in range(a, b):
                    ds[i] = data[i]
            else:
                for j, k in _pieces(a, b, batch):
                    ds[j:k] = data[j:k]
            for _ in range(flushes):
                f.flush()
            times.append(perf() - ts)
        f.flush()
        total = perf() - t0
    os.unlink(path)
    return summarize(times, total, len(data), data.nbytes)


def ingest_h5replay(path: str, data: np.ndarray, kind: str, seg: int, batch: int, replay: bool) -> dict[str, float]:
    """Segment writers: append (batch 1) or extend, then `commit(start)` on an HDF5Storage, or
    `ReplayBuffer.commit_segment` (which publishes: two flushes per segment). One flush at the end."""
    if replay:
        rb = ReplayBuffer.create(space_of(kind), len(data), path)
        storage, open_writer = rb.storage, rb.open_segment_writer
    else:
        storage = HDF5Storage.create(space_of(kind), len(data), path)
        open_writer = storage.open_segment_writer
    times = []
    try:
        t0 = perf()
        for a, b in _segments(len(data), seg):
            ts = perf()
            writer = open_writer()
            if batch == 1:
                for i in range(a, b):
                    writer.append(data[i])
            else:
                for j, k in _pieces(a, b, batch):
                    writer.extend(data[j:k])
            if replay:
                rb.commit_segment(writer)
            else:
                writer.commit(a)
            times.append(perf() - ts)
        storage.flush()
        total = perf() - t0
    finally:
        (rb if replay else storage).close()
    os.unlink(path)
    return summarize(times, total, len(data), data.nbytes)


def ingest_cases(path: str, data: np.ndarray, kind: str, seg: int) -> dict[str, Callable[[], dict[str, float]]]:
    """The ingest cases of one row kind, each a call that writes `data` into `path`."""
    return {
        "raw h5py, row by row": lambda: ingest_raw(path, data, seg, 1),
        "raw h5py, batch 64": lambda: ingest_raw(path, data, seg, WRITE_BATCH),
        "raw h5py, batch 64 + 2 flushes/seg": lambda: ingest_raw(path, data, seg, WRITE_BATCH, flushes=2),
        "unienv-style buffered writer, append": lambda: ingest_raw(path, data, seg, 1, buffered=True),
        "segment writer, append": lambda: ingest_h5replay(path, data, kind, seg, 1, False),
        "segment writer, extend 64": lambda: ingest_h5replay(path, data, kind, seg, WRITE_BATCH, False),
        "ReplayBuffer.commit_segment, extend 64": lambda: ingest_h5replay(path, data, kind, seg, WRITE_BATCH, True),
    }


def run_ingest(tmp: str, sizes: Sizes, repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in (SMALL, IMAGE):
        n, seg = sizes.ingest_rows[kind], sizes.segment_rows[kind]
        data = make_rows(kind, n, seed=1)
        path = os.path.join(tmp, f"ingest-{kind}.h5")
        ingest_raw(path, data, seg, WRITE_BATCH)  # warm-up, untimed: page cache and allocator
        cases = ingest_cases(path, data, kind, seg)
        # Round-robin over the cases, so a slow spell of this shared host hits all of them alike.
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
        for _ in range(repeat):
            for name, fn in cases.items():
                runs[name].append(fn())
        got = {name: median_of(r) for name, r in runs.items()}
        base, base_flush = got["raw h5py, batch 64"], got["raw h5py, batch 64 + 2 flushes/seg"]
        buffered = got["unienv-style buffered writer, append"]
        table = []
        for name, m in got.items():
            m["vs_raw_batch64"], m["vs_raw_batch64_total"] = ratios(m, base)
            check = ""
            if name == "segment writer, append":
                m["vs_buffered"], m["vs_buffered_total"] = ratios(m, buffered)
                m["target_met"] = m["vs_buffered"] >= 1.0
                check = f"{m['vs_buffered']:.2f}x unienv-style >=1x {verdict(m['vs_buffered'], 1.0)}"
            elif name.startswith("segment writer"):
                m["target_met"] = m["vs_raw_batch64"] >= 0.8
                check = f">=0.8x {verdict(m['vs_raw_batch64'], 0.8)}"
            if name.startswith("ReplayBuffer"):
                m["vs_raw_batch64_flushed"], _ = ratios(m, base_flush)
                check = f"{m['vs_raw_batch64_flushed']:.2f}x vs raw+flushes (info)"
            table.append([name, fmt(m["rows_per_s"]), f"{m['mb_per_s']:.1f}", fmt(m["units_per_s"]),
                          f"{m['p50_ms']:.2f}", f"{m['p99_ms']:.2f}", f"{m['vs_raw_batch64']:.2f}x", check])
        print_table(f"1. ingest {kind}: {n:,} rows, segments of {seg} rows (one final flush in every case; "
                    "ratios of median segment times)",
                    ["case", "rows/s", "MB/s", "seg/s", "p50 ms", "p99 ms", "vs raw b64", "target"], table)
        results[kind] = got
        del data
    return results


# ------------------------------------------------------------------------------------------ 2. reads

LAYOUTS = {"contiguous": {}, "chunked": {"chunks": True}, "gzip": {"compression": "gzip"}}


def build_read_files(tmp: str, kind: str, n: int) -> dict[str, str]:
    """One file per layout, filled with the same rows block by block, flushed and closed."""
    paths = {name: os.path.join(tmp, f"read-{kind}-{name}.h5") for name in LAYOUTS}
    stores = {name: HDF5Storage.create(space_of(kind), n, paths[name], **kw) for name, kw in LAYOUTS.items()}
    block = max(1, (16 << 20) // row_bytes(kind))
    try:
        for a in range(0, n, block):
            rows = make_rows(kind, min(block, n - a), seed=1000 + a)
            for store in stores.values():
                store.set(slice(a, a + len(rows)), rows)
    finally:
        for store in stores.values():
            store.flush()
            store.close()
    return paths


def time_reads(methods: dict[str, Callable[[np.ndarray], Any]], batches: list[np.ndarray], budget: float,
               rbytes: int) -> dict[str, dict[str, float]]:
    """Time every method on every batch, interleaved: batch i of method k is batches[(i + 7k) % n],
    so a slow spell of the shared host hits all methods alike, yet no method reads rows another
    has just pulled into the CPU caches. A method stops once its own time exceeds `budget`."""
    nb, names = len(batches), list(methods)
    # Warm-up, untimed, up to a quarter of the budget each: opens the map, walks the chunk index
    # and takes the page faults of a fresh map, so every method is timed warm, as a long-lived
    # learner runs (not the first one to touch a page paying for all). Its first two batches also
    # check that every method returns exactly the memmap gather's rows.
    for k, (name, fn) in enumerate(methods.items()):
        t0 = perf()
        for i in range(nb):
            idx = batches[(i + 7 * k) % nb]
            rows = fn(idx)
            if i < 2 and not np.array_equal(rows, methods["memmap np.take"](idx)):
                raise AssertionError(f"{name} returned other rows than the memmap gather")
            if perf() - t0 > budget / 4:
                break
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(nb):
        for k, name in enumerate(names):
            if sum(times[name]) > budget:
                continue
            idx = batches[(i + 7 * k) % nb]
            ts = perf()
            methods[name](idx)
            times[name].append(perf() - ts)
    rows = {name: len(t) * BATCH_ROWS for name, t in times.items()}
    return {name: summarize(t, sum(t), rows[name], rows[name] * rbytes) for name, t in times.items()}


def read_methods(storage: HDF5Storage, mm: np.ndarray) -> dict[str, Callable[[np.ndarray], Any]]:
    ds = storage.dataset(HDF5Storage.DEFAULT_KEY)

    def fancy(idx: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(idx, return_inverse=True)
        return ds[unique][inverse]

    def sorted_unique(idx: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(idx, return_inverse=True)
        return read_sorted_unique_rows(ds, unique)[inverse]

    return {"get": storage.get, "read_sorted_unique_rows": sorted_unique, "h5py fancy": fancy,
            "memmap np.take": lambda idx: np.take(mm, idx, axis=0)}


def run_reads(tmp: str, sizes: Sizes, repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in (SMALL, IMAGE):
        n, rbytes = sizes.read_rows[kind], row_bytes(kind)
        t0 = perf()
        paths = build_read_files(tmp, kind, n)
        print(f"\n(built {kind} files: {n:,} rows x 3 layouts in {perf() - t0:.1f} s)")
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, n, BATCH_ROWS) for _ in range(sizes.num_batches)]
        shape, dtype = ROW[kind]
        with h5py.File(paths["contiguous"], "r") as f:
            offset = int(f["data"].id.get_offset())
        # The fair baseline: a numpy gather of the very same rows, from the contiguous file's bytes
        # (viewed as a plain ndarray, so results skip memmap's Python-level __array_finalize__).
        mm = np.asarray(np.memmap(paths["contiguous"], dtype=dtype, mode="r", offset=offset, shape=(n, *shape)))
        table = []
        for layout, path in paths.items():
            storage = HDF5Storage.load_from(path, None)
            try:
                methods = read_methods(storage, mm)
                runs = [time_reads(methods, batches, sizes.budget, rbytes) for _ in range(repeat)]
                got = {name: median_of([r[name] for r in runs]) for name in methods}
            finally:
                storage.close()
            fancy, memmap = got["h5py fancy"], got["memmap np.take"]
            for name, m in got.items():
                m["vs_fancy"], m["vs_fancy_total"] = ratios(m, fancy)
                m["vs_memmap"], m["vs_memmap_total"] = ratios(m, memmap)
                check = ""
                if name == "get" and layout != "gzip":
                    m["target_met"] = m["vs_fancy"] >= 10 and m["vs_memmap"] >= 1 / 3
                    check = (f">=10x fancy {verdict(m['vs_fancy'], 10)}; "
                             f">=0.33x memmap {verdict(m['vs_memmap'], 1 / 3)}")
                elif name == "get":
                    check = "info (gzip: no map, falls back)"
                table.append([f"{layout}: {name}", fmt(m["rows_per_s"]), fmt(m["mb_per_s"]),
                              fmt(m["units_per_s"]), f"{m['p50_ms']:.3f}", f"{m['p99_ms']:.3f}",
                              str(int(m["count"])), f"{m['vs_fancy']:.1f}x", f"{m['vs_memmap']:.2f}x", check])
            results.setdefault(kind, {})[layout] = got
        del mm
        for path in paths.values():
            os.unlink(path)
        print_table(f"2. reads {kind}: {sizes.num_batches} batches of {BATCH_ROWS} random rows of {n:,} "
                    f"(interleaved, at most {sizes.budget:g} s each; memmap of the contiguous file; ratios of p50s)",
                    ["layout: method", "rows/s", "MB/s", "batch/s", "p50 ms", "p99 ms", "n",
                     "vs fancy", "vs memmap", "target (get)"], table)
    return results


# ------------------------------------------------------------------------------------------ 3. RSS


def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0])
    return out


def _rss_child(path: str, num_bytes: int, conn: Any) -> None:
    """Spawned: stream ~num_bytes of images into one segment of an unbounded storage, then commit."""
    storage = HDF5Storage.create(space_of(IMAGE), None, path)
    pool = make_rows(IMAGE, 4 * WRITE_BATCH, seed=7).reshape(4, WRITE_BATCH, 84, 84, 3)
    num_batches = max(1, num_bytes // (WRITE_BATCH * row_bytes(IMAGE)))
    writer = storage.open_segment_writer()
    try:  # reset VmHWM so it measures the peak from here on (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    before = _status_kb()
    ru_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sampled = before["VmRSS"]
    t0 = perf()
    for k in range(num_batches):
        batch = pool[k % 4]
        batch[:, 0, 0, 0] = k & 0xFF  # different bytes in every batch
        writer.extend(batch)
        if k % 32 == 0:
            sampled = max(sampled, _status_kb()["VmRSS"])
    t_stream = perf() - t0
    streamed = _status_kb()
    t1 = perf()
    writer.commit(0)
    storage.flush()
    t_commit = perf() - t1
    end = _status_kb()
    ru_end = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = num_batches * WRITE_BATCH
    storage.close()
    peak = max(sampled, end["VmRSS"], end["VmHWM"] if hwm_reset else 0)
    conn.send({
        "rows": rows, "mb": rows * row_bytes(IMAGE) / 1e6, "stream_s": t_stream, "commit_s": t_commit,
        "stream_mb_per_s": rows * row_bytes(IMAGE) / 1e6 / t_stream,
        "rss_before_mb": before["VmRSS"] / 1024, "rss_streamed_mb": streamed["VmRSS"] / 1024,
        "rss_end_mb": end["VmRSS"] / 1024, "peak_mb": peak / 1024, "hwm_reset": hwm_reset,
        "ru_maxrss_before_mb": ru_before / 1024, "ru_maxrss_end_mb": ru_end / 1024,
        "growth_mb": (peak - before["VmRSS"]) / 1024,
    })
    conn.close()


def run_rss(tmp: str, sizes: Sizes, repeat: int) -> dict[str, Any]:
    free = shutil.disk_usage(tmp).free
    need = 3 * sizes.rss_bytes
    gb = sizes.rss_bytes / 1e9
    print(f"\n3. RSS while streaming one {gb:.1f} GB segment (writes ~{2 * gb:.1f} GB: staging + final rows; "
          f"{free / 1e9:.0f} GB free in {tmp})")
    if free < need:
        print(f"   SKIPPED: needs {need / 1e9:.1f} GB free")
        return {"skipped": f"{free} bytes free, need {need}"}
    ctx = multiprocessing.get_context("spawn")
    runs = []
    for _ in range(repeat):
        path = os.path.join(tmp, "rss.h5")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rss_child, args=(path, sizes.rss_bytes, child))
        proc.start()
        child.close()
        try:
            runs.append(parent.recv())
        except EOFError:
            proc.join(timeout=60)
            print(f"   FAILED: the child process died (exit code {proc.exitcode}); see its traceback above")
            return {"failed": True}
        finally:
            proc.join(timeout=60)
            if os.path.exists(path):
                os.unlink(path)
    r = {k: (statistics.median(run[k] for run in runs) if not isinstance(runs[0][k], bool) else runs[0][k])
         for k in runs[0]}
    r["target_met"] = r["growth_mb"] < 100
    print_table("", ["figure", "value"], [
        ["rows streamed (batches of 64)", f"{int(r['rows']):,} ({r['mb']:.0f} MB)"],
        ["stream (extend): s / MB/s", f"{r['stream_s']:.2f} / {r['stream_mb_per_s']:.0f}"],
        ["commit + flush: s", f"{r['commit_s']:.2f}"],
        ["VmRSS before / after stream / after commit MB",
         f"{r['rss_before_mb']:.1f} / {r['rss_streamed_mb']:.1f} / {r['rss_end_mb']:.1f}"],
        ["peak VmRSS MB (VmHWM reset before streaming)" if r["hwm_reset"] else "peak sampled VmRSS MB",
         f"{r['peak_mb']:.1f}"],
        ["ru_maxrss before / end MB (lifetime, inherits the parent's)",
         f"{r['ru_maxrss_before_mb']:.1f} / {r['ru_maxrss_end_mb']:.1f}"],
        ["growth (peak - before) MB, target < 100", f"{r['growth_mb']:.1f}  {'PASS' if r['target_met'] else 'MISS'}"],
    ])
    return r


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 30 s: a smoke test")
    parser.add_argument("--only", choices=("ingest", "reads", "rss"), help="run one section")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--repeat", type=int, default=1, metavar="N", help="median of N runs (default 1)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    sizes = QUICK if args.quick else FULL
    print(f"h5replay storage benchmark ({'quick' if args.quick else 'full'}, repeat {args.repeat}): "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}, h5py {h5py.version.version}, "
          f"HDF5 {h5py.version.hdf5_version}, {os.cpu_count()} CPUs")
    results: dict[str, Any] = {"meta": {"quick": args.quick, "repeat": args.repeat, "sizes": asdict(sizes),
                                        "numpy": np.__version__, "h5py": h5py.version.version,
                                        "hdf5": h5py.version.hdf5_version}}
    sections = {"ingest": run_ingest, "reads": run_reads, "rss": run_rss}
    started = perf()
    with tempfile.TemporaryDirectory(prefix="h5replay-bench-") as tmp:
        for name, run in sections.items():
            if args.only in (None, name):
                results[name] = run(tmp, sizes, args.repeat)
    results["meta"]["seconds"] = perf() - started
    print(f"\ndone in {results['meta']['seconds']:.1f} s (targets are informational; exit status is 0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
