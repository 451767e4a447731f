"""Final observations and n-step transitions over the wire: every actor path carries an episode's
final observation (a streamed segment, one push, a push left in flight, push_episodes, a long
episode), a learner's sample_transitions equals the plain-Python model, over one server, its
reader processes and two shards; and a final that does not fit, or a server without observation
keys, is refused naming the problem, with nothing stored."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transition_helpers import SPACE, Model, check_sample, episode

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError, ProtocolError, SpaceMismatchError

pytestmark = pytest.mark.timeout(120)

KINDS = ["terminated", "truncated", "cut"]


def push_every_way(actor: ActorClient, model: Model, first: int) -> int:
    """Episodes by every actor path, with or without finals; returns the next row id."""
    def next_episode(length: int, kind: str) -> tuple[dict[str, Any], Any]:
        nonlocal first
        rows, final = episode(first, length, kind)
        model.episodes.append((first, rows, final))
        first += length
        return rows, final

    rows, final = next_episode(10, "truncated")  # streamed: 4 rows a message, then the commit
    with actor.segment() as seg:
        seg.extend(rows)
        seg.set_final(final)
    rows, final = next_episode(3, "terminated")  # fits one message: one push at commit
    seg = actor.segment()
    seg.extend(rows)
    seg.commit(final=final)
    rows, final = next_episode(2, "cut")
    actor.push_episode(rows, final=final)
    rows, final = next_episode(4, "truncated")
    actor.push_episode(rows, final=final, wait=False).result()
    batches = [next_episode(n, kind) for n, kind in ((2, "terminated"), (3, "cut"), (1, "truncated"))]
    actor.push_episodes([r for r, _ in batches], finals=[f for _, f in batches])
    rows, final = next_episode(9, "terminated")  # longer than a message: streamed by push_episode
    actor.push_episode(rows, final=final)
    return first


# The observation stored as compressed records (h5replay/storage/packed.py), `pos` in slots too
# small for it (every record spilled): transitions read them decoded, finals stay raw.
COMPRESSED = {"compression": {"obs/pos": "lz4", "obs/id": "zstd"}, "compression_slot": {"obs/pos": 4}}


@pytest.mark.parametrize(("readers", "storage"), [(0, {}), (2, {}), (2, COMPRESSED)])
def test_a_learner_draws_the_models_transitions_from_a_server(start_server: Any, readers: int,
                                                               storage: dict[str, Any]) -> None:
    server = start_server(space=SPACE, capacity=1000, observation_keys=("obs",), num_readers=readers,
                          multiprocessing=True, storage_kwargs=storage)
    model = Model()
    with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
        push_every_way(actor, model, 0)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.transition_keys is not None and learner.transition_keys.observation == ("obs",)
        for n in (1, 3, 5):
            drawn = check_sample(learner, model, n, 0.9, size=400)
        assert {9, 12, 33} <= set(drawn.tolist()), "the last steps of episodes are drawn"


def test_over_two_shards_each_transition_is_its_shards(start_server: Any) -> None:
    servers = [start_server(name, space=SPACE, capacity=1000, observation_keys=("obs",)) for name in ("a.h5", "b.h5")]
    model = Model()  # both shards get the same episodes: a row id means the same step on either
    for server in servers:
        with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
            push_every_way(actor, model if not model.episodes else Model(), 0)
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=10)
    with LearnerClient(config=config, endpoints=[s.endpoint for s in servers]) as learner:
        batch, info = learner.sample_transitions(300, n_step=3, gamma=0.5, with_info=True)
        assert set(info.shard_ids.tolist()) == {0, 1} and info.has_final is not None
        for i, row in enumerate(info.row_ids.astype(np.int64)):
            want = model.expected(int(row), 3, 0.5)
            assert batch["reward"][i] == pytest.approx(want["reward"], rel=1e-6)
            assert batch["next"]["obs"]["id"][i] == want["next"][1] and bool(info.has_final[i]) == want["has_final"]


def test_finals_that_do_not_fit_are_refused_and_nothing_is_stored(start_server: Any) -> None:
    from service_helpers import RawClient, error_of

    from h5replay import protocol as P
    from h5replay.spaces import Schema

    server = start_server(space=SPACE, capacity=1000, observation_keys=("obs",))
    rows, final = episode(0, 3, "terminated")
    with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
        with pytest.raises(SpaceMismatchError, match="pos"):
            actor.push_episode(rows, final={"pos": np.zeros(5, np.float32), "id": 1})
        with pytest.raises(SpaceMismatchError, match="id"):
            actor.push_episodes([rows], finals=[{"pos": np.zeros(2, np.float32)}])
        with pytest.raises(ConfigError, match="1 finals for 2 episodes"):
            actor.push_episodes([rows, rows], finals=[final])
        seg = actor.segment()
        seg.extend(rows)
        with pytest.raises(SpaceMismatchError):
            seg.set_final({"nope": 1})
        seg.abort()
        encoded, _ = Schema(SPACE).encode_batch(rows)
        with RawClient(server.endpoint) as raw:  # a client that skips the checks
            for finals, says in [({"obs/pos": np.zeros((1, 3), np.float32), "obs/id": np.zeros(1, np.int64)}, "obs/pos"),
                                 ({"obs/pos": np.zeros((1, 2), np.float32)}, "obs/id"),
                                 ({"obs/pos": np.zeros((2, 2), np.float32), "obs/id": np.zeros(2, np.int64)},
                                  "must have 1 rows")]:
                reply = raw.call(lambda rid, f=finals: P.PushEpisode(rid, 3, encoded, 0.0, np.zeros(0), bytes(16),
                                                                     None, np.zeros((0, 0)), f))
                assert says in str(error_of(reply)), error_of(reply)
        assert actor.info()["length"] == 0, "nothing of a refused episode is stored"
        actor.push_episode(rows, final=final)
        assert actor.info()["length"] == 3


def test_a_server_without_observation_keys_says_so(start_server: Any) -> None:
    server = start_server(space=SPACE, capacity=100)
    rows, final = episode(0, 2, "terminated")
    with ActorClient(server.endpoint, timeout=10) as actor, LearnerClient(server.endpoint, timeout=10) as learner:
        with pytest.raises(ConfigError, match="keeps no final observations.*--observation-keys"):
            actor.push_episode(rows, final=final)
        actor.push_episode(rows)
        with pytest.raises(ConfigError, match="keeps no final observations"):
            learner.sample_transitions(4)
        with pytest.raises(ConfigError, match="n_step must be"):
            learner.sample_transitions(4, n_step=0)
        assert learner.sample(4)["action"].shape == (4,)


def test_a_lying_transition_request_is_refused(start_server: Any) -> None:
    from service_helpers import RawClient, error_of, header

    server = start_server(space=SPACE, capacity=100, observation_keys=("obs",))
    rows, final = episode(0, 3, "terminated")
    with ActorClient(server.endpoint, timeout=10) as actor:
        actor.push_episode(rows, final=final)
    with RawClient(server.endpoint) as raw:
        for fields, says in [({"batch_size": 1, "n_step": 0}, "'n_step' must be >= 1"),
                             ({"batch_size": 1, "gamma": 1.5}, "field 'gamma' must be a number in [0, 1]"),
                             ({"batch_size": 1, "gamma": "x"}, "field 'gamma'"),
                             ({"batch_size": 1, "n_step": 10**9}, "over the limit")]:
            whole = {"batch_size": 1, "n_step": 1, "gamma": 0.9, "seed": None, "min_seq": 0, **fields}
            reply = raw.request([header("sample_transitions", raw.next_id(), whole)])
            error = error_of(reply)
            assert isinstance(error, ProtocolError) and says in str(error), error
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.sample_transitions(5, n_step=2)["discount"].shape == (5,)


@pytest.mark.parametrize("how", ["space file", "flag"])
def test_serve_takes_the_observation_keys_from_the_space_file_or_the_flag(tmp_path: Any, how: str) -> None:
    import json
    import signal
    from pathlib import Path

    from fault_helpers import cli_server
    from service_helpers import free_port

    from h5replay.storage import ReplayBuffer

    space = Path(__file__).resolve().parents[2] / "docker" / "cartpole-space.json"
    if how == "flag":  # the space alone, the keys by flag
        plain = tmp_path / "space.json"
        plain.write_text(json.dumps({k: v for k, v in json.loads(space.read_text()).items() if k != "observation_keys"}))
        extra = ["--space", str(plain), "--observation-keys", "obs"]
    else:
        extra = ["--space", str(space)]
    bind, read_bind = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with cli_server(tmp_path / "rb.h5", bind, read_bind, tmp_path / "serve.log", "--capacity", "100", *extra) as proc:
        with ActorClient(bind, timeout=10) as actor:
            assert actor.keeps_finals
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    with ReplayBuffer.load_from(tmp_path / "rb.h5") as rb:
        assert rb.transition_keys is not None and rb.transition_keys.observation == ("obs",)


def test_a_queue_hands_each_transition_out_once_in_order_over_several_messages(start_server: Any) -> None:
    """Transitions meet a consuming table (FIFO, each row once) and requests split over messages:
    every step comes once, in order, with the model's n-step values."""
    from h5replay import protocol as P
    from h5replay.sampling import Fifo, Table

    server = start_server(space=SPACE, capacity=1000, observation_keys=("obs",),
                          tables={"queue": Table(Fifo(), max_times_sampled=1)}, limits=P.Limits(max_rows_per_message=8))
    model = Model()
    with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
        total = push_every_way(actor, model, 0)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        batch, info = learner.sample_transitions(total, n_step=2, gamma=0.5, with_info=True)
        assert info.row_ids.tolist() == list(range(total)), "each step once, in order"
        for i, row in enumerate(info.row_ids.astype(np.int64)):
            want = model.expected(int(row), 2, 0.5)
            assert batch["discount"][i] == pytest.approx(want["discount"]) and bool(info.has_final[i]) == want["has_final"]
        assert learner.info()["table.queue.sampled"] == total


def test_finals_acknowledged_before_a_sigkill_of_the_writer_are_in_the_file(tmp_path: Any) -> None:
    import json
    import signal

    from fault_helpers import cli_server
    from service_helpers import free_port

    from h5replay.storage import ReplayBuffer

    space_file = tmp_path / "space.json"
    space_file.write_text(json.dumps({**SPACE.to_json(), "observation_keys": ["obs"]}))
    bind, read_bind = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    model = Model()
    with cli_server(tmp_path / "rb.h5", bind, read_bind, tmp_path / "serve.log", "--space", str(space_file),
                    "--capacity", "1000") as proc:
        with ActorClient(config=ClientConfig(endpoint=bind, timeout=10, batch_rows=4)) as actor:
            push_every_way(actor, model, 0)  # every commit acknowledged
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    with ReplayBuffer.load_from(tmp_path / "rb.h5") as rb:
        episodes = rb.episodes()
        assert len(episodes) == len(model.episodes)
        for ep, (_, _, final) in zip(episodes, model.episodes):
            got = rb.final_observation(ep.episode_id)
            assert (got is None) == (final is None) and (final is None or got["id"] == final["id"])
        check_sample(rb, model, 3, 0.9)


def test_transitions_kept_from_a_short_queue_draw_keep_their_n_step_values(start_server: Any) -> None:
    """A queue draw that cannot be filled keeps what it drew for the next call (the rule of
    consuming samples): the kept transitions come back with their next observation, discount and
    has_final, as the model says, on one server and over two shards."""
    from h5replay import protocol as P
    from h5replay.errors import RateLimitedError
    from h5replay.sampling import Fifo, Table

    queue = {"queue": Table(Fifo(), max_times_sampled=1)}
    servers = [start_server(name, space=SPACE, capacity=1000, observation_keys=("obs",), tables=queue,
                            limits=P.Limits(max_rows_per_message=8)) for name in ("a.h5", "b.h5")]
    models = [Model(), Model()]
    totals = []
    for server, model in zip(servers, models):
        with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=4)) as actor:
            totals.append(push_every_way(actor, model, 0))

    def check(batch: Any, info: Any, model_of: Any) -> None:
        assert info.has_final is not None and len(info.has_final) == len(info.row_ids)
        for i, row in enumerate(info.row_ids.astype(np.int64)):
            want = model_of(i).expected(int(row), 2, 0.5)
            assert batch["discount"][i] == pytest.approx(want["discount"]), (i, row)
            assert batch["next"]["obs"]["id"][i] == want["next"][1] and bool(info.has_final[i]) == want["has_final"]

    config = ClientConfig(endpoint=servers[0].endpoint, timeout=10, rate_limit_timeout=0.2)
    with LearnerClient(config=config) as learner:
        with pytest.raises(RateLimitedError):
            learner.sample_transitions(totals[0] + 5, n_step=2, gamma=0.5, with_info=True)
        kept = learner.num_kept
        assert 0 < kept < totals[0]
        for size in (1, kept - 1):  # the kept part, split
            batch, info = learner.sample_transitions(size, n_step=2, gamma=0.5, with_info=True)
            check(batch, info, lambda i: models[0])
        batch, info = learner.sample_transitions(totals[0] - kept, n_step=2, gamma=0.5, with_info=True)
        check(batch, info, lambda i: models[0])
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=10, rate_limit_timeout=0.2)
    with LearnerClient(config=config, endpoints=[servers[1].endpoint, servers[0].endpoint]) as learner:
        with ActorClient(config=ClientConfig(endpoint=servers[0].endpoint, timeout=10, batch_rows=4)) as actor:
            totals[0] = push_every_way(actor, models[0], totals[0])
        batch, info = learner.sample_transitions(20, n_step=2, gamma=0.5, with_info=True)
        check(batch, info, lambda i: models[1] if info.shard_ids[i] == 0 else models[0])
