"""export / compact / info of a buffer with compressed leaves (zstd, lz4: h5replay's records).

A copy keeps every row bit for bit, its ids and episodes, and, asked for no layout of its own,
the compressed layout (the leaf's group with the same codec, level and slot size). `export
--plain` turns each compressed leaf into an ordinary dataset through hdf5plugin's standard filter,
which plain h5py reads in a process that never imports h5replay, and h5replay reads too. `info`
describes a compressed leaf instead of failing on it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from compressed_helpers import SPACE, episode, image, mismatches
from fault_helpers import cli_command

from h5replay.errors import ConfigError
from h5replay.storage import ReplayBuffer
from h5replay.storage.export import compact_file, export_buffer, export_file
from h5replay.storage.packed import CODEC_ATTR, LEVEL_ATTR

pytestmark = pytest.mark.timeout(120)

LEAF = "obs/image"
LEVELS = {"zstd": 5, "lz4": 3}  # not the codecs' defaults: a copy must keep the level it was given
SLOT = 512  # bytes (a raw row is 2304): noisy rows spill


def h5replay(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=timeout)


def refused(done: subprocess.CompletedProcess[str], command: str) -> str:
    """The one-line error of a command refused as bad usage (exit 2)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"h5replay {command}: "), lines[0]
    return lines[0]


def make(path: Path, codec: str = "zstd", capacity: int = 96, multiprocessing: bool = False) -> None:
    """A wrapped ring (12 episodes of 10 rows into 96: the oldest overwritten, one partly) and an
    open episode at the tail."""
    rb = ReplayBuffer.create(SPACE, capacity, path, multiprocessing=multiprocessing, compression={LEAF: codec},
                             compression_level={LEAF: LEVELS[codec]}, compression_slot={LEAF: SLOT})
    with rb:
        for e in range(12):
            writer = rb.open_segment_writer()
            writer.extend(episode(e, 10))
            rb.commit_segment(writer)
        rb.extend(episode(12, 4))


def held(path: Path) -> dict[str, Any]:
    """Everything a copy must keep: row ids and their rows, episodes, where the open episode starts."""
    with ReplayBuffer.load_from(path) as rb:
        view = rb.last_view
        ids = np.arange(view.begin, view.end)
        rows = rb.get_rows(ids)
        assert not mismatches(rows)
        return {"ids": ids, "rows": rows, "open": view.open_start,
                "episodes": [(e.episode_id, e.first_row_id, e.length) for e in rb.episodes()]}


def assert_same(copy: dict[str, Any], source: dict[str, Any]) -> None:
    np.testing.assert_array_equal(copy["ids"], source["ids"])
    assert copy["episodes"] == source["episodes"] and copy["open"] == source["open"]
    for key in ("episode", "step"):
        np.testing.assert_array_equal(copy["rows"][key], source["rows"][key])
    np.testing.assert_array_equal(copy["rows"]["obs"]["image"], source["rows"]["obs"]["image"])
    assert not mismatches(copy["rows"])


def stored_layout(path: Path) -> tuple[str, int, int, int]:
    """(codec, level, slot bytes, rows) as the file records them, read with plain h5py."""
    with h5py.File(path, "r") as f:
        group = f[LEAF]
        assert isinstance(group, h5py.Group)
        codec = group.attrs[CODEC_ATTR]
        return (codec.decode() if isinstance(codec, bytes) else str(codec), int(group.attrs[LEVEL_ATTR]),
                int(group["slots"].shape[1]), int(group["slots"].shape[0]))


# ------------------------------------------------------------------------- export and compact


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_export_and_compact_keep_rows_ids_and_the_compressed_layout(tmp_path: Path, codec: str) -> None:
    source = tmp_path / "a.h5"
    make(source, codec)
    before = held(source)
    assert before["ids"][0] > 0 and len(before["episodes"]) >= 8  # wrapped, the open episode held
    layout = stored_layout(source)
    assert layout == (codec, LEVELS[codec], SLOT, 96)

    export_file(source, tmp_path / "b.h5")
    assert stored_layout(tmp_path / "b.h5") == layout
    assert_same(held(tmp_path / "b.h5"), before)

    compact_file(source)
    assert stored_layout(source) == layout
    assert_same(held(source), before)
    with ReplayBuffer.load_from(source) as again:
        assert again.storage.compressed_leaves == {LEAF: codec}
        column = again.storage.compressed_leaf(LEAF)
        assert (column.codec_name, column.level, column.slot_bytes) == (codec, LEVELS[codec], SLOT)

    export_file(source, tmp_path / "c.h5", capacity=200)  # another capacity: the same records
    assert stored_layout(tmp_path / "c.h5") == (*layout[:3], 200)
    assert_same(held(tmp_path / "c.h5"), before)


def test_a_copy_of_a_served_compressed_file_can_be_served_again(tmp_path: Path) -> None:
    # The records are unfiltered datasets: a copy that kept them stays writable under SWMR.
    make(tmp_path / "a.h5", multiprocessing=True)
    before = held(tmp_path / "a.h5")
    compact_file(tmp_path / "a.h5")
    with ReplayBuffer.load_from(tmp_path / "a.h5", read_only=False, multiprocessing=True) as rb:
        assert rb.storage.compressed_leaves == {LEAF: "zstd"}
        rb.extend(episode(13, 3))
        rb.end_episode()
    after = held(tmp_path / "a.h5")  # every row still the one pushed
    assert after["episodes"][-1][1:] == (before["open"], 7)  # the open episode's 4 rows, and 3 more
    assert set(after["episodes"][:-1]) <= set(before["episodes"])

    # Stored raw (compression None, asked for), it is chunked like the other leaves: still servable.
    export_file(tmp_path / "a.h5", tmp_path / "raw.h5", compression=None)
    with h5py.File(tmp_path / "raw.h5", "r") as f:
        assert all(f[path].chunks is not None and f[path].compression is None for path in ("episode", "step", LEAF))
    with ReplayBuffer.load_from(tmp_path / "raw.h5", read_only=False, multiprocessing=True) as rb:
        assert rb.storage.compressed_leaves == {}
    assert_same(held(tmp_path / "raw.h5"), after)


def test_a_layout_asked_for_replaces_the_records(tmp_path: Path) -> None:
    make(tmp_path / "a.h5")
    before = held(tmp_path / "a.h5")
    export_file(tmp_path / "a.h5", tmp_path / "gzip.h5", compression="gzip")
    export_file(tmp_path / "a.h5", tmp_path / "none.h5", compression=None)  # None, asked for: uncompressed
    assert h5replay("export", str(tmp_path / "a.h5"), str(tmp_path / "cli.h5"), "--compression", "none").returncode == 0
    for name, compression in (("gzip.h5", "gzip"), ("none.h5", None), ("cli.h5", None)):
        with h5py.File(tmp_path / name, "r") as f:
            assert isinstance(f[LEAF], h5py.Dataset) and f[LEAF].compression == compression, name
        assert_same(held(tmp_path / name), before)
    with ReplayBuffer.load_from(tmp_path / "a.h5") as rb, pytest.raises(ConfigError, match="fixed capacity"):
        export_buffer(rb, tmp_path / "unbounded.h5", capacity=None)  # records need a ring: never silently raw
    assert not os.path.exists(tmp_path / "unbounded.h5")


def test_export_of_a_compressed_file_cut_short_keeps_a_readable_run(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "cut.h5"
    rb = ReplayBuffer.create(SPACE, 2000, path, multiprocessing=True, compression={LEAF: "zstd"})
    with rb:
        for e in range(40):
            writer = rb.open_segment_writer()
            writer.extend(episode(e, 30))
            rb.commit_segment(writer)
    os.truncate(path, os.path.getsize(path) - 64 * 1024)  # the newest records (and spill slots) lost
    with caplog.at_level(logging.WARNING, "h5replay.storage"):
        export_file(path, tmp_path / "copy.h5")
    assert "is cut short: the copy keeps" in caplog.text
    with ReplayBuffer.load_from(tmp_path / "copy.h5") as copy:
        episodes = copy.episodes()
        assert 0 < len(episodes) < 40 and episodes[0].episode_id == 0
        assert all(e.first_row_id == 30 * e.episode_id and e.length == 30 for e in episodes)
        rows = copy.get_at(slice(None))
        assert len(copy) == 30 * len(episodes) and not mismatches(rows)
        assert copy.storage.compressed_leaves == {LEAF: "zstd"}


# ------------------------------------------------------------------------------ export --plain

READ_PLAIN = textwrap.dedent("""
    import json, sys
    import h5py, hdf5plugin
    import numpy as np

    with h5py.File(sys.argv[1], "r") as f:
        ds = f["obs/image"]
        dcpl = ds.id.get_create_plist()
        filters = [[int(v) for v in (dcpl.get_filter(i)[0], *dcpl.get_filter(i)[2])] for i in range(dcpl.get_nfilters())]
        np.savez(sys.argv[2], image=ds[:], episode=f["episode"][:], step=f["step"][:])
    print(json.dumps({"filters": filters, "h5replay": sorted(m for m in sys.modules if m.startswith("h5replay"))}))
""")


@pytest.mark.parametrize(("codec", "expected_filter"), [("zstd", [32015, LEVELS["zstd"]]), ("lz4", [32004])])
def test_export_plain_is_read_by_h5py_and_hdf5plugin_alone(tmp_path: Path, codec: str,
                                                           expected_filter: list[int]) -> None:
    make(tmp_path / "a.h5", codec)
    before = held(tmp_path / "a.h5")
    done = h5replay("export", str(tmp_path / "a.h5"), str(tmp_path / "plain.h5"), "--plain")
    assert done.returncode == 0, done.stderr

    # A process that has h5py and hdf5plugin, and never imports h5replay.
    read = subprocess.run([sys.executable, "-c", READ_PLAIN, str(tmp_path / "plain.h5"), str(tmp_path / "rows.npz")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert read.returncode == 0, read.stderr
    report = json.loads(read.stdout)
    assert report == {"filters": [expected_filter], "h5replay": []}
    with np.load(tmp_path / "rows.npz") as plain:
        # The file's slots hold the rows held (and nothing where no row was written).
        written = {(int(e), int(s)): img for e, s, img in zip(plain["episode"], plain["step"], plain["image"])}
        pushed = set(zip(before["rows"]["episode"].tolist(), before["rows"]["step"].tolist()))
        assert pushed <= set(written)
        assert all(np.array_equal(written[key], image(*key)) for key in pushed)

    # h5replay itself reads it read-only (registering hdf5plugin's filters on the way).
    assert_same(held(tmp_path / "plain.h5"), before)
    with ReplayBuffer.load_from(tmp_path / "plain.h5") as rb:
        assert rb.storage.compressed_leaves == {}
    # HDF5 filters under SWMR grow a ring without bound: serving the plain copy so is refused.
    with pytest.raises(ConfigError, match="grows the file without bound"):
        ReplayBuffer.load_from(tmp_path / "plain.h5", read_only=False, multiprocessing=True)


def test_export_plain_refusals(tmp_path: Path) -> None:
    make(tmp_path / "a.h5")
    a, out = str(tmp_path / "a.h5"), str(tmp_path / "out.h5")
    assert "--plain" in refused(h5replay("export", a, out, "--plain", "--compression", "gzip"), "export")
    assert "--plain" in refused(h5replay("export", a, out, "--plain", "--compression", "none"), "export")
    assert "--plain" in refused(h5replay("export", a, "x/y-v0", "--plain", "--to", "minari"), "export")
    assert not os.path.exists(out)
    with pytest.raises(ConfigError, match="compression_level"):
        export_file(a, out, plain=True, compression_level={LEAF: 3})
    help_text = h5replay("export", "--help").stdout
    assert "--plain" in help_text and "hdf5plugin" in help_text


HIDE_HDF5PLUGIN = "import sys; sys.modules['hdf5plugin'] = None  # as if it were not installed\n"


def test_a_missing_hdf5plugin_is_named_with_the_extra_to_install(tmp_path: Path) -> None:
    make(tmp_path / "a.h5")
    assert h5replay("export", str(tmp_path / "a.h5"), str(tmp_path / "plain.h5"), "--plain").returncode == 0
    script = HIDE_HDF5PLUGIN + textwrap.dedent("""
        from h5replay.errors import ConfigError
        from h5replay.storage import ReplayBuffer
        from h5replay.storage.export import export_file
        for attempt in (lambda: export_file(sys.argv[1], sys.argv[3], plain=True),
                        lambda: ReplayBuffer.load_from(sys.argv[2])):
            try:
                attempt()
            except ConfigError as exc:
                print(exc)
            else:
                print("no error")
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a.h5"), str(tmp_path / "plain.h5"),
                           str(tmp_path / "again.h5")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout
    assert all("'hdf5plugin'" in line and "pip install 'h5replay[compression]'" in line for line in lines), lines
    assert "reading dataset 'obs/image'" in lines[1]
    assert not os.path.exists(tmp_path / "again.h5")


# ----------------------------------------------------------------------------------------- info


def test_info_describes_compressed_leaves(tmp_path: Path) -> None:
    make(tmp_path / "a.h5")
    done = h5replay("info", str(tmp_path / "a.h5"))
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.strip().startswith(f"{LEAF}:"))
    assert "records, compression zstd level 5" in line and f"{SLOT}-byte slots" in line and "spill slots" in line
    described = json.loads(h5replay("info", "--json", str(tmp_path / "a.h5")).stdout)
    leaf = next(d for d in described["datasets"] if d["path"] == LEAF)
    assert leaf["layout"] == "records" and (leaf["compression"], leaf["compression_opts"]) == ("zstd", 5)
    assert leaf["slot_bytes"] == SLOT and leaf["spill_slots"] >= 1 and leaf["bytes_on_disk"] > 0  # noisy rows spill

    assert h5replay("export", str(tmp_path / "a.h5"), str(tmp_path / "plain.h5"), "--plain").returncode == 0
    done = h5replay("info", str(tmp_path / "plain.h5"))
    assert done.returncode == 0, done.stderr
    assert "compression zstd(5) (HDF5 filter 32015)" in done.stdout
