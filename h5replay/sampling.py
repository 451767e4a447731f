"""How a ReplayBuffer hands out rows: its tables, each a sampler, a rate limit, and how often a
row may be sampled.

Chosen when a file is created and stored in it (reopening restores them):

* `Table(sampler, rate_limit=, max_times_sampled=)`: one way of drawing from the rows; a buffer
  has one or more, by name (`SamplingConfig` is the same class, its earlier name).
* samplers (`h5replay.samplers`, one module each): `Uniform()`; `Prioritized(exponent,
  initial_priority)`, probability proportional to priority ** exponent (Schaul et al. 2016);
  `Fifo()` / `Lifo()`, the oldest / newest rows that may still be sampled, no row twice in a
  batch; `Recency(half_life)`, newer rows likelier; `Mixture({sampler: weight, ...})`.
* `RateLimit(min_size_to_sample, samples_per_insert, error_buffer)`: Reverb's MinSize and
  SampleToInsertRatio, counted in rows. `RateLimiter` is the arithmetic, pure.
* `max_times_sampled`: a row sampled that often is never sampled again (with `Fifo()` and 1,
  the buffer is a queue).

Pure (numpy only, no h5py): clients and the CLI use it too; `h5replay.storage` re-exports it.
The buffer keeps the state (priorities, counters) in its file.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from h5replay.errors import ConfigError
from h5replay.samplers import (
    MAX_WEIGHT,
    Fifo,
    Lifo,
    Mixture,
    Prioritized,
    Recency,
    Sampler,
    Uniform,
    sampler_from_json,
    sampler_to_json,
)
from h5replay.samplers.prioritized import positive_finite

__all__ = ["Uniform", "Prioritized", "Fifo", "Lifo", "Recency", "Mixture", "Sampler", "RateLimit", "RateLimiter", "SamplingConfig",
           "sampler_from_json", "sampler_to_json", "rate_limit_from_json", "rate_limit_to_json",
           "rows_at_once", "MAX_WEIGHT", "Table", "DEFAULT_TABLE", "MAX_TABLES",
           "check_table_name", "check_tables", "table_from_json", "describe_tables",
           "table_description", "described_tables", "described_samplers", "table_from_settings", "tables_from_settings", "SETTINGS"]

_UNIFORM = Uniform()


@dataclass(frozen=True)
class RateLimit:
    """Reverb's rate limiters, counted in rows.

    Sampling waits until `min_size_to_sample` rows are held. With `samples_per_insert` R, the
    buffer keeps `inserted * R - sampled` within `min_size_to_sample * R +- error_buffer`: a
    sample that would take it below waits for inserts, an insert that would take it above waits
    for samples (Reverb's SampleToInsertRatio). `error_buffer` must leave room for a batch:
    a request bigger than the whole window is refused at once, never left to wait forever.
    """

    min_size_to_sample: int = 1
    samples_per_insert: float | None = None
    error_buffer: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.min_size_to_sample, bool) or not isinstance(self.min_size_to_sample, int) \
                or self.min_size_to_sample < 1:
            raise ConfigError(f"min_size_to_sample must be an int >= 1, got {self.min_size_to_sample!r}")
        if self.samples_per_insert is None:
            if self.error_buffer is not None:
                raise ConfigError("error_buffer goes with samples_per_insert; give both or neither")
            return
        if not positive_finite(self.samples_per_insert):
            raise ConfigError(f"samples_per_insert must be a finite number > 0, got {self.samples_per_insert!r}")
        if self.error_buffer is None or not positive_finite(self.error_buffer):
            raise ConfigError(f"samples_per_insert needs an error_buffer, a finite number > 0, got {self.error_buffer!r}")
        if self.error_buffer < max(1.0, self.samples_per_insert):
            raise ConfigError(f"error_buffer {self.error_buffer} is below max(1, samples_per_insert="
                              f"{self.samples_per_insert}): no single row could be inserted or sampled")

    @property
    def active(self) -> bool:
        return self.min_size_to_sample > 1 or self.samples_per_insert is not None

    @classmethod
    def queue(cls, size: int) -> RateLimit:
        """Reverb's Queue limiter: inserts wait while `size` rows are held unsampled, samples wait
        while none is. With `Fifo()` and `max_times_sampled=1`, a lossless queue of `size` rows
        (give the buffer a capacity of at least `size`)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ConfigError(f"a queue's size must be an int >= 2, got {size!r}")
        return cls(min_size_to_sample=1, samples_per_insert=1.0, error_buffer=float(size - 1))


def rows_at_once(description: Any, *, sampling: bool) -> int | None:
    """The most rows one insert (or sample) may move under the rate limit a server describes (its
    hello's `sampling`, `SamplingConfig.describe()`), or None when it has no ratio limit: what a
    client puts in one message at most, so that the server never refuses it as too big.

    A description that is not a valid rate limit (a newer or a lying server) bounds nothing. A
    server of several tables (`describe_tables`): an insert goes to every table, so the least of
    theirs; a sample, the table's own (give `table_description(...)`)."""
    if not isinstance(description, dict):
        return None
    names = described_tables(description)
    if len(names) > 1 and not sampling:
        bounds = [rows_at_once(table_description(description, name), sampling=False) for name in names]
        known = [b for b in bounds if b is not None]
        return min(known) if known else None
    try:
        limit = RateLimit(description.get("min_size_to_sample"), description.get("samples_per_insert"),  # type: ignore[arg-type]
                          description.get("error_buffer"))
    except (ConfigError, TypeError):
        return None
    if limit.samples_per_insert is None:
        return None
    return RateLimiter(limit).max_rows(sampling)


def rate_limit_to_json(limit: RateLimit) -> str:
    return json.dumps(asdict(limit))


def rate_limit_from_json(text: str) -> RateLimit:
    try:
        return RateLimit(**json.loads(text))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"unknown rate limit description {text!r}: {exc}") from exc


class RateLimiter:
    """The arithmetic of a RateLimit over the counters (inserted rows, sampled rows, rows held)."""

    def __init__(self, limit: RateLimit) -> None:
        self.limit = limit
        spi = limit.samples_per_insert
        if spi is None:
            self.min_diff, self.max_diff = -math.inf, math.inf
        else:
            offset = spi * limit.min_size_to_sample
            self.min_diff = offset - float(limit.error_buffer or 0.0)
            self.max_diff = offset + float(limit.error_buffer or 0.0)

    def _diff(self, inserted: int, sampled: int) -> float:
        return inserted * (self.limit.samples_per_insert or 0.0) - sampled

    def sample_blocker(self, rows: int, inserted: int, sampled: int, held: int) -> str | None:
        """Why sampling `rows` rows must wait now (None: it may go ahead)."""
        if held < self.limit.min_size_to_sample:
            return (f"the buffer holds {held} rows, fewer than min_size_to_sample={self.limit.min_size_to_sample}: "
                    f"inserts are behind by {self.limit.min_size_to_sample - held} rows")
        if self.limit.samples_per_insert is None:
            return None
        after = self._diff(inserted, sampled + rows)
        if after < self.min_diff:
            behind = (self.min_diff - after) / self.limit.samples_per_insert
            return (f"sampling is ahead of inserts: {sampled} rows sampled for {inserted} inserted at "
                    f"samples_per_insert={self.limit.samples_per_insert}; {rows} more need about {math.ceil(behind)} "
                    "more inserted rows")
        return None

    def insert_blocker(self, rows: int, inserted: int, sampled: int, held: int) -> str | None:
        """Why inserting `rows` rows must wait now (None: it may go ahead)."""
        if self.limit.samples_per_insert is None or held + rows <= self.limit.min_size_to_sample:
            return None
        after = self._diff(inserted + rows, sampled)
        if after > self.max_diff:
            return (f"inserts are ahead of sampling: {inserted} rows inserted for {sampled} sampled at "
                    f"samples_per_insert={self.limit.samples_per_insert}; {rows} more need about "
                    f"{math.ceil(after - self.max_diff)} more sampled rows")
        return None

    def never(self, rows: int, sampling: bool, inserted: int, sampled: int, held: int) -> str | None:
        """Why a request of `rows` can never go ahead, however long it waits (None: it can), from
        the counters now. Inserts raise the balance `inserted * R - sampled` and samples lower it,
        each within the window [min_diff, max_diff]; a balance outside the window (the start, below
        it) only moves towards it. So the most an insert can ever add is `max_diff - min(now,
        min_diff)`, and the most a sample can take `max(now, max_diff) - min_diff`; an insert that
        keeps the rows held within `min_size_to_sample` is never limited at all."""
        spi = self.limit.samples_per_insert
        if spi is None:
            return None
        now = self._diff(inserted, sampled)
        if sampling:
            room = max(now, self.max_diff) - self.min_diff
            need = float(rows)
        else:
            if held + rows <= self.limit.min_size_to_sample:
                return None
            room = self.max_diff - min(now, self.min_diff)
            need = rows * spi
        if need <= room:
            return None
        side = "sample" if sampling else "insert"
        window = self.max_diff - self.min_diff
        return (f"{'a' if sampling else 'an'} {side} of {rows} rows moves the sample/insert balance by {need:g}, more "
                f"than the whole window allows ({room:g}; 2 * error_buffer = {window:g}, more before min_size_to_sample "
                f"rows are held): raise error_buffer or {side} fewer rows at a time (at most "
                f"{self.max_rows(sampling)} can always go)")

    def max_rows(self, sampling: bool) -> int:
        """The most rows one sample (or insert) should carry: `error_buffer` rows sampled, or
        `error_buffer / samples_per_insert` inserted. The limit admits that much from any state
        learners and actors can reach, even at the start, before anything can be sampled (the
        balance is then at most `min_size_to_sample * R`, so `error_buffer` of room is left); the
        whole window only once samples can bring the balance down. A client sizes its messages
        by it, so that every message it sends can go ahead once the other side has moved."""
        spi = self.limit.samples_per_insert
        if spi is None:
            return 2**62
        room = float(self.limit.error_buffer or 0.0)
        if sampling:
            return max(1, int(math.floor(room)))
        rows = int(math.floor(room / spi))
        while rows > 1 and rows * spi > room:  # the floor of a quotient that was rounded up
            rows -= 1
        return max(1, rows)


@dataclass(frozen=True, init=False)
class Table:
    """One way of sampling a buffer's rows: a sampler, its rate limit, and how often a row may be
    sampled (`max_times_sampled`; None or 0: any number of times). A buffer has one or more,
    by name, fixed when its file is created; they draw from the same rows (Reverb's tables over
    one item store)."""

    sampler: Sampler
    rate_limit: RateLimit
    max_times_sampled: int

    def __init__(self, sampler: Sampler = _UNIFORM, rate_limit: RateLimit | None = None,
                 max_times_sampled: int | None = None) -> None:
        if not isinstance(sampler, Sampler) or not sampler.KIND:
            raise ConfigError(f"sampler must be a Sampler: Uniform(), Prioritized(...), Fifo(), Lifo(), Recency(...) or "
                              f"Mixture(...), got {str(sampler)[:80]}")
        limit = RateLimit() if rate_limit is None else rate_limit
        if not isinstance(limit, RateLimit):
            raise ConfigError(f"rate_limit must be a RateLimit, got {rate_limit!r}")
        m = 0 if max_times_sampled is None else max_times_sampled
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < 2**32 - 1:
            raise ConfigError(f"max_times_sampled must be an int >= 0 (0: no limit), got {m!r}")
        if m and not sampler.MAY_REMOVE:
            raise ConfigError(f"{type(sampler).__name__}() draws with replacement and cannot remove rows: "
                              f"max_times_sampled={m} needs Uniform(), Prioritized(...), Fifo() or Lifo()")
        object.__setattr__(self, "sampler", sampler)
        object.__setattr__(self, "rate_limit", limit)
        object.__setattr__(self, "max_times_sampled", m)

    @property
    def removes(self) -> bool:
        """Whether sampling removes rows (max_times_sampled is set)."""
        return self.max_times_sampled > 0

    @property
    def prioritized(self) -> bool:
        """Whether its rows have priorities (its sampler, or a component of it, draws by them)."""
        return self.sampler.prioritized_part is not None

    @property
    def ordered(self) -> bool:
        return self.sampler.IN_ORDER

    @property
    def writer_only(self) -> str | None:
        """Why only the writer may sample (None: any reader may): sampling then changes the
        buffer, counters or removals, that every sampler must agree on."""
        if self.removes:
            return f"max_times_sampled={self.max_times_sampled} removes rows as they are sampled"
        if self.rate_limit.active:
            return "the rate limit counts every sample"
        return None

    def describe(self) -> dict[str, Any]:
        """Flat name -> scalar: what `info()` and `h5replay stats` show."""
        part = self.sampler.prioritized_part
        return {
            "sampler": self.sampler.KIND,
            "sampler_settings": sampler_to_json(self.sampler),
            "priority_exponent": part.exponent if part is not None else None,
            "initial_priority": part.initial_priority if part is not None else None,
            **asdict(self.rate_limit),
            "max_times_sampled": self.max_times_sampled,
        }

    def to_json(self) -> str:
        return json.dumps({"sampler": json.loads(sampler_to_json(self.sampler)), "rate_limit": asdict(self.rate_limit),
                           "max_times_sampled": self.max_times_sampled})


#: The settings of a buffer with one table (the name of earlier versions; the same class).
SamplingConfig = Table

#: The name of the one table of a buffer made with `sampler=` / `rate_limit=` / `max_times_sampled=`
#: (and of every file made before tables).
DEFAULT_TABLE = "default"
_TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}")
MAX_TABLES = 16


def check_table_name(name: object) -> str:
    """A table's name: 1 to 64 letters, digits, '_' or '-' (not starting with '-'): it names an
    HDF5 group, a JSON key, a part of a figure's name ("table.<name>.sampled") and a metrics label.

    Raises:
        ConfigError: any other name (named in the message).
    """
    if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
        raise ConfigError(f"a table's name is 1 to 64 letters, digits, '_' or '-' (not starting with '-'), got "
                          f"{str(name)[:80]!r}")
    return name


def check_tables(tables: object) -> dict[str, Table]:
    """A buffer's tables, checked: a non-empty mapping of at most MAX_TABLES names to `Table`s.

    Raises:
        ConfigError: not a mapping of valid names to Tables (names the offending table).
    """
    if not isinstance(tables, Mapping) or not tables:
        raise ConfigError(f"tables must be a non-empty mapping of names to Table(...), got {str(tables)[:80]!r}")
    if len(tables) > MAX_TABLES:
        raise ConfigError(f"a buffer has at most {MAX_TABLES} tables, got {len(tables)}")
    out: dict[str, Table] = {}
    for name, table in tables.items():
        check_table_name(name)
        if not isinstance(table, Table):
            raise ConfigError(f"table {name!r} must be a Table(...), got {str(table)[:80]!r}")
        out[name] = table
    return out


def table_from_json(text: str, name: str = DEFAULT_TABLE) -> Table:
    """A table a file records (`Table.to_json`).

    Raises:
        ConfigError: not a table this version knows (names the table).
    """
    try:
        obj = json.loads(text)
        if not isinstance(obj, dict) or set(obj) != {"sampler", "rate_limit", "max_times_sampled"}:
            raise ValueError("not an object of sampler, rate_limit and max_times_sampled")
        return Table(sampler_from_json(json.dumps(obj["sampler"])), rate_limit_from_json(json.dumps(obj["rate_limit"])),
                     obj["max_times_sampled"])
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError(f"table {name!r}: unknown table description {text[:200]!r}: {exc}") from exc


#: The keys of a table's settings (`table_from_settings`, `serve --tables`): the serve flags'.
SETTINGS = ("sampler", "priority_exponent", "initial_priority", "half_life", "components", "min_size_to_sample",
            "samples_per_insert", "error_buffer", "max_times_sampled")
_SAMPLER_SETTINGS = {"uniform": (), "fifo": (), "lifo": (), "prioritized": ("priority_exponent", "initial_priority"),
                     "recency": ("half_life",), "mixture": ("components",)}


def _sampler_from_settings(settings: Mapping[str, Any], where: str) -> Sampler:
    kind = settings.get("sampler")
    if kind is None:
        kind = "prioritized" if any(settings.get(k) is not None for k in ("priority_exponent", "initial_priority")) \
            else "recency" if settings.get("half_life") is not None else "uniform"
    if kind not in _SAMPLER_SETTINGS:
        raise ConfigError(f"{where}: sampler must be one of {', '.join(_SAMPLER_SETTINGS)}, got {str(kind)[:40]!r}")
    for key in ("priority_exponent", "initial_priority", "half_life", "components"):
        if settings.get(key) is not None and key not in _SAMPLER_SETTINGS[kind]:
            raise ConfigError(f"{where}: {key} does not go with sampler {kind!r}")
    if kind == "prioritized":
        exponent = settings.get("priority_exponent")
        return Prioritized(0.6 if exponent is None else exponent, settings.get("initial_priority"))
    if kind == "recency":
        if settings.get("half_life") is None:
            raise ConfigError(f"{where}: sampler 'recency' needs half_life (rows)")
        return Recency(settings["half_life"])
    if kind == "mixture":
        parts = settings.get("components")
        if not isinstance(parts, list) or not parts or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], Mapping) for p in parts):
            raise ConfigError(f"{where}: a mixture's components are [[{{sampler settings}}, weight], ...], got "
                              f"{str(parts)[:80]}")
        for settings_, _ in parts:
            unknown = set(settings_) - set(("sampler", "priority_exponent", "initial_priority", "half_life"))
            if unknown:
                raise ConfigError(f"{where}: a mixture component has unknown settings {sorted(unknown)}")
        return Mixture([(_sampler_from_settings(p[0], f"{where}, component {i}"), p[1]) for i, p in enumerate(parts)])
    return {"uniform": Uniform, "fifo": Fifo, "lifo": Lifo}[kind]()


def table_from_settings(settings: object, name: str = DEFAULT_TABLE) -> Table:
    """A table from its settings by the serve flags' names (`SETTINGS`; absent or None: the
    default), as `serve --tables FILE` reads them, the flags themselves included.

    Raises:
        ConfigError: not an object of known settings, or settings a table refuses (names the table).
    """
    where = f"table {name!r}"
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where}: settings must be a JSON object of {', '.join(SETTINGS)}, got {str(settings)[:80]}")
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"{where}: unknown setting(s) {', '.join(map(repr, unknown))}; known: {', '.join(SETTINGS)}")
    try:
        sampler = _sampler_from_settings(settings, where)
        limit = RateLimit(settings.get("min_size_to_sample") or 1, settings.get("samples_per_insert"),
                          settings.get("error_buffer"))
        return Table(sampler, limit, settings.get("max_times_sampled"))
    except ConfigError as exc:
        message = str(exc)
        raise ConfigError(message if message.startswith(where) else f"{where}: {message}") from None
    except TypeError as exc:  # a value of the wrong type reaching a constructor
        raise ConfigError(f"{where}: {exc}") from None


def tables_from_settings(obj: object) -> dict[str, Table]:
    """The tables of a `--tables` file: a JSON object of table name to its settings.

    Raises:
        ConfigError: not such an object, a bad name or bad settings (names the table and the setting).
    """
    if not isinstance(obj, Mapping) or not obj:
        raise ConfigError(f"tables must be a non-empty JSON object of table name to settings, got {str(obj)[:80]}")
    for name in obj:
        check_table_name(name)
    return check_tables({name: table_from_settings(settings, name) for name, settings in obj.items()})


def describe_tables(tables: Mapping[str, Table], writer_only: set[str] | frozenset[str] = frozenset()) -> dict[str, Any]:
    """A server's tables as flat scalars (its hello's `sampling`, its stats): "tables" (their
    names, comma-separated), each table's `describe()` as "table.<name>.<figure>" with its
    "writer_samples" (whether only the writer draws from it: the names in `writer_only`), and, for
    a buffer of one table, the same figures by their plain names too."""
    out: dict[str, Any] = {"tables": ",".join(tables), "writer_samples": bool(writer_only)}
    for name, table in tables.items():
        figures = {**table.describe(), "writer_samples": name in writer_only}
        out.update({f"table.{name}.{key}": value for key, value in figures.items()})
        if len(tables) == 1:
            out.update(figures)
    return out


def described_tables(described: Mapping[str, Any]) -> list[str]:
    """The table names a `describe_tables(...)` (a server's hello, a buffer's info) lists, in
    order; none from a server that names no tables."""
    return [name for name in str(described.get("tables", "")).split(",") if name]


def described_samplers(described: Mapping[str, Any]) -> dict[str, Sampler] | None:
    """Every table's sampler, by name, from `describe_tables(...)` (a server's hello); None when
    the description does not say (a server that names no tables): then the server checks alone."""
    out = {}
    for name in described_tables(described):
        settings = described.get(f"table.{name}.sampler_settings")
        try:
            out[name] = sampler_from_json(settings) if isinstance(settings, str) else None
        except ConfigError:
            out[name] = None
        if out[name] is None:
            return None
    return out or None  # type: ignore[return-value]


def table_description(described: Mapping[str, Any], table: str | None) -> dict[str, Any]:
    """One table's figures from `describe_tables(...)` (a server's hello): by its plain names.
    A server that names no tables has one, described by plain names.

    Raises:
        ConfigError: no such table, or none named where there are several (names them).
    """
    names = described_tables(described)
    if not names:
        return dict(described)
    if table is None:
        if len(names) != 1:
            raise ConfigError(f"this server has {len(names)} tables ({', '.join(map(repr, names))}): name one with "
                              "table=")
        table = names[0]
    if table not in names:
        raise ConfigError(f"no table {str(table)[:80]!r}: this server's tables are {', '.join(map(repr, names))}")
    prefix = f"table.{table}."
    return {key[len(prefix):]: value for key, value in described.items() if key.startswith(prefix)}
