"""docker/: what can be checked without a container engine (`make compose-test` runs the real one).

The compose file parses; every service's command (with the environment variables' defaults put
in) is a valid `h5replay` invocation; ports, volumes and the healthcheck agree with the CLI and
with the Dockerfile; and the same topology, run as plain processes from the very commands in
compose.yaml (server, 3 actors, a learner, on loopback), does its job and stops cleanly on
SIGTERM, as `docker compose down` would stop it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import free_port, read_file

from h5replay.cli import build_parser
from h5replay.config import ServerConfig
from h5replay.spaces import space_from_json

yaml = pytest.importorskip("yaml")

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
AUTH_OVERRIDE = DOCKER / "compose.auth.yaml"  # optional: the --auth variant, layered over compose.yaml
SUBCOMMAND = {"server": "serve", "actor": "actor", "learner": "learner"}
READ_TIMEOUT = 120  # seconds any one process of the topology test may take


def load(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return dict(yaml.safe_load(fh))


COMPOSE = load(COMPOSE_FILE)
SERVICES: dict[str, Any] = COMPOSE["services"]

# ------------------------------------------------------------------------------- compose helpers

_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR-default}, from `env` (not os.environ)."""
    env = env or {}

    def value(match: re.Match[str]) -> str:
        name, op, default = match["name"], match["op"], match["default"] or ""
        got = env.get(name)
        if op == ":-":
            return got if got else default
        if op == "-":
            return default if got is None else got
        assert got is not None, f"${{{name}}} has no default in {COMPOSE_FILE.name}"
        return got

    out = _VARIABLE.sub(value, text)
    assert "$" not in out, f"unsupported interpolation left in {text!r}"
    return out


def command(service: str, env: dict[str, str] | None = None, services: dict[str, Any] = SERVICES) -> list[str]:
    """The argv the image's entrypoint (`h5replay`) gets for `service`."""
    cmd = services[service]["command"]
    assert isinstance(cmd, list), f"{service}: write command as a list, so no shell splitting is involved"
    return [interpolate(str(arg), env) for arg in cmd]


def option(argv: list[str], name: str) -> str:
    """The value of `--name VALUE` or `--name=VALUE` in argv."""
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def parse(argv: list[str]) -> Any:
    """argv as the CLI parses it; a usage error fails the test with argparse's message."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`h5replay {shlex.join(argv)}` is not a valid invocation (exit {exc.code})") from None


def port_of(endpoint: str) -> int:
    return int(endpoint.rpartition(":")[2])


def host_of(endpoint: str) -> str:
    return endpoint[len("tcp://"):].rpartition(":")[0]


def seconds(duration: str) -> float:
    """A compose duration such as 1m30s or 60s, in seconds."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), f"bad duration {duration!r}"
    return sum(float(n) * units[u] for n, u in parts)


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of docker/Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DOCKER / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def final_stage() -> list[tuple[str, str]]:
    instructions = dockerfile()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    return instructions[last_from:]


def server_argv(env: dict[str, str] | None = None) -> list[str]:
    return command("server", env)


# ------------------------------------------------------------------------------ the compose file


def test_compose_has_a_server_actors_and_a_learner_of_one_image_built_once():
    assert set(SERVICES) == {"server", "actor", "learner"}
    build = SERVICES["server"]["build"]
    assert (COMPOSE_FILE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert (COMPOSE_FILE.parent / build["context"]).resolve() == DOCKER.parent  # the repository root
    # Only the server builds: every service with a `build` is built again by `up --build`.
    assert [name for name, service in SERVICES.items() if "build" in service] == ["server"]
    images = {interpolate(str(service["image"])) for service in SERVICES.values()}
    assert images == {"h5replay:local"}
    assert interpolate(str(SERVICES["actor"]["image"]), {"H5REPLAY_IMAGE": "h5replay:other"}) == "h5replay:other"


@pytest.mark.parametrize("service", sorted(SUBCOMMAND))
def test_each_command_is_a_valid_h5replay_invocation(service):
    argv = command(service)
    assert argv[0] == SUBCOMMAND[service]
    args = parse(argv)
    assert args.command == SUBCOMMAND[service]
    # And `h5replay SUBCOMMAND --help`, run as the image runs it, documents every option used.
    done = subprocess.run([sys.executable, "-m", "h5replay", argv[0], "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for arg in argv:
        if arg.startswith("--"):
            assert arg.split("=")[0] in done.stdout, f"{service}: {arg} is not an option of `h5replay {argv[0]}`"


@pytest.mark.parametrize("variable,value", [("H5REPLAY_CAPACITY", "5000"), ("H5REPLAY_READERS", "3"),
                                            ("H5REPLAY_EPISODES", "7"), ("H5REPLAY_BATCH_SIZE", "32"),
                                            ("H5REPLAY_REPORT_EVERY", "2"), ("H5REPLAY_ENV", "Acrobot-v1"),
                                            ("H5REPLAY_PORT", "6000"), ("H5REPLAY_READ_PORT", "6001")])
def test_settings_come_from_environment_variables(variable, value):
    env = {variable: value}
    argvs = [command(s, env) for s in SUBCOMMAND]
    assert any(value in arg for argv in argvs for arg in argv), f"{variable} changes no command"
    for argv in argvs:
        parse(argv)
    header = re.split(r"^services:", COMPOSE_FILE.read_text(), flags=re.M)[0]
    assert variable in header, f"{variable} is not documented at the top of {COMPOSE_FILE.name}"


def test_the_server_binds_for_other_containers_and_advertises_reads_any_client_can_reach():
    args = parse(server_argv())
    assert host_of(args.bind) == "0.0.0.0" and host_of(args.read_bind) == "0.0.0.0"
    # The hello names the wildcard read endpoint, which a client takes as the host it reached the
    # server on: server:5556 in the compose network, 127.0.0.1:5556 on the host. Advertising
    # tcp://server:5556 would leave the published read port useless from the host.
    assert args.advertise_read is None
    # A wildcard bind is refused without authentication unless --insecure says so.
    assert args.insecure or args.auth
    ServerConfig(path="/data/replay.h5", bind=args.bind, read_bind=args.read_bind, insecure=args.insecure,
                 auth_dir=args.auth, num_readers=args.readers)


@pytest.mark.parametrize("env", [{}, {"H5REPLAY_PORT": "7100", "H5REPLAY_READ_PORT": "7200"}])
def test_ports_agree_between_the_cli_compose_and_the_dockerfile(env):
    args = parse(server_argv(env))
    ports = {port_of(args.bind), port_of(args.read_bind)}
    for mapping in SERVICES["server"]["ports"]:
        parts = interpolate(str(mapping), env).split(":")
        assert len(parts) == 3 and parts[0] == "127.0.0.1", f"{mapping}: publish on the host's loopback only"
        # The same port inside and out: the wildcard read endpoint means the same port to every client.
        assert parts[1] == parts[2], f"{mapping}: the host port must be the container's"
    assert {int(interpolate(str(m), env).split(":")[2]) for m in SERVICES["server"]["ports"]} == ports
    if not env:
        exposed = {int(p) for word, rest in final_stage() if word == "EXPOSE" for p in rest.split()}
        assert exposed == ports
    for client in ("actor", "learner"):
        endpoint = command(client, env)[1]
        assert endpoint == f"tcp://server:{port_of(args.bind)}", f"{client} must dial the server's service name"
        assert "ports" not in SERVICES[client] and "container_name" not in SERVICES[client]  # --scale works
    ping = parse([interpolate(str(a), env) for a in SERVICES["server"]["healthcheck"]["test"][2:]])
    assert ping.endpoint == f"tcp://127.0.0.1:{port_of(args.bind)}"


def test_the_healthcheck_pings_the_servers_endpoint_in_compose_and_the_dockerfile():
    test = [interpolate(str(arg)) for arg in SERVICES["server"]["healthcheck"]["test"]]
    assert test[0] == "CMD" and test[1] == "h5replay"
    ping = parse(test[2:])
    assert ping.command == "ping"
    bind = parse(server_argv()).bind
    assert ping.endpoint == f"tcp://127.0.0.1:{port_of(bind)}"  # inside the server's own container
    assert ping.timeout < seconds(SERVICES["server"]["healthcheck"]["timeout"])
    (healthcheck,) = [rest for word, rest in final_stage() if word == "HEALTHCHECK"]
    exec_form = json.loads(healthcheck[healthcheck.index("CMD ") + 4:])
    assert exec_form == test[1:]
    for client in ("actor", "learner"):  # they run the same image but are no servers
        assert SERVICES[client]["healthcheck"] == {"disable": True}
        assert SERVICES[client]["depends_on"]["server"]["condition"] == "service_healthy"


def test_the_data_volume_and_the_space_file_are_where_the_server_command_looks():
    args = parse(server_argv())
    volumes = [interpolate(str(v)) for v in SERVICES["server"]["volumes"]]
    targets = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    data_dir = str(Path(args.path).parent)
    assert targets[data_dir] in COMPOSE.get("volumes", {}), "the data directory is a named volume"
    # No VOLUME in the image: it would give every actor and learner container an anonymous volume
    # that `down` leaves behind. The image makes the directory, owned by its user.
    assert not [rest for word, rest in dockerfile() if word == "VOLUME"]
    assert any(word == "RUN" and f"mkdir -p {data_dir} " in rest and "chown" in rest for word, rest in final_stage())
    space_source = COMPOSE_FILE.parent / targets[args.space]
    assert space_source.exists()
    space = space_from_json(json.loads(space_source.read_text()))
    assert ("COPY", f"docker/{space_source.name} {args.space}") in final_stage()  # the image has it too
    gym = pytest.importorskip("gymnasium")
    from h5replay.examples.gym_actor import gym_row_space

    env = gym.make(option(command("actor"), "--env"))
    assert gym_row_space(env) == space, "the actors' environment must match the server's space"
    env.close()


def test_stop_grace_periods_leave_time_for_the_sigterm_flush():
    assert seconds(SERVICES["server"]["stop_grace_period"]) >= 30
    for client in ("actor", "learner"):
        assert seconds(SERVICES[client]["stop_grace_period"]) >= 10


def test_the_dockerfile_runs_the_cli_as_a_user_of_its_own():
    stage = final_stage()
    assert stage[0] == ("FROM", "python:3.11-slim")
    users = [rest for word, rest in stage if word == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:"))
    assert [rest for word, rest in stage if word == "ENTRYPOINT"] == ['["h5replay"]']
    (install,) = [rest for word, rest in stage if word == "RUN" and "pip install" in rest]
    assert "[gym]" in install  # the actor service runs a gymnasium environment
    assert ("WORKDIR", "/src") in dockerfile()  # the wheel is built from the sources copied in a build stage


def test_the_image_installs_from_docker_wheels_only_when_wheels_are_there():
    """An ordinary build fetches from PyPI; with the project's wheel in docker/wheels/ (as `make
    compose-test` leaves it for a build that cannot reach PyPI), nothing is fetched."""
    instructions = dockerfile()
    assert ("COPY", "docker/wheels/ /wheels/") in instructions
    (build,) = [rest for word, rest in instructions if word == "RUN" and "pip wheel" in rest]
    assert build.startswith("if ls /wheels/h5replay-*.whl") and "NO_INDEX" in build
    (install,) = [rest for word, rest in final_stage() if word == "RUN" and "pip install" in rest]
    assert "--no-index" in install and "[ -e /wheels/NO_INDEX ]" in install and "--find-links /wheels" in install
    wheels = DOCKER / "wheels"
    assert (wheels / "README.md").is_file()
    ignored = (DOCKER.parent / ".dockerignore").read_text().splitlines()
    assert "!docker/wheels/" in ignored  # sent to the builder


@pytest.mark.parametrize("path", ["docker/keys/learner.key_secret", "docker/wheels/numpy-2.0-cp311.whl"])
def test_secrets_and_built_wheels_are_ignored_by_git(path):
    if shutil.which("git") is None or not (DOCKER.parent / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "check-ignore", "-q", path], cwd=DOCKER.parent, capture_output=True, timeout=30)
    assert done.returncode == 0, f"{path} is not ignored by git"
    copied = [src for word, rest in dockerfile() if word == "COPY" and not rest.startswith("--from")
              for src in rest.split()[:-1]]
    for source in copied:
        assert (DOCKER.parent / source).exists(), f"COPY {source}: not in the build context (the repository root)"


def test_the_auth_override_serves_with_keys_from_a_volume_the_image_user_owns():
    if not AUTH_OVERRIDE.exists():
        pytest.skip("no docker/compose.auth.yaml")
    override = load(AUTH_OVERRIDE)
    assert "secrets" not in override  # a directory as a secret's `file:` makes compose warn on every command
    assert set(override["volumes"]) == {"keys"}
    merged = {name: {**SERVICES[name], **override["services"].get(name, {})} for name in SERVICES}
    server = parse(command("server", services=merged))
    assert server.auth == "/keys" and not server.insecure
    for name in ("actor", "learner"):
        args = parse(command(name, services=merged))
        assert args.secret_key == f"/keys/{name}.key_secret" and args.server_key == "/keys/server.key"
    for name in SERVICES:
        assert "keys:/keys:ro" in override["services"][name]["volumes"], name
    ping = parse([interpolate(str(a)) for a in merged["server"]["healthcheck"]["test"][2:]])
    assert ping.command == "ping" and ping.secret_key.startswith("/keys/") and ping.server_key == "/keys/server.key"
    # The keys step: a one-off service (kept out of `up` by its profile) that writes the volume as
    # the image's user, which owns /keys in the image (a host folder would belong to someone else).
    keys = override["services"]["keys"]
    assert keys["profiles"] and keys["volumes"] == ["keys:/keys"]
    assert parse(keys["command"]).command == "keys" and keys["command"][-1] == "/keys"
    assert interpolate(str(keys["image"])) == interpolate(str(SERVICES["server"]["image"]))
    assert any(word == "RUN" and "/keys" in rest and "chown h5replay:h5replay /data /keys" in rest
               for word, rest in final_stage())
    header = AUTH_OVERRIDE.read_text().split("services:")[0]
    assert "run --rm keys" in header and "docker/keys" in header


# -------------------------------------------------------- the same topology, as plain processes


class Topology:
    """compose.yaml's services as local processes: the commands as written, with the container
    world mapped onto this machine (service names and 0.0.0.0 onto loopback ports, volumes onto
    folders), every process logging to a file and killed at the end if still running."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        args = parse(server_argv(env))
        self.ports = {port_of(args.bind): free_port(), port_of(args.read_bind): free_port()}
        self.mounts: dict[str, Path] = {}
        for volume in SERVICES["server"]["volumes"]:
            source, target = interpolate(str(volume), env).split(":")[:2]
            if source in COMPOSE.get("volumes", {}):
                (tmp_path / source).mkdir()
                self.mounts[target] = tmp_path / source
            else:
                self.mounts[target] = (COMPOSE_FILE.parent / source).resolve()

    def local(self, argv: list[str]) -> list[str]:
        out = []
        for arg in argv:
            match = re.fullmatch(r"tcp://(0\.0\.0\.0|server|127\.0\.0\.1):(\d+)", arg)
            if match:
                arg = f"tcp://127.0.0.1:{self.ports[int(match[2])]}"
            for target, source in self.mounts.items():
                if arg == target or arg.startswith(target + "/"):
                    arg = str(source) + arg[len(target):]
            out.append(arg)
        return out

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp_path / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        out = open(self.tmp_path / f"{name}.out", "wb")  # noqa: SIM115
        proc = subprocess.Popen([sys.executable, "-m", "h5replay", *self.local(argv)], stdout=out, stderr=log,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        out.close()
        log.close()
        self.procs.append((name, proc))
        return proc

    def output(self, name: str) -> str:
        return (self.tmp_path / f"{name}.out").read_text() + (self.tmp_path / f"{name}.log").read_text()

    def wait_healthy(self, timeout: float) -> None:
        """As compose's `service_healthy`: run the healthcheck until it passes."""
        test = self.local([interpolate(str(arg), self.env) for arg in SERVICES["server"]["healthcheck"]["test"][2:]])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if subprocess.run([sys.executable, "-m", "h5replay", *test], capture_output=True, timeout=60).returncode == 0:
                return
            time.sleep(0.5)
        raise AssertionError(f"the server never became healthy:\n{self.output('server')}")

    def close(self) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_the_compose_topology_as_plain_processes_streams_samples_and_stops_cleanly(tmp_path):
    pytest.importorskip("gymnasium")
    env = {"H5REPLAY_EPISODES": "5", "H5REPLAY_REPORT_EVERY": "1", "H5REPLAY_CAPACITY": "100000"}
    topology = Topology(tmp_path, env)
    try:
        server = topology.start("server", server_argv(env))
        topology.wait_healthy(60)
        actors = [topology.start(f"actor{i}", command("actor", env)) for i in range(3)]
        learner = topology.start("learner", command("learner", env))
        for i, actor in enumerate(actors):
            assert actor.wait(READ_TIMEOUT) == 0, topology.output(f"actor{i}")
        time.sleep(1.5)  # a report on the finished data
        # `docker compose down`: the clients first, then the server, each by SIGTERM.
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(seconds(SERVICES["learner"]["stop_grace_period"])) == 0, topology.output("learner")
        server.send_signal(signal.SIGTERM)
        assert server.wait(seconds(SERVICES["server"]["stop_grace_period"])) == 0, topology.output("server")
    finally:
        topology.close()

    learned = topology.output("learner")
    read_port = topology.ports[port_of(parse(server_argv()).read_bind)]
    assert f"reads on tcp://127.0.0.1:{read_port}" in learned  # the advertised read endpoint was used
    assert "in 15 episodes" in learned and "mean return" in learned
    done = [line for line in learned.splitlines() if line.startswith("learner done:")]
    assert done and not done[0].startswith("learner done: 0 batches"), learned
    assert "stopped cleanly" in topology.output("server")

    segments, rows = read_file(tmp_path / "data" / Path(parse(server_argv()).path).name)
    assert len(segments) == 15 and sum(n for _, n in segments) == len(rows["reward"])
    for start, n in segments:
        done_flags = rows["terminated"][start:start + n] | rows["truncated"][start:start + n]
        assert done_flags[-1] and not done_flags[:-1].any()
    assert np.all(rows["reward"] == 1.0)  # CartPole pays 1 per step
