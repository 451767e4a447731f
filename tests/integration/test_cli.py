"""The command line as a new user meets it, run for real (`python -m h5replay ...` in a subprocess).

Each bad input gets one line that says what to do, never a traceback (unless --debug, before or
after the subcommand); a failed `serve` leaves no file behind; `serve` never silently ignores a
space or capacity, nor makes an unbounded file unasked; `stats` reaches an --auth server; `space
python` writes the JSON of one's own space; `info` tells what a sparse file takes on disk; `demo`
cleans up after itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from fault_helpers import cli_command, cli_server
from service_helpers import EPISODE_SPACE, episode_rows, free_port, running_server, server_config

from h5replay.client import ActorClient
from h5replay.config import ClientConfig
from h5replay.errors import ProtocolError
from h5replay.sampling import Prioritized, RateLimit, SamplingConfig
from h5replay.server import ServerProcess
from h5replay.server.auth import generate_keys
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer


def h5replay(*args: str, timeout: float = 60, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli_command(*args), capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env)


def one_line_error(done: subprocess.CompletedProcess[str], code: int, command: str) -> str:
    """The single stderr line of a refused command (exit `code`), without the command's prefix."""
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"h5replay {command}: "), lines[0]
    return lines[0][len(f"h5replay {command}: "):]


@pytest.fixture
def space_file(tmp_path: Path) -> Path:
    path = tmp_path / "space.json"
    path.write_text(json.dumps(EPISODE_SPACE.to_json()))
    return path


def serve_args(path: Path, *extra: str) -> list[str]:
    return ["serve", str(path), "--bind", f"tcp://127.0.0.1:{free_port()}",
            "--read-bind", f"tcp://127.0.0.1:{free_port()}", *extra]


# ------------------------------------------------------------------------------------ --debug


@pytest.mark.timeout(60)
def test_debug_works_before_and_after_the_subcommand(tmp_path):
    missing = str(tmp_path / "missing.h5")
    quiet = h5replay("info", missing)
    assert quiet.returncode != 0 and "Traceback" not in quiet.stderr and len(quiet.stderr.strip().splitlines()) == 1
    for argv in (["--debug", "info", missing], ["info", missing, "--debug"], ["info", "--debug", missing]):
        loud = h5replay(*argv)
        assert loud.returncode != 0 and "Traceback" in loud.stderr, (argv, loud.stderr)
    nested = h5replay("keys", "generate", str(tmp_path / "keys"), "--debug")  # a subcommand's subcommand too
    assert nested.returncode == 0, nested.stderr


# ------------------------------------------------------------------------------ output and files


@pytest.mark.timeout(120)
def test_info_json_into_a_pipe_closed_early_ends_without_a_traceback(tmp_path):
    path = tmp_path / "wide.h5"
    # Hundreds of fields: far more JSON than a pipe buffers, so writing goes on after `head` left.
    wide = DictSpace({f"field_{i:03d}": BoxSpace(-1, 1, (2,)) for i in range(400)})
    ReplayBuffer.create(wide, 10, str(path)).close()
    with subprocess.Popen(cli_command("info", "--json", str(path)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.read(100)  # as `| head -c 100` would, then go away
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(60)
    assert "Traceback" not in err and "BrokenPipe" not in err and "Broken pipe" not in err, err
    assert proc.returncode in (0, 1)
    assert h5replay("info", "--json", str(path)).stdout.count('"field_') >= 400  # the whole output, normally


@pytest.mark.timeout(60)
def test_export_onto_an_existing_file_suggests_overwrite(tmp_path):
    source, target = tmp_path / "a.h5", tmp_path / "b.h5"
    ReplayBuffer.create(EPISODE_SPACE, 10, str(source)).close()
    target.write_bytes(b"keep me")
    message = one_line_error(h5replay("export", str(source), str(target)), 2, "export")
    assert "--overwrite" in message and "overwrite=True" not in message
    assert target.read_bytes() == b"keep me"
    assert h5replay("export", str(source), str(target), "--overwrite").returncode == 0


@pytest.mark.timeout(300)
def test_demo_removes_its_temporary_directory(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = h5replay("demo", "--actors", "1", "--episodes", "3", env=env, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "h5replay demo: OK" in done.stdout and "--dir" in done.stdout
    assert "waits for each episode's commit" in done.stdout, "the demo says what its rows/s measured"
    assert "Next, with the command-line tool in .venv/bin" in done.stdout and "h5replay serve replay.h5" in done.stdout
    assert "limit " not in done.stdout, "no rate limit is set, so none is reported"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("h5replay-demo-")]
    kept = tmp_path / "kept"
    kept.mkdir()
    assert h5replay("demo", "--actors", "1", "--episodes", "2", "--dir", str(kept), env=env, timeout=240).returncode == 0
    assert (kept / "demo.h5").is_file()


@pytest.mark.timeout(120)
def test_info_says_what_a_sparse_file_takes_on_disk(tmp_path):
    # The README's kind of file: 84x84x3 images, a contiguous ring of 20,000 rows (0.4 GB long).
    path = tmp_path / "images.h5"
    space = DictSpace({"image": BoxSpace(0, 255, (84, 84, 3), np.uint8), "action": BoxSpace(-1, 1, (2,))})
    with ReplayBuffer.create(space, 20_000, str(path)) as buffer:
        buffer.extend({"image": np.zeros((80, 84, 84, 3), np.uint8), "action": np.zeros((80, 2), np.float32)})
        buffer.end_episode()
    description = json.loads(h5replay("info", "--json", str(path)).stdout)
    assert description["file_bytes"] > 400e6 and description["disk_bytes"] < 50e6, description
    text = h5replay("info", str(path)).stdout
    (line,) = [line for line in text.splitlines() if line.startswith("on disk")]
    assert f"{description['disk_bytes'] / 1e6:.1f} MB" in line and "sparse" in line


@pytest.mark.timeout(120)
def test_info_and_stats_show_the_sampler_and_the_rate_limiter(tmp_path):
    path = tmp_path / "prioritized.h5"
    sampling = SamplingConfig(Prioritized(0.6), RateLimit(10, 4.0, 100.0))
    with running_server(server_config(path, sampling=sampling)) as server:
        with ActorClient(server.endpoint, timeout=10) as actor:
            actor.push_episode(episode_rows(4, 0, 20))
        done = h5replay("stats", server.endpoint, "--interval", "0.1")
        assert done.returncode == 0, done.stderr
        view = done.stdout
        assert "  default          prioritized (exponent 0.6, 0 priority updates)" in view, view
        assert "rate limit: at least 10 rows, 4.0 samples per insert +- 100.0; it counts 20 inserted, 0 sampled" in view
        assert "inserts waiting  0 (waited" in view and "samples waiting  0 (waited" in view
        assert "drawn by the writer (a rate limit or removals)" in view
        stats = json.loads(h5replay("stats", server.endpoint, "--json", "--interval", "0.1").stdout)
        assert stats["sampler"] == "prioritized" and float(stats["priority_sum"]) > 0
        assert stats["samples_per_insert"] == 4.0 and stats["inserted"] == 20
        assert {"sample_wait_s", "insert_wait_s", "waiting_samples", "waiting_inserts"} <= stats.keys()
    text = h5replay("info", str(path)).stdout
    assert "sampling  prioritized (exponent 0.6, new rows get the largest seen)" in text, text
    assert "at least 10 rows to sample, 4.0 samples per insert within +-100.0; 20 rows inserted, 0 sampled" in text


@pytest.mark.timeout(60)
def test_info_of_an_endpoint_points_to_stats():
    message = one_line_error(h5replay("info", "tcp://127.0.0.1:5555"), 2, "info")
    assert "h5replay stats tcp://127.0.0.1:5555" in message


# ------------------------------------------------------------------------------- serve: the file


@pytest.mark.timeout(60)
def test_serve_needs_capacity_or_unbounded_to_create_a_file(tmp_path, space_file):
    path = tmp_path / "new.h5"
    message = one_line_error(h5replay(*serve_args(path, "--space", str(space_file))), 2, "serve")
    assert "--capacity N" in message and "--unbounded" in message
    assert not list(tmp_path.glob("new.h5*"))
    both = h5replay(*serve_args(path, "--space", str(space_file), "--capacity", "10", "--unbounded"))
    assert both.returncode == 2 and "not allowed with" in both.stderr


BAD_SERVE_FLAGS = [  # issue 21, defect 16: each was taken, or failed as something else than bad usage
    ("--bind", "tcp://127.0.0.1:86546"),  # libzmq served it on port 21010
    ("--read-bind", "tcp://127.0.0.1:65536"),
    ("--advertise-read", "tcp://server:0"),
    ("--open-timeout", "nan"),  # "reader process 0 failed to start", exit 1
    ("--idle-timeout", "nan"),  # taken
    ("--session-timeout", "inf"),
    ("--heartbeat-timeout", "1e9"),  # past libzmq's heartbeat TTL
    ("--priority-publish-interval", "nan"),
    ("--samples-per-insert", "inf"),
    ("--min-free-bytes", "inf"),  # an OverflowError traceback
    ("--metrics-port", "70000"),
    ("--readers", "100000"),
    ("--idempotency-window", str(1 << 70)),  # an OverflowError traceback
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flag", "value"), BAD_SERVE_FLAGS, ids=[f"{f}={v}" for f, v in BAD_SERVE_FLAGS])
def test_serve_refuses_a_number_or_endpoint_out_of_range_as_bad_usage(tmp_path, space_file, flag, value):
    """Exit 2 and one line naming the setting, before anything is made."""
    path = tmp_path / "rb.h5"
    message = one_line_error(h5replay(*serve_args(path, "--space", str(space_file), "--capacity", "100", flag, value)),
                             2, "serve")
    assert flag in message or flag[2:].replace("-", "_") in message or value in message, message
    assert not list(tmp_path.glob("rb.h5*"))


@pytest.mark.timeout(90)
def test_serve_unbounded_makes_an_unbounded_file(tmp_path, space_file):
    path = tmp_path / "grows.h5"
    args = serve_args(path, "--space", str(space_file), "--unbounded")
    with cli_server(path, args[3], args[5], tmp_path / "serve.log", "--space", str(space_file), "--unbounded") as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    with ReplayBuffer.load_from(str(path)) as buffer:
        assert buffer.capacity is None
    # Reopened as it is, or with the same settings; --capacity is refused for it.
    message = one_line_error(h5replay(*serve_args(path, "--capacity", "100")), 2, "serve")
    assert "capacity unbounded" in message and "100" in message


@pytest.mark.timeout(120)
def test_serve_refuses_a_space_or_capacity_other_than_the_files(tmp_path, space_file):
    path = tmp_path / "rb.h5"
    with ReplayBuffer.create(EPISODE_SPACE, 1000, str(path)) as buffer:
        buffer.extend(episode_rows(1, 0, 30))
        buffer.end_episode()
    message = one_line_error(h5replay(*serve_args(path, "--capacity", "5000")), 2, "serve")
    assert "capacity 1000" in message and "5000" in message  # the file's and the one asked for
    other = tmp_path / "other.json"
    other.write_text(json.dumps(DictSpace({"obs": BoxSpace(-1, 1, (3,))}).to_json()))
    message = one_line_error(h5replay(*serve_args(path, "--space", str(other))), 2, "serve")
    assert "'obs'" in message and "'episode'" in message  # both spaces shown
    message = one_line_error(h5replay(*serve_args(path, "--unbounded")), 2, "serve")
    assert "capacity 1000" in message and "--unbounded" in message
    with ReplayBuffer.load_from(str(path)) as buffer:  # as it was
        assert (buffer.capacity, buffer.space, buffer.get_segments()) == (1000, EPISODE_SPACE, [(0, 30)])
    # The same space and capacity (as compose passes them at every start) are accepted.
    args = serve_args(path, "--space", str(space_file), "--capacity", "1000")
    with cli_server(path, args[3], args[5], tmp_path / "serve.log", "--space", str(space_file),
                    "--capacity", "1000") as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


@pytest.mark.timeout(60)
def test_serving_a_plain_h5py_file_says_to_export_it(tmp_path):
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["obs"] = np.zeros((10, 4), np.float32)
    message = one_line_error(h5replay(*serve_args(path)), 2, "serve")
    assert f"h5replay export {path}" in message and "superblock" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.h5"]  # not even a lock file
    exported = tmp_path / "replay.h5"
    assert h5replay("export", str(path), str(exported)).returncode == 0
    args = serve_args(exported)
    with cli_server(exported, args[3], args[5], tmp_path / "serve.log") as proc:  # what the message said works
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# ------------------------------------------------------------------------------ serve: the ports


def _listening() -> tuple[socket.socket, int]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    return holder, holder.getsockname()[1]


@pytest.mark.serial  # "at once" is a whole `h5replay serve` run in under 10 s: 10.5 s beside 4 workers at load 9
@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["--bind", "--read-bind"])
def test_a_taken_port_fails_at_once_in_one_line_and_leaves_no_file(tmp_path, space_file, which):
    holder, port = _listening()
    with holder:
        ports = {"--bind": free_port(), "--read-bind": free_port(), which: port}
        started = time.monotonic()
        done = h5replay("serve", str(tmp_path / "rb.h5"), "--space", str(space_file), "--capacity", "100",
                        "--bind", f"tcp://127.0.0.1:{ports['--bind']}",
                        "--read-bind", f"tcp://127.0.0.1:{ports['--read-bind']}")
        took = time.monotonic() - started
    message = one_line_error(done, 2, "serve")
    assert f"tcp://127.0.0.1:{port}" in message and "already in use" in message and which in message
    assert took < 10, took
    assert list(tmp_path.iterdir()) == [space_file]  # neither rb.h5 nor rb.h5.lock


@pytest.mark.timeout(60)
def test_a_client_sent_to_the_read_port_is_told_the_servers_endpoint(tmp_path):
    """The read port serves reads, info and heartbeats (so ping and stats answer there too); a
    client's hello gets an error that names the server's endpoint."""
    config = server_config(tmp_path / "rb.h5")
    with ServerProcess(config, timeout=60) as server:
        assert server.process.is_alive()
        assert h5replay("ping", server.read_endpoint, "--timeout", "5").returncode == 0
        done = h5replay("stats", server.read_endpoint, "--json", "--interval", "0.1")
        assert done.returncode == 0 and json.loads(done.stdout)["length"] == 0, done.stderr
        assert json.loads(done.stdout)["role"] == "reader"
        view = h5replay("stats", server.read_endpoint, "--interval", "0.1").stdout
        assert f"{server.read_endpoint}: a read endpoint. A reader process answers the file's figures only" in view
        assert "\ningest\n" not in view and "\nclients\n" not in view
        with pytest.raises(ProtocolError) as info:
            ActorClient(server.read_endpoint, timeout=5)
    message = str(info.value)
    assert "read endpoint" in message and server.endpoint in message


# ------------------------------------------------------------------------------------- stats


@pytest.mark.timeout(90)
def test_stats_reaches_an_auth_server_with_keys(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    config = server_config(tmp_path / "rb.h5", auth_dir=str(keys))
    with ServerProcess(config, timeout=60) as server:
        with ActorClient(server.endpoint, timeout=10, secret_key=keys / "actor.key_secret",
                         server_key=keys / "server.key") as actor:
            actor.push_episode(episode_rows(1, 0, 25))
        done = h5replay("stats", server.endpoint, "--json", "--interval", "0.1", "--secret-key",
                        str(keys / "learner.key_secret"), "--server-key", str(keys / "server.key"))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["total_rows"] == 25
        refused = h5replay("stats", server.endpoint, "--timeout", "1")
        one_line_error(refused, 1, "stats")


@pytest.mark.timeout(120)
def test_stats_count_every_sample_and_give_rates_since_the_start(tmp_path):
    """Rows drawn by the reader processes count (they once showed as 0 sampled), and the rates
    since the start are not 0 right after the commits (the interval's may well be)."""
    from h5replay.client import LearnerClient

    with running_server(server_config(tmp_path / "rb.h5")) as server:
        with ActorClient(server.endpoint, timeout=10) as actor:
            for e in range(10):
                actor.push_episode(episode_rows(1, e, 30))
        over_the_socket = ClientConfig(endpoint=server.endpoint, timeout=10, local_reads=False)  # the readers draw
        with LearnerClient(config=over_the_socket) as learner:
            for seed in range(20):
                learner.sample(64, seed=seed)
            learner.sample_sequences(8, 5, seed=0)
            learner.get_rows(np.arange(10))
        stats = json.loads(h5replay("stats", server.endpoint, "--json", "--interval", "0.1").stdout)
        assert stats["rows_sampled"] == 20 * 64 + 8 * 5, stats
        assert stats["rows_out"] == stats["rows_sampled"] + 10, "reads by id are sent, not sampled"
        assert stats["rows_in"] == 300 and stats["rows_in_per_s_since_start"] > 0
        assert stats["commits_per_s_since_start"] > 0 and stats["role"] == "writer"
        view = h5replay("stats", server.endpoint, "--interval", "0.1").stdout
        assert "rows sampled     1,320" in view and "/s since start   (drawn by the readers)" in view, view
        assert "rows held        300 of 10,000 (3.0%); 300 added in all" in view


@pytest.mark.timeout(60)
def test_stats_watch_refreshes_until_interrupted(tmp_path):
    with running_server(server_config(tmp_path / "rb.h5")) as server:
        proc = subprocess.Popen(cli_command("stats", server.endpoint, "--watch", "--json", "--interval", "0.2"),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(2.0)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=20)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        snapshots = [json.loads(line) for line in out.splitlines()]
        assert len(snapshots) >= 3 and all(s["role"] == "writer" for s in snapshots)
        assert snapshots[-1]["uptime"] > snapshots[0]["uptime"]


# ------------------------------------------------------------------------------------- space


@pytest.mark.timeout(120)
def test_space_python_writes_the_json_of_ones_own_space(tmp_path):
    (tmp_path / "myspaces.py").write_text(textwrap.dedent("""
        import numpy as np
        from h5replay.storage import BinarySpace, BoxSpace, DictSpace, TextSpace

        ROW = DictSpace({"obs": BoxSpace(-1, 1, (3,)), "done": BinarySpace(), "note": TextSpace(8)})

        def make_row():
            return ROW

        NOT_A_SPACE = 3
    """))
    from h5replay.storage import BinarySpace, TextSpace

    expected = DictSpace({"obs": BoxSpace(-1, 1, (3,)), "done": BinarySpace(), "note": TextSpace(8)}).to_json()
    for target in ("myspaces:ROW", "myspaces:make_row"):
        done = h5replay("space", "python", target, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == expected
    (tmp_path / "space.json").write_text(done.stdout)
    for target, words in (("myspaces:NOT_A_SPACE", "not a space"), ("nomodule:X", "cannot import"),
                          ("myspaces:MISSING", "no attribute"), ("myspaces", "MODULE:ATTR")):
        assert words in one_line_error(h5replay("space", "python", target, cwd=tmp_path), 2, "space"), target
    # And the file serves.
    path = tmp_path / "rb.h5"
    args = serve_args(path)
    with cli_server(path, args[3], args[5], tmp_path / "serve.log", "--space", str(tmp_path / "space.json"),
                    "--capacity", "100") as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    with ReplayBuffer.load_from(str(path)) as buffer:
        assert buffer.space.to_json() == expected


def test_space_python_reads_a_gymnasium_space(tmp_path):
    pytest.importorskip("gymnasium")
    (tmp_path / "gymspaces.py").write_text("import gymnasium\nOBS = gymnasium.spaces.Box(-2, 2, (5,))\n")
    done = h5replay("space", "python", "gymspaces:OBS", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["shape"] == [5]



def test_info_reports_a_rate_limit_only_when_one_is_set(tmp_path):
    from h5replay.sampling import RateLimit
    from h5replay.storage import ReplayBuffer
    from h5replay.storage.inspect import describe_file, format_description

    ReplayBuffer.create(EPISODE_SPACE, 10, tmp_path / "plain.h5").close()
    assert "limit " not in format_description(describe_file(str(tmp_path / "plain.h5")))
    ReplayBuffer.create(EPISODE_SPACE, 10, tmp_path / "limited.h5", rate_limit=RateLimit(5)).close()
    assert "limit     at least 5 rows to sample" in format_description(describe_file(str(tmp_path / "limited.h5")))


def test_every_option_with_a_default_says_it_in_its_help():
    import argparse

    from h5replay.cli import build_parser

    silent = []

    def walk(parser: argparse.ArgumentParser, command: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{command} {name}".strip())
            elif (action.option_strings and action.default not in (None, False, argparse.SUPPRESS)
                  and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))
                  and "default" not in (action.help or "")):
                silent.append(f"{command} {action.option_strings[-1]} (default {action.default!r})")

    walk(build_parser(), "")
    assert not silent, "options whose help hides their default: " + ", ".join(silent)
    rate_limit = build_parser().parse_args(["serve", "x.h5"])  # and the one with a cost says so
    assert rate_limit.min_size_to_sample is None
    help_text = subprocess.run(cli_command("serve", "--help"), capture_output=True, text=True, timeout=60).stdout
    assert "through the writer, not the reader" in " ".join(help_text.split())
