"""Progress of long commands: done of total with rate and time left on a terminal, redrawn at
most 10 times a second and always at the end; nothing at all when the stream is not a terminal."""

from __future__ import annotations

import io

import pytest

from h5replay.progress import Progress

pytestmark = pytest.mark.timeout(30)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_says_done_of_total_the_rate_and_the_time_left() -> None:
    progress = Progress("compact", stream=Terminal())
    line = progress.line(2_500, 10_000, progress.started + 5.0)
    assert "compact [#######" in line and " 25% 2,500/10,000 rows, 500 rows/s, 15s left (5s)" in line
    assert "1m40s left" in progress.line(1_000, 11_000, progress.started + 10.0)
    assert progress.line(10, 10, progress.started + 1).endswith("done (1s)")
    assert "? (0s)" in progress.line(0, 10, progress.started)


def test_a_terminal_is_redrawn_in_place_a_pipe_gets_nothing() -> None:
    terminal = Terminal()
    progress = Progress("export", stream=terminal)
    for done in range(0, 1001):
        progress(done, 1000)
    out = terminal.getvalue()
    assert out.count("\r\x1b[K") < 20, "throttled to 10 redraws a second"
    assert out.endswith("\n") and "1,000/1,000 rows" in out.splitlines()[-1]
    pipe = io.StringIO()
    quiet = Progress("export", stream=pipe)
    for done in range(0, 11):
        quiet(done, 10)
    assert pipe.getvalue() == ""
