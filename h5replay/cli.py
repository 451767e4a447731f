"""The `h5replay` command: parse, build the config, call the library. Logs go to stderr.

Exit codes: 0 success, 1 failure, 2 bad usage. Errors are one line unless `--debug`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import typing
from collections.abc import Sequence
from typing import Any

from h5replay import __version__
from h5replay.cli_export import add_commands as add_export_commands
from h5replay.cli_export import cmd_compact, cmd_export, cmd_import
from h5replay.config import DEFAULT_ENDPOINT, MAX_SECONDS, ServerConfig, check_seconds
from h5replay.errors import ConfigError, H5ReplayError

__all__ = ["main", "build_parser"]

log = logging.getLogger("h5replay")


class UsageError(Exception):
    """Bad usage: exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (as every other error here) instead of the whole
    usage block, which buries the one line that says what is wrong."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def _int_at_least(lowest: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lowest:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {lowest}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _byte_size(text: str) -> int:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.strip().upper().rstrip("B"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * units[unit])
    except (ValueError, OverflowError):  # not a number, NaN, or infinite
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes (e.g. 500M, 1G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _number(text: str) -> float:
    """A finite float: NaN and infinities are refused here, not deep inside the server."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number")
    return value


def _seconds(text: str, zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    try:
        check_seconds("the value", value, zero=zero)
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number of seconds {'>=' if zero else '>'} 0, "
                                         f"at most {MAX_SECONDS:g}") from None
    return value


def _seconds_or_zero(text: str) -> float:
    return _seconds(text, zero=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="h5replay", description="An HDF5 experience store for reinforcement learning.")
    parser.add_argument("--version", action="version", version=f"h5replay {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    # Every subcommand takes --debug too, so it works after the subcommand's name as well; SUPPRESS
    # leaves the value of a --debug given before the name in place.
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks and debug logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    serve = sub.add_parser("serve", parents=[common], help="serve a replay file to actors and learners")
    serve.add_argument("path", metavar="PATH", help="the HDF5 file (created when missing)")
    serve.add_argument("--space", metavar="SPACE.json",
                       help="space of a new file, a JSON file (`h5replay space`); an existing file must have it")
    size = serve.add_mutually_exclusive_group()
    size.add_argument("--capacity", type=_positive_int, metavar="N",
                      help="rows the file holds, a ring (needed for a new file; an existing one must have it)")
    size.add_argument("--unbounded", action="store_true", help="a new file that grows without limit")
    serve.add_argument("--bind", default=DEFAULT_ENDPOINT, help=f"actors' endpoint (default {DEFAULT_ENDPOINT})")
    serve.add_argument("--read-bind", help="learners' endpoint (default: the next port; any free port when --bind has port 0; <ipc path>.read)")
    serve.add_argument("--advertise-read", metavar="ENDPOINT",
                       help="read endpoint told to learners, when --read-bind is not reachable as written "
                            "(e.g. tcp://server:5556 for a bind on 0.0.0.0 in a container)")
    serve.add_argument("--readers", type=_non_negative_int, default=1, metavar="K",
                       help="reader processes serving learners (default 1; 0: the writer serves reads)")
    serve.add_argument("--fsync", action="store_true", help="fsync every commit (survives power loss; slower)")
    serve.add_argument("--no-check-bounds", dest="check_bounds", action="store_false",
                       help="store Box values outside the space's low/high bounds, and NaN (by default they are "
                            "refused as gymnasium's Box.contains would: NaN even where the bounds are infinite)")
    serve.add_argument("--metrics-port", type=_positive_int, metavar="P",
                       help="serve Prometheus metrics on http://ADDRESS:P/metrics (needs h5replay[metrics])")
    serve.add_argument("--metrics-address", default="127.0.0.1", help="address of the metrics port (default 127.0.0.1)")
    serve.add_argument("--auth", metavar="DIR", help="accept only CURVE keys listed in DIR/actors and DIR/learners")
    serve.add_argument("--insecure", action="store_true", help="allow binding beyond loopback without --auth")
    sampling = serve.add_argument_group("sampling (a new file; an existing one keeps its own)")
    sampling.add_argument("--sampler", choices=("uniform", "prioritized", "fifo", "lifo", "recency"),
                          help="how rows are drawn (default uniform)")
    sampling.add_argument("--half-life", type=_number, metavar="N",
                          help="recency: a row N rows older is half as likely (DreamerV3's recency selector)")
    sampling.add_argument("--tables", metavar="FILE",
                          help="several tables over one file: a JSON object of table name to settings with the "
                               "flags' names (sampler, priority_exponent, initial_priority, half_life, components, "
                               "min_size_to_sample, samples_per_insert, error_buffer, max_times_sampled); not with "
                               "the single-table flags")
    sampling.add_argument("--priority-exponent", type=_number, metavar="A",
                          help="prioritized: probability ~ priority ** A (default 0.6)")
    sampling.add_argument("--initial-priority", type=_number, metavar="P",
                          help="prioritized: the priority of a row given none (default: the largest so far)")
    sampling.add_argument("--min-size-to-sample", type=_positive_int, metavar="N",
                          help="samples wait until N rows are held (Reverb's MinSize; default 1: no wait). A rate "
                               "limit sends every sample through the writer, not the reader processes, and a sample "
                               "waits up to the client's rate_limit_timeout (60 s), then RateLimitedError")
    sampling.add_argument("--samples-per-insert", type=_number, metavar="R",
                          help="keep rows sampled / rows inserted near R (Reverb's SampleToInsertRatio; default: no "
                               "ratio)")
    sampling.add_argument("--error-buffer", type=_number, metavar="E",
                          help="how far sampling may run ahead of or behind R (needed with --samples-per-insert: no "
                               "default; at least max(1, R))")
    sampling.add_argument("--max-times-sampled", type=_non_negative_int, metavar="K",
                          help="a row sampled K times is removed (fifo and 1: a queue; default 0: never)")
    sampling.add_argument("--priority-publish-interval", type=_seconds_or_zero, default=0.0, metavar="S",
                          help="let priority updates wait up to S seconds for a publish (fewer flushes, e.g. "
                               "with --fsync; a SIGKILL loses at most that long of them; default 0: every pass)")
    serve.add_argument("--observation-keys", nargs="+", metavar="KEY", help="a new file: the space's observation "
                       "keys (episodes keep a final observation; learners draw n-step transitions)")
    serve.add_argument("--compression", nargs="+", metavar="LEAF=CODEC[:LEVEL]", type=_compression_flag,
                       help="a new file: store these leaves compressed, e.g. obs/image=zstd:3 or obs=lz4 (lossless; "
                            "zstd or lz4, needs pip install 'h5replay[compression]'); learners receive the records as "
                            "stored and decode them; an existing file keeps its own")
    serve.add_argument("--compression-slot", nargs="+", metavar="LEAF=SIZE", type=_slot_flag,
                       help="a new file: the slot of a compressed row, as a fraction of a raw row (0.125, the "
                            "default) or in bytes; a record that does not fit goes to the leaf's spill area")
    serve.add_argument("--idempotency-window", type=_positive_int, metavar="N",
                       help="a new file remembers the idempotency keys of its last N episodes (default 65536): a "
                            "commit retried later than N episodes is stored again; an existing file keeps its own")
    serve.add_argument("--heartbeat-timeout", type=_seconds, default=5.0, metavar="S",
                       help="drop a client whose connection is silent this long (default 5)")
    serve.add_argument("--session-timeout", type=_seconds, default=300.0, metavar="S",
                       help="abort the open segments of a client idle this long (default 300)")
    serve.add_argument("--idle-timeout", type=_seconds, default=30.0, metavar="S",
                       help="forget a client with no open segment idle this long, freeing its slot (default 30)")
    serve.add_argument("--max-clients-per-key", type=_positive_int, default=64, metavar="N",
                       help="with --auth: clients one key may have connected at once, on the writer's endpoint "
                            "and on the learners' (default 64)")
    serve.add_argument("--actor-slots", type=_non_negative_int, metavar="N",
                       help="with --auth: client slots only actor keys may take (default: a quarter of them)")
    serve.add_argument("--min-free-bytes", type=_byte_size, metavar="N",
                       help="free space the disk must keep: below it new rows are refused (DiskFullError), reads go "
                            "on, writes resume once space is freed (default: 1G or 5%% of the file system, the "
                            "smaller; suffixes K, M, G)")
    serve.add_argument("--open-timeout", type=_seconds, default=30.0, metavar="S",
                       help="give up opening a file (a damaged one keeps HDF5 retrying) after this long (default 30)")

    ping = sub.add_parser("ping", parents=[common], help="exit 0 when a server answers")
    ping.add_argument("endpoint", metavar="ENDPOINT")
    ping.add_argument("--timeout", type=_seconds, default=2.0, help="seconds to wait for an answer (default 2)")
    ping.add_argument("--secret-key", metavar="FILE", help="a client's CURVE secret key file (with --auth)")
    ping.add_argument("--server-key", metavar="FILE", help="the server's CURVE public key file (with --auth)")

    stats = sub.add_parser("stats", parents=[common], help="live figures of a server: ingest, sampling by table, "
                           "storage, clients")
    stats.add_argument("endpoint", metavar="ENDPOINT")
    stats.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for an answer (default 5)")
    stats.add_argument("--interval", type=_seconds, default=1.0,
                       help="seconds between the two snapshots the rates are taken over (default 1)")
    stats.add_argument("--json", action="store_true", help="print JSON (with --watch: a line per interval)")
    stats.add_argument("--watch", action="store_true", help="refresh every interval until Ctrl-C")
    stats.add_argument("--secret-key", metavar="FILE", help="a client's CURVE secret key file (with --auth)")
    stats.add_argument("--server-key", metavar="FILE", help="the server's CURVE public key file (with --auth)")

    info = sub.add_parser("info", parents=[common], help="what a replay file holds: space, length, episodes, layout, bytes")
    info.add_argument("path", metavar="FILE")
    info.add_argument("--json", action="store_true", help="print JSON")
    info.add_argument("--open-timeout", type=_seconds, default=30.0, metavar="S",
                      help="give up opening a file (a damaged one keeps HDF5 retrying) after this long (default 30)")

    keys = sub.add_parser("keys", parents=[common], help="CURVE keys for --auth")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION")
    keys_sub.required = True
    generate = keys_sub.add_parser("generate", parents=[common], help="make server, actor and learner key pairs in DIR")
    generate.add_argument("directory", metavar="DIR")

    def client_keys(p: argparse.ArgumentParser) -> None:
        p.add_argument("--secret-key", metavar="FILE", help="this client's CURVE secret key file (with --auth)")
        p.add_argument("--server-key", metavar="FILE", help="the server's CURVE public key file (with --auth)")
        p.add_argument("--timeout", type=_seconds, default=30.0, help="seconds to wait for the server (default 30)")

    actor = sub.add_parser("actor", parents=[common], help="example actor: a gymnasium environment with a random policy")
    actor.add_argument("endpoint", metavar="ENDPOINT", nargs="+",
                       help="the server's endpoint; several: shards, the actor writes to one and fails over")
    actor.add_argument("--env", default="CartPole-v1", help="gymnasium environment id (default CartPole-v1)")
    actor.add_argument("--episodes", type=_non_negative_int, default=0, help="episodes to send (0: until SIGTERM)")
    actor.add_argument("--seed", type=int, default=None)
    actor.add_argument("--pixels", action="store_true", help="observe rendered frames, 64x96x3 uint8 (needs pygame)")
    actor.add_argument("--log-every", type=_non_negative_int, default=100, metavar="N",
                       help="log a line every N episodes (0: never; default 100)")
    client_keys(actor)

    learner = sub.add_parser("learner", parents=[common], help="example learner: samples and prints what it learns of the data")
    learner.add_argument("endpoint", metavar="ENDPOINT", nargs="+",
                         help="the server's endpoint; several: shards, the learner samples all of them")
    learner.add_argument("--batch-size", type=_positive_int, default=256, help="rows per sample (default 256)")
    learner.add_argument("--seconds", type=_seconds_or_zero, default=0.0, help="how long to run (0: until SIGTERM)")
    learner.add_argument("--report-every", type=_seconds, default=5.0,
                         help="seconds between reports of what was sampled (default 5)")
    client_keys(learner)

    space = sub.add_parser("space", parents=[common], help="print a row space as JSON, for `serve --space`")
    space_sub = space.add_subparsers(dest="space_command", metavar="SOURCE")
    space_sub.required = True
    gym = space_sub.add_parser("gym", parents=[common], help="rows of a gymnasium environment (obs, action, reward, flags)")
    gym.add_argument("env_id", metavar="ENV_ID")
    gym.add_argument("--pixels", action="store_true", help="the space of `h5replay actor --pixels`")
    python = space_sub.add_parser("python", parents=[common], help="a space object of yours: MODULE:ATTR (a Space, a gymnasium "
                                                  "space, or a function of no arguments returning one)")
    python.add_argument("target", metavar="MODULE:ATTR", help="e.g. mypackage.spaces:ROW_SPACE (the current "
                                                              "directory is importable)")

    add_export_commands(sub, common)

    ray = sub.add_parser("ray", parents=[common], help="h5replay shards on a running Ray cluster (needs h5replay[ray])")
    ray_sub = ray.add_subparsers(dest="ray_command", metavar="ACTION")
    ray_sub.required = True
    ray_start = ray_sub.add_parser("start", parents=[common], help="start one server per node (detached); print the endpoints")
    ray_start.add_argument("--shards", type=_positive_int, required=True, metavar="N", help="how many servers")
    ray_start.add_argument("--directory", required=True, metavar="DIR",
                           help="a folder on each node's local disk; shard k serves DIR/shard-k.h5")
    ray_start.add_argument("--space", metavar="SPACE.json", help="space of new files (`h5replay space`)")
    ray_size = ray_start.add_mutually_exclusive_group()
    ray_size.add_argument("--capacity", type=_positive_int, metavar="N", help="rows each new file holds, a ring")
    ray_size.add_argument("--unbounded", action="store_true", help="new files grow without limit")
    ray_start.add_argument("--spread", action="store_true",
                           help="allow several shards per node (round the nodes); default: one per node")
    ray_start.add_argument("--host", help="address to bind (default: each node's IP as Ray knows it)")
    ray_start.add_argument("--readers", type=_non_negative_int, default=1, metavar="K",
                           help="reader processes per shard (default 1)")
    ray_start.add_argument("--fsync", action="store_true", help="fsync every commit")
    ray_start.add_argument("--no-check-bounds", dest="check_bounds", action="store_false",
                           help="store Box values outside the space's bounds, and NaN (see `serve --no-check-bounds`; "
                                "default: refuse them)")
    ray_start.add_argument("--idempotency-window", type=_positive_int, metavar="N",
                           help="new files remember the idempotency keys of their last N episodes (default 65536)")
    ray_start.add_argument("--auth", metavar="DIR", help="CURVE keys, in DIR on every node (see `serve --auth`)")
    ray_start.add_argument("--insecure", action="store_true",
                           help="bind the nodes' IPs without --auth (Ray's own network is trusted anyway)")
    ray_start.add_argument("--json", action="store_true", help="print the shards' details as JSON")
    for p in (ray_start, ray_sub.add_parser("endpoints", parents=[common], help="print the endpoints of running shards"),
              ray_sub.add_parser("stop", parents=[common], help="stop the shards (each flushes and closes its file)")):
        p.add_argument("--address", default="auto", help="the Ray cluster (default auto: the one this node belongs to)")
        p.add_argument("--name", default="h5replay", help="name of the shards' Ray actors (default h5replay)")

    demo = sub.add_parser("demo", parents=[common], help="start a server, actors and a learner on an embedded default")
    demo.add_argument("--actors", type=_positive_int, default=4, help="actor processes (default 4)")
    demo.add_argument("--episodes", type=_positive_int, default=40, help="episodes per actor (default 40)")
    demo.add_argument("--dir", help="keep the demo file in this directory (default: a temporary one)")
    return parser


def _load_space(path: str) -> Any:
    from h5replay.spaces import space_from_json

    try:
        with open(path, encoding="utf-8") as fh:
            return space_from_json(json.load(fh))
    except OSError as exc:
        raise ConfigError(f"cannot read the space file {path!r}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path!r} is not valid JSON: {exc}") from exc


def _observation_keys(args: argparse.Namespace) -> tuple[str, ...] | None:
    """`--observation-keys`, else those the --space file declares (None: neither)."""
    from h5replay.transitions import declared_observation_keys

    given = tuple(args.observation_keys or ())
    return given or (declared_observation_keys(args.space) if args.space else None)


def _describe_existing(path: str, open_timeout: float) -> dict[str, Any] | None:
    """What `info` says of an existing file, or None when it cannot be read before a server opens it
    (a file a killed server left behind is recovered by the server itself, and the server says
    what is wrong with a damaged one)."""
    from h5replay.storage.inspect import describe_file

    try:
        return describe_file(path, open_timeout)
    except (H5ReplayError, OSError):
        return None


def _compression_flag(text: str) -> tuple[str, str, int | None]:
    """LEAF=CODEC[:LEVEL] -> (leaf, codec, level)."""
    leaf, sep, codec = text.partition("=")
    name, _, level = codec.partition(":")
    if not sep or not leaf or not name:
        raise argparse.ArgumentTypeError(f"expected LEAF=CODEC[:LEVEL] (e.g. obs/image=zstd:3), got {text!r}")
    try:
        return leaf, name, int(level) if level else None
    except ValueError:
        raise argparse.ArgumentTypeError(f"the level in {text!r} must be an int") from None


def _slot_flag(text: str) -> tuple[str, float | int]:
    """LEAF=FRACTION or LEAF=BYTES -> (leaf, size)."""
    leaf, sep, size = text.partition("=")
    try:
        value: float | int = int(size) if size.isdigit() else float(size)
    except ValueError:
        value = -1
    if not sep or not leaf or value <= 0:
        raise argparse.ArgumentTypeError(f"expected LEAF=FRACTION (0.25) or LEAF=BYTES (4096), got {text!r}")
    return leaf, value


def _compression_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The storage options --compression and --compression-slot give (the storage checks them)."""
    out: dict[str, Any] = {}
    flags = args.compression or []
    if flags:
        out["compression"] = {leaf: codec for leaf, codec, _ in flags}
        levels = {leaf: level for leaf, _, level in flags if level is not None}
        if levels:
            out["compression_level"] = levels
    if args.compression_slot:
        out["compression_slot"] = dict(args.compression_slot)
    return out


def _check_serve_args(args: argparse.Namespace) -> None:
    """A new file needs its size said; an existing one must be a replay file (and as big as said).
    The server itself refuses a --space or --capacity other than an existing file's."""
    if not os.path.exists(args.path):
        if args.capacity is None and not args.unbounded:
            raise UsageError(f"{args.path!r} does not exist; creating it needs --capacity N (rows it holds, a ring) "
                             "or --unbounded")
        return
    description = _describe_existing(args.path, args.open_timeout)
    if description is None:
        return
    if "replay" not in description:
        raise ConfigError(f"{args.path!r} is an HDF5 file but not a replay file (it has no episode table); copy its "
                          f"rows into one with `h5replay export {args.path} OUT.h5`, then serve OUT.h5")
    if args.unbounded and description["capacity"] is not None:
        raise ConfigError(f"{args.path!r} exists with capacity {description['capacity']}, not unbounded; drop "
                          "--unbounded (it is for a new file) or give a new path")


_TABLE_FLAGS = ("sampler", "priority_exponent", "initial_priority", "half_life", "min_size_to_sample",
                "samples_per_insert", "error_buffer", "max_times_sampled")


def _sampling_config(args: argparse.Namespace) -> Any:
    """The one table the flags give, or None when none was given."""
    from h5replay.sampling import table_from_settings

    given = {name: getattr(args, name) for name in _TABLE_FLAGS if getattr(args, name) is not None}
    if not given:
        return None
    if args.tables is not None:
        raise UsageError(f"--tables gives every table's settings: leave out --{next(iter(given)).replace('_', '-')}")
    try:
        return table_from_settings(given)
    except ConfigError as exc:  # in the flags' own words
        raise UsageError(str(exc).replace("table 'default': ", "").replace("_", "-")) from None


def _tables_config(args: argparse.Namespace) -> Any:
    """The tables a --tables file gives (None: no --tables)."""
    from h5replay.sampling import tables_from_settings

    if args.tables is None:
        return None
    try:
        with open(args.tables, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--tables {args.tables!r}: cannot read it: {exc.strerror or exc}") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"--tables {args.tables!r} is not JSON: {exc}") from None
    try:
        return tables_from_settings(obj)
    except ConfigError as exc:
        raise ConfigError(f"--tables {args.tables!r}: {exc}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from h5replay.server import Server

    _check_serve_args(args)
    config = ServerConfig(
        path=args.path,
        space=_load_space(args.space) if args.space else None,
        capacity=args.capacity,
        bind=args.bind,
        read_bind=args.read_bind,
        advertise_read=args.advertise_read,
        num_readers=args.readers,
        fsync=args.fsync,
        priority_publish_interval=args.priority_publish_interval,
        metrics_port=args.metrics_port,
        metrics_address=args.metrics_address,
        auth_dir=args.auth,
        insecure=args.insecure,
        heartbeat_timeout=args.heartbeat_timeout,
        session_timeout=args.session_timeout,
        open_timeout=args.open_timeout,
        min_free_bytes=args.min_free_bytes,
        idle_timeout=args.idle_timeout,
        max_clients_per_key=args.max_clients_per_key,
        actor_slots=args.actor_slots,
        sampling=_sampling_config(args), tables=_tables_config(args),
        check_bounds=args.check_bounds,
        idempotency_window=args.idempotency_window,
        observation_keys=_observation_keys(args),
        storage_kwargs=_compression_kwargs(args),
    )
    return Server(config).run()


def _connection(endpoint: str, timeout: float, secret_key: str | None = None, server_key: str | None = None) -> Any:
    from h5replay.client._connection import Connection, curve_keys
    from h5replay.config import ClientConfig

    return Connection(endpoint, ClientConfig(endpoint=endpoint, timeout=timeout, name="h5replay-cli"),
                      curve=curve_keys(secret_key, server_key))


def cmd_ping(args: argparse.Namespace) -> int:
    from h5replay import protocol as P

    conn = _connection(args.endpoint, args.timeout, args.secret_key, args.server_key)
    try:
        started = time.perf_counter()
        conn.request(lambda rid: P.Heartbeat(rid))
        print(f"{args.endpoint} answered in {(time.perf_counter() - started) * 1000:.1f} ms")
    finally:
        conn.close()
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    from h5replay import protocol as P
    from h5replay.cli_stats import run_stats

    conn = _connection(args.endpoint, args.timeout, args.secret_key, args.server_key)
    try:
        return run_stats(args.endpoint, lambda: dict(conn.request(lambda rid: P.Info(rid)).stats),
                         interval=args.interval, as_json=args.json, watch=args.watch)
    finally:
        conn.close()


def cmd_info(args: argparse.Namespace) -> int:
    from h5replay.storage.inspect import describe_file, format_description

    if args.path.startswith(("tcp://", "ipc://")):
        raise UsageError(f"info reads a file; for the server at {args.path} run `h5replay stats {args.path}`")
    description = describe_file(args.path, args.open_timeout)
    # A fixed-capacity file is as long as its capacity from the start, but sparse: rows not yet
    # written take no disk space. Say what the disk holds, next to the length.
    description["disk_bytes"] = os.stat(args.path).st_blocks * 512
    if args.json:
        print(json.dumps(description, indent=2))
        return 0
    lines = format_description(description).splitlines()
    if description["disk_bytes"] < description["file_bytes"]:
        lines.insert(1, f"on disk   {description['disk_bytes'] / 1e6:.1f} MB (sparse: unwritten rows take no space; "
                        "the figures per dataset below are what the rows will take)")
    print("\n".join(lines))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from h5replay.server.auth import generate_keys

    for path in generate_keys(args.directory):
        print(path)
    print(f"serve with: h5replay serve FILE --auth {args.directory}; clients use secret_key=.../actor.key_secret "
          f"(or learner.key_secret) and server_key={args.directory}/server.key", file=sys.stderr)
    return 0


def cmd_actor(args: argparse.Namespace) -> int:
    from h5replay.examples.gym_actor import run_actor

    return run_actor(args.endpoint, env_id=args.env, episodes=args.episodes, seed=args.seed, timeout=args.timeout,
                     secret_key=args.secret_key, server_key=args.server_key, pixels=args.pixels,
                     log_every=args.log_every)


def cmd_learner(args: argparse.Namespace) -> int:
    from h5replay.examples.learner import run_learner

    return run_learner(args.endpoint, batch_size=args.batch_size, seconds=args.seconds,
                       report_every=args.report_every, timeout=args.timeout,
                       secret_key=args.secret_key, server_key=args.server_key)


def cmd_ray(args: argparse.Namespace) -> int:
    try:
        import ray

        from h5replay.integrations.ray import ShardSet, start_shards
    except ImportError as exc:
        raise ConfigError(f"{exc}") from exc
    if not ray.is_initialized():
        ray.init(address=args.address, logging_level=logging.WARNING)
    if args.ray_command == "stop":
        ShardSet.connect(args.name).stop()
        print(f"stopped the shards {args.name}-*", file=sys.stderr)
        return 0
    if args.ray_command == "endpoints":
        print(" ".join(ShardSet.connect(args.name).endpoints))
        return 0
    options: dict[str, Any] = {"num_readers": args.readers, "fsync": args.fsync, "insecure": args.insecure,
                               "check_bounds": args.check_bounds, "idempotency_window": args.idempotency_window}
    if args.auth:
        options["auth_dir"] = args.auth
    if not args.space and not args.capacity and not args.unbounded:
        log.info("no --space / --capacity: each shard's file must exist already")
    shards = start_shards(args.shards, _load_space(args.space) if args.space else None,
                          None if args.unbounded else args.capacity, args.directory, per_node=not args.spread,
                          host=args.host, name=args.name, **options)
    if args.json:
        print(json.dumps(shards.stats(), indent=2, default=str))
    else:
        print(" ".join(shards.endpoints))
    return 0


def cmd_space(args: argparse.Namespace) -> int:
    if args.space_command == "python":
        print(json.dumps(_python_space(args.target).to_json(), indent=2))
        return 0
    from h5replay.examples.gym_actor import space_json

    print(json.dumps(space_json(args.env_id, pixels=args.pixels), indent=2))
    return 0


def _python_space(target: str) -> Any:
    """The space named by MODULE:ATTR: a Space, a gymnasium space, or a function of no arguments
    returning either. The current directory is importable, as for `python -m`."""
    import importlib
    import inspect

    from h5replay.integrations.gym import space_from_gymnasium
    from h5replay.spaces import Space

    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise UsageError(f"expected MODULE:ATTR (e.g. mypackage.spaces:ROW_SPACE), got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may raise anything while it is imported
        raise ConfigError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if inspect.isroutine(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigError(f"{target}() raised {type(exc).__name__}: {exc}") from exc
    if isinstance(obj, Space):
        return obj
    if type(obj).__module__.startswith("gymnasium."):
        return space_from_gymnasium(obj)
    raise ConfigError(f"{target} is of type {type(obj).__name__!r}, not a space (h5replay.storage.Space or a gymnasium space)")


def cmd_demo(args: argparse.Namespace) -> int:
    from h5replay.demo import run_demo

    return run_demo(num_actors=args.actors, episodes_per_actor=args.episodes, directory=args.dir)


COMMANDS = {
    "serve": cmd_serve, "ping": cmd_ping, "stats": cmd_stats, "info": cmd_info, "keys": cmd_keys, "demo": cmd_demo,
    "actor": cmd_actor, "learner": cmd_learner, "space": cmd_space, "export": cmd_export, "compact": cmd_compact,
    "import": cmd_import, "ray": cmd_ray,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error (or --help)
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, so that a reader gone away (`| head`) is seen below
        return code
    except BrokenPipeError:
        # The reader of our output left (`h5replay info --json FILE | head`): nothing to report.
        # Point stdout at /dev/null so the interpreter's last flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        return 1
    except (ConfigError, UsageError) as exc:
        if args.debug:
            raise
        print(f"h5replay {args.command}: {exc}", file=sys.stderr)
        return 2
    except (H5ReplayError, OSError) as exc:
        if args.debug:
            raise
        print(f"h5replay {args.command}: {exc}", file=sys.stderr)
        return 1
