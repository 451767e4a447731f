"""Actors give priorities by table over the wire (`priorities={"replay": p}`; a bare array for every
prioritized table) on every path that carries rows: streamed segments, one push, push_episodes,
an episode longer than a message, shards, and across a restart. Each served file ends with the
priorities a local buffer given the same calls has; a bad name or count is refused naming it, with
nothing stored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import EPISODE_SPACE, episode_rows

from h5replay.client import ActorClient
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError
from h5replay.sampling import Fifo, Prioritized, Table
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(120)

TABLES = {"replay": Table(Prioritized(1.0)), "other": Table(Prioritized(0.5)),
          "queue": Table(Fifo(), max_times_sampled=1)}


def _steps(episode: int, length: int) -> list[dict[str, Any]]:
    rows = episode_rows(0, episode, length)
    return [{key: values[i] for key, values in rows.items()} for i in range(length)]


def _step_priority(i: int) -> Any:
    """Streamed steps: by table, for every table, both tables, or none, in turn."""
    return [{"replay": 10.0 + i}, 2.0, {"replay": 3.0, "other": 4.0 + i}, None][i % 4]


# (episode rows, priorities) of the whole episodes pushed: by table, both, bare, none.
EPISODES = [
    (episode_rows(0, 1, 3), {"other": [5.0, 6.0, 7.0]}),
    (episode_rows(0, 2, 2), {"replay": [8.0, 9.0], "other": [1.5, 2.5]}),
    (episode_rows(0, 3, 4), [0.5, 1.0, 1.5, 2.0]),
    (episode_rows(0, 4, 2), None),
]
LONG = (episode_rows(0, 5, 11), {"replay": np.arange(11) + 20.0})  # over rows_per_message: streamed


def _through_actor(actor: ActorClient) -> None:
    with actor.segment() as seg:  # 10 steps, 4 rows a message: three appends, then the commit
        for i, step in enumerate(_steps(0, 10)):
            seg.append(step, priority=_step_priority(i))
    actor.push_episode(*EPISODES[0])
    actor.push_episode(*EPISODES[1], wait=False).result()
    actor.push_episodes([rows for rows, _ in EPISODES[2:]], priorities=[p for _, p in EPISODES[2:]])
    actor.push_episode(*LONG)


def _through_buffer(rb: ReplayBuffer) -> None:
    writer = rb.open_segment_writer()  # one commit, as the server's (a row given none takes its default then)
    for i, step in enumerate(_steps(0, 10)):
        writer.append(step, priority=_step_priority(i))
    rb.commit_segment(writer)
    for rows, priorities in [*EPISODES, LONG]:
        rb.extend(rows, priorities=priorities)
        rb.end_episode()


def _priorities(path: Path) -> dict[str, list[float]]:
    with ReplayBuffer.load_from(path) as rb:
        ids = np.arange(rb.view.begin, rb.view.end)
        return {table: rb.priorities(ids, table=table).tolist() for table in ("replay", "other")}


def _model(tmp_path: Path, rounds: int) -> dict[str, list[float]]:
    path = tmp_path / "model.h5"
    with ReplayBuffer.create(EPISODE_SPACE, 1000, str(path), tables=TABLES) as rb:
        for _ in range(rounds):
            _through_buffer(rb)
    return _priorities(path)


def test_every_actor_path_gives_each_table_its_priorities_across_a_restart(start_server: Any, tmp_path: Path) -> None:
    for _ in range(2):  # the second round after a restart on the same file
        server = start_server(capacity=1000, tables=TABLES)
        with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
            assert actor.rows_per_message == 4
            _through_actor(actor)
        server.stop(timeout=10)
    served = _priorities(tmp_path / "rb.h5")
    assert served == _model(tmp_path, 2)
    assert served["replay"][:4] == [10.0, 2.0, 3.0, served["replay"][3]] and served["other"][2] == 6.0
    assert served["other"][10:13] == [5.0, 6.0, 7.0] and served["replay"][13:15] == [8.0, 9.0]


def test_over_shards_each_episode_takes_its_tables_priorities_to_its_shard(start_server: Any, tmp_path: Path) -> None:
    servers = [start_server(name, capacity=1000, tables=TABLES) for name in ("a.h5", "b.h5")]
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=10, batch_rows=4)
    with ActorClient(config=config, endpoints=[s.endpoint for s in servers]) as actor:
        _through_actor(actor)
    for server in servers:
        server.stop(timeout=10)
    got = [_priorities(tmp_path / name) for name in ("a.h5", "b.h5")]
    assert [got[0][t] + got[1][t] for t in ("replay", "other")] != [[], []]
    # One actor writes to one shard while it answers: that shard holds what a local buffer holds.
    assert _model(tmp_path, 1) in got


@pytest.mark.parametrize(("give", "says"), [
    (lambda a: a.push_episode(episode_rows(0, 0, 2), priorities={"nope": [1.0, 2.0]}), "no table 'nope'"),
    (lambda a: a.push_episode(episode_rows(0, 0, 2), priorities={"queue": [1.0, 2.0]}),
     "table 'queue' samples by Fifo()"),
    (lambda a: a.push_episode(episode_rows(0, 0, 2), priorities={"replay": [1.0]}),
     "table 'replay': got 1 priorities for 2 rows"),
    (lambda a: a.push_episode(episode_rows(0, 0, 2), priorities={"replay": [1.0, -1.0]}), "priority 1 is -1.0"),
    (lambda a: a.push_episode(episode_rows(0, 0, 2), priorities={"../x": [1.0, 2.0]}), "a table's name is"),
    (lambda a: a.push_episodes([episode_rows(0, 0, 2), episode_rows(0, 1, 2)],
                               priorities=[None, {"nope": [1.0, 2.0]}]), "no table 'nope'"),
    (lambda a: _segment_with(a, {"queue": 1.0}), "table 'queue' samples by Fifo()"),
    (lambda a: a.push_episode(episode_rows(0, 0, 9), priorities={"replay": np.full(9, 1e290)}),
     "priorities for table 'replay': priority 0 is 1e[+]290"),
    (lambda a: a.push_episode(episode_rows(0, 0, 9), priorities=np.full(9, 1e290)), "priority 0 is 1e[+]290"),
])
def test_a_bad_table_or_priority_from_an_actor_is_refused_naming_it_and_nothing_is_stored(
        start_server: Any, give: Any, says: str) -> None:
    server = start_server(capacity=1000, tables=TABLES)
    with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
        actor.push_episode(episode_rows(0, 9, 3), priorities={"replay": [1.0, 2.0, 3.0]})
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            give(actor)
        info = actor.info()
        assert (info["length"], info["num_episodes"]) == (3, 1), "nothing of the refused episode is stored"
        # The server goes on; each table's bound is its own ("other" weighs priority ** 0.5).
        actor.push_episode(episode_rows(0, 10, 2), priorities={"other": [1.0, 1e290]})
        assert actor.info()["length"] == 5


def _segment_with(actor: ActorClient, priority: Any) -> None:
    with actor.segment() as seg:
        for step in _steps(0, 6):  # more than one message: the server refuses an append
            seg.append(step, priority=priority)


def test_priorities_by_table_from_a_client_that_lies_are_refused_by_the_server(start_server: Any) -> None:
    """What the client checks, the server checks again: a raw client that skips the checks gets a
    refusal naming the problem, and nothing of its rows is stored."""
    from service_helpers import RawClient, error_of

    from h5replay import protocol as P
    from h5replay.spaces import Schema

    server = start_server(capacity=1000, tables=TABLES)
    rows, _ = Schema(EPISODE_SPACE).encode_batch(episode_rows(0, 0, 2))

    def push(tables: Any, by_table: Any) -> Any:
        return lambda rid: P.PushEpisode(rid, 2, rows, 0.0, np.zeros(0), bytes(16), tables,
                                         np.asarray(by_table, dtype=np.float64))

    with RawClient(server.endpoint) as raw:
        for request, says in [
            (push(("nope",), [[1.0, 2.0]]), "no table 'nope'"),
            (push(("queue",), [[1.0, 2.0]]), "table 'queue' samples by Fifo()"),
            (push(("replay",), [[1.0, -2.0]]), "priority 1 is -2.0"),
            (push(("replay",), [[1.0, np.inf]]), "priority 1 is inf"),
            (push(("replay", "other"), [[1.0, 2.0]]), "table_priorities must be (tables, rows) = (2, 2)"),
            (push(("replay", "replay"), [[1.0, 2.0], [1.0, 2.0]]), "names a table twice"),
            (push(None, [[1.0, 2.0]]), "table_priorities needs priority_tables"),
            (push(("../x",), [[1.0, 2.0]]), "a table's name is"),
            (push(("replay",), [[1e290, 1.0]]), "priorities for table 'replay': priority 0"),
            (lambda rid: P.PushEpisodes(rid, 2, np.array([1, 1]), np.zeros((2, 16), np.uint8) + [[1], [2]], rows, 0.0,
                                        np.zeros(0), ("replay", "queue"), np.ones((2, 2))),
             "table 'queue' samples by Fifo()"),
        ]:
            error = error_of(raw.call(request))
            assert says in str(error), (says, error)
    with ActorClient(server.endpoint, timeout=10) as actor:
        assert actor.info()["length"] == 0, "nothing of a refused push is stored"
        actor.push_episode(episode_rows(0, 1, 2), priorities={"replay": [1.0, 2.0]})
        assert actor.info()["length"] == 2
