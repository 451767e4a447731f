"""Minari and h5replay (real minari, real gymnasium envs, datasets under tmp_path, no network):
episodes recorded into a replay export to a dataset `minari.load_dataset` opens with the same
arrays and import back equal, finals included; `h5replay export --to minari` / `import`; a
dataset made by Minari's own DataCollector imports; the import's memory stays flat; a ring that
evicted episodes exports what it holds; bad datasets and replays are refused naming the problem.
`make test-interop` installs minari and runs it."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

minari = pytest.importorskip("minari")
gym = pytest.importorskip("gymnasium")

from h5replay.cli import main  # noqa: E402
from h5replay.errors import ConfigError  # noqa: E402
from h5replay.integrations.gym import row_space, value_from_gymnasium  # noqa: E402
from h5replay.integrations.minari import from_minari, to_minari  # noqa: E402
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]
STEPS = ("action", "reward", "terminated", "truncated")


@pytest.fixture(autouse=True)
def datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Minari's datasets live under tmp_path for each test."""
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def record(env: Any, path: Path, episodes: int, *, capacity: int | None = None, seed: int = 0) -> ReplayBuffer:
    """A replay of `episodes` random-policy episodes of `env`, each with its final observation."""
    rb = ReplayBuffer.create(row_space(env.observation_space, env.action_space), capacity, path,
                             observation_keys=("obs",))
    env.action_space.seed(seed)
    for i in range(episodes):
        obs, _ = env.reset(seed=seed + i)
        writer, done = rb.open_segment_writer(), False
        while not done:
            action = env.action_space.sample()
            next_obs, reward, terminated, truncated, _ = env.step(action)
            writer.append({"obs": value_from_gymnasium(env.observation_space, obs),
                           "action": value_from_gymnasium(env.action_space, action),
                           "reward": np.float32(reward), "terminated": terminated, "truncated": truncated})
            obs, done = next_obs, terminated or truncated
        rb.commit_segment(writer, final=value_from_gymnasium(env.observation_space, obs))
    return rb


def held(rb: ReplayBuffer) -> list[dict[str, Any]]:
    """Every episode `rb` holds: its rows and its final observation."""
    out = []
    for e in rb.episodes():
        rows = rb.get_rows(np.arange(e.first_row_id, e.first_row_id + e.length))
        out.append({**rows, "final": rb.final_observation(e.episode_id)})
    return out


def same(a: Any, b: Any) -> bool:
    return bool(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b))


def assert_dataset_holds(dataset: Any, episodes: list[dict[str, Any]]) -> None:
    assert dataset.total_episodes == len(episodes)
    for got, want in zip(dataset.iterate_episodes(), episodes, strict=True):
        assert same(got.observations, np.concatenate([want["obs"], want["final"][None]]))
        for minari_key, key in (("actions", "action"), ("rewards", "reward"), ("terminations", "terminated"),
                                ("truncations", "truncated")):
            assert same(getattr(got, minari_key), want[key]), minari_key


def assert_same_episodes(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        for key in ("obs", *STEPS, "final"):
            assert same(np.asarray(g[key]), np.asarray(w[key])), key


@pytest.mark.parametrize("env_id, episodes", [("CartPole-v1", 6), ("Pendulum-v1", 3)])
def test_a_replay_exports_to_minari_and_imports_back_equal(tmp_path: Path, env_id: str, episodes: int) -> None:
    env = gym.make(env_id, max_episode_steps=40)  # truncated episodes (Pendulum's all are) and terminated ones
    with record(env, tmp_path / "replay.h5", episodes) as rb:
        want = held(rb)
        dataset = to_minari(rb, f"h5replay/{env_id.lower()}-v0", env=env_id)
    assert_dataset_holds(minari.load_dataset(f"h5replay/{env_id.lower()}-v0"), want)
    assert dataset.observation_space == env.observation_space and dataset.action_space == env.action_space
    assert dataset.recover_environment().spec.id == env_id
    with from_minari(f"h5replay/{env_id.lower()}-v0", tmp_path / "back.h5") as back:
        assert back.space == row_space(env.observation_space, env.action_space)  # RecordEpisodes can extend it
        assert_same_episodes(held(back), want)


def test_nested_spaces_go_both_ways(tmp_path: Path) -> None:
    """Dict and Tuple observations (stored as h5replay Dict spaces), MultiBinary / MultiDiscrete actions."""
    obs_space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,), np.float32),
                                 "pair": gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.MultiBinary(4)])})
    for action_space in (gym.spaces.MultiBinary(3), gym.spaces.MultiDiscrete([2, 5])):
        obs_space.seed(1), action_space.seed(1)
        name = type(action_space).__name__
        path, dataset_id = tmp_path / f"{name}.h5", f"nested/{name}-v0"
        with ReplayBuffer.create(row_space(obs_space, action_space), None, path, observation_keys=("obs",)) as rb:
            for length in (3, 5):
                writer = rb.open_segment_writer()
                for t in range(length):
                    writer.append({"obs": value_from_gymnasium(obs_space, obs_space.sample()),
                                   "action": value_from_gymnasium(action_space, action_space.sample()),
                                   "reward": np.float32(t), "terminated": t == length - 1, "truncated": False})
                rb.commit_segment(writer, final=value_from_gymnasium(obs_space, obs_space.sample()))
            want = held(rb)
            dataset = to_minari(rb, dataset_id)
        assert dataset.observation_space == obs_space and dataset.action_space == action_space
        for got, w in zip(dataset.iterate_episodes(), want, strict=True):
            assert isinstance(got.observations["pair"], tuple)  # as gymnasium gives a Tuple's values
            assert same(got.observations["pair"][1][-1], w["final"]["pair"]["1"])
            assert same(got.observations["pos"][:-1], w["obs"]["pos"])
        with from_minari(dataset_id, tmp_path / f"back-{name}.h5") as back:
            got_back = held(back)
        for g, w in zip(got_back, want, strict=True):
            assert same(g["obs"]["pos"], w["obs"]["pos"]) and same(g["final"]["pos"], w["final"]["pos"])
            for i in ("0", "1"):
                assert same(g["obs"]["pair"][i], w["obs"]["pair"][i]) and same(g["final"]["pair"][i], w["final"]["pair"][i])
            assert same(g["action"], w["action"]) and same(g["reward"], w["reward"])


def test_the_cli_exports_and_imports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with record(gym.make("CartPole-v1"), tmp_path / "replay.h5", 4) as rb:
        want = held(rb)
    assert main(["export", str(tmp_path / "replay.h5"), "cli/cartpole-v1", "--to", "minari"]) == 0
    assert_dataset_holds(minari.load_dataset("cli/cartpole-v1"), want)
    assert main(["export", str(tmp_path / "replay.h5"), "cli/cartpole-v1", "--to", "minari"]) == 2  # taken
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "replay.h5"), "cli/cartpole-v1", "--to", "minari", "--overwrite"]) == 0
    assert main(["export", str(tmp_path / "replay.h5"), "cli/x-v0", "--to", "minari", "--compression", "gzip"]) == 2
    assert "--compression apply to a replay file" in capsys.readouterr().err
    assert main(["import", "cli/cartpole-v1", str(tmp_path / "back.h5")]) == 0
    assert "4 episodes" in capsys.readouterr().out
    with ReplayBuffer.load_from(tmp_path / "back.h5") as back:
        assert_same_episodes(held(back), want)
    assert main(["export", str(tmp_path / "back.h5"), str(tmp_path / "copy.h5")]) == 0  # --to h5replay, as before


# minari 0.5.4's DataCollector.close() deletes its temporary folder but not the TemporaryDirectory
# object, whose finalizer then warns: dropped here, inside the test (see the gc.collect below).
@pytest.mark.filterwarnings("ignore:Implicitly cleaning up:ResourceWarning")
def test_a_dataset_made_by_minaris_data_collector_imports(tmp_path: Path) -> None:
    env = minari.DataCollector(gym.make("CartPole-v1"))
    for seed in range(5):
        env.reset(seed=seed)
        done = False
        while not done:
            _, _, terminated, truncated, _ = env.step(env.action_space.sample())
            done = terminated or truncated
    env.create_dataset("collected/cartpole-v0", algorithm_name="random", author="h5replay tests",
                       author_email="tests@h5replay.invalid", code_permalink="tests/interop/test_minari.py",
                       description="random CartPole episodes", eval_env="CartPole-v1")
    env.close()
    del env
    gc.collect()
    dataset = minari.load_dataset("collected/cartpole-v0")
    with from_minari("collected/cartpole-v0", tmp_path / "collected.h5") as rb:
        got = held(rb)
        assert rb.num_episodes == dataset.total_episodes == 5 and len(rb) == dataset.total_steps
    for g, e in zip(got, dataset.iterate_episodes(), strict=True):
        assert same(g["obs"], e.observations[:-1]) and same(g["final"], e.observations[-1])
        assert same(g["action"], e.actions.astype(np.int64))
        assert same(g["reward"], e.rewards.astype(np.float32))  # float64 in Minari; float32 as RecordEpisodes keeps
        assert same(g["terminated"], e.terminations) and same(g["truncated"], e.truncations)


def new_dataset(dataset_id: str, observation_space: Any, action_space: Any) -> Any:
    """An empty dataset of these spaces, made by minari (which warns that it was made from no env)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "env_spec is None", UserWarning)
        return minari.create_dataset_from_buffers(
            dataset_id, [], observation_space=observation_space, action_space=action_space, algorithm_name="synthetic",
            author="h5replay tests", author_email="tests@h5replay.invalid", code_permalink="tests/interop",
            description="synthetic", eval_env="CartPole-v1")


def write_dataset(dataset_id: str, episodes: int, steps: int, width: int) -> Any:
    """A dataset of `episodes` episodes of `steps` steps of `width` float32s, written one at a time."""
    dataset = new_dataset(dataset_id, gym.spaces.Box(-np.inf, np.inf, (width,), np.float32), gym.spaces.Discrete(3))
    rng = np.random.default_rng(0)

    def buffers() -> Any:
        for _ in range(episodes):
            yield minari.data_collector.EpisodeBuffer(
                observations=rng.standard_normal((steps + 1, width), np.float32),
                actions=rng.integers(0, 3, steps), rewards=rng.standard_normal(steps),
                terminations=np.eye(1, steps, steps - 1, bool)[0], truncations=np.zeros(steps, bool))

    dataset.storage.update_episodes(buffers())
    return dataset


STREAMING = """
import sys, tracemalloc
import minari
from h5replay.integrations.minari import from_minari, to_minari
from h5replay.storage import ReplayBuffer

def anonymous():  # resident memory less file-backed pages (h5replay reads its files through mmap)
    with open("/proc/self/statm") as f:
        _, resident, shared = f.read().split()[:3]
    return (int(resident) - int(shared)) * 4096

def peaks(run):
    before, highest = anonymous(), [0]
    tracemalloc.start()
    run(lambda done, total: highest.append(anonymous()))  # after each episode
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return max(highest) - before, traced

dataset = minari.load_dataset("big/synthetic-v0")  # minari and h5py loaded, its metadata read

def imported(progress):
    with from_minari("big/synthetic-v0", sys.argv[1], check_bounds=False, progress=progress) as rb:
        assert rb.num_episodes == dataset.total_episodes

def exported(progress):
    with ReplayBuffer.load_from(sys.argv[1]) as rb:
        assert to_minari(rb, "big/again-v0", progress=progress).total_episodes == dataset.total_episodes

print(*peaks(imported), *peaks(exported))
"""


def test_import_and_export_stream_episode_by_episode(tmp_path: Path) -> None:
    """A 100 MB dataset imports, and exports back, in a process whose memory grows by a few MB
    (HDF5's C caches included: minari's file open for every episode at once grows them by 50 MB
    here) and whose traced Python / numpy memory peaks at a few episodes."""
    episodes, steps, width = 1000, 100, 256
    write_dataset("big/synthetic-v0", episodes, steps, width)
    dataset_bytes = episodes * (steps + 1) * width * 4  # the observations alone
    out = subprocess.run([sys.executable, "-c", STREAMING, str(tmp_path / "big.h5")], capture_output=True,
                         text=True, timeout=240, check=True).stdout.split()
    import_rss, import_traced, export_rss, export_traced = map(int, out)
    print(f"a {dataset_bytes / 1e6:.0f} MB dataset: import grew memory by {import_rss / 1e6:.1f} MB (traced peak "
          f"{import_traced / 1e6:.2f} MB), export by {export_rss / 1e6:.1f} MB ({export_traced / 1e6:.2f} MB)")
    assert import_rss < 20e6 and export_rss < 20e6, (import_rss, export_rss)
    assert import_traced < 5e6 and export_traced < 5e6, (import_traced, export_traced)


def test_a_ring_that_evicted_episodes_exports_those_it_holds(tmp_path: Path) -> None:
    env = gym.make("CartPole-v1", max_episode_steps=12)
    with record(env, tmp_path / "ring.h5", 10, capacity=64) as rb:
        kept = rb.episodes()
        assert kept[0].episode_id > 0  # the oldest were evicted
        want = held(rb)
        dataset = to_minari(rb, "ring/cartpole-v0")
    assert dataset.total_episodes == len(kept)
    assert_dataset_holds(dataset, want)


def test_an_episode_without_a_final_is_refused_or_skipped(tmp_path: Path, datasets: Path) -> None:
    env = gym.make("CartPole-v1", max_episode_steps=10)
    with record(env, tmp_path / "replay.h5", 3) as rb:
        writer = rb.open_segment_writer()
        writer.extend({k: v for k, v in held(rb)[0].items() if k != "final"})
        rb.commit_segment(writer)  # no final: episode 3
        with pytest.raises(ConfigError, match="episode 3 .* has no final observation.*missing_final='skip'"):
            to_minari(rb, "finals/cartpole-v0")
        assert not (datasets / "finals" / "cartpole-v0").exists()  # nothing left of it
        dataset = to_minari(rb, "finals/cartpole-v0", missing_final="skip")
        assert dataset.total_episodes == 3
        with pytest.raises(ConfigError, match="missing_final is 'error' or 'skip'"):
            to_minari(rb, "finals/other-v0", missing_final="repeat")


def test_bad_replays_and_ids_are_refused_naming_the_problem(tmp_path: Path) -> None:
    space = DictSpace({"obs": BoxSpace(-1, 1, (2,)), "act": BoxSpace(0, 1, (), np.int64),
                       "reward": BoxSpace(-1, 1, (), np.float32)})
    with ReplayBuffer.create(space, None, tmp_path / "plain.h5") as rb:
        with pytest.raises(ConfigError, match="keeps no final observations .*observation_keys="):
            to_minari(rb, "bad/plain-v0")
    with record(gym.make("CartPole-v1", max_episode_steps=5), tmp_path / "replay.h5", 1) as rb:
        with pytest.raises(ConfigError, match="no action leaf 'act'"):
            to_minari(rb, "bad/plain-v0", action_key="act")
        with pytest.raises(ConfigError, match="not a Minari dataset id: .*name-vN"):
            to_minari(rb, "no version")
        to_minari(rb, "bad/taken-v0")
        with pytest.raises(ConfigError, match="'bad/taken-v0' already exists"):
            to_minari(rb, "bad/taken-v0")


def test_bad_datasets_are_refused_naming_the_version_format_space_or_episode(tmp_path: Path, datasets: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no Minari dataset 'absent/x-v0'.*MINARI_DATASETS_PATH"):
        from_minari("absent/x-v0", tmp_path / "x.h5")
    write_dataset("bad/layout-v0", 2, 5, 3)
    meta_path = datasets / "bad" / "layout-v0" / "data" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    for key, value, message in (("minari_version", "0.3.1", "written by Minari '0.3.1', a format h5replay does not "
                                                             "read: it reads those of Minari 0.4.0 and later"),
                                ("data_format", "zarr", "stored as 'zarr'; h5replay reads hdf5")):
        meta_path.write_text(json.dumps({**meta, key: value}))
        with pytest.raises(ConfigError, match=message):
            from_minari("bad/layout-v0", tmp_path / "x.h5")
        assert not os.path.exists(tmp_path / "x.h5")
    meta_path.write_text(json.dumps(meta))

    import h5py
    with h5py.File(meta_path.parent / "main_data.hdf5", "a") as f:  # episode 1 loses its final observation
        obs = f["episode_1/observations"][:-1]
        del f["episode_1/observations"]
        f["episode_1/observations"] = obs
    with pytest.raises(ConfigError, match="episode 1 of Minari dataset 'bad/layout-v0' has 5 observations for 5 "
                                          "rewards, not the 6"):
        from_minari("bad/layout-v0", tmp_path / "x.h5")
    assert not os.path.exists(tmp_path / "x.h5")  # nothing is left of the half-made replay

    new_dataset("bad/space-v0", gym.spaces.Tuple([]), gym.spaces.Discrete(2))
    with pytest.raises(ConfigError, match="Minari dataset 'bad/space-v0': cannot convert the empty gymnasium Tuple"):
        from_minari("bad/space-v0", tmp_path / "x.h5")


def test_leaves_beyond_the_steps_export_as_infos(tmp_path: Path) -> None:
    env = gym.make("CartPole-v1")
    space = DictSpace({**row_space(env.observation_space, env.action_space).spaces,
                       "value": BoxSpace(-np.inf, np.inf, (), np.float32)})
    with ReplayBuffer.create(space, None, tmp_path / "extras.h5", observation_keys=("obs",)) as rb:
        writer = rb.open_segment_writer()
        writer.extend({"obs": np.zeros((3, 4), np.float32), "action": np.array([0, 1, 0]),
                       "reward": np.ones(3, np.float32), "terminated": np.array([False, False, True]),
                       "truncated": np.zeros(3, bool), "value": np.array([0.5, 1.5, 2.5], np.float32)})
        rb.commit_segment(writer, final=np.ones(4, np.float32))
        episode = next(iter(to_minari(rb, "extras/cartpole-v0")))
    assert same(episode.infos["value"], np.array([0.5, 1.5, 2.5], np.float32))  # one per step
    assert same(episode.observations[-1], np.ones(4, np.float32))
