"""The `h5replay` commands that copy a replay: `export` (to another replay file, or `--to minari`),
`import` (`--from minari`) and `compact`. `h5replay.cli` adds them to its parser and runs them;
like it, this only parses and calls the library (h5replay.storage, h5replay.integrations.minari).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from h5replay.errors import ConfigError
from h5replay.progress import Progress

__all__ = ["add_commands", "cmd_export", "cmd_import", "cmd_compact"]


def _level(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    return value


def _layout_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--compression", choices=("gzip", "lzf", "none"),
                   help="compression of every dataset, zstd and lz4 leaves included (default: a copy keeps its "
                        "source's layout, compressed leaves with their codec, level and slot size; else none)")
    p.add_argument("--level", type=_level, help="gzip level 0..9")
    p.add_argument("--chunks", default="auto",
                   help="auto (contiguous when possible, else ~64 KiB of whole rows), or rows per chunk (default auto)")
    p.add_argument("--capacity", default="same", help="rows the copy holds: same, unbounded, or N (default same)")


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add export, import and compact to the `h5replay` subcommands `sub`."""
    export = sub.add_parser("export", parents=[common], help="copy a replay (or plain h5py) file, changing layout or "
                                                             "compression, or write it as a Minari dataset")
    export.add_argument("path", metavar="FILE")
    export.add_argument("out", metavar="OUT", help="the new file, or with --to minari a dataset id "
                                                   "((namespace/)name-vN, under MINARI_DATASETS_PATH)")
    export.add_argument("--to", choices=("h5replay", "minari"), default="h5replay",
                        help="what OUT is (default h5replay; minari needs h5replay[minari])")
    export.add_argument("--overwrite", action="store_true")
    export.add_argument("--new-replay", action="store_true",
                        help="make the copy a new replay (its own replay id, publish count from 0), to serve it beside "
                             "its source; by default it is the same replay, which clients follow when it is served in "
                             "the source's place")
    export.add_argument("--plain", action="store_true",
                        help="write each zstd/lz4 leaf (h5replay's records) as an ordinary dataset through the "
                             "standard HDF5 filter of its codec (hdf5plugin's Zstd, same level; or LZ4), which h5py "
                             "reads after `import hdf5plugin`, without h5replay (needs h5replay[compression]; the "
                             "copy cannot be served with multiprocessing); not with --compression")
    export.add_argument("--skip-missing-finals", action="store_true",
                        help="--to minari: leave out episodes kept without a final observation (by default they "
                             "are refused)")
    _layout_flags(export)

    imported = sub.add_parser("import", parents=[common], help="a new replay file from a local Minari dataset "
                                                               "(needs h5replay[minari])")
    imported.add_argument("source", metavar="DATASET_ID", help="a Minari dataset id, under MINARI_DATASETS_PATH")
    imported.add_argument("out", metavar="FILE")
    imported.add_argument("--from", dest="source_kind", choices=("minari",), default="minari",
                          help="what DATASET_ID is (default minari)")
    imported.add_argument("--overwrite", action="store_true")
    _layout_flags(imported)

    compact = sub.add_parser("compact", parents=[common], help="rewrite a replay file in place (no server may be running)")
    compact.add_argument("path", metavar="FILE")
    _layout_flags(compact)


def _layout_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if args.compression not in (None, "none"):
        kwargs["compression"] = args.compression
        if args.level is not None:
            kwargs["compression_level"] = args.level
    elif args.level is not None:
        raise ConfigError("--level needs --compression gzip")
    elif args.compression == "none":
        kwargs["compression"] = None  # asked for: a copy's zstd and lz4 leaves are no longer kept either
    if args.chunks != "auto":
        try:
            kwargs["chunks"] = (int(args.chunks),)
        except ValueError:
            raise ConfigError(f"--chunks must be auto or a number of rows, got {args.chunks!r}") from None
    if args.capacity == "unbounded":
        kwargs["capacity"] = None
    elif args.capacity != "same":
        try:
            kwargs["capacity"] = int(args.capacity)
        except ValueError:
            raise ConfigError(f"--capacity must be same, unbounded or a number, got {args.capacity!r}") from None
    return kwargs


def _minari() -> Any:
    try:
        from h5replay.integrations import minari
    except ImportError as exc:
        raise ConfigError(str(exc)) from exc
    return minari


def cmd_export(args: argparse.Namespace) -> int:
    if args.to == "minari":
        return _export_minari(args)
    from h5replay.storage import export_file

    if args.skip_missing_finals:
        raise ConfigError("--skip-missing-finals applies to --to minari")
    if args.plain and args.compression is not None:
        raise ConfigError(f"--plain writes each compressed leaf through the standard HDF5 filter of its own codec; "
                          f"leave out --compression {args.compression}")
    if os.path.exists(args.out) and not args.overwrite:
        raise ConfigError(f"{args.out!r} already exists; pass --overwrite to replace it")
    export_file(args.path, args.out, overwrite=args.overwrite, progress=Progress("export"), new_replay=args.new_replay,
                plain=args.plain, **_layout_kwargs(args))
    print(f"wrote {args.out}")
    return 0


def _export_minari(args: argparse.Namespace) -> int:
    given = [flag for flag, value in (("--new-replay", args.new_replay), ("--plain", args.plain),
                                      ("--compression", args.compression is not None),
                                      ("--level", args.level is not None), ("--chunks", args.chunks != "auto"),
                                      ("--capacity", args.capacity != "same")) if value]
    if given:
        raise ConfigError(f"{', '.join(given)} apply to a replay file, not to --to minari")
    from h5replay.storage import ReplayBuffer

    with ReplayBuffer.load_from(args.path) as rb:
        dataset = _minari().to_minari(rb, args.out, overwrite=args.overwrite, progress=Progress("export", "episodes"),
                                      missing_final="skip" if args.skip_missing_finals else "error")
    print(f"wrote Minari dataset {args.out} ({dataset.total_episodes} episodes, {dataset.total_steps} steps) at "
          f"{dataset.storage.data_path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    kwargs = _layout_kwargs(args)
    capacity = kwargs.pop("capacity", None)
    with _minari().from_minari(args.source, args.out, capacity=capacity, overwrite=args.overwrite,
                               progress=Progress("import", "episodes"), **kwargs) as rb:
        print(f"wrote {args.out} ({rb.num_episodes} episodes, {len(rb)} rows)")
    return 0


def cmd_compact(args: argparse.Namespace) -> int:
    from h5replay.storage import compact_file

    before = os.path.getsize(args.path)
    compact_file(args.path, progress=Progress("compact"), **_layout_kwargs(args))
    print(f"{args.path}: {before / 1e6:.1f} MB -> {os.path.getsize(args.path) / 1e6:.1f} MB")
    return 0
