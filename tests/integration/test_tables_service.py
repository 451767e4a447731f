"""Several tables over one served file: learners name the table they draw from, over the wire,
through `serve --tables`, across a restart and a SIGKILL of the writer; Recency and Mixture draw
by their stated laws over the wire too (chi-square, as tests/unit/test_samplers.py does locally)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fault_helpers import cli_command, cli_server
from service_helpers import EPISODE_SPACE, episode_rows, free_port
from stats_helpers import chi_square_p

from h5replay.client import ActorClient, LearnerClient
from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.sampling import Fifo, Lifo, Mixture, Prioritized, RateLimit, Recency, Table, Uniform
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(120)

TABLES = {"replay": Table(Prioritized(1.0)), "queue": Table(Fifo(), max_times_sampled=1),
          "limited": Table(rate_limit=RateLimit(1, 1.0, 1000.0))}


def push(endpoint: str, episodes: int, length: int = 10) -> None:
    with ActorClient(endpoint, timeout=10) as actor:
        for e in range(episodes):
            actor.push_episode(episode_rows(0, e, length), priorities=np.full(length, 1.0 + e))


def test_learners_draw_from_the_table_they_name(start_server: Any) -> None:
    server = start_server(capacity=1000, tables=TABLES)
    push(server.endpoint, 6)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        # The queue hands each row out once, in order, over two calls; the replay still draws them.
        first, info = learner.sample(40, with_info=True, table="queue")
        rest, info2 = learner.sample(20, with_info=True, table="queue")
        assert np.concatenate([info.row_ids, info2.row_ids]).tolist() == list(range(60))
        _, replay = learner.sample(4000, seed=1, with_info=True, table="replay")
        assert set(replay.row_ids.tolist()) == set(range(60))
        np.testing.assert_allclose(replay.probabilities, (replay.row_ids // 10 + 1.0) / sum(10 * (1.0 + e)
                                                                                            for e in range(6)))
        learner.update_priorities([0], [100.0], table="replay")
        batches = learner.batches(8, table="limited", prefetch=2)
        for _ in range(3):
            assert len(next(batches)["step"]) == 8
        batches.close()  # type: ignore[attr-defined]
        windows = learner.sample_sequences(5, 3, table="replay")
        assert windows["step"].shape == (5, 3)
        stats = learner.info()  # the batches drawn ahead when the loop was left are kept, not lost
        assert stats["table.queue.sampled"] == 60 and stats["table.limited.sampled"] == 24 + learner.num_kept
        assert stats["tables"] == "replay,queue,limited"


@pytest.mark.parametrize(("call", "says"), [
    (lambda lr: lr.sample(1), "3 tables ('replay', 'queue', 'limited'): name one with table="),
    (lambda lr: lr.sample(1, table="nope"), "no table 'nope'"),
    (lambda lr: lr.sample_sequences(1, 2, table="nope"), "no table 'nope'"),
    (lambda lr: lr.batches(1, table="nope"), "no table 'nope'"),
    (lambda lr: lr.update_priorities([0], [1.0], table="queue"), "table .queue. samples by fifo, not by priority"),
    (lambda lr: lr.update_priorities([0], [1.0]), "name one with table="),
])
def test_a_table_the_server_does_not_have_is_refused_naming_its_tables(start_server: Any, call: Any,
                                                                       says: str) -> None:
    server = start_server(capacity=100, tables=TABLES)
    push(server.endpoint, 1)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
            call(learner)
        assert learner.sample(10, table="queue")["step"].tolist() == list(range(10))  # nothing was taken


def test_a_hostile_table_name_on_the_wire_is_refused_and_the_server_goes_on(start_server: Any) -> None:
    from service_helpers import RawClient, error_of, header

    server = start_server(capacity=100, tables=TABLES)
    push(server.endpoint, 1)
    with RawClient(server.endpoint) as raw:
        for name in ("../../etc", "x" * 10_000, "", "table.queue", 7, ["queue"]):
            reply = raw.request([header("sample", raw.next_id(), {"batch_size": 1, "seed": None, "min_seq": 0, "table": name})])
            assert "field 'table'" in str(error_of(reply))
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert len(learner.sample(10, table="queue")["step"]) == 10


def _serve(path: Path, tables_file: Path, tmp_path: Path) -> Any:
    bind, read_bind = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    return bind, cli_server(path, bind, read_bind, tmp_path / "serve.log", "--space", str(space), "--capacity",
                            "500", "--tables", str(tables_file))


def test_serve_tables_holds_every_tables_counts_across_a_sigkill_and_a_restart(tmp_path: Path) -> None:
    tables_file = tmp_path / "tables.json"
    tables_file.write_text(json.dumps({
        "replay": {"sampler": "prioritized", "priority_exponent": 1.0},
        "queue": {"sampler": "fifo", "max_times_sampled": 1},
        "mix": {"sampler": "mixture", "components": [[{"sampler": "uniform"}, 0.5],
                                                     [{"sampler": "recency", "half_life": 50}, 0.5]]},
    }))
    path = tmp_path / "rb.h5"
    bind, server = _serve(path, tables_file, tmp_path)
    with server as proc:
        push(bind, 5)
        with LearnerClient(bind, timeout=10) as learner:
            assert learner.sample(15, table="queue")["step"].shape == (15,)
            learner.update_priorities([3], [9.0], table="replay")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with ReplayBuffer.load_from(path) as rb:  # what the killed writer had acknowledged
        assert set(rb.tables) == {"replay", "queue", "mix"}
        assert rb.tables["mix"].sampler == Mixture({Uniform(): 0.5, Recency(50): 0.5})
        assert rb.info()["table.queue.sampled"] == 15 and rb.priorities([3], table="replay").tolist() == [9.0]
    bind, server = _serve(path, tables_file, tmp_path)  # the same tables: served again
    with server, LearnerClient(bind, timeout=10) as learner:
        _, info = learner.sample(35, with_info=True, table="queue")
        assert info.row_ids.tolist() == list(range(15, 50))  # the queue goes on where it was


@pytest.mark.parametrize(("tables", "says"), [
    ('{"a": {"sampler": "fifo", "max_times_sampled": 1, "bogus": 3}}', "table 'a': unknown setting\\(s\\) 'bogus'"),
    ('["fifo"]', "tables must be a non-empty JSON object"),
    ('{"a": {"sampler": "recency"}}', "table 'a': sampler 'recency' needs half_life"),
    ('{"a": {"sampler": "uniform", "half_life": 3}}', "table 'a': half_life does not go with sampler 'uniform'"),
    ('{"a b": {}}', "a table's name is"),
    ('{"q": {"sampler": "recency", "half_life": 5, "max_times_sampled": 1}}', "table 'q': Recency\\(\\) draws"),
    ('{"a": {"sampler": "mixture", "components": [[{"sampler": "fifo"}, 1]]}}', "components draw by chance"),
    ("{not json", "is not JSON"),
])
def test_a_bad_tables_file_is_refused_in_one_line_naming_the_table_and_setting(tmp_path: Path, tables: str,
                                                                               says: str) -> None:
    tables_file = tmp_path / "tables.json"
    tables_file.write_text(tables)
    space = tmp_path / "space.json"
    space.write_text(json.dumps(EPISODE_SPACE.to_json()))
    done = subprocess.run(cli_command("serve", str(tmp_path / "rb.h5"), "--bind", "tcp://127.0.0.1:1", "--space",
                                      str(space), "--capacity", "10", "--tables", str(tables_file)),
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert __import__("re").search(says, lines[0]), lines[0]
    assert not (tmp_path / "rb.h5").exists()


@pytest.mark.parametrize("table", ["recent", "mix"])
def test_recency_and_a_mixture_draw_by_their_laws_over_the_wire(start_server: Any, table: str) -> None:
    tables = {"recent": Table(Recency(25.0)), "mix": Table(Mixture({Uniform(): 0.4, Recency(10.0): 0.6}))}
    server = start_server(capacity=150, tables=tables)
    push(server.endpoint, 20)  # 200 rows in a ring of 150
    with LearnerClient(server.endpoint, timeout=10) as learner:
        draws = []
        for k in range(20):
            _, info = learner.sample(5000, seed=k, with_info=True, table=table)
            draws.append(info)
        begin, end = learner.info()["oldest_row_id"], 200  # the ring releases its oldest rows a little early
        held = np.arange(begin, end)

        def rec(half_life: float) -> np.ndarray:
            weights = 0.5 ** ((end - 1 - held) / half_life)
            return weights / weights.sum()  # type: ignore[no-any-return]

        expected = rec(25.0) if table == "recent" else 0.4 / held.size + 0.6 * rec(10.0)
        ids = np.concatenate([d.row_ids for d in draws]).astype(np.int64)
        probabilities = np.concatenate([d.probabilities for d in draws])
        assert chi_square_p(np.bincount(ids - begin, minlength=held.size), expected * ids.size) > 1e-4
        np.testing.assert_allclose(probabilities, expected[ids - begin], rtol=1e-9)


def test_over_shards_a_table_goes_to_every_shard_and_the_queue_hands_each_row_out_once(start_server: Any) -> None:
    from h5replay.config import ClientConfig

    tables = {"replay": Table(Prioritized(1.0)), "queue": Table(Fifo(), max_times_sampled=1)}
    a = start_server("a.h5", capacity=1000, tables=tables)
    b = start_server("b.h5", capacity=1000, tables=tables)
    for server, first in ((a, 0), (b, 1000)):
        with ActorClient(server.endpoint, timeout=10) as actor:
            batch = episode_rows(1, 0, 40)
            batch["step"] = np.arange(first, first + 40, dtype=np.int32)
            actor.push_episode(batch)
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=10, name="learner", rate_limit_timeout=0.5)
    with LearnerClient(config=config, endpoints=[a.endpoint, b.endpoint]) as learner:
        with pytest.raises(ConfigError, match="name one with table="):
            learner.sample(1)
        with pytest.raises(ConfigError, match="no table 'nope'"):
            learner.sample(1, table="nope")
        got = learner.sample(50, table="queue")["step"].tolist() + learner.sample(30, table="queue")["step"].tolist()
        assert sorted(got) == [*range(40), *range(1000, 1040)], "every committed row exactly once, over both shards"
        replay = learner.sample(400, seed=3, table="replay")["step"]  # the queue's rows stay in the replay
        assert set(replay.tolist()) <= set(got) and len(set(replay.tolist())) > 60
        _, info = learner.sample(2, table="replay", with_info=True)
        assert learner.update_priorities(info.row_ids, [5.0, 6.0], table="replay") == 0
        with pytest.raises(ConfigError, match="table 'queue' samples by fifo"):
            learner.update_priorities(info.row_ids, [5.0, 6.0], table="queue")


def test_a_tables_sample_split_over_several_messages_is_whole_and_in_order(start_server: Any) -> None:
    from h5replay import protocol as P

    server = start_server(capacity=1000, tables=TABLES, limits=P.Limits(max_rows_per_message=16))
    push(server.endpoint, 6)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        _, info = learner.sample(50, with_info=True, table="queue")  # four messages
        assert info.row_ids.tolist() == list(range(50))
        _, info = learner.sample(40, seed=2, with_info=True, table="replay")
        assert len(info.row_ids) == 40 and learner.info()["table.queue.sampled"] == 50


@pytest.mark.parametrize("readers", [0, 1])
def test_an_in_order_sample_split_over_several_messages_gives_no_row_twice(start_server: Any, readers: int) -> None:
    """Fifo and lifo without removal, drawn by readers: each part of a split batch passes over the
    rows the parts before it drew, so the batch is the oldest (newest) rows, each once, in order."""
    from h5replay import protocol as P

    tables = {"old": Table(Fifo()), "new": Table(Lifo())}
    server = start_server(capacity=1000, tables=tables, num_readers=readers, limits=P.Limits(max_rows_per_message=16))
    push(server.endpoint, 6)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        _, info = learner.sample(50, with_info=True, table="old")  # four messages
        assert info.row_ids.tolist() == list(range(50))
        _, info = learner.sample(50, with_info=True, table="new")
        assert info.row_ids.tolist() == list(range(59, 9, -1))
        with pytest.raises(NotEnoughDataError, match="Fifo sampling of 61 rows without replacement needs 61 rows"):
            learner.sample(61, table="old")
