"""Several tables over one ring: what each table keeps apart, bad input named on every path,
files made before tables, restarts and a SIGKILL of the writer. (The state machine in
tests/property/test_tables_model.py walks the same against a model.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest

from h5replay.errors import ConfigError, RateLimitedError, ReadOnlyError
from h5replay.sampling import DEFAULT_TABLE, Fifo, Lifo, Prioritized, RateLimit, Table, Uniform
from h5replay.storage import BoxSpace, ReplayBuffer, compact_file, export_file

pytestmark = pytest.mark.timeout(60)

SPACE = BoxSpace(0, 2**40, (), np.int64)  # every row holds its own id
REPLAY = "_h5replay/replay"
TABLES = {"replay": Table(Prioritized(1.0)), "queue": Table(Fifo(), max_times_sampled=1), "uniform": Table()}


def make(path: Path, capacity: int | None = 100, tables: dict[str, Table] | None = None) -> ReplayBuffer:
    return ReplayBuffer.create(SPACE, capacity, path, tables=tables or TABLES)


def test_a_row_the_queue_removed_is_still_drawn_by_the_other_tables(tmp_path: Path) -> None:
    with make(tmp_path / "b.h5") as rb:
        rb.extend(np.arange(10), priorities=np.arange(1, 11, dtype=float))
        rb.end_episode()
        assert rb.sample(10, table="queue").tolist() == list(range(10))  # the queue is drained
        with pytest.raises(Exception, match="without replacement"):
            rb.sample(1, table="queue")
        assert len(rb) == 10  # ... and every row stays in the ring for the others
        drawn, info = rb.sample(2000, np.random.default_rng(0), with_info=True, table="replay")
        assert set(drawn.tolist()) == set(range(10))
        np.testing.assert_allclose(info.probabilities, (info.row_ids.astype(float) + 1) / 55.0)
        assert set(rb.sample(500, np.random.default_rng(1), table="uniform").tolist()) == set(range(10))
        info_ = rb.info()
        assert info_["table.queue.sampleable"] == 0 and info_["table.replay.sampleable"] == 10
        assert info_["table.queue.sampled"] == 10 and info_["table.replay.sampled"] == 2000
        assert info_["tables"] == "replay,queue,uniform"


def test_rows_leave_the_ring_early_only_when_every_table_removed_them(tmp_path: Path) -> None:
    tables = {"old": Table(Fifo(), max_times_sampled=1), "new": Table(Lifo(), max_times_sampled=1)}
    with make(tmp_path / "b.h5", 10, tables) as rb:
        rb.extend(np.arange(6))
        assert rb.sample(3, table="old").tolist() == [0, 1, 2]
        assert len(rb) == 6  # "new" may still sample 0, 1, 2
        assert rb.sample(6, table="new").tolist() == [5, 4, 3, 2, 1, 0]
        assert len(rb) == 3 and rb.view.begin == 3  # both removed 0, 1, 2: they left
        assert rb.sample(3, table="old").tolist() == [3, 4, 5]
        assert len(rb) == 0


def test_each_tables_rate_limit_holds_alone_and_inserts_wait_on_any(tmp_path: Path) -> None:
    tables = {"limited": Table(rate_limit=RateLimit(1, 1.0, 3.0)), "free": Table()}
    with make(tmp_path / "b.h5", 100, tables) as rb:
        rb.extend(np.arange(4))
        for _ in range(50):  # the free table's samples count for nothing in the other's limit
            rb.sample(4, table="free")
        with pytest.raises(RateLimitedError, match="table 'limited': inserts are ahead of sampling"):
            rb.extend(np.arange(4, 6))
        rb.sample(4, table="limited")
        with pytest.raises(RateLimitedError, match="table 'limited': sampling is ahead of inserts"):
            rb.sample(4, table="limited")
        rb.extend(np.arange(4, 6))
        assert rb.rate_limit_blocker(3, sampling=True, table="limited")[0] is None
        assert rb.rate_limit_blocker(1000, sampling=True, table="limited")[1]  # never, and said so
        assert rb.rate_limit_blocker(1000, sampling=True, table="free") == (None, False)


def test_priorities_go_to_the_tables_they_name(tmp_path: Path) -> None:
    tables = {"a": Table(Prioritized(1.0)), "b": Table(Prioritized(1.0)), "q": Table(Fifo(), max_times_sampled=1)}
    with make(tmp_path / "b.h5", 100, tables) as rb:
        rb.extend(np.arange(3), priorities=[1.0, 2.0, 3.0])  # a bare array: every prioritized table
        rb.extend(np.arange(3, 5), priorities={"b": [7.0, 8.0]})  # only b's; a takes its default
        writer = rb.open_segment_writer()
        writer.extend(np.arange(5, 7), priorities=[5.0, 6.0])
        rb.commit_segment(writer)
        assert rb.priorities(range(7), table="a").tolist() == [1.0, 2.0, 3.0, 3.0, 3.0, 5.0, 6.0]
        assert rb.priorities(range(7), table="b").tolist() == [1.0, 2.0, 3.0, 7.0, 8.0, 5.0, 6.0]
        rb.update_priorities([0], [9.0], table="b")
        assert rb.priorities([0], table="a").tolist() == [1.0] and rb.priorities([0], table="b").tolist() == [9.0]


@pytest.mark.parametrize(("call", "says"), [
    (lambda rb: rb.sample(1), "3 tables ('replay', 'queue', 'uniform'): name one with table="),
    (lambda rb: rb.sample(1, table="nope"), "no table 'nope': this buffer's tables are 'replay', 'queue', 'uniform'"),
    (lambda rb: rb.sample_sequences(1, 2, table="nope"), "no table 'nope'"),
    (lambda rb: rb.update_priorities([0], [1.0]), "name one with table="),
    (lambda rb: rb.update_priorities([0], [1.0], table="queue"), "table 'queue' samples by Fifo()"),
    (lambda rb: rb.priorities([0], table="uniform"), "only a Prioritized sampler keeps priorities"),
    (lambda rb: rb.extend(np.arange(2), priorities={"queue": [1.0, 2.0]}), "table 'queue' samples by Fifo()"),
    (lambda rb: rb.extend(np.arange(2), priorities={"nope": [1.0, 2.0]}), "no table 'nope'"),
    (lambda rb: rb.extend(np.arange(2), priorities={"replay": [1.0]}), "got 1 priorities for 2 rows"),
    (lambda rb: rb.extend(np.arange(2), priorities=[1.0, -1.0]), "priority 1 is -1.0"),
    (lambda rb: rb.sampling, "name one with table="),
])
def test_bad_table_input_is_refused_naming_it_and_changes_nothing(tmp_path: Path, call: object, says: str) -> None:
    with make(tmp_path / "b.h5") as rb:
        rb.extend(np.arange(4), priorities=[1.0, 2.0, 3.0, 4.0])
        rb.end_episode()
        before = (rb.view, rb.priorities(range(4), table="replay").tolist())
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            call(rb)  # type: ignore[operator]
        assert (rb.view, rb.priorities(range(4), table="replay").tolist()) == before


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"tables": {}}, "non-empty mapping"),
    ({"tables": {"a b": Table()}}, "a table's name is"),
    ({"tables": {".x": Table()}}, "a table's name is"),
    ({"tables": {"a": Uniform()}}, "table 'a' must be a Table"),
    ({"tables": {f"t{i}": Table() for i in range(17)}}, "at most 16 tables"),
    ({"tables": {"a": Table()}, "sampler": Uniform()}, "not both"),
    ({"tables": {"q": Table(rate_limit=RateLimit(min_size_to_sample=500))}}, "table 'q': min_size_to_sample=500"),
])
def test_bad_tables_are_refused_before_any_file_is_made(tmp_path: Path, kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        ReplayBuffer.create(SPACE, 100, tmp_path / "b.h5", **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "b.h5").exists()


@pytest.mark.parametrize("way", ["reopen", "export", "compact"])
def test_tables_and_their_counters_survive_a_reopen_an_export_and_a_compaction(tmp_path: Path, way: str) -> None:
    path = tmp_path / "b.h5"
    with make(path) as rb:
        rb.extend(np.arange(8), priorities=np.arange(1, 9, dtype=float))
        rb.sample(3, table="queue")
        rb.sample(5, table="uniform")
        rb.update_priorities([1], [50.0], table="replay")
    if way == "export":
        export_file(path, tmp_path / "copy.h5")
        path = tmp_path / "copy.h5"
    elif way == "compact":
        compact_file(path)
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        assert rb.tables == TABLES
        info = rb.info()
        assert (info["table.queue.sampled"], info["table.uniform.sampled"], info["table.replay.sampled"]) == (3, 5, 0)
        assert info["table.queue.sampleable"] == 5 and len(rb) == 8
        assert rb.priorities([1, 2], table="replay").tolist() == [50.0, 3.0]
        assert rb.sample(2, table="queue").tolist() == [3, 4]  # the queue goes on where it was


def test_a_reader_process_samples_the_tables_only_the_writer_need_not(tmp_path: Path) -> None:
    path = tmp_path / "b.h5"
    with make(path) as rb:
        rb.extend(np.arange(5), priorities=[1.0, 1.0, 1.0, 1.0, 6.0])
        rb.end_episode()
        rb.flush()
        with ReplayBuffer.load_from(path, read_only=True, multiprocessing=True) as reader:
            _, info = reader.sample(4, np.random.default_rng(0), with_info=True, table="replay")
            np.testing.assert_allclose(info.probabilities, np.where(info.row_ids == 4, 0.6, 0.1))
            with pytest.raises(ReadOnlyError, match="table 'queue': max_times_sampled=1 removes rows"):
                reader.sample(1, table="queue")
            rb.update_priorities([4], [1.0], table="replay")
            rb.flush()
            _, info = reader.sample(4, np.random.default_rng(0), with_info=True, table="replay")
            np.testing.assert_allclose(info.probabilities, 0.2)


def _as_layout_2(path: Path) -> None:
    """Rewrite a one-table file as h5replay wrote files before tables: the table's settings and
    datasets in the replay group itself, and a journal of one row with its counters inline."""
    with h5py.File(path, "r+") as f:
        group = f[REPLAY]
        table = group[f"tables/{DEFAULT_TABLE}"]
        for name in list(table):
            group.move(f"tables/{DEFAULT_TABLE}/{name}", name)
        for name, value in table.attrs.items():
            group.attrs[name] = value
        del group["tables"]
        del group.attrs["tables"]
        journal = group["journal"][...]
        row = np.zeros(16, np.int64)
        row[:12] = journal[:12]  # mark, layout, seq ... inserted
        row[1] = 2
        row[12:15] = journal[16 + 4 : 16 + 7]  # the table's sampled, plog, pckpt
        row[15] = zlib.crc32(row[:15].tobytes())
        del group["journal"]
        group.create_dataset("journal", data=row, maxshape=(16,), chunks=(16,))


def test_a_file_made_before_tables_opens_as_the_table_default_and_is_upgraded_when_written(tmp_path: Path) -> None:
    path = tmp_path / "old.h5"
    with ReplayBuffer.create(SPACE, 10, path, sampler=Prioritized(1.0), max_times_sampled=2) as rb:
        rb.extend(np.arange(4), priorities=[1.0, 2.0, 3.0, 4.0])
        rb.sample(2, np.random.default_rng(0))
        rb.update_priorities([0], [7.0])
    with ReplayBuffer.load_from(path, read_only=True) as rb:
        expected = rb.info()
    _as_layout_2(path)
    with ReplayBuffer.load_from(path, read_only=True, multiprocessing=True) as reader:  # read as it is
        assert reader.tables == {DEFAULT_TABLE: Table(Prioritized(1.0), max_times_sampled=2)}
        assert reader.priorities(range(4)).tolist() == [7.0, 2.0, 3.0, 4.0]
        assert reader.info()["table.default.sampled"] == 2
    with ReplayBuffer.load_from(path, read_only=False) as rb:  # upgraded: same rows, counters, priorities
        assert {**rb.info(), "seq": expected["seq"]} == {**expected, "sampleable": 4, "priority_updates_ignored": 0,
                                                          "table.default.sampleable": 4,
                                                          "table.default.priority_updates_ignored": 0}
        assert rb.priorities(range(4)).tolist() == [7.0, 2.0, 3.0, 4.0]
    with h5py.File(path, "r") as f:
        assert json.loads(f[REPLAY].attrs["tables"]) == [DEFAULT_TABLE] and "priorities" not in f[REPLAY]
        assert f[REPLAY]["journal"].shape == (32,)


_KILLED_WRITER = textwrap.dedent("""
    import sys, numpy as np
    from h5replay.sampling import Fifo, Prioritized, RateLimit, Table
    from h5replay.storage import BoxSpace, ReplayBuffer
    tables = {"replay": Table(Prioritized(1.0)), "queue": Table(Fifo(), max_times_sampled=1),
              "limited": Table(rate_limit=RateLimit(1, 1.0, 1000.0))}
    rb = ReplayBuffer.create(BoxSpace(0, 2**40, (), np.int64), 50, sys.argv[1], tables=tables)
    for i in range(20):
        w = rb.open_segment_writer()
        w.extend(np.arange(3 * i, 3 * i + 3), priorities=[1.0 + i] * 3)
        rb.commit_segment(w)
        rb.sample(2, table="queue")
        rb.sample(3, table="limited")
        rb.update_priorities([3 * i], [100.0 + i], table="replay")
        rb.flush()
    w = rb.open_segment_writer()
    w.extend(np.arange(1000, 1003))
    rb.sample(5, table="queue")  # counted in memory, never published: gone with the process
    print("ready", flush=True)
    sys.stdin.read()
""")


def test_every_tables_counters_and_removals_are_exact_after_a_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "b.h5"
    with subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path)], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            proc.kill()
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        info = rb.info()
        assert len(rb) == 50 and rb.view.begin == 10  # 60 rows committed, capacity 50
        assert (info["table.queue.sampled"], info["table.limited.sampled"], info["table.replay.sampled"]) == (40, 60, 0)
        # The queue removed rows 0..39 (two per commit, oldest first): 10..39 of those held.
        assert info["table.queue.sampleable"] == 20
        assert rb.sample(20, table="queue").tolist() == list(range(40, 60))
        assert rb.priorities([12, 13, 57], table="replay").tolist() == [104.0, 5.0, 119.0]
