"""An operator's mistakes with the file: a second server on it by another name, a damaged file, a
file cut short. The server refuses, says why in time, and never writes a byte it should not.

Each test starts real servers (`h5replay serve` or ServerProcess) on real files in tmp_path.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import cli_command
from service_helpers import EPISODE_SPACE, episode_rows, row_problems, server_config

from h5replay.client import ActorClient, LearnerClient
from h5replay.server import ServerProcess
from h5replay.storage import ReplayBuffer
from h5replay.storage.recovery import status_flags

SWMR_WRITING = 0x04


def _serve(path: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`h5replay serve PATH` on two fresh loopback ports, expected to fail (bounded by `timeout`)."""
    config = server_config(path)
    return subprocess.run(cli_command("serve", str(path), "--bind", config.bind, "--read-bind", config.resolved_read_bind,
                                      *extra), capture_output=True, text=True, timeout=timeout)


def _commit(endpoint: str, actor: int, episodes: range, length: int = 20) -> None:
    with ActorClient(endpoint, timeout=10) as client:
        for e in episodes:
            client.push_episode(episode_rows(actor, e, length))


# ------------------------------------------------------------------ two servers, one file (case 1)


@pytest.mark.timeout(180)
def test_a_second_server_reaching_the_file_by_another_name_is_refused(tmp_path):
    """Issue 14, case 1: a symlink or a hard link to a served file gave a second writer its own
    lock; it "recovered" the live file and both wrote it. The lock follows the file now."""
    path = tmp_path / "replay.h5"
    (tmp_path / "current.h5").symlink_to(path)
    config = server_config(path, capacity=2000)
    with ServerProcess(config, timeout=60) as first:
        os.link(path, tmp_path / "hard.h5")
        _commit(first.endpoint, 1, range(5))
        for name in ("current.h5", "hard.h5", "sub/../replay.h5"):
            (tmp_path / "sub").mkdir(exist_ok=True)
            done = _serve(tmp_path / name)
            assert done.returncode == 1, f"{name}: a second server ran (exit {done.returncode}): {done.stderr[-1500:]}"
            assert f"already open for writing by another process (pid {first.pid})" in done.stderr, done.stderr[-1500:]
            # Recovery never touched the live writer's file: its SWMR mark is still there.
            assert status_flags(path) & SWMR_WRITING, f"{name}: the live file's status flags were cleared"
        _commit(first.endpoint, 1, range(5, 10))
        with LearnerClient(first.endpoint, timeout=10) as learner:
            assert len(learner.episodes()) == 10
    with ReplayBuffer.load_from(path) as rb:  # one writer wrote it: whole and readable
        assert rb.num_episodes == 10 and not row_problems(rb.get_at(slice(None)))


# ------------------------------------------------------------------ a damaged file (case 1, second half)


_KILLED_WRITER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    from service_helpers import EPISODE_SPACE, episode_rows
    from h5replay.storage import ReplayBuffer
    rb = ReplayBuffer.create(EPISODE_SPACE, 1000, sys.argv[1], multiprocessing=True)
    for e in range(3):
        w = rb.open_segment_writer(); w.extend(episode_rows(1, e, 10)); rb.commit_segment(w)
    os._exit(0)  # as a SIGKILL would: the SWMR writer's mark stays in the superblock
""")


def _damaged_copy(tmp_path: Path) -> Path:
    """A killed server's file whose dataset header fails its checksum (as two writers left it):
    a plain open is refused (the writer's mark), and an SWMR reader retried the damaged block
    for ever."""
    path = tmp_path / "damaged.h5"
    done = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path), str(Path(__file__).parent.parent)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-1500:]
    data = bytearray(path.read_bytes())
    header = data.find(b"OHDR", 64)  # an object header of one of the datasets
    assert header > 0
    data[header + 12] ^= 0xFF
    path.write_bytes(bytes(data))
    assert status_flags(path) & SWMR_WRITING
    return path


@pytest.mark.timeout(120)
def test_info_and_serve_give_up_on_a_damaged_file_in_time(tmp_path):
    """Opening a damaged file hung in HDF5's retries (11 minutes and more), deaf to SIGTERM. Now
    `info` and `serve` say the file is damaged, within seconds."""
    damaged = _damaged_copy(tmp_path)
    before = damaged.read_bytes()
    started = time.monotonic()
    done = subprocess.run(cli_command("info", str(damaged)), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "damaged" in done.stderr, done.stderr[-1500:]
    served = _serve(damaged, timeout=60)
    assert served.returncode != 0 and "damaged" in served.stderr, served.stderr[-1500:]
    assert time.monotonic() - started < 30
    assert damaged.read_bytes() == before, "a refused file was changed"


_OPENING = textwrap.dedent("""
    import sys, time
    from h5replay.storage._h5file import opening
    try:
        with opening(sys.argv[1], float(sys.argv[2])):
            print("waiting", flush=True)
            time.sleep(60)  # stands for HDF5 retrying a damaged block
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
        sys.exit(3)
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["deadline", "sigterm", "sigint"])
def test_opening_gives_up_at_its_deadline_or_a_signal(tmp_path, how):
    timeout = "0.5" if how == "deadline" else "30"
    proc = subprocess.Popen([sys.executable, "-c", _OPENING, str(tmp_path / "f.h5"), timeout], stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "waiting"
        started = time.monotonic()
        if how != "deadline":
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == 3, out
    assert time.monotonic() - started < 5
    assert "StorageError" in out
    assert ("took more than 0.5 s" in out) if how == "deadline" else (f"interrupted by SIG{how[3:].upper()}" in out), out


# ------------------------------------------------------------------ a file cut short (case 3)


def _killed_server_file(tmp_path: Path, episodes: int = 40) -> Path:
    """A file a SIGKILLed server left: `episodes` committed episodes of 100 rows, in chunks of
    64 KiB (`chunks=True`), so the newest published rows lie in the file's last 64 KiB."""
    path = tmp_path / "killed.h5"
    ReplayBuffer.create(EPISODE_SPACE, 5000, path, multiprocessing=True, chunks=True).close()
    config = server_config(path, capacity=5000, num_readers=0)
    server = ServerProcess(config, timeout=60)
    try:
        _commit(server.endpoint, 1, range(episodes), length=100)
    finally:
        server.kill()
    assert status_flags(path) & SWMR_WRITING
    return path


@pytest.mark.timeout(180)
def test_a_file_cut_short_is_refused_not_served_as_zeros(tmp_path):
    """Issue 14, case 3: 64 KiB cut off a killed server's file; recovery extended it with zeros and
    learners got all-zero rows. Now the server refuses, says how much is missing and what to do,
    and leaves the file as it found it; `export` copies what is readable."""
    killed = _killed_server_file(tmp_path)
    cut = tmp_path / "cut.h5"
    shutil.copyfile(killed, cut)
    length = os.path.getsize(cut) - 64 * 1024
    os.truncate(cut, length)
    done = _serve(cut, "--readers", "0")
    assert done.returncode == 1, f"a cut file was served (exit {done.returncode}): {done.stderr[-1500:]}"
    assert "65536 bytes shorter" in done.stderr and "h5replay export" in done.stderr, done.stderr[-1500:]
    assert os.path.getsize(cut) == length, "the refused file was lengthened"

    copy = tmp_path / "copy.h5"
    exported = subprocess.run(cli_command("export", str(cut), str(copy)), capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr[-1500:]
    with ReplayBuffer.load_from(copy) as rb:
        rows = rb.get_at(slice(None))
        assert 0 < len(rb) < 4000 and not row_problems(rows), "the copy holds rows that were never written"
        assert np.all(rows["length"] == 100) and len(rb) == 100 * rb.num_episodes
    # The copy serves.
    with ServerProcess(server_config(copy, capacity=None, num_readers=0), timeout=60) as server:
        with LearnerClient(server.endpoint, timeout=10) as learner:
            assert not row_problems(learner.sample(64))


_STAGED_THEN_KILLED = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, sys.argv[2])
    from service_helpers import EPISODE_SPACE, episode_rows
    from h5replay.storage import ReplayBuffer
    rb = ReplayBuffer.create(EPISODE_SPACE, 5000, sys.argv[1], multiprocessing=True, segment_buffer_bytes=4096)
    for e in range(10):  # committed and published
        w = rb.open_segment_writer(); w.extend(episode_rows(1, e, 50)); rb.commit_segment(w)
    open_writer = rb.open_segment_writer()
    open_writer.extend(episode_rows(2, 0, 500))  # staged in the file, never committed
    rb.flush()  # the superblock now records the staging rows' end
    print(os.path.getsize(sys.argv[1]), flush=True)
    os._exit(0)  # as a SIGKILL would: nothing closed
""")


@pytest.mark.timeout(120)
def test_a_file_missing_only_unpublished_rows_still_recovers(tmp_path):
    """A write that failed (a full disk) can leave the file shorter than its superblock says, with
    only rows nobody published missing: that file must still reopen, at its last publish."""
    path = tmp_path / "staged.h5"
    done = subprocess.run([sys.executable, "-c", _STAGED_THEN_KILLED, str(path), str(Path(__file__).parent.parent)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-1500:]
    size = os.path.getsize(path)
    os.truncate(path, size - 4096)  # the last staging block, written last, never published
    from h5replay.storage._h5file import missing_bytes

    assert missing_bytes(str(path), size - 4096) > 0, "the file is not shorter than its superblock says"
    with ReplayBuffer.load_from(path, read_only=False, multiprocessing=True) as rb:
        assert rb.num_episodes == 10 and not row_problems(rb.get_at(slice(None)))
