"""LeRobot datasets (v3.0) with `h5replay.integrations.lerobot`, against the real `lerobot`:
gymnasium episodes exported load in `LeRobotDataset` with the same episodes and frames, and come
back equal (final observations too); a dataset written by LeRobot's own recording API imports;
the import's memory stays flat on a dataset of several files; bad versions and features are
refused naming them. Offline: every dataset is a local folder under tmp_path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when huggingface_hub is imported: never the network
lerobot_dataset = pytest.importorskip("lerobot.datasets.lerobot_dataset")
gym = pytest.importorskip("gymnasium")

import datasets  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from h5replay.errors import ConfigError, StorageError  # noqa: E402
from h5replay.integrations.gym_record import row_space  # noqa: E402
from h5replay.integrations.lerobot import FINALS_PATH, from_lerobot, to_lerobot  # noqa: E402
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, TextSpace  # noqa: E402
from h5replay.storage.replay import ReplayBuffer  # noqa: E402

LeRobotDataset = lerobot_dataset.LeRobotDataset
pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LeRobot's home and the datasets cache in tmp_path, so nothing lands in ~/.cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "lerobot-home"))
    monkeypatch.setattr(lerobot_dataset, "HF_LEROBOT_HOME", tmp_path / "lerobot-home")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")


def pendulum_buffer(path: Path, episodes: int = 3, steps: int = 40, seed: int = 0) -> ReplayBuffer:
    """Real Pendulum-v1 episodes (Box obs and action), each committed with its final observation."""
    env = gym.make("Pendulum-v1", max_episode_steps=steps)
    env.action_space.seed(seed)
    buffer = ReplayBuffer.create(row_space(env.observation_space, env.action_space), None, path,
                                 observation_keys=["obs"])
    for episode in range(episodes):
        obs, _ = env.reset(seed=seed + episode)
        done = False
        while not done:
            action = env.action_space.sample()
            nxt, reward, terminated, truncated, _ = env.step(action)
            buffer.append({"obs": obs, "action": action, "reward": np.float32(reward),
                           "terminated": terminated, "truncated": truncated})
            obs, done = nxt, terminated or truncated
        buffer.end_episode(final=obs)
    env.close()
    return buffer


def assert_same_replay(a: ReplayBuffer, b: ReplayBuffer) -> None:
    assert b.storage.single_instance_space == a.storage.single_instance_space
    assert [(e.first_row_id - a.view.begin, e.length) for e in a.episodes()] == \
        [(e.first_row_id - b.view.begin, e.length) for e in b.episodes()]
    rows_a, rows_b = a.get_at(slice(0, len(a)), decode=False), b.get_at(slice(0, len(b)), decode=False)
    assert rows_a.keys() == rows_b.keys()
    for key in rows_a:
        assert rows_a[key].dtype == rows_b[key].dtype, key
        np.testing.assert_array_equal(rows_a[key], rows_b[key], err_msg=key)
    for ea, eb in zip(a.episodes(), b.episodes()):
        fa, fb = a.final_observation(ea.episode_id), b.final_observation(eb.episode_id)
        assert (fa is None) == (fb is None)
        if fa is not None:
            np.testing.assert_array_equal(fa, fb)


def test_pendulum_episodes_load_in_lerobot_and_come_back_equal(tmp_path: Path) -> None:
    buffer = pendulum_buffer(tmp_path / "a.h5")
    to_lerobot(buffer, tmp_path / "ds", fps=20, task="swing up")
    dataset = LeRobotDataset("local/pendulum", root=tmp_path / "ds")

    assert dataset.num_episodes == 3 and len(dataset) == len(buffer) == 120 and dataset.fps == 20
    assert dataset.meta.info["codebase_version"] == "v3.0"
    assert list(dataset.meta.episodes["length"]) == [e.length for e in buffer.episodes()]
    assert list(dataset.meta.episodes["dataset_from_index"]) == [0, 40, 80]
    rows = buffer.get_at(slice(0, len(buffer)))
    for i in range(len(dataset)):
        frame = dataset[i]
        assert frame["episode_index"].item() == i // 40 and frame["frame_index"].item() == i % 40
        assert frame["task"] == "swing up"
        # float32 values exactly; LeRobot hands a feature of shape (1,) back as a scalar
        np.testing.assert_array_equal(frame["observation.state"].numpy(), rows["obs"][i])
        np.testing.assert_array_equal(frame["action"].numpy().reshape(1), rows["action"][i])
        assert frame["next.reward"].numpy() == rows["reward"][i]
        assert frame["next.done"].item() == rows["terminated"][i]
        assert frame["next.truncated"].item() == rows["truncated"][i]
    stats = dataset.meta.stats
    np.testing.assert_allclose(stats["observation.state"]["mean"], rows["obs"].mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(stats["action"]["max"], rows["action"].max(axis=0))
    assert int(stats["action"]["count"][0]) == 120

    back = from_lerobot(tmp_path / "ds", tmp_path / "b.h5")
    assert back.transition_keys == buffer.transition_keys
    assert_same_replay(buffer, back)
    back.sample_transitions(8)  # the imported replay is a working one, finals included
    back.close()
    buffer.close()


def test_a_dict_observation_with_an_image_leaf_round_trips(tmp_path: Path) -> None:
    space = DictSpace({
        "obs": {"state": BoxSpace(-1, 1, (2,)), "camera": BoxSpace(0, 255, (4, 5, 3), np.uint8)},
        "action": BoxSpace(-2, 2, (2,), np.float64), "reward": BoxSpace(-np.inf, np.inf, ()),
        "terminated": BinarySpace(), "truncated": BinarySpace(), "cost": BoxSpace(0, 10, (), np.int64),
    })
    rng = np.random.default_rng(3)
    buffer = ReplayBuffer.create(space, 100, tmp_path / "a.h5", observation_keys=["obs"])
    for length in (5, 7):
        buffer.extend({"obs": {"state": rng.uniform(-1, 1, (length, 2)).astype(np.float32),
                               "camera": rng.integers(0, 256, (length, 4, 5, 3), dtype=np.uint8)},
                       "action": rng.uniform(-2, 2, (length, 2)), "reward": rng.random(length).astype(np.float32),
                       "terminated": np.arange(length) == length - 1, "truncated": np.zeros(length, bool),
                       "cost": rng.integers(0, 10, length)})
        buffer.end_episode()  # no final observation: the import keeps none either
    to_lerobot(buffer, tmp_path / "ds", fps=10)
    dataset = LeRobotDataset("local/dict", root=tmp_path / "ds")
    assert sorted(dataset.meta.features) == sorted([
        "observation.state", "observation.camera", "action", "next.reward", "next.done", "next.truncated", "cost",
        "timestamp", "frame_index", "episode_index", "index", "task_index"])
    rows = buffer.get_at(slice(0, 12))
    frame = dataset[6]
    np.testing.assert_array_equal(frame["observation.camera"].numpy(), rows["obs"]["camera"][6])
    # The file holds float64 (the import gives it back exactly); LeRobot's loader makes its tensors
    # with torch.tensor(list), which is float32.
    assert pq.read_schema(tmp_path / "ds" / "data" / "chunk-000" / "file-000.parquet").field("action").type == \
        pa.list_(pa.float64(), 2)
    np.testing.assert_array_equal(frame["action"].numpy(), rows["action"][6].astype(np.float32))
    assert frame["cost"].item() == rows["cost"][6] and frame["episode_index"].item() == 1
    back = from_lerobot(tmp_path / "ds", tmp_path / "b.h5")
    assert_same_replay(buffer, back)
    back.close()
    buffer.close()


# LeRobot's own recording warns: its stats of a bool feature (np.histogram of it), and its frames of a
# feature of shape (1,) (datasets' float() of a 1-element array; numpy >= 2.4 makes that an error).
@pytest.mark.filterwarnings("ignore:Converting input from bool to:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
def test_a_dataset_recorded_with_lerobots_own_api_imports(tmp_path: Path) -> None:
    features = {"observation.state": {"dtype": "float32", "shape": (3,), "names": None},
                "observation.environment_state": {"dtype": "float32", "shape": (2,), "names": None},
                "action": {"dtype": "float32", "shape": (2,), "names": None},
                "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
                "next.done": {"dtype": "bool", "shape": (1,), "names": None}}
    recorded = LeRobotDataset.create("local/recorded", fps=15, features=features, root=tmp_path / "ds",
                                     use_videos=False)
    rng = np.random.default_rng(1)
    frames: list[dict[str, Any]] = []
    for length in (4, 6, 3):
        for t in range(length):
            frame = {"observation.state": rng.random(3, dtype=np.float32),
                     "observation.environment_state": rng.random(2, dtype=np.float32),
                     "action": rng.random(2, dtype=np.float32), "next.reward": np.array([t], np.float32),
                     "next.done": np.array([t == length - 1])}
            frames.append({k: v.copy() for k, v in frame.items()})
            recorded.add_frame({**frame, "task": "pick"})
        recorded.save_episode()
    recorded.finalize()
    assert not (tmp_path / "ds" / FINALS_PATH).exists()

    buffer = from_lerobot(tmp_path / "ds", tmp_path / "r.h5")
    space = buffer.storage.single_instance_space
    assert sorted(space.keys()) == ["action", "obs", "reward", "terminated"]
    assert sorted(space["obs"].keys()) == ["environment_state", "state"]
    assert space["reward"].shape == () and space["terminated"] == BinarySpace()
    assert [e.length for e in buffer.episodes()] == [4, 6, 3]
    rows = buffer.get_at(slice(0, 13))
    np.testing.assert_array_equal(rows["obs"]["state"], np.stack([f["observation.state"] for f in frames]))
    np.testing.assert_array_equal(rows["obs"]["environment_state"],
                                  np.stack([f["observation.environment_state"] for f in frames]))
    np.testing.assert_array_equal(rows["action"], np.stack([f["action"] for f in frames]))
    np.testing.assert_array_equal(rows["reward"], np.concatenate([f["next.reward"] for f in frames]))
    np.testing.assert_array_equal(rows["terminated"], np.concatenate([f["next.done"] for f in frames]))
    assert buffer.final_observation(buffer.episodes()[0].episode_id) is None  # LeRobot keeps none
    buffer.close()


_MEASURE = textwrap.dedent("""
    import json, sys, tracemalloc
    import pyarrow as pa
    from h5replay.integrations.lerobot import from_lerobot
    from_lerobot(sys.argv[1], sys.argv[1] + ".h5").close()  # warm up: first imports of modules are not the data
    tracemalloc.start()
    buffer = from_lerobot(sys.argv[2], sys.argv[2] + ".h5", batch_rows=512)
    peak = tracemalloc.get_traced_memory()[1]
    print(json.dumps({"tracemalloc_peak": peak, "arrow_peak": pa.default_memory_pool().max_memory(),
                      "rows": len(buffer), "episodes": buffer.num_episodes}))
    buffer.close()
""")


def many_frames(path: Path, episodes: int, length: int = 1000, dim: int = 128) -> ReplayBuffer:
    space = DictSpace({"obs": BoxSpace(-np.inf, np.inf, (dim,)), "action": BoxSpace(-1, 1, (2,)),
                       "reward": BoxSpace(-np.inf, np.inf, ()), "terminated": BinarySpace(),
                       "truncated": BinarySpace()})
    rng = np.random.default_rng(7)
    buffer = ReplayBuffer.create(space, None, path, observation_keys=["obs"])
    for _ in range(episodes):
        buffer.extend({"obs": rng.standard_normal((length, dim), dtype=np.float32),
                       "action": rng.uniform(-1, 1, (length, 2)).astype(np.float32),
                       "reward": rng.random(length, dtype=np.float32), "terminated": np.zeros(length, bool),
                       "truncated": np.arange(length) == length - 1})
        buffer.end_episode(final=rng.standard_normal(dim, dtype=np.float32))
    return buffer


def test_the_import_streams_in_flat_memory(tmp_path: Path) -> None:
    """30 000 frames of 128 float32 (15 MiB of observations) in 5 data files, imported by a fresh
    process in batches of 512 frames: its Python/numpy and Arrow peaks stay far below the data."""
    episodes, length, dim = 60, 500, 128  # Arrow holds about one row group (one episode) at a time
    buffer = many_frames(tmp_path / "a.h5", episodes, length, dim)
    to_lerobot(buffer, tmp_path / "big", fps=50, data_files_size_in_mb=4)
    assert len(list((tmp_path / "big" / "data").glob("*/*.parquet"))) >= 4  # a new file past 4 MB
    small = many_frames(tmp_path / "s.h5", 1, 10, dim)
    to_lerobot(small, tmp_path / "small", fps=50)
    small.close()

    out = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "small"), str(tmp_path / "big")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                         check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    data_bytes = episodes * length * dim * 4
    print(f"streaming import of {episodes * length} frames ({data_bytes / 2**20:.1f} MiB of observations): "
          f"{figures}")
    assert figures["rows"] == episodes * length and figures["episodes"] == episodes
    assert figures["tracemalloc_peak"] < data_bytes / 16, figures
    assert figures["arrow_peak"] < data_bytes / 4, figures

    back = ReplayBuffer.load_from(tmp_path / "big.h5")
    assert_same_replay(buffer, back)
    back.close()
    dataset = LeRobotDataset("local/big", root=tmp_path / "big")  # LeRobot reads the files as one
    assert len(dataset) == episodes * length and dataset.num_episodes == episodes
    last = buffer.get_at(len(buffer) - 1)
    np.testing.assert_array_equal(dataset[len(dataset) - 1]["observation.state"].numpy(), last["obs"])
    buffer.close()


@pytest.fixture()
def exported(tmp_path: Path) -> Path:
    buffer = pendulum_buffer(tmp_path / "a.h5", episodes=2, steps=10)
    root = to_lerobot(buffer, tmp_path / "ds", fps=10)
    buffer.close()
    return root


def edit_info(root: Path, change: Any) -> None:
    path = root / "meta" / "info.json"
    info = json.loads(path.read_text())
    change(info)
    path.write_text(json.dumps(info))


@pytest.mark.parametrize("version", ["v2.1", "v4.0", None])
def test_a_dataset_of_another_version_is_refused_naming_it(exported: Path, tmp_path: Path, version: Any) -> None:
    edit_info(exported, lambda info: info.update(codebase_version=version))
    with pytest.raises(ConfigError, match=f"codebase_version {version!r}"):
        from_lerobot(exported, tmp_path / "b.h5")
    assert not (tmp_path / "b.h5").exists()


@pytest.mark.parametrize("dtype", ["video", "image", "string", "complex64"])
def test_a_feature_that_cannot_be_mapped_is_refused_naming_it(exported: Path, tmp_path: Path, dtype: str) -> None:
    def add(info: dict[str, Any]) -> None:
        info["features"]["observation.images.top"] = {"dtype": dtype, "shape": [3, 8, 8], "names": None}
        del info["h5replay"]  # as any other LeRobot dataset

    edit_info(exported, add)
    with pytest.raises(ConfigError, match=rf"feature 'observation\.images\.top'.*{dtype}.*exclude="):
        from_lerobot(exported, tmp_path / "b.h5")
    buffer = from_lerobot(exported, tmp_path / "b.h5", exclude=["observation.images.top"])
    assert buffer.storage.single_instance_space["obs"] == BoxSpace(-np.inf, np.inf, (3,)) and len(buffer) == 20
    buffer.close()
    with pytest.raises(ConfigError, match="'observation.images.side'"):
        from_lerobot(exported, tmp_path / "c.h5", exclude=["observation.images.side"])


def test_without_its_h5replay_entry_the_dataset_maps_by_lerobots_names(exported: Path, tmp_path: Path) -> None:
    edit_info(exported, lambda info: info.pop("h5replay"))
    buffer = from_lerobot(exported, tmp_path / "b.h5")
    space = buffer.storage.single_instance_space
    assert space["obs"] == BoxSpace(-np.inf, np.inf, (3,)) and space["action"].shape == (1,)
    assert space["reward"].shape == () and space["truncated"] == BinarySpace()
    assert buffer.final_observation(buffer.episodes()[1].episode_id) is not None  # the finals file still maps
    buffer.close()


def test_frames_that_disagree_with_the_episode_records_are_refused(exported: Path, tmp_path: Path) -> None:
    path = exported / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(table.schema.get_field_index("length"), "length",
                                    pa.array([12, 8])), path)
    with pytest.raises(StorageError, match="episode 1"):
        from_lerobot(exported, tmp_path / "b.h5")


def test_the_export_refuses_what_lerobot_cannot_hold(tmp_path: Path, exported: Path) -> None:
    text = ReplayBuffer.create(DictSpace({"obs": BoxSpace(-1, 1, (2,)), "note": TextSpace(8)}), 10, tmp_path / "t.h5")
    text.append({"obs": np.zeros(2, np.float32), "note": "hi"})
    text.end_episode()
    with pytest.raises(ConfigError, match="leaf 'note'"):
        to_lerobot(text, tmp_path / "t-ds", fps=10)
    taken = ReplayBuffer.create(DictSpace({"obs": BoxSpace(-1, 1, (2,)), "index": BoxSpace(0, 9, ())}), 10,
                                tmp_path / "i.h5")
    with pytest.raises(ConfigError, match="leaf 'index'.*LeRobot's own column"):
        to_lerobot(taken, tmp_path / "i-ds", fps=10)
    good = pendulum_buffer(tmp_path / "g.h5", episodes=1, steps=5)
    with pytest.raises(ConfigError, match="not an empty folder"):
        to_lerobot(good, exported, fps=10)
    empty = ReplayBuffer.create(good.storage.single_instance_space, 10, tmp_path / "e.h5", observation_keys=["obs"])
    with pytest.raises(ConfigError, match="no complete episode"):
        to_lerobot(empty, tmp_path / "i-ds", fps=10)
    with pytest.raises(ConfigError, match="fps"):
        to_lerobot(good, tmp_path / "f-ds", fps=0)
    for buffer in (text, taken, good, empty):
        buffer.close()
    assert not any(p.exists() for p in (tmp_path / "t-ds", tmp_path / "i-ds", tmp_path / "f-ds"))
