"""The README's Python examples for a server of one's own and a space file run as printed."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from service_helpers import free_port

from h5replay.spaces import space_from_json

README = Path(__file__).resolve().parents[2] / "README.md"


def python_block(after_heading: str) -> str:
    """The first ```python block after the heading `after_heading`."""
    text = README.read_text()
    section = text[text.index(after_heading):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, f"no python block after {after_heading!r}"
    return match[1]


def two_free_ports() -> int:
    """A port p with p + 1 free too (the server's default read port is the next one)."""
    for _ in range(100):
        port = free_port()  # outside the ephemeral range, as free_port says why
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


@pytest.mark.timeout(180)
def test_a_server_from_python_as_the_readme_shows(tmp_path):
    code = python_block("## A server from Python")
    port = two_free_ports()
    code = code.replace("tcp://127.0.0.1:5555", f"tcp://127.0.0.1:{port}")
    # The last line serves in this process until a signal: everything up to it is what runs here.
    body, _, rest = code.partition("Server(config).run()")
    assert rest.strip().startswith("#") and "Server, ServerProcess" in body
    done = subprocess.run([sys.executable, "-c", body], cwd=tmp_path, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "10"
    assert (tmp_path / "replay.h5").is_file()


@pytest.mark.timeout(60)
def test_the_space_file_example_writes_what_serve_reads(tmp_path):
    (tmp_path / "myspaces.py").write_text(python_block("The space file for `serve --space`"))
    done = subprocess.run([sys.executable, "myspaces.py"], cwd=tmp_path, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    space = space_from_json(json.loads((tmp_path / "space.json").read_text()))
    assert sorted(space.keys()) == ["action", "done", "obs"]
    same = subprocess.run([sys.executable, "-m", "h5replay", "space", "python", "myspaces:ROW"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=50)
    assert json.loads(same.stdout) == json.loads((tmp_path / "space.json").read_text())
