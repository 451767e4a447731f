"""A real writer process (and its reader processes) with actors and learners over loopback TCP.

What is read must equal what was sent, with episode boundaries and order kept; the reopened file
must hold every committed episode exactly once, and nothing else.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time

import numpy as np
import pytest
from service_helpers import (
    EPISODE_SPACE,
    SPAWN,
    actor_main,
    endpoint,
    episode_problems,
    episode_rows,
    file_episodes,
    learner_main,
    processes,
    read_file,
    running_server,
    server_config,
    wait_until,
)

from h5replay.client import ActorClient, LearnerClient, Receipt
from h5replay.config import ClientConfig
from h5replay.errors import NotEnoughDataError, SegmentStateError, ServerUnavailableError, SpaceMismatchError
from h5replay.storage import BinarySpace, BoxSpace, DictSpace, TextSpace


def concat(*batches: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def take(rows: dict[str, np.ndarray], idx) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in rows.items()}


def assert_rows_equal(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"leaf {key!r}")


# ------------------------------------------------------------------------------------ round trip


@pytest.mark.timeout(60)
def test_round_trip_through_every_client_call(start_server, tmp_path):
    server = start_server()
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        assert actor.space == EPISODE_SPACE and learner.space == EPISODE_SPACE
        assert actor.capacity == learner.capacity == 10_000
        assert learner.read_endpoint == server.read_endpoint != server.config.read_bind  # port 0: a free port

        first = episode_rows(1, 0, 5)  # step by step
        seg = actor.segment()
        for i in range(5):
            seg.append(take(first, i))
        assert len(seg) == 5
        assert seg.commit() == Receipt(episode_id=0, first_row_id=0, length=5)
        with pytest.raises(SegmentStateError, match="committed"):
            seg.commit()

        second = episode_rows(1, 1, 600)  # in uneven pieces, more than one message's worth
        seg = actor.segment()
        for lo, hi in ((0, 1), (1, 250), (250, 257), (257, 600)):
            seg.extend(take(second, slice(lo, hi)))
        assert seg.commit() == Receipt(1, 5, 600)

        seg = actor.segment()  # streamed to the server, then dropped
        seg.extend(episode_rows(1, 2, 300))
        seg.abort()
        seg.abort()  # safe twice
        with pytest.raises(SegmentStateError, match="aborted"):
            seg.append(take(first, 0))

        third, fourth = episode_rows(1, 3, 7), episode_rows(1, 4, 400)
        assert actor.push_episode(third) == Receipt(2, 605, 7)  # one message
        assert actor.push_episode(fourth) == Receipt(3, 612, 400)  # over batch_rows: a segment
        assert actor.segment().commit().length == 0  # an empty episode records nothing

        # The learner reads its own process's writes at once: a commit is published before it returns.
        everything = concat(first, second, third, fourth)
        assert learner.get_segments() == [(0, 5), (5, 600), (605, 7), (612, 400)]
        assert len(learner) == 1012

        idx = [0, -1, 3, 3, 700, -1012, 611, 611]  # negatives, duplicates, any order
        assert_rows_equal(learner.get(idx), take(everything, np.array(idx) % 1012))
        assert_rows_equal(learner.get(np.arange(605, 612)), third)
        with pytest.raises(IndexError, match="1012"):
            learner.get([1012])
        with pytest.raises(IndexError):
            learner.get([0, -1013])
        assert learner.get([])["obs"].shape == (0, 16)

        batch, info = learner.sample(64, seed=7, with_info=True)
        again, again_info = learner.sample(64, seed=7, with_info=True)
        np.testing.assert_array_equal(info.row_ids, again_info.row_ids)
        assert info.row_ids.dtype == np.uint64 and info.episode_ids.dtype == np.uint64
        assert_rows_equal(batch, again)
        assert_rows_equal(batch, take(everything, info.row_ids.astype(np.int64)))
        assert_rows_equal(learner.get_rows(info.row_ids), batch)
        np.testing.assert_allclose(info.probabilities, 1 / 1012)
        firsts = np.array([0, 5, 605, 612])
        np.testing.assert_array_equal(info.episode_ids, np.searchsorted(firsts, info.row_ids.astype(np.int64), "right") - 1)
        _, other = learner.sample(64, seed=8, with_info=True)
        assert not np.array_equal(info.row_ids, other.row_ids)
        assert_rows_equal(learner.sample(16, seed=3), learner.sample(16, seed=3))

        windows = learner.sample_sequences(10, 6, seed=1)
        assert windows["obs"].shape == (10, 6, 16) and windows["step"].shape == (10, 6)
        assert np.all(windows["episode"] == windows["episode"][:, :1])
        assert np.all(np.diff(windows["step"], axis=1) == 1)
        assert not np.any(windows["episode"] == 2)  # rows of the aborted episode are nowhere
        with pytest.raises(NotEnoughDataError, match="600"):  # no episode holds 601 steps
            learner.sample_sequences(1, 601)
        assert not np.any(learner.sample(512, seed=5)["episode"] == 2)

        info = learner.info()
        assert info["length"] == 1012 and info["capacity"] == 10_000
        assert info["num_episodes"] == 4 and info["total_episodes"] == 4
        assert info["open_segments"] == 0 and info["clients"] >= 2
        assert 1012 < info["rows_in"] <= 1012 + 300 and info["aborts"] >= 1  # unsent rows of an abort stay home
        assert info["rows_out"] > 0 and info["read_requests"] > 0 and info["server_version"]
        assert actor.info()["length"] == 1012
    assert server.stop() == 0
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == []
    assert found == [(1, 0), (1, 1), (1, 3), (1, 4)]


@pytest.mark.timeout(60)
def test_text_and_bool_leaves_cross_the_wire(start_server, tmp_path):
    space = DictSpace({"done": BinarySpace(), "mask": BinarySpace((3,)), "note": TextSpace(8),
                       "x": BoxSpace(0, 100, (), np.int64)})
    server = start_server(space=space, capacity=100)
    notes = ["", "héllo", "日本語テキスト", "12345678", "🙂🙂🙂🙂🙂🙂🙂🙂", "a\tb c"]
    batch = {
        "done": np.array([False, False, True, False, True, True]),
        "mask": np.array([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=bool),
        "note": notes,
        "x": np.arange(6, dtype=np.int64),
    }
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        actor.push_episode(batch)
        with actor.segment() as seg:
            seg.append({"done": True, "mask": [1, 1, 0], "note": "fin", "x": 6})
        with pytest.raises(SpaceMismatchError, match="note"):  # refused before it leaves the process
            actor.push_episode({**batch, "note": ["far too long for eight", *notes[1:]]})
        got = learner.get(np.arange(7))
        assert got["note"].tolist() == [*notes, "fin"]
        assert got["done"].dtype == bool and got["done"].tolist() == [*batch["done"].tolist(), True]
        np.testing.assert_array_equal(got["mask"], np.vstack([batch["mask"], [[True, True, False]]]))
        np.testing.assert_array_equal(got["x"], np.arange(7))
        sampled = learner.sample(20, seed=0)
        assert set(sampled["note"].tolist()) <= {*notes, "fin"}
        assert learner.get_segments() == [(0, 6), (6, 1)]
    assert server.stop() == 0
    segments, rows = read_file(tmp_path / "rb.h5")
    assert segments == [(0, 6), (6, 1)]
    assert rows["note"].tolist() == [*notes, "fin"]


@pytest.mark.timeout(60)
def test_segment_context_manager_commits_on_exit_and_aborts_on_exception(start_server, tmp_path):
    server = start_server()
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        with actor.segment() as seg:
            seg.extend(episode_rows(2, 0, 40))
        assert seg.receipt == Receipt(0, 0, 40)

        with pytest.raises(KeyError), actor.segment() as doomed:
            doomed.extend(episode_rows(2, 1, 300))  # 256 rows are on the server already
            raise KeyError("the environment crashed")
        assert actor.info()["open_segments"] == 0
        with pytest.raises(SegmentStateError):
            doomed.commit()

        with actor.segment() as seg:  # an explicit commit inside the block is not repeated
            seg.extend(episode_rows(2, 2, 3))
            receipt = seg.commit()
        assert receipt == seg.receipt == Receipt(1, 40, 3)
        assert learner.get_segments() == [(0, 40), (40, 3)]
        assert not np.any(learner.get(np.arange(43))["episode"] == 1)
    assert server.stop() == 0
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == [] and found == [(2, 0), (2, 2)]


# ------------------------------------------------------------------------ many clients, one process


def _actor_thread(client: ActorClient, actor: int, episodes: range, receipts: dict, errors: list) -> None:
    try:
        for e in episodes:
            n = 1 + (actor * 37 + e * 11) % 290
            rows = episode_rows(actor, e, n)
            if e % 2:
                receipts[(actor, e)] = client.push_episode(rows)
            else:
                with client.segment() as seg:
                    seg.extend(take(rows, slice(0, n // 2)))
                    for i in range(n // 2, n):
                        seg.append(take(rows, i))
                receipts[(actor, e)] = seg.receipt
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def _learner_thread(learner: LearnerClient, stop: threading.Event, problems: list, errors: list) -> None:
    try:
        while not stop.is_set():
            for start, length in learner.get_segments()[-3:]:
                problems.extend(episode_problems(learner.get(np.arange(start, start + length)), length))
            time.sleep(0.01)
    except BaseException as exc:
        errors.append(exc)


@pytest.mark.timeout(60)
def test_several_actors_and_learners_in_one_process(start_server, tmp_path):
    server = start_server()
    own = [ActorClient(server.endpoint, timeout=10, name=f"own-{i}") for i in range(2)]
    shared = ActorClient(server.endpoint, timeout=10, name="shared")
    learners = [LearnerClient(server.endpoint, timeout=10) for _ in range(2)]
    receipts: dict = {}
    errors: list = []
    problems: list = []
    stop = threading.Event()
    try:
        # actors 0, 1 own a client each; actors 2, 3 share one; three readers share two learners
        writers = [threading.Thread(target=_actor_thread, args=(client, a, range(12), receipts, errors))
                   for a, client in enumerate([*own, shared, shared])]
        readers = [threading.Thread(target=_learner_thread, args=(learners[i % 2], stop, problems, errors))
                   for i in range(3)]
        for t in [*writers, *readers]:
            t.start()
        for t in writers:
            t.join(40)
        stop.set()
        for t in readers:
            t.join(10)
        assert not any(t.is_alive() for t in [*writers, *readers])
    finally:
        stop.set()
        for client in [*own, shared, *learners]:
            client.close()
    assert errors == [] and problems == []
    assert len(receipts) == 48
    assert server.stop() == 0
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == []
    assert sorted(found) == sorted(receipts)
    by_id = sorted(receipts.items(), key=lambda item: item[1].episode_id)
    assert [key for key, _ in by_id] == found  # receipts name the file's episodes in commit order


# ---------------------------------------------------------------------------------- unavailable


@pytest.mark.timeout(30)
@pytest.mark.parametrize("client_class", [ActorClient, LearnerClient])
def test_nothing_listening_raises_server_unavailable_in_time(client_class):
    nowhere = endpoint()
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=nowhere.rpartition(":")[2]) as caught:
        client_class(nowhere, timeout=0.5)
    assert time.monotonic() - started < 2.0
    assert isinstance(caught.value, TimeoutError)


# --------------------------------------------------------------------------------- other set-ups


@pytest.mark.timeout(60)
def test_writer_serves_reads_when_there_are_no_reader_processes(start_server, tmp_path):
    server = start_server(num_readers=0, multiprocessing=False)
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.read_endpoint == server.endpoint
        episodes = [episode_rows(3, e, 10 + 50 * e) for e in range(4)]
        receipts = [actor.push_episode(rows) for rows in episodes]
        assert [r.length for r in receipts] == [10, 60, 110, 160]
        assert learner.get_segments() == [(0, 10), (10, 60), (70, 110), (180, 160)]
        assert_rows_equal(learner.get(np.arange(70, 180)), episodes[2])
        assert_rows_equal(learner.sample(8, seed=4), learner.sample(8, seed=4))
        assert learner.sample_sequences(4, 20)["step"].shape == (4, 20)
        assert learner.info()["rows_out"] > 0
    assert server.stop() == 0
    found, problems = file_episodes(tmp_path / "rb.h5")
    assert problems == [] and found == [(3, e) for e in range(4)]


@pytest.mark.timeout(60)
def test_several_reader_processes_behind_the_proxy(start_server, tmp_path):
    server = start_server(num_readers=2)
    wire = ClientConfig(endpoint=server.endpoint, timeout=10, local_reads=False)  # the readers draw
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(config=wire) as learner:
        episodes = [episode_rows(4, e, 20) for e in range(5)]
        for rows in episodes:
            actor.push_episode(rows)
        for _ in range(20):  # the proxy spreads these over both readers
            assert_rows_equal(learner.get(np.arange(40, 60)), episodes[2])
            assert learner.sample(16)["step"].shape == (16,)
        assert learner.info()["read_requests"] >= 40
    assert server.stop() == 0


@pytest.mark.timeout(60)
def test_a_space_that_is_one_bare_leaf(start_server, tmp_path):
    space = BoxSpace(-1000, 1000, (3,), np.float32)
    server = start_server(space=space, capacity=50)
    steps = np.arange(30, dtype=np.float32)[:, None] * np.array([1, -1, 0.5], np.float32)
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        assert actor.space == space
        assert learner.get_segments() == [] and len(learner) == 0
        with pytest.raises(NotEnoughDataError, match="empty"):
            learner.sample(1)
        assert actor.push_episode(steps[:10]) == Receipt(0, 0, 10)
        with actor.segment() as seg:
            for row in steps[10:30]:
                seg.append(row)
        got = learner.get([0, 29, -1, 5])
        assert isinstance(got, np.ndarray) and got.dtype == np.float32
        np.testing.assert_array_equal(got, steps[[0, 29, 29, 5]])
        np.testing.assert_array_equal(learner.sample(5, seed=1), learner.sample(5, seed=1))
        assert learner.sample_sequences(2, 4).shape == (2, 4, 3)
        assert learner.get_segments() == [(0, 10), (10, 20)]
    assert server.stop() == 0
    segments, rows = read_file(tmp_path / "rb.h5")
    assert segments == [(0, 10), (10, 20)]
    np.testing.assert_array_equal(rows, steps)


# ------------------------------------------------------------------------------ the full scenario

NUM_ACTORS, NUM_EPISODES, VICTIM, VICTIM_EPISODES = 8, 50, 5, 20


@pytest.mark.slow
@pytest.mark.timeout(110)
def test_eight_actors_two_learners_and_an_actor_killed_mid_episode(tmp_path):
    config = server_config(tmp_path / "rb.h5", capacity=NUM_ACTORS * NUM_EPISODES * 300)
    committed: dict[int, list[tuple[int, int, int, int]]] = {}
    learned = []
    with running_server(config) as server, processes() as procs:
        results, learner_out = SPAWN.Queue(), SPAWN.Queue()
        stop, partial = SPAWN.Event(), SPAWN.Event()
        actors = {
            a: SPAWN.Process(
                target=actor_main,
                args=(server.endpoint, a, VICTIM_EPISODES if a == VICTIM else NUM_EPISODES, 100 + a, results,
                      partial if a == VICTIM else None),
                name=f"actor-{a}",
            )
            for a in range(NUM_ACTORS)
        }
        learners = [SPAWN.Process(target=learner_main, args=(server.endpoint, s, stop, learner_out), name=f"learner-{s}")
                    for s in range(2)]
        for proc in [*actors.values(), *learners]:
            proc.start()
            procs.append(proc)

        deadline = time.monotonic() + 80
        killed = False
        while len(committed) < NUM_ACTORS:
            assert time.monotonic() < deadline, f"only actors {sorted(committed)} finished"
            if not killed and partial.is_set():
                os.kill(actors[VICTIM].pid, signal.SIGKILL)  # 290 rows of its episode are on the server
                killed = True
            try:
                kind, actor, receipts = results.get(timeout=0.1)
            except queue.Empty:
                dead = [a for a, p in actors.items() if p.exitcode not in (None, 0) and a not in committed]
                assert not dead or dead == [VICTIM] and killed, f"actor(s) {dead} failed"
                continue
            assert kind == "committed"
            committed[actor] = receipts
        assert wait_until(lambda: killed or partial.is_set(), 30)
        if not killed:
            os.kill(actors[VICTIM].pid, signal.SIGKILL)
        for a, proc in actors.items():
            proc.join(30)
            assert proc.exitcode == (-signal.SIGKILL if a == VICTIM else 0), (a, proc.exitcode)
        stop.set()
        learned = [learner_out.get(timeout=30) for _ in learners]
        for proc in learners:
            proc.join(30)
            assert proc.exitcode == 0

        with ActorClient(server.endpoint, timeout=10) as probe:  # the victim's open segment went away
            assert wait_until(lambda: probe.info()["open_segments"] == 0, 10)
            assert probe.info()["aborts"] >= 1
        assert server.stop() == 0

    expected = {(a, e): (n, episode_id, start) for a, receipts in committed.items() for e, n, episode_id, start in receipts}
    for problems, seen, reads in learned:
        assert problems == []
        assert reads >= 3
        assert set(map(tuple, seen)) <= expected.keys()  # learners only ever saw committed episodes

    found, problems = file_episodes(config.path)
    assert problems == []
    assert len(found) == len(set(found)) == len(expected)  # each committed episode exactly once
    assert set(found) == expected.keys()
    assert (VICTIM, VICTIM_EPISODES) not in found  # the partial episode never appears
    segments, _ = read_file(config.path)
    for key, (n, episode_id, start) in expected.items():
        assert found[episode_id] == key and segments[episode_id] == (start, n)
    for a in range(NUM_ACTORS):  # each actor's episodes are in the file in the order it sent them
        mine = [e for actor, e in found if actor == a]
        assert mine == sorted(mine)


@pytest.mark.timeout(60)
def test_an_actor_copies_each_appended_step_so_the_caller_may_reuse_its_arrays(start_server, tmp_path):
    """Steps of exactly the stored dtypes and shapes take the actor's fast path (no conversion):
    it still copies them, so one set of arrays refilled for every step stores every step."""
    server = start_server()
    rows = episode_rows(3, 0, 300)  # more than one message's worth: sent in batches as it goes
    step = {k: np.empty(v.shape[1:], v.dtype) for k, v in rows.items()}  # reused for every step
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        seg = actor.segment()
        for i in range(300):
            for k in step:
                step[k][...] = rows[k][i]
            seg.append(step)
        seg.append({"actor": 3, "episode": 0, "step": 300, "length": 300, "obs": rows["obs"][0].tolist()})  # converted
        receipt = seg.commit()
        got = learner.get_rows(receipt.first_row_id + np.arange(301))
    for k in rows:
        assert np.array_equal(got[k][:300], rows[k]), k
    assert got["step"][300] == 300 and np.array_equal(got["obs"][300], rows["obs"][0])
    assert server.stop() == 0


def test_a_server_bound_to_port_0_lets_its_reader_pick_a_free_port_too(start_server):
    """Regression: with bind port 0 and no read_bind, the reader bound the port after the one the
    kernel picked, and failed to start when another socket held it (seen under make test). Both
    now come from the kernel; on Linux bind(0) hands out ports of one parity, so the read port is
    never the next one."""
    server = start_server(bind="tcp://127.0.0.1:0", read_bind=None, num_readers=1)
    write_port, read_port = (int(endpoint.rpartition(":")[2]) for endpoint in server.endpoints)
    assert read_port not in (0, write_port + 1)
    with ActorClient(server.endpoint) as actor, LearnerClient(server.endpoint) as learner:
        actor.push_episode(episode_rows(1, 0, 10))
        assert learner.wait_for_size(10, timeout=10) == 10
        assert learner.read_endpoint.endswith(f":{read_port}")
