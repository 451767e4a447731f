"""SIGKILL the writer at random moments while actors stream and learners sample; restart it with
no manual step; nothing acknowledged is lost, nothing torn or aborted is visible.

Durability level under test: a commit is acknowledged after the episode's rows and the replay
state that points at them were written and flushed to the OS (`ReplayBuffer.commit_segment`
publishes before it returns). That survives a crash of the server process; it does not survive
power loss unless the server runs with `fsync=True` (`--fsync`).

The server clears HDF5's SWMR status marks itself when it reopens a file whose writer died
(storage/recovery.py): no `h5clear` is run here, and one round restarts through the real
`python -m h5replay serve` command.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter

import numpy as np
import pytest
from fault_helpers import (
    CrashHistory,
    cli_server,
    crash_actor_main,
    crash_async_actor_main,
    crash_learner_main,
    drain,
    read_file_state,
    segment_table_problems,
)
from service_helpers import EPISODE_SPACE, SPAWN, endpoint, episode_rows, processes, server_config

from h5replay.client import LearnerClient
from h5replay.server import ServerProcess
from h5replay.storage import ReplayBuffer
from h5replay.storage.recovery import status_flags

SEED = 20_261_130
ROUNDS = 20  # kills; then one more start for a clean shutdown
CLI_ROUND = 10  # this round's server is `python -m h5replay serve`
READER_ROUNDS = {0, 7, 14}  # these (and the CLI round) serve reads from reader processes
CAPACITY = 20_000  # small enough that the ring wraps several times during the test
MAX_LEN = 300
NUM_ACTORS = 4
NUM_LEARNERS = 2


def _wait_for_acks(out, events, history: CrashHistory, timeout: float, need=lambda acks: acks > 0) -> int:
    """Drain reports until `need(acks so far)` holds or `timeout` passes; returns the acks seen."""
    acks = 0
    deadline = time.monotonic() + timeout
    while not need(acks) and time.monotonic() < deadline:
        drain(out, events, timeout=0.2)
        acks += history.feed(events)
    return acks


def _check_after_kill(path, out, events, history: CrashHistory, label: str):
    """Open the killed writer's file directly and check it against what the workers reported."""
    time.sleep(0.2)  # an actor that got its ack just before the kill is putting it on the queue
    drain(out, events)
    history.feed(events)
    assert status_flags(path) != 0, f"{label}: a killed SWMR writer should leave status flags set"
    state = read_file_state(path, MAX_LEN)
    if history.unknown_held(state):  # a start report may still be in a worker's pipe
        drain(out, events, timeout=3.0)
        history.feed(events)
    problems = state.problems + history.problems(state, MAX_LEN)
    assert not problems, f"{label}: " + "\n".join(problems)
    assert not history.wrong, f"{label}: receipts with another length: {history.wrong[:5]}"
    return state


def _check_restarted(config, previous) -> None:
    """The restarted server shows at least what the killed one had published."""
    with LearnerClient(config.bind, timeout=10) as learner:
        info = learner.info()
        segments = learner.get_segments()
    assert not segment_table_problems(segments, None, None), segments[:10]
    if previous is not None:
        assert info["total_episodes"] >= previous.total_episodes, info
        assert info["total_rows"] >= previous.total_rows, info


@pytest.mark.timeout(300)
def test_sigkill_at_random_moments_loses_no_acknowledged_commit(tmp_path):
    _crash_rounds(tmp_path, ROUNDS, CAPACITY, cli_round=CLI_ROUND, reader_rounds=READER_ROUNDS)


@pytest.mark.timeout(240)
def test_sigkill_of_a_compressed_ring_loses_no_acknowledged_commit_and_leaves_every_row_decodable(tmp_path):
    """The same, over a ring whose `obs` leaf is stored as zstd records with slots of half a row:
    records in slots and in the spill area are rewritten as the ring wraps, and a kill at any
    moment leaves every held row decodable and whole (read_file_state decodes all of them)."""
    _crash_rounds(tmp_path, 8, 4_000, cli_round=None, reader_rounds={0, 5}, storage_kwargs={
        "compression": {"obs": "zstd"}, "compression_slot": {"obs": 0.5}})
    with ReplayBuffer.load_from(tmp_path / "crash.h5") as rb:
        column = rb.file_storage._packed["obs"]
        spilled = int((column._spill_table()[0] > 0).sum())
    assert spilled, "no record went to the spill area: the test does not reach it"


def _crash_rounds(tmp_path, rounds, capacity, *, cli_round, reader_rounds, storage_kwargs=None):
    rng = np.random.default_rng(SEED)
    path = tmp_path / "crash.h5"
    log = tmp_path / "serve.log"
    # Fixed ports (not port 0): the workers keep dialling the same endpoints across restarts.
    config = server_config(path, capacity=capacity, num_readers=0, bind=endpoint(), read_bind=endpoint(),
                           storage_kwargs=storage_kwargs or {})
    stop, out = SPAWN.Event(), SPAWN.Queue()
    history, events = CrashHistory(), []
    previous = None
    report = []  # (round, readers, delay, acks before the kill window, rows held, rows committed)
    with processes() as procs:
        for actor in range(1, NUM_ACTORS + 1):
            main = crash_async_actor_main if actor == NUM_ACTORS else crash_actor_main  # one on asyncio
            procs.append(SPAWN.Process(target=main, args=(config.bind, actor, SEED + actor, MAX_LEN, stop, out)))
        for learner in range(NUM_LEARNERS):
            procs.append(SPAWN.Process(target=crash_learner_main, args=(config.bind, 100 + learner, stop, out)))
        for proc in procs:
            proc.start()

        for rnd in range(rounds):
            readers = 1 if rnd in reader_rounds or rnd == cli_round else 0
            delay = float(rng.uniform(0.05, 1.5))
            with contextlib.ExitStack() as stack:
                if rnd == cli_round:
                    cli = stack.enter_context(cli_server(path, config.bind, config.resolved_read_bind, log,
                                                         "--heartbeat-timeout", "1"))
                    kill = cli.kill
                else:
                    server = ServerProcess(config.replace(num_readers=readers), timeout=60)
                    stack.callback(server.kill)
                    kill = server.kill
                _check_restarted(config, previous)
                # Kill while the actors are back at work: after a new ack, at a random moment.
                acks = _wait_for_acks(out, events, history, timeout=30)
                assert acks, f"round {rnd}: no actor reconnected within 30 s"
                time.sleep(delay)
                kill()
            state = _check_after_kill(path, out, events, history, f"round {rnd} (killed after {delay:.2f} s)")
            if previous is not None:
                assert state.total_episodes >= previous.total_episodes and state.total_rows >= previous.total_rows
            if rnd == cli_round:
                text = log.read_text(errors="replace")
                assert "no authentication: loopback only" in text, text[-2000:]
                assert "was not closed cleanly" in text and "cleared its status flags" in text, text[-2000:]
            previous = state
            report.append((rnd, readers, delay, acks, state.length, state.total_rows))

        # One more start: every actor carries on; then everyone stops and the server shuts down cleanly.
        server = ServerProcess(config, timeout=60)
        try:
            _check_restarted(config, previous)
            before = set(history.acks)

            def every_actor_acked(_acks: int) -> bool:
                return {a for (a, e) in history.acks if (a, e) not in before} == set(range(1, NUM_ACTORS + 1))

            _wait_for_acks(out, events, history, timeout=30, need=every_actor_acked)
            assert every_actor_acked(0), "not every actor carried on after the last restart"
            stop.set()
            for proc in procs:
                proc.join(30)
            drain(out, events, timeout=1.0)
            history.feed(events)
        finally:
            exit_code = server.stop(30)
    assert exit_code == 0
    assert status_flags(path) == 0, "a clean shutdown leaves no status flags"
    state = read_file_state(path, MAX_LEN)
    problems = state.problems + history.problems(state, MAX_LEN)
    assert not problems, "after the clean shutdown: " + "\n".join(problems)

    assert len(history.done) == NUM_ACTORS, history.done
    assert len(history.learners) == NUM_LEARNERS, history.learners
    for _, seed, learner_problems, reads, failures in history.learners:
        assert not learner_problems, f"learner {seed}: {learner_problems}"
        assert reads > 0, f"learner {seed} never read (failures: {failures})"
    lost_phases = Counter(phase.split(":")[0] for phase in history.lost.values())
    print(f"\ncrash recovery: {rounds} kills, {len(history.acks)} acknowledged commits, {state.total_rows} rows "
          f"committed in a ring of {capacity}; requests cut by a kill: {dict(lost_phases)}; learner reads "
          f"{[r for _, _, _, r, _ in history.learners]}, failures {[f for *_, f in history.learners]}")
    for row in report:
        print("  round %2d readers %d killed after %.2f s; %3d acks before; %5d rows held of %6d committed" % row)
    assert state.total_rows > 2 * capacity, "the ring did not wrap: lower the capacity"
    # Over the kills with 4 busy actors, kills cut streamed appends, commits and one-message episodes.
    assert lost_phases["append"] + lost_phases["commit"] + lost_phases["push"] >= rounds // 2, lost_phases


@pytest.mark.timeout(60)
def test_eviction_is_published_once_per_capacity_64th(tmp_path):
    capacity = 6400
    with ReplayBuffer.create(EPISODE_SPACE, capacity, os.fspath(tmp_path / "ring.h5")) as rb:
        for e in range(200):  # fill and wrap the ring
            commit(rb, e, 50)
        publishes = []
        original = rb._publish
        rb._publish = lambda: (publishes.append(1), original())[1]
        for e in range(200, 400):  # 10,000 rows: at most 100 evictions, plus one publish per commit
            commit(rb, e, 50)
        evictions = len(publishes) - 200
    assert evictions <= 200 * 50 // (capacity // 64) + 1, f"{evictions} eviction publishes for 200 commits"


def commit(rb: ReplayBuffer, episode: int, length: int) -> None:
    writer = rb.open_segment_writer()
    writer.extend(episode_rows(1, episode, length))
    rb.commit_segment(writer)
