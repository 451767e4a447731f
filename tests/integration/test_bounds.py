"""Box bounds over the wire: a server refuses values outside a finite bound, and NaN, naming the
field, the row, the index and the bound, and keeps serving; `--no-check-bounds` stores them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fault_helpers import cli_server
from service_helpers import EPISODE_SPACE, episode_rows, file_episodes, free_port, read_file

from h5replay.client import ActorClient
from h5replay.errors import SpaceMismatchError

pytestmark = pytest.mark.timeout(120)


def test_a_server_refuses_values_outside_the_bounds_and_nan_and_keeps_serving(start_server, tmp_path: Path) -> None:
    server = start_server()
    with ActorClient(server.endpoint, timeout=10) as actor:
        rows = episode_rows(0, 0, 5)
        rows["actor"][3] = 5000  # the space says [0, 1000]
        with pytest.raises(SpaceMismatchError, match=r"field 'actor', row 3 is 5000, outside the space's bounds \[0, 1000\]"):
            actor.push_episode(rows)
        rows = episode_rows(0, 0, 700)  # streamed as a segment: refused at the append, the segment aborted
        rows["obs"][600, 2] = np.nan  # obs has infinite bounds: NaN is refused all the same
        with pytest.raises(SpaceMismatchError, match=r"field 'obs', row \d+ index \(2,\) is NaN"):
            with actor.segment() as seg:
                seg.extend(rows)
        assert actor.push_episode(episode_rows(0, 1, 4)).length == 4  # the server goes on
        stats = actor.info()
    assert stats["num_episodes"] == 1 and stats["open_segments"] == 0
    assert server.stop() == 0
    assert file_episodes(tmp_path / "rb.h5") == ([(0, 1)], [])


def test_serve_no_check_bounds_stores_what_fits_the_dtype_and_shape(tmp_path: Path) -> None:
    space_file = tmp_path / "space.json"
    space_file.write_text(json.dumps(EPISODE_SPACE.to_json()))
    bind, read_bind = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with cli_server(tmp_path / "rb.h5", bind, read_bind, tmp_path / "serve.log", "--space", str(space_file),
                    "--capacity", "100", "--no-check-bounds") as proc:
        with ActorClient(bind, timeout=10) as actor:
            rows = episode_rows(0, 0, 3)
            rows["actor"][1] = 5000
            rows["obs"][2, 0] = np.nan
            assert actor.push_episode(rows).length == 3
        proc.terminate()
        assert proc.wait(30) == 0
    _, stored = read_file(tmp_path / "rb.h5")
    assert stored["actor"].tolist() == [0, 5000, 0] and np.isnan(stored["obs"][2, 0])
