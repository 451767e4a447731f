"""`make compose-test`: build the image and run docker/compose.yaml for real, then with
compose.auth.yaml, then docker/compose.shards.yaml (two shards, one stopped and started again).

With the real engine and real containers (a server, 3 actors and a learner), each deployment must:
take episodes and serve them to its learner; answer `h5replay stats` from the host, and serve a
learner on the host through the published read port; go `down` within 15 s with every container
exiting 0 and no volume left but its named ones; and keep its data for a second `up`.

What it needs and cannot find, it sets up: the Docker Engine and Compose (Debian's docker.io and
docker-compose, with apt-get, as root), the daemon (`dockerd --exec-opt
native.cgroupdriver=cgroupfs`, in the background, its log in build/compose-test/), and the
Dockerfile's base image when no registry can be reached (a stand-in: Debian's python3 from
`debootstrap --variant=minbase`, imported under the same name). Container builds here may not
reach PyPI either, so the project's and its dependencies' wheels are built on the host into
docker/wheels/, which the Dockerfile installs from (and which is emptied again at the end).

When no engine can be started, it prints one line saying why and exits 0. Every wait is bounded;
the containers, volumes and networks it made are removed at the end, and a daemon it started is
stopped. Ports are published on 127.0.0.1 only.

    python docker/compose_test.py          # from the repository root, h5replay installed
    python docker/compose_test.py shards   # only some deployments: plain, auth, shards
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
WORK = ROOT / "build" / "compose-test"
WHEELS = DOCKER / "wheels"
IMAGE = "h5replay:compose-test"
ACTORS = 3
DOWN_SECONDS = 15.0  # `down` must finish within this
DEBIAN_MIRROR = os.environ.get("H5REPLAY_DEBIAN_MIRROR", "http://deb.debian.org/debian")
STAND_IN_LABEL = "org.h5replay.stand-in"


class Skip(Exception):
    """No container engine can be started here: say why, exit 0."""


class Failure(Exception):
    """The deployment did not do what it must."""


def say(text: str) -> None:
    print(f"compose-test: {text}", flush=True)


def run(cmd: list[str], timeout: float, *, check: bool = True, env: dict[str, str] | None = None,
        binary: bool = False, stdin: bytes | None = None) -> subprocess.CompletedProcess[Any]:
    """Run `cmd` to completion within `timeout` seconds (`stdin`: bytes to feed it); a non-zero exit
    raises Failure (with `check`)."""
    try:
        if stdin is not None:
            done = subprocess.run(cmd, capture_output=True, input=stdin, timeout=timeout, env=env, cwd=ROOT)
        else:
            done = subprocess.run(cmd, capture_output=True, text=not binary, timeout=timeout, env=env, cwd=ROOT,
                                  stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Failure(f"`{' '.join(cmd)}` did not finish within {timeout:.0f} s") from None
    except FileNotFoundError:
        raise Failure(f"`{cmd[0]}` is not installed") from None
    if check and done.returncode != 0:
        err = done.stderr if isinstance(done.stderr, str) else done.stderr.decode(errors="replace")
        raise Failure(f"`{' '.join(cmd)}` exited {done.returncode}: {_tail(err)}")
    return done


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def wait_for(what: str, predicate: Callable[[], bool], timeout: float, interval: float = 1.0) -> float:
    """Poll until `predicate()` holds; returns the seconds it took. Raises Failure after `timeout`."""
    started = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise Failure(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    say(f"{what} ({time.monotonic() - started:.1f} s)")


# ------------------------------------------------------------------------------- engine and tools


def _docker_answers() -> tuple[bool, str]:
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return False, "no docker command"
    except subprocess.TimeoutExpired:
        return False, "`docker info` did not answer within 30 s"
    return done.returncode == 0, _tail(done.stderr, 1)


def _apt_install(packages: list[str], why: str) -> None:
    if os.geteuid() != 0:
        raise Skip(f"{why}, and installing {' '.join(packages)} needs root")
    if shutil.which("apt-get") is None:
        raise Skip(f"{why}, and there is no apt-get to install {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    say(f"{why}: apt-get install {' '.join(packages)}")
    try:
        run(["apt-get", "update", "-qq"], 600, env=env)
        run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages], 900, env=env)
    except Failure as exc:
        raise Skip(f"{why}, and installing {' '.join(packages)} failed: {str(exc).splitlines()[-1]}") from None


class Engine:
    """The Docker daemon and the compose command; starts (and later stops) a daemon when none answers."""

    def __init__(self) -> None:
        self.daemon: subprocess.Popen[bytes] | None = None
        self.compose: list[str] = []

    def start(self) -> None:
        answers, why = _docker_answers()
        if not answers:
            if shutil.which("dockerd") is None:
                _apt_install(["docker.io", "docker-compose"], "no Docker engine here (dockerd is not installed)")
            answers, why = _docker_answers()
        if not answers:
            self._start_daemon(why)
        self.compose = self._compose_command()

    def _start_daemon(self, why: str) -> None:
        if os.geteuid() != 0:
            raise Skip(f"the Docker daemon does not answer ({why}) and starting dockerd needs root")
        WORK.mkdir(parents=True, exist_ok=True)
        log_path = WORK / "dockerd.log"
        with open(log_path, "ab") as log:
            self.daemon = subprocess.Popen(["dockerd", "--exec-opt", "native.cgroupdriver=cgroupfs"], stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.daemon.poll() is None:
            if _docker_answers()[0]:
                say(f"started dockerd (pid {self.daemon.pid}; log {log_path.relative_to(ROOT)})")
                return
            time.sleep(1)
        last = _tail(log_path.read_text(errors="replace"), 1)
        self.stop()
        raise Skip(f"the Docker daemon did not start within 60 s (last line of {log_path.relative_to(ROOT)}: {last})")

    def _compose_command(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError, subprocess.TimeoutExpired):
            if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30,
                              stdin=subprocess.DEVNULL).returncode == 0:
                return ["docker", "compose"]
        if shutil.which("docker-compose") is None:
            _apt_install(["docker-compose"], "no docker compose plugin nor docker-compose here")
        return ["docker-compose"]

    def stop(self) -> None:
        """Stop the daemon this run started (with its containerd), if it did."""
        if self.daemon is None or self.daemon.poll() is not None:
            return
        self.daemon.send_signal(signal.SIGTERM)
        try:
            self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait(10)


# ------------------------------------------------------------------------------ the image


def base_images() -> list[str]:
    """The images the Dockerfile's stages start FROM (not counting earlier stages)."""
    names: list[str] = []
    stages: set[str] = set()
    for line in (DOCKER / "Dockerfile").read_text().splitlines():
        match = re.match(r"\s*FROM\s+(\S+)(?:\s+AS\s+(\S+))?", line, re.IGNORECASE)
        if match:
            if match[1] not in stages and match[1] not in names:
                names.append(match[1])
            if match[2]:
                stages.add(match[2])
    return names


def ensure_base_image(name: str) -> None:
    if run(["docker", "image", "inspect", name], 60, check=False).returncode == 0:
        return
    pulled = run(["docker", "pull", name], 300, check=False)
    if pulled.returncode == 0:
        say(f"pulled {name}")
        return
    with step(f"no registry answered for {name} ({_tail(pulled.stderr, 1)}); made a stand-in from Debian's "
              f"python3 (label {STAND_IN_LABEL}; `docker rmi {name}` removes it)"):
        make_stand_in(name)


def make_stand_in(name: str) -> None:
    """`name` built from Debian bookworm (minbase) with python3, python3-venv and python3-pip."""
    if not name.startswith("python:3.11"):
        raise Failure(f"cannot pull {name}, and the stand-in (Debian bookworm's Python 3.11) would not be it")
    if shutil.which("debootstrap") is None:
        _apt_install(["debootstrap"], "the stand-in base image needs debootstrap")
    rootfs = WORK / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    rootfs.parent.mkdir(parents=True, exist_ok=True)
    try:
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,python3-pip", "bookworm",
             str(rootfs), DEBIAN_MIRROR], 1200)
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for path in (rootfs / cache).glob("*"):
                if path.is_file():
                    path.unlink()
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                   'CMD ["python3"]', f"LABEL {STAND_IN_LABEL}=debootstrap-bookworm"]
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        try:
            done = subprocess.run(["docker", "import", *[a for c in changes for a in ("--change", c)], "-", name],
                                  stdin=tar.stdout, capture_output=True, text=True, timeout=600)
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar.wait(60)
        if done.returncode != 0:
            raise Failure(f"docker import failed: {_tail(done.stderr)}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def build_wheels(base: str) -> None:
    """The project's wheel and its dependencies' (with the gym extra), for the base image's Python."""
    clear_wheels()
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(WHEELS), "."], 600)
    probe = run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", base, "-c",
                 "import json, platform, sys; print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
                 "'glibc': platform.libc_ver()[1], 'machine': platform.machine()}))"], 120)
    target = json.loads(probe.stdout)
    glibc_minor = int(target["glibc"].split(".")[1])
    platforms = [f"manylinux_2_{minor}_{target['machine']}" for minor in range(17, glibc_minor + 1)]
    platforms.append(f"manylinux2014_{target['machine']}")
    (project,) = WHEELS.glob("h5replay-*.whl")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
         target["python"], "--implementation", "cp", *[a for p in platforms for a in ("--platform", p)],
         "--dest", str(WHEELS), f"{project}[gym]"], 600)


def clear_wheels() -> None:
    for path in WHEELS.glob("*.whl"):
        path.unlink()


# ---------------------------------------------------------------------------------- deployments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Deployment:
    """One compose project (its own name, host ports and volumes), driven as a user would."""

    def __init__(self, engine: Engine, name: str, files: list[str], auth: bool) -> None:
        self.engine, self.auth = engine, auth
        self.project = f"h5replay-ct-{name}-{os.getpid()}"
        self.files = files
        self.port, self.read_port = free_port(), free_port()
        while self.read_port == self.port:
            self.read_port = free_port()
        settings = {
            "H5REPLAY_IMAGE": IMAGE, "H5REPLAY_PORT": str(self.port), "H5REPLAY_READ_PORT": str(self.read_port),
            "H5REPLAY_CAPACITY": "200000", "H5REPLAY_EPISODES": "0", "H5REPLAY_REPORT_EVERY": "2",
        }
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("H5REPLAY_")} | settings
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.keys_dir: Path | None = None

    def compose(self, *args: str, timeout: float = 300, check: bool = True,
                binary: bool = False) -> subprocess.CompletedProcess[Any]:
        files = [a for f in self.files for a in ("-f", str(DOCKER / f))]
        return run([*self.engine.compose, "-p", self.project, *files, *args], timeout, check=check, env=self.env,
                   binary=binary)

    # ------------------------------------------------------------------ host tools

    def key_args(self) -> list[str]:
        if self.keys_dir is None:
            return []
        return ["--secret-key", str(self.keys_dir / "learner.key_secret"), "--server-key", str(self.keys_dir / "server.key")]

    def h5replay(self, *args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess[Any]:
        return run([sys.executable, "-m", "h5replay", *args], timeout, check=check)

    def stats(self) -> dict[str, Any]:
        done = self.h5replay("stats", self.endpoint, "--json", "--interval", "0.2", "--timeout", "10", *self.key_args())
        return dict(json.loads(done.stdout))

    def stats_or_none(self) -> dict[str, Any] | None:
        try:
            return self.stats()
        except Failure:
            return None

    # ------------------------------------------------------------------ steps

    def make_keys(self) -> None:
        """The keys step of compose.auth.yaml, then the learner's pair copied out for host tools."""
        self.compose("run", "--rm", "keys", timeout=120)
        archive = self.compose("run", "--rm", "-T", "--entrypoint", "tar", "keys", "-C", "/keys", "-c",
                               "learner.key", "learner.key_secret", "server.key", timeout=120, binary=True)
        self.keys_dir = Path(tempfile.mkdtemp(prefix="h5replay-ct-keys-"))
        # As the README pipes it: `... | tar -x --no-same-owner -C DIR` (the archive's files belong to uid 10001).
        run(["tar", "-x", "--no-same-owner", "-C", str(self.keys_dir)], 60, stdin=archive.stdout)
        got = sorted(p.name for p in self.keys_dir.iterdir())
        if got != ["learner.key", "learner.key_secret", "server.key"]:
            raise Failure(f"the keys copied out of the volume are {got}")

    def up(self) -> None:
        # Compose waits for the server's healthcheck before it starts the actors and the learner.
        self.compose("up", "-d", "--no-build", "--scale", f"actor={ACTORS}", timeout=300)

    def check_flowing(self, at_least: int) -> int:
        """Episodes arrive and the learner reads them; returns the episodes held."""
        seen: dict[str, Any] = {}

        def flowing() -> bool:
            stats = self.stats_or_none()
            if stats is None:
                return False
            seen.update(stats)
            return bool(stats["total_episodes"] >= at_least and stats["rows_out"] > 0)

        try:
            wait_for(f"{at_least} episodes in and rows read by the learner", flowing, 120)
        except Failure as exc:
            raise Failure(f"{exc} (last stats from the host: {seen or 'none answered'})") from None
        wait_for("a report of the learner on what it sampled", self.learner_reported, 60)
        return int(seen["total_episodes"])

    def learner_reported(self) -> bool:
        logs = self.compose("logs", "--no-color", "learner", timeout=60).stdout
        return bool(re.search(r"rows held .* in [\d,]+ episodes; sampled .*\(([1-9][\d,]*) batches so far\)", logs))

    def check_host_learner(self) -> None:
        """A learner on the host reads through the published read port (the hello names 0.0.0.0)."""
        done = self.h5replay("learner", self.endpoint, "--seconds", "3", "--report-every", "1", "--timeout", "10",
                             *self.key_args(), timeout=60)
        match = re.search(r"learner done: ([\d,]+) batches", done.stdout)
        if not match or match[1] == "0" or f"reads on tcp://127.0.0.1:{self.read_port}" not in done.stderr:
            raise Failure(f"the learner on the host read nothing:\n{_tail(done.stdout + done.stderr)}")

    def check_refuses_strangers(self) -> None:
        """Without keys, `stats` gets no answer, says keys may be why, and the server logs the refusal."""
        done = self.h5replay("stats", self.endpoint, "--timeout", "2", check=False)
        if done.returncode != 1 or len(done.stderr.strip().splitlines()) != 1:
            raise Failure(f"stats without keys: exit {done.returncode}, {done.stdout + done.stderr!r}")
        logs = ""

        def logged() -> bool:
            nonlocal logs
            logs = self.compose("logs", "--no-color", "server", timeout=60).stdout
            return "without CURVE keys" in logs

        try:
            wait_for("the server's log line about the refused handshake", logged, 30)
        except Failure as exc:
            raise Failure(f"{exc}; the server's log:\n{_tail(logs, 30)}") from None

    def down(self) -> tuple[float, float]:
        """`down` within DOWN_SECONDS, every container exiting 0; returns (seconds `down` took, seconds
        until the last container exited)."""
        containers = self.containers()
        since = time.time()
        started = time.monotonic()
        self.compose("down", timeout=120)
        took = time.monotonic() - started
        exits = self.exit_codes(int(since) - 1, len(containers))
        stopped = max((t for _, t in exits.values()), default=since) - since
        if took > DOWN_SECONDS:
            raise Failure(f"`down` took {took:.1f} s (more than {DOWN_SECONDS:.0f} s; the last container exited "
                          f"after {stopped:.1f} s)")
        codes = {name: code for name, (code, _) in exits.items()}
        if sorted(codes) != sorted(containers) or any(code != "0" for code in codes.values()):
            raise Failure(f"containers' exit codes on `down`: {codes} (expected 0 from each of {sorted(containers)})")
        if self.containers():
            raise Failure(f"containers left after `down`: {self.containers()}")
        return took, stopped

    def containers(self) -> list[str]:
        done = run(["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project}",
                    "--format", "{{.Names}}"], 60)
        return sorted(done.stdout.split())

    def exit_codes(self, since: int, expected: int) -> dict[str, tuple[str, float]]:
        """{container: (exit code, time it exited)} from the engine's `die` events since `since`."""
        exits: dict[str, tuple[str, float]] = {}

        def collected() -> bool:
            done = run(["docker", "events", "--since", str(since), "--until", str(int(time.time()) + 1),
                        "--filter", f"label=com.docker.compose.project={self.project}", "--filter", "event=die",
                        "--format", "{{.Actor.Attributes.name}} {{.Actor.Attributes.exitCode}} {{.TimeNano}}"], 60)
            exits.clear()
            for line in done.stdout.splitlines():
                if line.strip():
                    name, code, nanoseconds = line.split()
                    exits[name] = (code, int(nanoseconds) / 1e9)
            return len(exits) >= expected

        with contextlib.suppress(Failure):
            wait_for("die events", collected, 10)
        return exits

    def volumes(self) -> set[str]:
        return set(run(["docker", "volume", "ls", "-q"], 60).stdout.split())

    def networks(self) -> set[str]:
        return set(run(["docker", "network", "ls", "--format", "{{.Name}}"], 60).stdout.split())

    def logs(self) -> str:
        done = self.compose("logs", "--no-color", "--tail", "30", timeout=60, check=False)
        return str(done.stdout) + str(done.stderr)

    def remove(self) -> None:
        """Everything this project made: containers, networks, volumes; and the host's key copy."""
        self.compose("down", "-v", "--remove-orphans", timeout=180, check=False)
        for volume in self.volumes():
            if volume.startswith(self.project + "_"):
                run(["docker", "volume", "rm", "-f", volume], 60, check=False)
        if self.keys_dir is not None:
            shutil.rmtree(self.keys_dir, ignore_errors=True)


class ShardsDeployment(Deployment):
    """docker/compose.shards.yaml: two server shards, actors and a learner given both endpoints."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine, "shards", ["compose.shards.yaml"], auth=False)
        ports: set[int] = set()
        while len(ports) < 4:
            ports.add(free_port())
        self.ports = sorted(ports)
        self.env |= {"H5REPLAY_PORT_0": str(self.ports[0]), "H5REPLAY_READ_PORT_0": str(self.ports[1]),
                     "H5REPLAY_PORT_1": str(self.ports[2]), "H5REPLAY_READ_PORT_1": str(self.ports[3])}
        self.endpoints = [f"tcp://127.0.0.1:{self.ports[0]}", f"tcp://127.0.0.1:{self.ports[2]}"]

    def shard_stats(self, shard: int) -> dict[str, Any] | None:
        done = self.h5replay("stats", self.endpoints[shard], "--json", "--interval", "0.2", "--timeout", "5",
                             check=False)
        return dict(json.loads(done.stdout)) if done.returncode == 0 else None

    def episodes(self) -> list[int]:
        """Episodes each shard holds (-1 for a shard that does not answer)."""
        return [int(s["total_episodes"]) if s else -1 for s in (self.shard_stats(0), self.shard_stats(1))]

    def grows(self, what: str, shard: int, by: int, timeout: float = 90) -> None:
        start = self.episodes()[shard]
        last = [start]

        def grown() -> bool:
            last[0] = self.episodes()[shard]
            return last[0] >= start + by

        try:
            wait_for(what, grown, timeout)
        except Failure as exc:
            raise Failure(f"{exc} (shard {shard} held {start} episodes, then {last[0]})") from None


def exercise_shards(deployment: ShardsDeployment) -> None:
    """Up, both shards take episodes and the learner reads; one shard stopped: the actors go on on
    the other and the learner too; started again: it takes episodes again; down, every exit 0."""
    name = "shards"
    try:
        with step(f"{name}: up (2 shards healthy, {ACTORS + 1} actors, learner)"):
            deployment.compose("up", "-d", "--no-build", "--scale", f"actor={ACTORS + 1}", timeout=300)
        with step(f"{name}: episodes arrive on the shards and the learner reads them"):
            wait_for("30 episodes over the shards", lambda: sum(max(0, n) for n in deployment.episodes()) >= 30, 120)
            wait_for("a report of the learner on what it sampled", deployment.learner_reported, 60)
        held = deployment.episodes()
        victim = max(range(2), key=lambda k: held[k])
        other = 1 - victim
        with step(f"{name}: shard{victim} stopped ({held} episodes held): its actors go on on shard{other}"):
            deployment.compose("stop", f"shard{victim}", timeout=120)
            deployment.grows(f"episodes on shard{other} with shard{victim} stopped", other, 20)
        with step(f"{name}: shard{victim} started again on its volume: it takes episodes again"):
            deployment.compose("start", f"shard{victim}", timeout=120)
            wait_for(f"shard{victim} answers", lambda: deployment.episodes()[victim] >= held[victim], 90)
            deployment.grows(f"episodes on shard{victim} after its restart", victim, 10)
        logs = ""

        def settled() -> bool:  # every episode an actor kept in doubt was settled on its shard
            nonlocal logs
            logs = deployment.compose("logs", "--no-color", "actor", "learner", timeout=60).stdout
            return bool(logs.count("settled an episode in doubt") == logs.count("keeps an episode of"))

        with step(f"{name}: every episode kept in doubt by an actor was settled on its shard"):
            wait_for("the episodes kept in doubt settled", settled, 60)
        if "Traceback" in logs:
            raise Failure(f"the actors' or the learner's logs hold a traceback:\n{_tail(logs, 30)}")
        took, stopped = deployment.down()
        say(f"{name}: down in {took:.1f} s (the last container exited after {stopped:.1f} s), {ACTORS + 4} "
            f"containers exited 0; episodes held before the stop {held}, at the end both shards took more; "
            f"{logs.count('keeps an episode of')} episode(s) kept in doubt, all settled")
    except Failure:
        say(f"{name}: the services' last log lines:\n{deployment.logs()}")
        raise
    finally:
        deployment.remove()


def exercise(deployment: Deployment) -> None:
    """Up, data flowing, stats and a learner from the host, down, up again on the same data, down."""
    name = "auth" if deployment.auth else "plain"
    volumes_before = deployment.volumes()
    networks_before = deployment.networks()
    try:
        if deployment.auth:
            with step(f"{name}: keys made in the keys volume by `run --rm keys`, the learner's pair copied out"):
                deployment.make_keys()
        with step(f"{name}: up (server healthy, {ACTORS} actors, learner)"):
            deployment.up()
        with step(f"{name}: episodes arrive, the learner reads them, `h5replay stats` answers from the host"):
            held = deployment.check_flowing(at_least=30)
        with step(f"{name}: a learner on the host reads through the published read port"):
            deployment.check_host_learner()
        if deployment.auth:
            with step(f"{name}: a client without keys is refused and the server logs it"):
                deployment.check_refuses_strangers()
        held = max(held, deployment.stats()["total_episodes"])
        took, stopped = deployment.down()
        left = deployment.volumes() - volumes_before
        expected = {f"{deployment.project}_data"} | ({f"{deployment.project}_keys"} if deployment.auth else set())
        if left != expected:
            raise Failure(f"volumes left after `down`: {sorted(left)} (expected only {sorted(expected)})")
        say(f"{name}: down in {took:.1f} s (the last container exited after {stopped:.1f} s), {ACTORS + 2} containers "
            f"exited 0, volumes left: {sorted(left)}")
        with step(f"{name}: up again on the same volume: the {held} episodes are still there, and more come"):
            deployment.up()
            again = deployment.stats()
            if again["total_episodes"] < held:
                raise Failure(f"the second up holds {again['total_episodes']} episodes, the first had {held}")
            deployment.check_flowing(at_least=again["total_episodes"] + 30)
        took, stopped = deployment.down()
        say(f"{name}: down again in {took:.1f} s (the last container exited after {stopped:.1f} s), every container "
            "exited 0")
    except Failure:
        say(f"{name}: the services' last log lines:\n{deployment.logs()}")
        raise
    finally:
        deployment.remove()
    left = deployment.networks() - networks_before
    if left:
        raise Failure(f"networks left after the test: {sorted(left)}")


DEPLOYMENTS = {"plain": ["compose.yaml"], "auth": ["compose.yaml", "compose.auth.yaml"],
               "shards": ["compose.shards.yaml"]}


def main(only: list[str]) -> int:
    unknown = sorted(set(only) - set(DEPLOYMENTS))
    if unknown:
        say(f"unknown deployment(s) {unknown}: choose among {', '.join(DEPLOYMENTS)} (none: all)")
        return 2
    started = time.monotonic()
    engine = Engine()
    results: dict[str, str] = {}
    try:
        try:
            engine.start()
        except Skip as exc:
            say(f"skipped: {exc}")
            return 0
        try:
            with step("base image(s) present: " + ", ".join(base_images())):
                for name in base_images():
                    ensure_base_image(name)
            try:
                with step("wheels of h5replay and its dependencies built on the host into docker/wheels/"):
                    build_wheels(base_images()[-1])
                with step(f"image {IMAGE} built by `{' '.join(engine.compose)} build` (the server's build only)"):
                    Deployment(engine, "build", ["compose.yaml"], auth=False).compose("build", timeout=1200)
                # The build stage's image, and the image this build replaced, are left untagged.
                run(["docker", "image", "prune", "-f", "--filter", "label=org.h5replay.stage"], 120)
            finally:
                clear_wheels()
        except Failure as exc:
            say(f"FAILED to build the image: {exc}")
            return 1
        for name, files in DEPLOYMENTS.items():
            if only and name not in only:
                continue
            try:
                if name == "shards":
                    exercise_shards(ShardsDeployment(engine))
                else:
                    exercise(Deployment(engine, name, files, auth=name == "auth"))
                results[name] = "passed"
            except Failure as exc:
                say(f"{name}: FAILED: {exc}")
                results[name] = "failed"
    finally:
        engine.stop()
    passed, failed = list(results.values()).count("passed"), list(results.values()).count("failed")
    say(f"{', '.join(f'{name} {result}' for name, result in results.items())} in {time.monotonic() - started:.0f} s")
    # The closing line in the form CI reads: deployments exercised.
    print(f"compose-test: {passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
