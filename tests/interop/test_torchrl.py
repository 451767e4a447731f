"""TorchRL with `H5ReplayStorage` (real TorchRL, real gymnasium envs, real files and a real server on
127.0.0.1): a `TensorDictReplayBuffer` extends and samples TensorDicts in TorchRL's layout, the
`("next", ...)` leaves included, locally and over a server; a collector's batches go in as they
are; a file is reopened where it stopped and read by h5replay's own API; two processes share one
server; bad keys, shapes, dtypes and settings are refused naming the problem."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import warnings
from typing import Any

import numpy as np
import pytest

torchrl = pytest.importorskip("torchrl")
gym = pytest.importorskip("gymnasium")

import torch  # noqa: E402
from tensordict import NonTensorData, TensorDict  # noqa: E402
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import RandomSampler, SamplerWithoutReplacement  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402

from h5replay.client import LearnerClient  # noqa: E402
from h5replay.errors import ClosedError, ConfigError, SpaceMismatchError  # noqa: E402
from h5replay.integrations.torchrl import H5ReplayStorage, transition_space  # noqa: E402
from h5replay.spaces import space_from_json  # noqa: E402
from h5replay.storage import ReplayBuffer as H5Replay  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]
SPAWN = mp.get_context("spawn")
NEXT_KEYS = {("next", k) for k in ("observation", "reward", "done", "terminated", "truncated")}


def rollout(steps: int, seed: int = 0) -> Any:
    """A real CartPole rollout that goes on through resets, as TorchRL lays it out (the same for a
    seed: the random actions come from torch's global generator)."""
    torch.manual_seed(seed)
    env = GymEnv("CartPole-v1")
    env.set_seed(seed)
    td = env.rollout(steps, break_when_any_done=False)
    env.close()
    return td


def transitions(n: int, seed: int) -> Any:
    """Synthetic transitions in CartPole's layout, different for every seed."""
    g = torch.Generator().manual_seed(seed)
    done = torch.rand(n, 1, generator=g) < 0.2
    return TensorDict({
        "observation": torch.randn(n, 4, generator=g),
        "action": torch.nn.functional.one_hot(torch.randint(0, 2, (n,), generator=g), 2),
        "done": torch.zeros(n, 1, dtype=torch.bool), "terminated": torch.zeros(n, 1, dtype=torch.bool),
        "truncated": torch.zeros(n, 1, dtype=torch.bool),
        "next": {"observation": torch.randn(n, 4, generator=g), "reward": torch.ones(n, 1), "done": done,
                 "terminated": done, "truncated": torch.zeros(n, 1, dtype=torch.bool)},
    }, batch_size=[n])


def same(a: Any, b: Any) -> None:
    """The two TensorDicts have the same keys, dtypes, shapes and values (TorchRL's "index" aside)."""
    a, b = a.exclude("index"), b.exclude("index")
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


def test_a_rollout_extends_and_samples_in_torchrls_layout(tmp_path: Any) -> None:
    td = rollout(60)
    assert td["next", "done"].any(), "the rollout should cross an episode's end"
    storage = H5ReplayStorage(1000, path=tmp_path / "replay.h5")
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32)
    rb.extend(td)
    assert len(rb) == len(storage) == 60 and storage.max_size == 1000
    same(storage[:], td)
    sample = rb.sample()
    assert sample.batch_size == (32,) and NEXT_KEYS <= set(sample.keys(True, True))
    same(sample, td[sample["index"]])  # index i: the i-th oldest row, here the i-th extended
    # At an episode's end the next observation is the terminal one, not the reset that follows.
    ends = torch.nonzero(td["next", "done"].squeeze(-1)).squeeze(-1)
    ends = ends[ends < 59]
    assert len(ends) and not torch.equal(storage[ends]["next", "observation"], storage[ends + 1]["observation"])
    rb.add(td[0])  # one transition, batch size []
    assert len(rb) == 61
    one = storage[-1]
    assert one.batch_size == () and torch.equal(one["observation"], td[0]["observation"])
    without = TensorDictReplayBuffer(storage=storage, sampler=SamplerWithoutReplacement(), batch_size=61)
    drawn = without.sample()
    assert sorted(drawn["index"].tolist()) == list(range(61))
    mask = torch.zeros(61, dtype=torch.bool)
    mask[[2, 5]] = True
    same(storage[mask], td[[2, 5]])
    storage.close()
    storage.close()  # safe twice
    with pytest.raises(ClosedError, match="was closed"):
        len(storage)


def test_the_ring_keeps_the_newest_rows(tmp_path: Any) -> None:
    storage = H5ReplayStorage(64, path=tmp_path / "ring.h5")
    rb = TensorDictReplayBuffer(storage=storage, batch_size=8)
    td = transitions(100, seed=1)
    for lo in range(0, 100, 25):
        rb.extend(td[lo:lo + 25])
    held = len(rb)
    assert 63 <= held <= 64  # h5replay releases the oldest rows a little ahead of need
    same(storage[:], td[100 - held:])
    assert rb.sample().batch_size == (8,)
    storage.close()


def test_a_collector_batch_goes_through_a_server(start_server: Any) -> None:
    with warnings.catch_warnings():  # torchrl.collectors warns of its own deprecated classes at import
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchrl.collectors import Collector
    env = GymEnv("CartPole-v1")
    env.set_seed(3)
    collector = Collector(env, policy=None, frames_per_batch=40, total_frames=80)
    batches = [batch.clone() for batch in collector]
    collector.shutdown()
    assert ("collector", "traj_ids") in batches[0].keys(True, True)
    space = transition_space(batches[0])
    assert space_from_json(H5ReplayStorage.space_json(batches[0])) == space
    server = start_server(space=space, capacity=5000)
    with H5ReplayStorage(endpoint=server.endpoint, timeout=10) as storage:
        assert storage.max_size == 5000
        rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=50)
        for batch in batches:
            rb.extend(batch)
        assert len(rb) == 80
        both = torch.cat(batches)
        same(storage[:], both)
        sample = rb.sample()
        same(sample, both[sample["index"]])
        with pytest.raises(NotImplementedError, match="shared by every client"):
            rb.empty()
    with LearnerClient(server.endpoint, timeout=10) as learner:  # h5replay's own reader sees the leaves
        rows = learner.get_rows(np.arange(80))
    np.testing.assert_array_equal(rows["next"]["observation"], both["next", "observation"].numpy())
    np.testing.assert_array_equal(rows["collector"]["traj_ids"], both["collector", "traj_ids"].numpy())


def _write_from_a_child(storage: H5ReplayStorage, seed: int) -> None:
    """A spawned process: extend the (unpickled) storage and sample from it."""
    rb = TensorDictReplayBuffer(storage=storage, batch_size=4)
    rb.extend(transitions(30, seed))
    assert len(rb) >= 30 and rb.sample().batch_size == (4,)
    storage.close()


def test_two_processes_share_one_server(start_server: Any) -> None:
    server = start_server(space=transition_space(transitions(1, 0)), capacity=5000)
    storage = H5ReplayStorage(endpoint=server.endpoint, timeout=10)
    rb = TensorDictReplayBuffer(storage=storage, batch_size=16)
    rb.extend(transitions(20, seed=10))
    child = SPAWN.Process(target=_write_from_a_child, args=(storage, 11))  # pickled by endpoint
    try:
        child.start()
        child.join(120)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
    assert len(rb) == 50, "the other process's rows are sampled too"
    same(storage[:], torch.cat([transitions(20, seed=10), transitions(30, seed=11)]))
    storage.close()


def test_a_file_is_reopened_where_it_stopped(tmp_path: Any) -> None:
    path = tmp_path / "replay.h5"
    first = H5ReplayStorage(200, path=path)
    TensorDictReplayBuffer(storage=first).extend(rollout(30, seed=1))
    first.close()
    again = H5ReplayStorage(path=path)  # no max_size: the file's
    assert again.max_size == 200 and len(again) == 30
    rb = TensorDictReplayBuffer(storage=again, batch_size=10)
    rb.extend(rollout(20, seed=2))
    assert len(rb) == 50
    same(again[:30], rollout(30, seed=1))
    again.close()
    reopened = pickle.loads(pickle.dumps(again))  # a storage pickles by its file
    same(reopened[30:], rollout(20, seed=2))
    reopened.close()
    with pytest.raises(ConfigError, match="holds 200 rows at most, not max_size=100"):
        H5ReplayStorage(100, path=path)
    replay = H5Replay.load_from(path)  # h5replay's own API reads what TorchRL wrote
    assert len(replay) == 50 and replay.num_episodes == 2  # one segment per extend
    np.testing.assert_array_equal(replay.get_at(np.arange(30))["next"]["reward"],
                                  rollout(30, seed=1)["next", "reward"].numpy())
    replay.close()
    emptied = H5ReplayStorage(path=path)
    TensorDictReplayBuffer(storage=emptied).empty()
    assert len(emptied) == 0
    emptied.close()


def test_bad_keys_shapes_and_dtypes_are_refused_naming_the_key(tmp_path: Any) -> None:
    storage = H5ReplayStorage(100, path=tmp_path / "replay.h5")
    rb = TensorDictReplayBuffer(storage=storage)
    td = transitions(5, seed=0)
    rb.extend(td)
    with pytest.raises(SpaceMismatchError, match=r"missing \('next', 'reward'\)"):
        rb.extend(td.exclude(("next", "reward")))
    with pytest.raises(SpaceMismatchError, match=r"unexpected 'extra'"):
        rb.extend(td.clone().set("extra", torch.zeros(5)))
    bad = td.clone()
    bad["next", "observation"] = torch.zeros(5, 3)
    with pytest.raises(SpaceMismatchError, match=r"key \('next', 'observation'\) has shape \(3,\) .* holds \(4,\)"):
        rb.extend(bad)
    bad = td.clone()
    bad["action"] = bad["action"].float()
    with pytest.raises(SpaceMismatchError, match=r"key 'action' has dtype torch.float32 but the storage holds int64"):
        rb.extend(bad)
    with pytest.raises(SpaceMismatchError, match=r"key 'action' has shape \(5, 2\) .* reshape\(-1\)"):
        rb.extend(td.unsqueeze(0))  # a [envs, time] batch: one row per env, unless flattened
    with pytest.raises(NotImplementedError, match="cannot overwrite rows"):
        rb[0] = td[0]
    assert len(rb) == 5, "nothing refused was written"
    storage.close()

    other = H5ReplayStorage(100, path=tmp_path / "other.h5")
    fresh = TensorDictReplayBuffer(storage=other)
    with pytest.raises(ConfigError, match=r"key 'observation' has dtype torch.bfloat16"):
        fresh.extend(td.clone().set("observation", td["observation"].bfloat16()))
    with pytest.raises(ConfigError, match=r"key \('info', 'name'\) holds NonTensorData"):
        fresh.extend(td.clone().set(("info", "name"), NonTensorData("x", batch_size=[5])))
    with pytest.raises(ConfigError, match="key 'a/b' cannot name an h5replay leaf"):
        fresh.extend(td.clone().set("a/b", torch.zeros(5)))
    assert len(fresh) == 0 and not (tmp_path / "other.h5").exists(), "a file is made with its first rows"
    other.close()
    with H5ReplayStorage(10, path=tmp_path / "plain.h5") as plain:
        with pytest.raises(ConfigError, match="stores TensorDicts"):
            ReplayBuffer(storage=plain).extend(torch.zeros(3, 2))


def test_bad_settings_are_refused_naming_the_problem(tmp_path: Any, start_server: Any) -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        H5ReplayStorage(10)
    with pytest.raises(ConfigError, match="exactly one"):
        H5ReplayStorage(10, path=tmp_path / "a.h5", endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="give max_size"):
        H5ReplayStorage(path=tmp_path / "new.h5")
    with pytest.raises(ConfigError, match="max_size must be an integer >= 1"):
        H5ReplayStorage(0, path=tmp_path / "new.h5")
    from h5replay.spaces import BoxSpace, DictSpace, TextSpace

    H5Replay.create(DictSpace({"obs": BoxSpace(0, 1, (2,)), "note": {"text": TextSpace(8)}}), 10,
                    tmp_path / "text.h5").close()
    with pytest.raises(ConfigError, match=r"TextSpace.* at key \('note', 'text'\), which a TensorDict"):
        H5ReplayStorage(path=tmp_path / "text.h5")

    server = start_server(space=BoxSpace(-1.0, 1.0, (3,)), capacity=100)
    with pytest.raises(ConfigError, match="not TensorDict rows"):
        H5ReplayStorage(endpoint=server.endpoint, timeout=10)
