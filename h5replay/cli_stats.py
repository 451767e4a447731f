"""`h5replay stats`: a server's figures, grouped for people (ingest, sampling by table, storage,
clients) or as JSON for machines, once or refreshed (`--watch`).

Rates come two ways, because one alone misleads: over the last interval ("now", what the server
is doing) and since the server started (what it has done). Asked of a read endpoint, a reader
process answers the file's figures only: the view says so.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from h5replay.sampling import described_tables, table_description

__all__ = ["RATED", "format_stats", "run_stats", "with_rates"]

# Counters given per second, over the interval and since the start.
RATED = ("rows_in", "rows_sampled", "rows_out", "commits", "bytes_in")


def with_rates(first: Mapping[str, Any], second: Mapping[str, Any], wall: float) -> dict[str, Any]:
    """`second` with `<counter>_per_s` (between the two snapshots) and `<counter>_per_s_since_start`."""
    out = dict(second)
    uptimes = (first.get("uptime"), second.get("uptime"))
    elapsed = float(uptimes[1]) - float(uptimes[0]) if None not in uptimes else wall  # type: ignore[arg-type]
    elapsed = max(elapsed, 1e-9)
    uptime = second.get("uptime")
    for name in RATED:
        now, before = second.get(name), first.get(name)
        if isinstance(now, int) and isinstance(before, int):
            out[f"{name}_per_s"] = round((now - before) / elapsed, 1)
            if isinstance(uptime, (int, float)) and uptime > 0:
                out[f"{name}_per_s_since_start"] = round(now / uptime, 1)
    return out


def _count(value: Any) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _bytes(value: Any) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}"
    return f"{int(value)} B"


def _rated(s: Mapping[str, Any], name: str, shown: Callable[[Any], str] = _count) -> str:
    """A counter, with its rate now and since the start when they are known."""
    text = shown(s.get(name))
    now, since = s.get(f"{name}_per_s"), s.get(f"{name}_per_s_since_start")
    if now is not None:
        text += f"   {shown(now) if shown is _bytes else f'{now:,.1f}'}/s now"
    if since is not None:
        text += f", {shown(since) if shown is _bytes else f'{since:,.1f}'}/s since start"
    return text


def _table_line(t: Mapping[str, Any]) -> str:
    """One table: its sampler, what it may hand out, and its rate limit when one is set."""
    sampler = str(t.get("sampler"))
    if sampler == "prioritized":
        sampler += f" (exponent {t.get('priority_exponent')}, {_count(t.get('priority_updates', 0))} priority updates)"
    parts = [sampler] + ([f"{_count(t['sampleable'])} rows sampleable"] if t.get("sampleable") is not None else [])
    if t.get("max_times_sampled"):
        parts.append(f"a row leaves after {t['max_times_sampled']} samples")
    spi, least = t.get("samples_per_insert"), t.get("min_size_to_sample") or 1
    if spi is not None or least > 1:
        limit = f"rate limit: at least {_count(least)} rows"
        if spi is not None:
            limit += f", {spi} samples per insert +- {t.get('error_buffer')}"
        parts.append(f"{limit}; it counts {_count(t.get('inserted'))} inserted, {_count(t.get('sampled'))} sampled")
    else:
        parts.append("no rate limit")
    return "; ".join(parts)


def format_stats(endpoint: str, s: Mapping[str, Any]) -> str:
    """The grouped, aligned view of one snapshot (with rates: `with_rates`)."""
    lines: list[str] = []

    def group(title: str, rows: list[tuple[str, Any]]) -> None:
        shown = [(label, value) for label, value in rows if value is not None]
        if shown:
            lines.append(title)
            lines.extend(f"  {label:<16} {value}" for label, value in shown)

    reader = s.get("role") == "reader"
    if reader:
        lines.append(f"{endpoint}: a read endpoint. A reader process answers the file's figures only; ingest, "
                     "clients and the rows served are the server's: ask its actor endpoint (serve --bind).")
    else:
        lines.append(f"{endpoint}: h5replay {s.get('server_version', '?')}, up {s.get('uptime', 0):,.1f} s")
        waited = f"{_count(s.get('waiting_inserts'))} (waited {s.get('insert_wait_s', 0.0):.3f} s in all)"
        group("ingest", [
            ("rows in", _rated(s, "rows_in")), ("commits", _rated(s, "commits")),
            ("bytes in", _rated(s, "bytes_in", _bytes)), ("aborts", _count(s.get("aborts"))),
            ("open segments", _count(s.get("open_segments"))), ("inserts waiting", waited),
        ])
        waited = f"{_count(s.get('waiting_samples'))} (waited {s.get('sample_wait_s', 0.0):.3f} s in all)"
        drawn_by = "the writer (a rate limit or removals)" if s.get("writer_samples") else "the readers"
        group("sampling", [
            ("rows sampled", _rated(s, "rows_sampled") + f"   (drawn by {drawn_by})"),
            ("rows sent", _rated(s, "rows_out") + "   (samples and reads by id)"),
            ("read requests", _count(s.get("read_requests"))), ("samples waiting", waited),
        ])
    names: list[str | None] = [*described_tables(s)] or [None]
    lines.append("tables")
    for name in names:
        lines.append(f"  {name or 'default':<16} {_table_line(table_description(s, name))}")
    capacity = s.get("capacity")
    held = _count(s.get("length"))
    if isinstance(capacity, int) and capacity:
        held += f" of {_count(capacity)} ({100 * int(s.get('length') or 0) / capacity:.1f}%)"
    else:
        held += " (unbounded)"
    group("storage", [
        ("rows held", held + f"; {_count(s.get('total_rows'))} added in all"),
        ("episodes", f"{_count(s.get('num_episodes'))} held; {_count(s.get('total_episodes'))} in all"),
        ("file", _bytes(s["file_bytes"]) if "file_bytes" in s else None),
    ])
    if not reader:
        group("clients", [
            ("connected", _count(s.get("clients"))),
            ("requests", f"{_count(s.get('requests'))} to the writer, {_count(s.get('errors'))} refused"),
        ])
    return "\n".join(lines)


def run_stats(endpoint: str, ask: Callable[[], dict[str, Any]], *, interval: float, as_json: bool, watch: bool,
              out: TextIO = sys.stdout) -> int:
    """Print the figures `ask()` gives (one snapshot now, one `interval` later, for the rates);
    with `watch`, again every `interval` until interrupted (Ctrl-C ends it with 0)."""
    started = time.monotonic()
    first = ask()
    try:
        while True:
            time.sleep(interval)
            second = ask()
            now = time.monotonic()
            figures = with_rates(first, second, now - started)
            if as_json:
                print(json.dumps(figures, sort_keys=True, indent=None if watch else 2), file=out, flush=True)
            else:
                if watch and out.isatty():
                    print("\x1b[H\x1b[2J", end="", file=out)  # clear the screen, cursor home
                print(format_stats(endpoint, figures), file=out, flush=True)
                if watch:
                    print(file=out)
            if not watch:
                return 0
            first, started = second, now
    except KeyboardInterrupt:
        return 0
