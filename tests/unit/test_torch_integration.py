"""h5replay.integrations.torch: tensors from batches, and a DataLoader over a real server.

The conversion and the dataset's settings are pure; the DataLoader tests run a loopback server
(a spawned ServerProcess over tmp_path), in-process and with two worker processes. Skipped when
PyTorch is not installed (it is an optional extra: pip install 'h5replay[torch]').
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader  # noqa: E402

from h5replay.client import ActorClient  # noqa: E402
from h5replay.config import ServerConfig  # noqa: E402
from h5replay.errors import ConfigError, NotEnoughDataError, ServerUnavailableError  # noqa: E402
from h5replay.integrations.torch import H5ReplayDataset, to_tensors  # noqa: E402
from h5replay.server import ServerProcess  # noqa: E402
from h5replay.storage import BinarySpace, BoxSpace, DictSpace, TextSpace  # noqa: E402

# Every row says which episode and step it is, so any batch can be checked on its own.
SPACE = DictSpace({
    "obs": {"image": BoxSpace(0, 255, (4, 4, 3), np.uint8), "state": BoxSpace(-np.inf, np.inf, (3,))},
    "id": BoxSpace(0, 10**6, (2,), np.int64),  # episode, step
    "done": BinarySpace(),
    "note": TextSpace(8),
})
EPISODES, LENGTH = 6, 20


def _episode(e: int) -> dict:
    steps = np.arange(LENGTH)
    return {
        "obs": {"image": np.full((LENGTH, 4, 4, 3), e, np.uint8),
                "state": np.stack([np.full(LENGTH, e), steps, steps * 0.5], axis=1).astype(np.float32)},
        "id": np.stack([np.full(LENGTH, e), steps], axis=1),
        "done": steps == LENGTH - 1,
        "note": [f"e{e}s{s}" for s in steps],
    }


def _free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def server(tmp_path) -> Iterator[ServerProcess]:
    config = ServerConfig(path=str(tmp_path / "rb.h5"), space=SPACE, capacity=10_000,
                          bind="tcp://127.0.0.1:0", read_bind="tcp://127.0.0.1:0")
    proc = ServerProcess(config)
    try:
        yield proc
    finally:
        proc.stop(timeout=20)


@pytest.fixture
def filled(server) -> str:
    with ActorClient(server.endpoint, timeout=10) as actor:
        for e in range(EPISODES):
            actor.push_episode(_episode(e))
    return server.endpoint


def _check_batch(batch: dict, batch_size: int) -> None:
    assert set(batch) == {"obs", "id", "done", "note"}
    assert batch["obs"]["image"].dtype == torch.uint8 and batch["obs"]["image"].shape == (batch_size, 4, 4, 3)
    assert batch["obs"]["state"].dtype == torch.float32 and batch["id"].dtype == torch.int64
    assert batch["done"].dtype == torch.bool
    episode, step = batch["id"][:, 0], batch["id"][:, 1]
    assert torch.equal(batch["obs"]["image"][:, 0, 0, 0].long(), episode)
    assert torch.equal(batch["obs"]["state"][:, 1].long(), step)
    assert torch.equal(batch["done"], step == LENGTH - 1)
    assert batch["note"] == [f"e{e}s{s}" for e, s in batch["id"].tolist()]


# --------------------------------------------------------------------------------------- pure


def test_to_tensors_keeps_nesting_dtypes_and_text_and_copies_read_only_arrays():
    image = np.arange(24, dtype=np.uint8).reshape(2, 4, 3)
    image.flags.writeable = False  # as the client hands them out: views of the received message
    out = to_tensors({"a": {"image": image, "flag": np.array([True, False])},
                      "t": np.array(["x", "é🙂"], dtype=object), "u": np.array([1, 2], np.uint16)})
    assert out["a"]["image"].dtype == torch.uint8 and out["a"]["image"].tolist() == image.tolist()
    assert out["a"]["flag"].dtype == torch.bool
    assert out["t"] == ["x", "é🙂"]
    assert out["u"].tolist() == [1, 2]
    out["a"]["image"][0, 0, 0] = 99  # a copy: writable, and the source is untouched
    assert image[0, 0, 0] == 0


def test_the_dataset_holds_only_settings_and_pickles_without_a_server():
    ds = H5ReplayDataset("tcp://127.0.0.1:1", 8, num_batches=3)  # nothing listens there: no connection yet
    copy = pickle.loads(pickle.dumps(ds))
    assert (copy.endpoint, copy.batch_size, len(copy)) == ("tcp://127.0.0.1:1", 8, 3)
    with pytest.raises(TypeError, match="forever"):
        len(H5ReplayDataset("tcp://127.0.0.1:1", 8))


@pytest.mark.parametrize("kwargs", [
    {"batch_size": 0}, {"batch_size": 4, "sequence_length": 0}, {"batch_size": 4, "num_batches": -1},
    {"batch_size": 4, "prefetch": 0}, {"batch_size": 4, "timeout": 0},
    {"batch_size": 4, "transitions": True, "n_step": 0}, {"batch_size": 4, "transitions": True, "gamma": 2.0},
    {"batch_size": 4, "transitions": True, "sequence_length": 2},
])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        H5ReplayDataset("tcp://127.0.0.1:1", **kwargs)


# ---------------------------------------------------------------------- with a real server


def test_a_dataloader_in_process_yields_num_batches_of_checked_rows(filled):
    loader = DataLoader(H5ReplayDataset(filled, 32, num_batches=5, timeout=10), batch_size=None)
    batches = list(loader)
    assert len(batches) == 5 == len(loader)
    for batch in batches:
        _check_batch(batch, 32)


def test_sequences_are_consecutive_steps_of_one_episode(filled):
    batches = list(DataLoader(H5ReplayDataset(filled, 8, sequence_length=5, num_batches=3, timeout=10),
                              batch_size=None))
    assert len(batches) == 3
    for batch in batches:
        ids = batch["id"]
        assert ids.shape == (8, 5, 2) and batch["obs"]["image"].shape == (8, 5, 4, 4, 3)
        assert torch.all(ids[:, :, 0] == ids[:, :1, 0])
        assert torch.all(torch.diff(ids[:, :, 1], dim=1) == 1)
        assert len(batch["note"]) == 8 and len(batch["note"][0]) == 5


def test_two_worker_processes_share_num_batches_each_with_its_own_client(filled):
    # spawn: the dataset is pickled to fresh processes, which must open their own sockets.
    loader = DataLoader(H5ReplayDataset(filled, 16, num_batches=5, timeout=20), batch_size=None,
                        num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 5
    for batch in batches:
        _check_batch(batch, 16)


def test_stopping_early_ends_the_sampling_thread(filled):
    iterator = iter(H5ReplayDataset(filled, 4, prefetch=2, timeout=10))  # forever
    _check_batch(next(iterator), 4)
    time.sleep(0.3)  # let the thread fill the queue and block on it
    iterator.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("h5replay-torch")]


def test_an_empty_buffer_is_waited_for_then_reported(server):
    started = time.monotonic()
    with pytest.raises(NotEnoughDataError):
        next(iter(H5ReplayDataset(server.endpoint, 4, timeout=1.0)))
    assert 0.9 < time.monotonic() - started < 10


def test_data_arriving_while_waiting_is_used(server):
    def write_later() -> None:
        time.sleep(0.5)
        with ActorClient(server.endpoint, timeout=10) as actor:
            actor.push_episode(_episode(0))

    writer = threading.Thread(target=write_later)
    writer.start()
    try:
        batch = next(iter(H5ReplayDataset(server.endpoint, 4, timeout=10)))
    finally:
        writer.join(10)
    _check_batch(batch, 4)


def test_no_server_raises_server_unavailable_in_time():
    started = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        next(iter(H5ReplayDataset(_free_endpoint(), 4, timeout=0.5)))
    assert time.monotonic() - started < 10


def test_transitions_come_as_tensors_with_next_and_discount(tmp_path):
    from service_helpers import running_server, server_config
    from transition_helpers import SPACE, Model, episode

    from h5replay.client import ActorClient

    model = Model()
    with running_server(server_config(tmp_path / "t.h5", space=SPACE, capacity=200, observation_keys=("obs",))) as srv:
        with ActorClient(srv.endpoint, timeout=10) as actor:
            for first, kind in ((0, "terminated"), (5, "truncated")):
                rows, final = episode(first, 5, kind)
                model.episodes.append((first, rows, final))
                actor.push_episode(rows, final=final)
        ds = H5ReplayDataset(srv.endpoint, 16, num_batches=2, timeout=10, transitions=True, n_step=3, gamma=0.5)
        for batch in DataLoader(ds, batch_size=None):
            assert isinstance(batch["discount"], torch.Tensor) and batch["next"]["obs"]["pos"].shape == (16, 2)
            for i, row in enumerate(batch["obs"]["id"].tolist()):
                want = model.expected(int(row), 3, 0.5)
                assert batch["reward"][i].item() == pytest.approx(want["reward"], rel=1e-6)
                assert batch["next"]["obs"]["id"][i].item() == want["next"][1]


def test_with_info_prioritized_replay_through_a_dataloader_and_its_priority_updates(tmp_path):
    """Each item is (batch, SampleInfo) whose ids are the batch's rows; priorities set through
    the dataset (from the training loop's process) steer the next draws of the workers."""
    from h5replay.sampling import Prioritized, SamplingConfig

    config = ServerConfig(path=str(tmp_path / "p.h5"), space=SPACE, capacity=10_000, bind="tcp://127.0.0.1:0",
                          read_bind="tcp://127.0.0.1:0", sampling=SamplingConfig(Prioritized(exponent=1.0)))
    proc = ServerProcess(config)
    try:
        with ActorClient(proc.endpoint, timeout=10) as actor:
            for e in range(EPISODES):
                actor.push_episode(_episode(e))
        ds = H5ReplayDataset(proc.endpoint, 32, num_batches=4, timeout=10, with_info=True, prefetch=1)
        for batch, info in DataLoader(ds, batch_size=None):
            _check_batch(batch, 32)
            assert torch.equal(torch.from_numpy(info.row_ids.astype(np.int64)), batch["id"][:, 0] * LENGTH + batch["id"][:, 1])
            assert info.probabilities.shape == (32,) and (info.probabilities > 0).all()
        everything = np.arange(EPISODES * LENGTH)
        assert ds.update_priorities(torch.from_numpy(everything), torch.full((everything.size,), 1e-6)) == 0, "none ignored"
        with pytest.raises(IndexError, match="never committed"):
            ds.update_priorities([7, 10**6], [1e6, 1.0])  # and nothing of it is changed
        assert ds.update_priorities([7], [1e6]) == 0
        assert pickle.loads(pickle.dumps(ds))._priorities is None, "a worker never gets the loop's client"
        drawn = np.concatenate([info.row_ids for _, info in DataLoader(ds, batch_size=None, num_workers=2)])
        assert drawn.size == 4 * 32 and (drawn == 7).mean() > 0.95, np.unique(drawn, return_counts=True)
        ds.close()
    finally:
        proc.stop(timeout=20)


def test_with_info_transitions_say_which_episodes_have_their_final(tmp_path):
    from service_helpers import running_server, server_config
    from transition_helpers import SPACE as TSPACE
    from transition_helpers import episode

    with running_server(server_config(tmp_path / "t.h5", space=TSPACE, capacity=200, observation_keys=("obs",))) as srv:
        with ActorClient(srv.endpoint, timeout=10) as actor:
            for first, kind in ((0, "terminated"), (5, "cut")):
                rows, final = episode(first, 5, kind)
                actor.push_episode(rows, final=final)
        ds = H5ReplayDataset(srv.endpoint, 64, num_batches=1, timeout=10, transitions=True, with_info=True)
        [(batch, info)] = list(DataLoader(ds, batch_size=None))
    ids = batch["obs"]["id"].numpy()
    np.testing.assert_array_equal(info.row_ids.astype(np.int64), ids)
    np.testing.assert_array_equal(info.has_final, ids < 5)


# ------------------------------------------------------------------------------ map-style, local


def _local_file(path, capacity: int = 10_000, episodes: int = EPISODES) -> None:
    from h5replay.storage import ReplayBuffer

    with ReplayBuffer.create(SPACE, capacity, path) as rb:
        for e in range(episodes):
            rb.extend(_episode(e))
            rb.end_episode()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shuffled_pass_of_the_map_dataset_reads_every_held_row_once(tmp_path, num_workers):
    from h5replay.integrations.torch import H5ReplayMapDataset

    _local_file(tmp_path / "rb.h5")
    ds = H5ReplayMapDataset(tmp_path / "rb.h5", with_info=True)
    assert len(ds) == EPISODES * LENGTH
    seen = []
    for batch, ids in DataLoader(ds, batch_size=16, shuffle=True, num_workers=num_workers):
        _check_batch(batch, len(ids))
        assert torch.equal(ids, batch["id"][:, 0] * LENGTH + batch["id"][:, 1])
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(EPISODES * LENGTH)) and seen != sorted(seen)
    row = ds[-1]
    assert row[1] == EPISODES * LENGTH - 1 and row[0]["note"] == f"e{EPISODES - 1}s{LENGTH - 1}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_map_datasets_loader_reads_whole_batches_without_collation(tmp_path, num_workers):
    from h5replay.integrations.torch import H5ReplayMapDataset

    _local_file(tmp_path / "rb.h5")
    ds = H5ReplayMapDataset(tmp_path / "rb.h5", with_info=True)
    batch, ids = ds[[5, 3, 5, -1]]
    assert ids.tolist() == [5, 3, 5, EPISODES * LENGTH - 1] and batch["id"][:, 1].tolist() == [5, 3, 5, LENGTH - 1]
    seen = []
    for batch, ids in ds.loader(16, shuffle=True, num_workers=num_workers, generator=torch.Generator().manual_seed(1)):
        _check_batch(batch, len(ids))
        assert torch.equal(ids, batch["id"][:, 0] * LENGTH + batch["id"][:, 1])
        seen.extend(ids.tolist())
    assert sorted(seen) == list(range(EPISODES * LENGTH)) and seen != sorted(seen)
    in_order = [ids for _, ids in ds.loader(50, drop_last=True)]
    assert len(in_order) == EPISODES * LENGTH // 50 and torch.equal(torch.cat(in_order), torch.arange(len(in_order) * 50))
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1"):
        ds.loader(0)


def test_the_map_dataset_indexes_the_rows_held_when_it_was_made(tmp_path):
    from h5replay.errors import EvictedError
    from h5replay.integrations.torch import H5ReplayMapDataset
    from h5replay.storage import ReplayBuffer

    path = tmp_path / "ring.h5"
    _local_file(path, capacity=50, episodes=3)  # rows 10..59 held of 60
    ds = H5ReplayMapDataset(path)
    assert len(ds) == 50 and ds[0]["id"].tolist() == [0, 10]
    with pytest.raises(IndexError, match="index 50 is out of range for a dataset of 50 rows"):
        ds[50]
    ds.close()
    with ReplayBuffer.load_from(path, read_only=False) as rb:
        rb.extend(_episode(3))
        rb.end_episode()
    with pytest.raises(EvictedError):
        ds[0]
    assert ds[49]["id"].tolist() == [2, LENGTH - 1], "the rows still held read as before"


def test_the_map_dataset_of_transitions_is_get_transitions(tmp_path):
    from transition_helpers import SPACE as TSPACE
    from transition_helpers import Model, episode

    from h5replay.integrations.torch import H5ReplayMapDataset
    from h5replay.storage import ReplayBuffer

    model = Model()
    with ReplayBuffer.create(TSPACE, 100, tmp_path / "t.h5", observation_keys=("obs",)) as rb:
        for first, kind in ((0, "terminated"), (6, "truncated"), (10, "cut")):
            rows, final = episode(first, {0: 6, 6: 4, 10: 3}[first], kind)
            model.episodes.append((first, rows, final))
            rb.extend(rows)
            rb.end_episode(final=final)
    ds = H5ReplayMapDataset(tmp_path / "t.h5", transitions=True, n_step=2, gamma=0.5)
    [batch] = list(DataLoader(ds, batch_size=len(ds), shuffle=True))
    for i, row in enumerate(batch["obs"]["id"].tolist()):
        want = model.expected(row, 2, 0.5)
        assert batch["reward"][i].item() == pytest.approx(want["reward"]) and batch["discount"][i].item() == want["discount"]
        assert batch["next"]["obs"]["id"][i].item() == want["next"][1]
        assert bool(batch["terminated"][i]) == want["terminated"] and bool(batch["truncated"][i]) == want["truncated"]


def test_bad_map_datasets_are_refused_naming_the_problem(tmp_path):
    from h5replay.integrations.torch import H5ReplayMapDataset
    from h5replay.storage import ReplayBuffer

    ReplayBuffer.create(SPACE, 10, tmp_path / "empty.h5").close()
    with pytest.raises(ConfigError, match="holds no rows"):
        H5ReplayMapDataset(tmp_path / "empty.h5")
    _local_file(tmp_path / "rb.h5", episodes=1)
    with pytest.raises(ConfigError, match="keeps no final observations"):
        H5ReplayMapDataset(tmp_path / "rb.h5", transitions=True)
    with pytest.raises(ConfigError, match="n_step"):
        H5ReplayMapDataset(tmp_path / "rb.h5", n_step=0)
