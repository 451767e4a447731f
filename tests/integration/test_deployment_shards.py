"""docker/compose.shards.yaml: two shards without Ray, checked without a container engine.

The file parses; every command (with the variables' defaults put in) is a valid `h5replay`
invocation; each shard has its own volume and ports; the clients are given both shards'
endpoints in the same order; and the same topology, run as plain processes from those very
commands on loopback, puts episodes in both files and a learner samples both.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from service_helpers import free_port, read_file
from test_deployment import DOCKER, host_of, interpolate, load, parse, port_of, seconds

SHARDS_FILE = DOCKER / "compose.shards.yaml"
COMPOSE = load(SHARDS_FILE)
SERVICES: dict[str, Any] = COMPOSE["services"]
SERVERS = ("shard0", "shard1")


def command(service: str, env: dict[str, str] | None = None) -> list[str]:
    cmd = SERVICES[service]["command"]
    assert isinstance(cmd, list), f"{service}: write command as a list"
    return [interpolate(str(arg), env) for arg in cmd]


def test_two_shards_actors_and_a_learner_of_one_image_built_once():
    assert set(SERVICES) == {*SERVERS, "actor", "learner"}
    assert [name for name, service in SERVICES.items() if "build" in service] == ["shard0"]
    build = SERVICES["shard0"]["build"]
    assert (SHARDS_FILE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert {interpolate(str(s["image"])) for s in SERVICES.values()} == {"h5replay:local"}


@pytest.mark.parametrize("service", [*SERVERS, "actor", "learner"])
def test_each_command_is_a_valid_h5replay_invocation(service):
    argv = command(service)
    assert parse(argv).command == {"actor": "actor", "learner": "learner"}.get(service, "serve")


def test_each_shard_has_its_own_file_volume_and_ports_and_the_clients_get_both_in_order():
    binds = []
    for name in SERVERS:
        args = parse(command(name))
        assert host_of(args.bind) == "0.0.0.0" and args.insecure
        volumes = [interpolate(str(v)) for v in SERVICES[name]["volumes"]]
        data = [v.split(":")[0] for v in volumes if v.split(":")[1] == str(Path(args.path).parent)]
        assert len(data) == 1 and data[0] in COMPOSE["volumes"]
        published = {int(interpolate(str(m)).split(":")[2]) for m in SERVICES[name]["ports"]}
        assert published == {port_of(args.bind), port_of(args.read_bind)}
        assert all(interpolate(str(m)).startswith("127.0.0.1:") for m in SERVICES[name]["ports"])
        ping = parse([interpolate(str(a)) for a in SERVICES[name]["healthcheck"]["test"][2:]])
        assert ping.endpoint == f"tcp://127.0.0.1:{port_of(args.bind)}"
        binds.append(f"tcp://{name}:{port_of(args.bind)}")
    volumes = {interpolate(str(v)).split(":")[0] for name in SERVERS for v in SERVICES[name]["volumes"]}
    assert {"data0", "data1"} <= volumes
    ports = [port_of(parse(command(n)).bind) for n in SERVERS] + [port_of(parse(command(n)).read_bind) for n in SERVERS]
    assert len(set(ports)) == 4, "each shard its own ports: a host client reads each where it advertises"
    for client in ("actor", "learner"):
        assert parse(command(client)).endpoint == binds, f"{client} must get every shard, in the same order"
        assert set(SERVICES[client]["depends_on"]) == set(SERVERS)
        assert all(d["condition"] == "service_healthy" for d in SERVICES[client]["depends_on"].values())
        assert "ports" not in SERVICES[client] and "container_name" not in SERVICES[client]
    for name in SERVERS:
        assert seconds(SERVICES[name]["stop_grace_period"]) >= 30


@pytest.mark.parametrize("variable", ["H5REPLAY_PORT_0", "H5REPLAY_PORT_1", "H5REPLAY_READ_PORT_1", "H5REPLAY_CAPACITY"])
def test_settings_come_from_documented_environment_variables(variable):
    env = {variable: "7123"}
    argvs = [command(s, env) for s in SERVICES]
    assert any("7123" in arg for argv in argvs for arg in argv), f"{variable} changes no command"
    for argv in argvs:
        parse(argv)
    header = re.split(r"^services:", SHARDS_FILE.read_text(), flags=re.M)[0]
    assert variable in header


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_shards_topology_as_plain_processes(tmp_path):
    """shard0, shard1, two actors and a learner from the file's commands, on loopback ports and
    folders: both files get episodes, and the learner samples both shards."""
    pytest.importorskip("gymnasium")
    env = {"H5REPLAY_EPISODES": "6", "H5REPLAY_REPORT_EVERY": "1", "H5REPLAY_CAPACITY": "50000"}
    ports: dict[int, int] = {}
    for name in SERVERS:
        args = parse(command(name, env))
        ports.update({port_of(args.bind): free_port(), port_of(args.read_bind): free_port()})
    space = (SHARDS_FILE.parent / "cartpole-space.json").resolve()

    def local(argv: list[str], data: Path | None = None) -> list[str]:
        out = []
        for arg in argv:
            match = re.fullmatch(r"tcp://(0\.0\.0\.0|shard[01]|127\.0\.0\.1):(\d+)", arg)
            if match:
                arg = f"tcp://127.0.0.1:{ports[int(match[2])]}"
            elif arg == "/etc/h5replay/space.json":
                arg = str(space)
            elif arg.startswith("/data/") and data is not None:
                arg = str(data / arg[len("/data/"):])
            out.append(arg)
        return out

    procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "h5replay", *argv], stdout=log, stderr=subprocess.STDOUT)
        procs.append((name, proc))
        return proc

    def output(name: str) -> str:
        return (tmp_path / f"{name}.log").read_text()

    try:
        for name in SERVERS:
            (tmp_path / name).mkdir()
            start(name, local(command(name, env), tmp_path / name))
        for name in SERVERS:
            ping = local([interpolate(str(a), env) for a in SERVICES[name]["healthcheck"]["test"][2:]])
            deadline = time.monotonic() + 60
            while subprocess.run([sys.executable, "-m", "h5replay", *ping], capture_output=True, timeout=60).returncode:
                assert time.monotonic() < deadline, output(name)
                time.sleep(0.5)
        actors = [start(f"actor{i}", local(command("actor", env))) for i in range(2)]
        learner = start("learner", local(command("learner", env)))
        for i, actor in enumerate(actors):
            assert actor.wait(120) == 0, output(f"actor{i}")
        time.sleep(1.5)
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(30) == 0, output("learner")
        for name, proc in procs[:2]:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, output(name)
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)

    assert "sampling batches of 256 from 2 shards" in output("learner"), output("learner")
    assert "in 12 episodes" in output("learner"), output("learner")
    held = [len(read_file(tmp_path / name / "replay.h5")[0]) for name in SERVERS]
    assert sum(held) == 12, held
