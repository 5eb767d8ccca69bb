"""Spec files: the one reader for sweep and slow-link files, their checks, and link rates.

Both kinds are YAML mappings read by `read_spec` (unknown keys and malformed files are a
ConfigError naming the key and file); a relative `base:` is looked up beside the spec file,
then in the checkout. The keys of each kind: hsdp/bench/sweep.py and hsdp/bench/slowlink.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Optional, TypedDict

from hsdp.config.loader import read_yaml
from hsdp.config.schema import ConfigError

REPO = Path(__file__).resolve().parents[2]
SWEEP_KEYS = ("base", "set", "columns", "ratio", "relative", "nocomm", "runs")
LINK_KEYS = ("base", "set", "rates", "delay_ms", "target", "timeout_s", "probe_s", "pin_cores", "runs")


class SweepSpec(TypedDict):
    """A checked sweep file (a dict, as `hsdp.sweep.load_sweep` has always returned)."""

    base: str  # absolute path of the base config
    set: list[str]  # overrides shared by every run
    columns: list[str]  # summary.json fields shown in the table
    ratio: Optional[str]  # a column shown as the first run's / this run's
    relative: Optional[list[str]]  # [column, run]: the column as a ratio to that run's
    nocomm: bool  # also run each run with mesh.backend=fake
    runs: dict[str, list[str]]  # run → its overrides


class LinkRunSpec(NamedTuple):
    """One run of a slow-link spec: its overrides, its own rates (None: the default rates), and an elastic
    run's node kill (`REPLICA@STEP`, hsdp.bench.elastic.Kill; None: no kill)."""

    overrides: list[str]
    rates: Optional[list[str]] = None
    kill: Optional[str] = None
    partition: Optional[str] = None  # REPLICA@AT:SECONDS (hsdp.bench.faults.Partition)
    slow: Optional[str] = None  # REPLICA:FACTOR[@AT[:SECONDS]] (a slow fault, hsdp/faults/spec.py)
    chaos: Optional[str] = None  # SEED:MTBF_S (hsdp.bench.chaos.Chaos)


@dataclass
class LinkSpec:
    """A checked slow-link spec file; keys it does not have are None (flags and defaults fill them)."""

    runs: dict[str, LinkRunSpec]
    shared: list[str] = field(default_factory=list)  # the file's `set:`
    base: Optional[str] = None  # absolute path
    rates: list[str] = field(default_factory=list)
    delay_ms: Optional[float] = None
    target: Optional[str] = None
    timeout_s: Optional[float] = None
    probe_s: Optional[float] = None
    pin_cores: Optional[bool] = None


def read_spec(path: str, kind: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """A spec file (sweep, slow-link) as a mapping whose keys are all in `keys`, or ConfigError naming the problem."""
    expected = f"a mapping with keys {', '.join(keys)}"
    spec = read_yaml(path, key=kind, expected=expected)
    if not isinstance(spec, dict):
        raise ConfigError(f"{kind}: {path}: expected {expected}")
    unknown = [k for k in spec if k not in keys]
    if unknown:
        raise ConfigError(f"{kind}: {path}: unknown keys {unknown} (expected: {', '.join(keys)})")
    return spec


def str_list(path: str, key: str, value: Any) -> list[str]:
    """A spec file's list of `section.key=value` strings ([] if absent), or ConfigError naming the key."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}: {path}: expected a list of section.key=value strings, got {value!r}")
    return value


def resolve_base(base: Any, spec_file: str) -> str:
    """The base config as an absolute path: absolute as given, else beside the spec file, else in the checkout."""
    if not isinstance(base, str):
        raise ConfigError(f"base: {spec_file}: expected a config file path, got {base!r}")
    given = Path(base).expanduser()
    beside = Path(spec_file).expanduser().resolve().parent
    candidates = [given] if given.is_absolute() else [beside / given, REPO / given]
    for c in candidates:
        if c.is_file():
            return str(c.resolve())
    raise ConfigError(f"base: {base} not found (looked for {' and '.join(str(c) for c in candidates)})")


def parse_only(text: str) -> set[str]:
    """`--only a,b` → {"a", "b"} (empty: every run)."""
    return set(filter(None, text.split(",")))


# ------------------------------------------------------------------ sweep files


def load_sweep(path: str) -> SweepSpec:
    """Read and check a sweep file; `base` comes back as an absolute path, lists as lists."""
    spec = read_spec(path, "sweep", SWEEP_KEYS)
    for key in ("base", "runs", "columns"):
        if key not in spec:
            raise ConfigError(f"sweep: {path}: missing key {key!r}")
    base = resolve_base(spec["base"], path)
    shared = str_list(path, "set", spec.get("set"))
    columns = str_list(path, "columns", spec["columns"])
    if not columns:
        raise ConfigError(f"columns: {path}: expected at least one summary.json field")
    ratio = spec.get("ratio")
    if ratio is not None and not isinstance(ratio, str):
        raise ConfigError(f"ratio: {path}: expected a summary.json field, got {ratio!r}")
    nocomm = spec.get("nocomm", False)
    if not isinstance(nocomm, bool):
        raise ConfigError(f"nocomm: {path}: expected true or false, got {nocomm!r}")
    runs = spec["runs"]
    if not isinstance(runs, dict) or not runs:
        raise ConfigError(f"runs: {path}: expected a mapping of run name to a list of overrides, got {runs!r}")
    runs = {str(run): str_list(path, f"runs.{run}", extra) for run, extra in runs.items()}
    relative = spec.get("relative")
    if relative is not None and not (
        isinstance(relative, list) and len(relative) == 2 and all(isinstance(r, str) for r in relative)
    ):
        raise ConfigError(f"relative: {path}: expected [summary.json field, run name], got {relative!r}")
    if relative is not None and relative[1] not in runs:
        raise ConfigError(f"relative: {path}: {relative[1]!r} is not one of the runs ({', '.join(runs)})")
    return SweepSpec(base=base, set=shared, columns=columns, ratio=ratio, relative=relative, nocomm=nocomm, runs=runs)


# ------------------------------------------------------------------ slow-link files and rates


def load_link_spec(path: str) -> LinkSpec:
    """Read and check a slow-link spec file (its keys: hsdp/bench/slowlink.py)."""
    spec = read_spec(path, "spec", LINK_KEYS)
    runs = spec.get("runs")
    if not isinstance(runs, dict) or not runs:
        raise ConfigError(f"runs: {path}: expected a mapping of run name to overrides")
    parsed = {}
    for run, entry in runs.items():
        if isinstance(entry, dict):
            keys = ("set", "rates", "kill", "partition", "slow", "chaos")
            bad = [k for k in entry if k not in keys]
            if bad:
                raise ConfigError(f"runs.{run}: {path}: unknown keys {bad} (expected: {', '.join(keys)})")
            rates = entry.get("rates")
            kill, partition, slow, chaos = (None if entry.get(k) is None else str(entry[k]) for k in keys[2:])
            parsed[str(run)] = LinkRunSpec(
                str_list(path, f"runs.{run}.set", entry.get("set")),
                None if rates is None else [str(r) for r in rates],
                kill,
                partition,
                slow,
                chaos,
            )
        else:
            parsed[str(run)] = LinkRunSpec(str_list(path, f"runs.{run}", entry))
    return LinkSpec(
        runs=parsed,
        shared=str_list(path, "set", spec.get("set")),
        base=resolve_base(spec["base"], path) if "base" in spec else None,
        rates=[str(r) for r in spec.get("rates") or []],
        delay_ms=spec.get("delay_ms"),
        target=spec.get("target"),
        timeout_s=spec.get("timeout_s"),
        probe_s=spec.get("probe_s"),
        pin_cores=pin_cores_value(path, spec.get("pin_cores")),
    )


def pin_cores_value(path: str, value: Any) -> Optional[bool]:
    """The spec's `pin_cores` (true/false), None if absent."""
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"pin_cores: {path}: expected true or false, got {value!r}")
    return value


def parse_runs_arg(items: list[str]) -> dict[str, LinkRunSpec]:
    """`--runs NAME=override,override ...` (NAME= for none) → runs at the default rates."""
    runs = {}
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--runs: expected NAME=override,override (or NAME= for none), got {item!r}")
        runs[name] = LinkRunSpec([o for o in rest.split(",") if o])
    return runs


def rate_number(text: str) -> Optional[tuple[float, int]]:
    """'20mbit' → (20.0, 10**6): a rate's number (any sign, inf and nan included) and its unit's scale; None if
    `text` is not a number followed by bit, kbit, mbit or gbit."""
    t = str(text).strip().lower()
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]), scale
            except ValueError:
                return None
    return None


def parse_rate(text: str) -> tuple[str, Optional[int]]:
    """'20mbit' → ('20mbit', 20_000_000); 'unshaped' → ('unshaped', None). Units: bit, kbit, mbit, gbit."""
    t = str(text).strip().lower()
    if t in ("unshaped", "none"):
        return "unshaped", None
    found = rate_number(t)
    if found is None:
        raise ConfigError(f"--rate: expected e.g. 20mbit, 1gbit, 500kbit or unshaped, got {text!r}")
    value, scale = found
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"--rate: expected a rate above 0 (e.g. 20mbit), got {text!r}")
    unit = {10**9: "gbit", 10**6: "mbit", 10**3: "kbit", 1: "bit"}[scale]
    return f"{value:g}{unit}", int(round(value * scale))
