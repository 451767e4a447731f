"""Ray: h5replay servers ("shards") placed on a Ray cluster, one per node, restarted where they ran.

Ray does placement, discovery and restarts; the data path stays on ZeroMQ, from actors straight to
the shards and from the shards to learners (h5replay.client._shards routes). Each shard is a Ray
actor pinned to its node (hard node affinity) that runs an ordinary h5replay server in a thread of
its worker process (with its reader processes as children), on a file in that node's local
`directory`. When that worker process dies, Ray starts the actor again on the same node
(`max_restarts`); it reopens the same file (crash recovery as on any restart) on the same ports,
which it chose at its first start and keeps next to the file, so clients find it again at the
endpoint they already have.

Ray assumes a trusted network (anyone who reaches the cluster can run code on it); the shards
bind each node's IP, which h5replay refuses without `insecure=True` or CURVE keys (`auth_dir`, a
folder present on every node, see `h5replay keys generate`).

Needs Ray (`pip install 'h5replay[ray]'`); the rest of h5replay never imports this module.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as exc:  # pragma: no cover - exercised only without ray
    raise ImportError("h5replay.integrations.ray needs Ray: pip install 'h5replay[ray]'") from exc

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig, is_loopback
from h5replay.errors import ConfigError, H5ReplayError, ServerUnavailableError
from h5replay.spaces import Space, space_from_json

__all__ = ["ShardSet", "start_shards", "NAMESPACE"]

log = logging.getLogger("h5replay.ray")

#: The Ray namespace of named (detached) shards.
NAMESPACE = "h5replay"
_START_TIMEOUT = 120.0  # seconds a shard may take to open (or recover) its file and serve


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ShardHost:
    """The Ray actor of one shard: serves `directory/shard-<index>.h5` from a thread of this
    process. Its constructor runs again on every restart (same arguments, same node)."""

    def __init__(self, index: int, space_json: Any, capacity: int | None, directory: str, host: str | None,
                 serve_options: dict[str, Any]) -> None:
        from h5replay.server import Server

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.index = index
        self.path = os.path.join(directory, f"shard-{index}.h5")
        self.starts = 0
        self._stopping = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._config: ServerConfig | None = None
        #: Why this shard does not serve (a start that failed stays failed: Ray restarts a process
        #: that died, not a configuration that cannot work). Reported by endpoint() and describe().
        self.failure: str | None = None
        try:
            os.makedirs(directory, exist_ok=True)
            bind, read_bind = self._endpoints(host or ray.util.get_node_ip_address())
            exists = os.path.exists(self.path)
            self._config = ServerConfig(
                path=self.path, space=None if exists or space_json is None else space_from_json(space_json),
                capacity=None if exists else capacity, bind=bind, read_bind=read_bind, **serve_options,
            )
            self.starts = self._count_start()
            self._server = Server(self._config)
            self._thread = threading.Thread(target=self._serve, name=f"h5replay-shard-{index}", daemon=True)
            self._thread.start()
            deadline = time.monotonic() + _START_TIMEOUT
            while not self._ready.wait(0.1):
                if not self._thread.is_alive():
                    break
                if time.monotonic() > deadline:
                    self.failure = f"it did not serve within {_START_TIMEOUT} s"
                    break
        except (H5ReplayError, OSError) as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
        if self.failure is not None:
            log.error("shard %d cannot serve %s: %s", index, self.path, self.failure)

    def _endpoints(self, host: str) -> tuple[str, str]:
        """The shard's endpoints: chosen at its first start, kept next to its file for restarts."""
        path = self.path + ".endpoints.json"
        if os.path.exists(path):
            with open(path, encoding="utf-8") as fh:
                saved = json.load(fh)
            return str(saved["bind"]), str(saved["read_bind"])
        bind, read_bind = f"tcp://{host}:{_free_port(host)}", f"tcp://{host}:{_free_port(host)}"
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"bind": bind, "read_bind": read_bind}, fh)
        os.replace(tmp, path)
        return bind, read_bind

    def _count_start(self) -> int:
        path = self.path + ".starts"
        starts = 1
        with contextlib.suppress(OSError, ValueError):
            with open(path, encoding="utf-8") as fh:
                starts = int(fh.read().strip() or 0) + 1
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(str(starts))
        return starts

    def _serve(self) -> None:
        try:
            code = self._server.run(self._ready)
        except BaseException as exc:  # noqa: B036 (reported by the constructor or below)
            self.failure, code = f"{type(exc).__name__}: {exc}", 1
        if not self._stopping and self._ready.is_set():
            # The server ended by itself (a failed write): end the process, so that Ray starts the
            # shard again and it recovers its file.
            log.error("shard %d stopped serving (exit code %s): restarting", self.index, code)
            logging.shutdown()
            os._exit(1)

    def endpoint(self) -> tuple[str, str | None]:
        """(the shard's endpoint, why it does not serve or None)."""
        return (self._config.bind if self._config is not None else "", self.failure)

    def describe(self) -> dict[str, Any]:
        """Where and what this shard is: index, node, pid, file, endpoints, number of starts."""
        return {
            "index": self.index, "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(), "pid": os.getpid(), "path": self.path,
            "endpoint": self._config.bind if self._config else None,
            "read_endpoint": self._config.resolved_read_bind if self._config else None,
            "starts": self.starts, "serving": self._thread is not None and self._thread.is_alive(),
            "failure": self.failure,
        }

    def stop(self, timeout: float = 60.0) -> bool:
        """Stop serving: open segments aborted, the file flushed and closed. True once stopped."""
        self._stopping = True
        if self._thread is None:
            return True
        self._server.stop()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class ShardSet:
    """Shards started by `start_shards` (or found by `ShardSet.connect`): endpoints, clients,
    figures, stop. Picklable: pass it (or just `.endpoints`) to Ray tasks and actors."""

    def __init__(self, handles: Sequence[Any], endpoints: Sequence[str], name: str | None = None) -> None:
        self.handles = list(handles)
        self.endpoints = list(endpoints)
        self.name = name

    def __len__(self) -> int:
        return len(self.endpoints)

    def actor_client(self, **kwargs: Any) -> ActorClient:
        """An ActorClient over every shard (keyword arguments as ActorClient's)."""
        return ActorClient(endpoints=self.endpoints, **kwargs)

    def learner_client(self, **kwargs: Any) -> LearnerClient:
        """A LearnerClient over every shard (keyword arguments as LearnerClient's)."""
        return LearnerClient(endpoints=self.endpoints, **kwargs)

    def stats(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Per shard: where it runs (node, pid, file, endpoints, starts) and its server's figures
        (length, episodes, clients, rows in, ...), or "error" for a shard that did not answer
        within `timeout` (it may be restarting)."""
        out: list[dict[str, Any]] = []
        for index, handle in enumerate(self.handles):
            try:
                entry = dict(ray.get(handle.describe.remote(), timeout=timeout))
            except Exception as exc:  # a dead or restarting actor: Ray's errors vary by case
                out.append({"index": index, "endpoint": self.endpoints[index], "error": repr(exc)})
                continue
            try:
                with ActorClient(self.endpoints[index], timeout=timeout, name="h5replay-ray-stats") as probe:
                    entry.update(probe.info())
            except ServerUnavailableError as exc:
                entry["error"] = str(exc)
            out.append(entry)
        return out

    def stop(self, timeout: float = 60.0) -> None:
        """Stop every shard (each flushes and closes its file), then end its Ray actor for good.
        Safe to call twice."""
        pending = []
        for handle in self.handles:
            with contextlib.suppress(Exception):
                pending.append(handle.stop.remote(timeout))
        with contextlib.suppress(Exception):
            ray.get(pending, timeout=timeout + 10)
        for handle in self.handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        self.handles = []

    def __enter__(self) -> ShardSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @classmethod
    def connect(cls, name: str = NAMESPACE, timeout: float = 30.0) -> ShardSet:
        """The detached shards started under `name` (`start_shards(..., name=name)` or `h5replay ray
        start`), from any driver connected to the cluster.

        Raises:
            ConfigError: no shard of that name exists.
        """
        handles: list[Any] = []
        while True:
            try:
                handles.append(ray.get_actor(f"{name}-{len(handles)}", namespace=NAMESPACE))
            except ValueError:
                break
        if not handles:
            raise ConfigError(f"no h5replay shards named {name!r} on this Ray cluster (namespace {NAMESPACE!r})")
        answers = ray.get([h.endpoint.remote() for h in handles], timeout=timeout)
        return cls(handles, [endpoint for endpoint, _ in answers], name)


def _nodes() -> list[dict[str, Any]]:
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: (str(n.get("NodeManagerAddress")), str(n["NodeID"])))


def start_shards(
    num_shards: int,
    space: Space | None,
    capacity: int | None,
    directory: str | os.PathLike[str],
    *,
    per_node: bool = True,
    host: str | None = None,
    name: str | None = None,
    max_restarts: int = -1,
    timeout: float = _START_TIMEOUT,
    **serve_options: Any,
) -> ShardSet:
    """Start `num_shards` h5replay servers on the Ray cluster this process is connected to.

    Shard k serves `directory/shard-k.h5` on its node (the file is made on the first start, with
    `space` and `capacity`; later starts reopen it). With `per_node=True` every shard gets a node of
    its own; with `per_node=False` the shards go round the nodes (several per node when there are
    more shards than nodes). Either way each shard is pinned to its node, so that a restart finds
    its file there.

    Args:
        num_shards: how many servers.
        space, capacity: of new files (a ring of `capacity` rows each; None: unbounded).
        directory: a folder on each node's local disk (SWMR needs a local file system).
        per_node: one shard per node (more shards than nodes is an error).
        host: the address to bind (default: each node's IP as Ray knows it).
        name: makes the shards detached named actors `name-k` in namespace "h5replay": they outlive
            this driver, and `ShardSet.connect(name)` finds them (as `h5replay ray start` does).
        max_restarts: restarts Ray gives each shard (-1: without limit).
        timeout: seconds to wait for every shard to serve.
        serve_options: ServerConfig fields for every shard (num_readers, fsync, insecure, auth_dir,
            limits, ...).

    Returns:
        A ShardSet: `.endpoints`, `.actor_client()`, `.learner_client()`, `.stats()`, `.stop()`.

    Raises:
        ConfigError: bad arguments, too few nodes, or non-loopback binds without insecure/auth_dir.
        ServerUnavailableError: the shards did not all serve within `timeout` (those started are stopped).
    """
    if isinstance(num_shards, bool) or not isinstance(num_shards, int) or num_shards < 1:
        raise ConfigError(f"num_shards must be a positive int, got {num_shards!r}")
    for key in ("path", "space", "capacity", "bind", "read_bind"):
        if key in serve_options:
            raise ConfigError(f"{key} is chosen per shard by start_shards; it is not a serve option")
    unknown = set(serve_options) - set(ServerConfig.__dataclass_fields__)
    if unknown:
        raise ConfigError(f"unknown serve options {sorted(unknown)}; see h5replay.config.ServerConfig")
    if not ray.is_initialized():
        ray.init()
    nodes = _nodes()
    if per_node and num_shards > len(nodes):
        raise ConfigError(f"{num_shards} shards, one per node, but the Ray cluster has {len(nodes)} live node(s); "
                          "start fewer shards, add nodes, or pass per_node=False")
    placed = [nodes[k % len(nodes)] for k in range(num_shards)]
    if not serve_options.get("insecure") and serve_options.get("auth_dir") is None:
        exposed = sorted({str(n["NodeManagerAddress"]) for n in placed
                          if not is_loopback(f"tcp://{host or n['NodeManagerAddress']}:1")})
        if exposed:
            raise ConfigError(
                f"the shards would bind {', '.join(exposed)} (the nodes' IPs), beyond loopback, without "
                "authentication; pass insecure=True (--insecure: Ray's network is trusted anyway) or auth_dir=DIR "
                "(--auth DIR, the same keys on every node)"
            )
    space_json = space.to_json() if space is not None else None
    handles = []
    remote = ray.remote(ShardHost)
    for k, node in enumerate(placed):
        options: dict[str, Any] = {
            "num_cpus": 0,  # it waits on sockets and the disk; the CPUs stay the cluster's
            "max_restarts": max_restarts,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node["NodeID"], soft=False),
        }
        if name is not None:
            options.update(name=f"{name}-{k}", namespace=NAMESPACE, lifetime="detached")
        handles.append(remote.options(**options).remote(k, space_json, capacity, os.fspath(directory), host,
                                                        serve_options))
    shards = ShardSet(handles, [], name)
    try:
        answers = ray.get([h.endpoint.remote() for h in handles], timeout=timeout)
    except Exception as exc:
        shards.stop()
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            raise ServerUnavailableError(f"the {num_shards} shards did not all serve within {timeout} s") from exc
        raise
    failed = [(k, failure) for k, (_, failure) in enumerate(answers) if failure is not None]
    if failed:
        shards.stop()
        raise ConfigError("; ".join(f"shard {k} did not start on node {placed[k]['NodeManagerAddress']}: {why}"
                                    for k, why in failed))
    shards.endpoints = [endpoint for endpoint, _ in answers]
    log.info("h5replay: %d shard(s) serving: %s", num_shards, " ".join(shards.endpoints))
    return shards
