"""Hostile files: h5replay's attributes and internal datasets holding the wrong types, sizes or
values, made on purpose from a normal file with plain h5py (a damaged disk, a crafted file).

Every entry point refuses each of them with one line naming the file and what is wrong: `h5replay
info / export / compact / serve` exit 1 without a traceback, and `ReplayBuffer.load_from` (writer,
plain reader, SWMR reader) raises StorageError. Sizes, shapes and types are checked before
anything is allocated or read for them: a claimed 2**40 rows would ask for TiBs, and the
MemoryError would come out as a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import pytest
from fault_helpers import cli_command
from service_helpers import EPISODE_SPACE, RawClient, episode_rows, running_server, server_config

from h5replay import protocol as P
from h5replay.cli import main
from h5replay.errors import LimitExceededError, SpaceMismatchError, StorageError
from h5replay.sampling import Prioritized
from h5replay.spaces import BoxSpace
from h5replay.storage import ReplayBuffer
from h5replay.storage._h5file import MAX_ID
from h5replay.storage.replay import state

pytestmark = pytest.mark.timeout(60)

SPACE = BoxSpace(-1, 1, (3,))
REPLAY = "_h5replay/replay"
TABLE = f"{REPLAY}/tables/default"  # the datasets of a one-table buffer's table
HUGE = 1 << 40
# What reads each part of a file: `info` and a plain or SWMR reader never open the idempotency
# key table (only a writer, and `export`, which copies the keys).
EVERY_OPEN = ("info", "export", "compact", "writer", "reader", "swmr_reader")
KEY_TABLE_OPENS = ("export", "compact", "writer")


def make_file(path: Path, capacity: int | None = 16, prioritized: bool = False) -> Path:
    """A normal buffer file: two keyed episodes (5 and 4 rows), and priority updates when prioritized."""
    rb = ReplayBuffer.create(SPACE, capacity, path, sampler=Prioritized(0.6, None) if prioritized else None)
    for n in (5, 4):
        writer = rb.open_segment_writer()
        writer.extend(np.zeros((n, 3), np.float32))
        rb.commit_segment(writer, idempotency_key=os.urandom(16))
    if prioritized:
        rb.update_priorities(np.array([0, 1]), np.array([2.0, 3.0]))
    rb.close()
    return path


def set_state(f: h5py.File, **fields: int) -> None:
    """Rewrite the journal's state with `fields` changed (those of a table: the first table's),
    its checksums made to match."""
    ds = f[f"{REPLAY}/journal"]
    table = {name: fields.pop(name) for name in ("sampled", "plog", "pckpt") if name in fields}
    ds[...] = state.encode(state.decode(ds[...], "", None).replace(**fields).with_table(0, **table))


def replace_dataset(f: h5py.File, name: str, **create: object) -> None:
    del f[name]
    f.create_dataset(name, **create)  # type: ignore[arg-type]


def nested_dicts(depth: int) -> str:
    return '{"type": "dict", "spaces": {"a": ' * depth + '{"type": "binary", "shape": []}' + "}}" * depth


@dataclass(frozen=True)
class Hostile:
    name: str
    corrupt: Callable[[h5py.File], None]
    says: str  # a part of the message: the attribute or dataset named
    opens: tuple[str, ...] = EVERY_OPEN
    capacity: int | None = 16
    prioritized: bool = False
    error: type[Exception] = StorageError

    def __str__(self) -> str:
        return self.name


def _huge_matching_capacity(f: h5py.File) -> None:
    """A capacity of 2**40 rows whose datasets all agree (sparse: nothing is written)."""
    f.attrs["h5replay_capacity"] = HUGE
    replace_dataset(f, "data", shape=(HUGE, 3), maxshape=(HUGE, 3), dtype=np.float32, chunks=(1024, 3))
    replace_dataset(f, f"{TABLE}/priorities", shape=(HUGE,), maxshape=(HUGE,), dtype=np.float64, chunks=(4096,),
                    fillvalue=np.nan)
    episodes = f[f"{REPLAY}/episodes"][...]
    replace_dataset(f, f"{REPLAY}/episodes", data=episodes, maxshape=(HUGE, 2), chunks=(16, 2))


def _space(text: str) -> Callable[[h5py.File], None]:
    def corrupt(f: h5py.File) -> None:
        f.attrs["h5replay_space"] = text

    return corrupt


def _attr(name: str, value: object, where: str = "/") -> Callable[[h5py.File], None]:
    def corrupt(f: h5py.File) -> None:
        f[where].attrs[name] = value

    return corrupt


CASES = [
    Hostile("capacity 'abc'", _attr("h5replay_capacity", "abc"), "'h5replay_capacity' = 'abc'"),
    Hostile("capacity NaN", _attr("h5replay_capacity", np.nan), "'h5replay_capacity'"),
    Hostile("capacity an array", _attr("h5replay_capacity", np.arange(3)), "'h5replay_capacity'"),
    Hostile("capacity 0", _attr("h5replay_capacity", 0), "'h5replay_capacity' = 0"),
    Hostile("format version 'abc'", _attr("h5replay_format_version", "abc"), "format version 'abc'"),
    Hostile("space of 2**40 elements a row",
            _space(json.dumps({"type": "box", "low": 0, "high": 1, "shape": [1 << 20, 1 << 20], "dtype": "float32"})),
            "'h5replay_space'"),
    Hostile("text space of 2**40 characters", _space(json.dumps({"type": "text", "max_length": HUGE})),
            "'h5replay_space'"),
    Hostile("space JSON nested 100000 deep", _space(nested_dicts(100_000)), "'h5replay_space'"),
    Hostile("space of dicts nested 40 deep", _space(nested_dicts(40)), "nested more than 32 deep"),
    Hostile("journal of float64", lambda f: replace_dataset(f, f"{REPLAY}/journal",
                                                            data=f[f"{REPLAY}/journal"][...].astype(np.float64)),
            "/_h5replay/replay/journal"),
    Hostile("journal of 2**40 values", lambda f: replace_dataset(f, f"{REPLAY}/journal", shape=(HUGE,),
                                                                 dtype=np.int64, chunks=(16,)),
            "/_h5replay/replay/journal"),
    Hostile("journal of 4 rows", lambda f: replace_dataset(f, f"{REPLAY}/journal",
                                                          data=f[f"{REPLAY}/journal"][...].reshape(4, -1)),
            "/_h5replay/replay/journal"),
    Hostile("episode table of float64", lambda f: replace_dataset(
        f, f"{REPLAY}/episodes", data=f[f"{REPLAY}/episodes"][...].astype(np.float64), maxshape=(16, 2)),
        "/_h5replay/replay/episodes"),
    Hostile("episode table of 2**40 rows", lambda f: replace_dataset(
        f, f"{REPLAY}/episodes", shape=(HUGE, 2), maxshape=(None, 2), dtype=np.int64, chunks=(4096, 2)),
        "/_h5replay/replay/episodes"),
    Hostile("key table of 2**40 rows", lambda f: replace_dataset(
        f, f"{REPLAY}/commit_keys", shape=(HUGE, 6), maxshape=(None, 6), dtype=np.int64, chunks=(4096, 6)),
        "commit_keys", KEY_TABLE_OPENS),
    Hostile("key table of float64", lambda f: replace_dataset(
        f, f"{REPLAY}/commit_keys", data=f[f"{REPLAY}/commit_keys"][...].astype(np.float64), maxshape=(65536, 6)),
        "commit_keys", KEY_TABLE_OPENS),
    Hostile("sampler attribute 7", _attr("sampler", 7, TABLE), "'sampler'"),
    Hostile("sampler JSON nested 100000 deep", _attr("sampler", "[" * 100_000 + "]" * 100_000, TABLE), "'sampler'"),
    Hostile("max_times_sampled 'abc'", _attr("max_times_sampled", "abc", TABLE), "'max_times_sampled'"),
    Hostile("priorities of another length", lambda f: replace_dataset(
        f, f"{TABLE}/priorities", shape=(8,), dtype=np.float64), "/_h5replay/replay/tables/default/priorities", prioritized=True),
    Hostile("priority log of 2**40 entries", lambda f: replace_dataset(
        f, f"{TABLE}/priority_log", shape=(HUGE, 2), dtype=np.int64, chunks=(4096, 2)),
        "/_h5replay/replay/tables/default/priority_log", prioritized=True),
    Hostile("running maximum priority of float64", lambda f: replace_dataset(
        f, f"{TABLE}/priority_max", shape=(2, 3), dtype=np.float64, chunks=(2, 3)),
        "/_h5replay/replay/tables/default/priority_max", prioritized=True),
    Hostile("priority updates past the log", lambda f: set_state(f, plog=HUGE), "priority log holds",
            prioritized=True),
    Hostile("ids near 2**63", lambda f: set_state(f, begin=2**63 - 20, end=2**63 - 11, open_start=2**63 - 11),
            "past 2**62"),
    Hostile("an unbounded buffer's rows past its datasets", lambda f: set_state(f, end=HUGE, open_start=HUGE),
            "its datasets hold 9 rows", ("info", "export", "compact", "writer", "reader"), capacity=None),
    Hostile("capacity 2**40 with every dataset agreeing", _huge_matching_capacity, "GiB of memory",
            prioritized=True),
    Hostile("data of another length than the capacity", lambda f: replace_dataset(
        f, "data", shape=(1 << 30, 3), dtype=np.float32, chunks=(1024, 3)), "holds 1073741824 rows",
        error=SpaceMismatchError),
]


@pytest.fixture
def hostile(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Hostile, Path]:
    case: Hostile = request.param
    path = make_file(tmp_path / "hostile.h5", case.capacity, case.prioritized)
    with h5py.File(path, "r+") as f:
        case.corrupt(f)
    return case, path


def _opens(cases: list[Hostile]) -> list[tuple[Hostile, str]]:
    return [(case, how) for case in cases for how in case.opens]


@pytest.mark.parametrize(("hostile", "how"), _opens(CASES), indirect=["hostile"], ids=str)
def test_a_hostile_file_is_refused_in_one_line(hostile: tuple[Hostile, str], how: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    case, path = hostile
    before = path.read_bytes()

    def refusal() -> str:
        if how in ("writer", "reader", "swmr_reader"):
            with pytest.raises(case.error) as refused:
                ReplayBuffer.load_from(path, read_only=how != "writer", multiprocessing=how == "swmr_reader").close()
            return str(refused.value)
        args = {"info": ["info", str(path)], "export": ["export", str(path), str(tmp_path / "out.h5")],
                "compact": ["compact", str(path)]}[how]
        assert main(args) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith(f"h5replay {how}: "), err
        assert not (tmp_path / "out.h5").exists() and not (tmp_path / "out.h5.partial").exists()
        return err

    message = refusal()
    assert case.says in message and str(path) in message, message
    if how in ("writer", "compact"):
        assert refusal() == message  # HDF5 touches a file it opened for writing, but nothing of h5replay's changed
    else:
        assert path.read_bytes() == before


SERVED = [case for case in CASES if case.name in (
    "capacity 'abc'", "space JSON nested 100000 deep", "journal of float64", "key table of 2**40 rows",
    "sampler attribute 7", "ids near 2**63")]


@pytest.mark.parametrize("hostile", SERVED, indirect=True, ids=str)
def test_serve_refuses_a_hostile_file_in_one_line(hostile: tuple[Hostile, str], tmp_path: Path) -> None:
    case, path = hostile
    done = subprocess.run(cli_command("serve", str(path), "--bind", f"ipc://{tmp_path}/w", "--read-bind",
                                      f"ipc://{tmp_path}/r"), capture_output=True, text=True, timeout=30)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("h5replay serve: ") and case.says in lines[0], done.stderr


def test_a_commit_that_would_take_ids_past_2_62_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    rb = ReplayBuffer.create(SPACE, 16, tmp_path / "rb.h5", first_row_id=MAX_ID - 20, first_episode_id=MAX_ID - 3)
    writer = rb.open_segment_writer()
    writer.extend(np.zeros((10, 3), np.float32))
    with pytest.raises(LimitExceededError, match="ids would reach 2\\*\\*62"):
        rb.commit_episodes(writer, [2] * 5)  # the rows would fit, 5 more episode ids would not
    assert writer.state == "open" and len(rb) == 0 and rb.published == rb.view
    assert rb.commit_segment(writer) == (MAX_ID - 3, MAX_ID - 20, 10)
    with pytest.raises(LimitExceededError):
        rb.extend(np.zeros((10, 3), np.float32))  # row ids up to MAX_ID - 1 only
    assert len(rb) == 10
    rb.extend(np.zeros((9, 3), np.float32))  # the last row ids there are
    rb.end_episode()
    rb.close()
    again = ReplayBuffer.load_from(tmp_path / "rb.h5")
    assert len(again) == 16 and again.published.end == MAX_ID - 1 and again.published.ep_end == MAX_ID - 1
    again.close()
    with pytest.raises(Exception, match="below 2\\*\\*62"):
        ReplayBuffer.create(SPACE, 16, tmp_path / "late.h5", first_row_id=MAX_ID)


def test_a_server_refuses_a_push_that_would_take_ids_past_2_62_and_keeps_serving(tmp_path: Path) -> None:
    path = tmp_path / "rb.h5"
    ReplayBuffer.create(EPISODE_SPACE, 10_000, path, first_row_id=MAX_ID - 20).close()
    with running_server(server_config(path)) as server, RawClient(server.endpoint) as raw:
        refused = raw.call(lambda rid: P.PushEpisode(rid, 30, episode_rows(0, 0, 30), 0.0))
        assert isinstance(refused, P.ErrorReply) and refused.code == P.ErrorCode.LIMIT_EXCEEDED.value, refused
        assert "ids would reach 2**62" in refused.message
        stored = raw.call(lambda rid: P.PushEpisode(rid, 5, episode_rows(0, 1, 5), 0.0))
        assert isinstance(stored, P.PushEpisodeReply) and stored.first_row_id == MAX_ID - 20
        assert server.stop() == 0
