"""Device profiles (``edgekv/profiles/devices/*.json``, shipped as package data): RAM an app can
use, memory bandwidth and the peak throughput of each compute unit, every figure with its public
source.

A figure is ``{"value": number, "source": "...", "estimate": bool}``; ``load_profile`` checks
every field and names the file and the field when one is missing or wrong."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..profiles import profile_dir

DEVICE_DIR = profile_dir("devices")
SCHEMA = "edgekv-device/1"
UNITS = ("cpu", "gpu", "npu")
# precision → (figure key, FLOP or op per unit of the figure, bytes per weight/cache value)
PRECISIONS = {"fp32": ("fp32_gflops", 1e9, 4), "fp16": ("fp16_gflops", 1e9, 2), "int8": ("int8_tops", 1e12, 1)}
_SIZE_UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}


class ProfileError(ValueError):
    """A device profile is missing, unreadable or lacks a field; the message names file and field."""


@dataclass(frozen=True)
class Figure:
    value: float
    source: str
    estimate: bool
    unit: str = ""


@dataclass(frozen=True)
class ComputeUnit:
    name: str
    description: str
    peaks: dict[str, Figure]  # precision → figure (GFLOP/s for fp, TOPS for int8 as given)

    def ops_per_second(self, precision: str) -> float:
        key, scale, _ = PRECISIONS[precision]
        return self.peaks[precision].value * scale

    def best_precision(self, wanted: str = "fp32") -> str:
        """``wanted`` if the unit has it, else the next narrower one it has."""
        order = list(PRECISIONS)
        for p in order[order.index(wanted):]:
            if p in self.peaks:
                return p
        return next(p for p in order if p in self.peaks)


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    description: str
    path: Path
    app_usable: Figure
    total_ram: Figure
    bandwidth: Figure
    units: dict[str, ComputeUnit]
    default_unit: str
    examples: list[str] = field(default_factory=list)

    @property
    def app_usable_bytes(self) -> int:
        return int(self.app_usable.value * _SIZE_UNITS[self.app_usable.unit])

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth.value * 1e9

    def sources(self) -> dict[str, str]:
        out = {"memory.app_usable": self.app_usable.source, "memory.bandwidth": self.bandwidth.source}
        for u in self.units.values():
            for p, fig in u.peaks.items():
                out[f"{u.name}.{PRECISIONS[p][0]}"] = fig.source
        return out


def _need(obj: dict, key: str, where: str, path: Path, kind=None):
    if not isinstance(obj, dict) or key not in obj:
        raise ProfileError(f"{path}: field '{where}{key}' is missing")
    value = obj[key]
    if kind is not None and not isinstance(value, kind) or (kind is str and not value.strip()):
        want = {str: "a non-empty string", dict: "an object", bool: "true or false"}.get(kind, str(kind))
        raise ProfileError(f"{path}: field '{where}{key}' must be {want}, not {value!r}")
    return value


def _figure(obj: dict, key: str, where: str, path: Path, units: tuple[str, ...] = ()) -> Figure:
    fig = _need(obj, key, where, path, dict)
    name = f"{where}{key}."
    value = _need(fig, "value", name, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ProfileError(f"{path}: field '{name}value' must be a positive number, not {value!r}")
    source = _need(fig, "source", name, path, str)
    estimate = _need(fig, "estimate", name, path, bool)
    unit = ""
    if units:
        unit = _need(fig, "unit", name, path, str)
        if unit not in units:
            raise ProfileError(f"{path}: field '{name}unit' is {unit!r}; use one of {', '.join(units)}")
    return Figure(float(value), source, estimate, unit)


def parse_profile(data: dict, path: Path) -> DeviceProfile:
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a device profile is a JSON object")
    schema = _need(data, "schema", "", path, str)
    if schema != SCHEMA:
        raise ProfileError(f"{path}: field 'schema' is {schema!r}; this edgekv reads {SCHEMA!r}")
    name = _need(data, "name", "", path, str)
    description = _need(data, "description", "", path, str)
    mem = _need(data, "memory", "", path, dict)
    sizes = tuple(_SIZE_UNITS)
    total = _figure(mem, "total_ram", "memory.", path, sizes)
    usable = _figure(mem, "app_usable", "memory.", path, sizes)
    bandwidth = _figure(mem, "bandwidth", "memory.", path, ("GB/s",))
    cu = _need(data, "compute_units", "", path, dict)
    units: dict[str, ComputeUnit] = {}
    for uname, spec in cu.items():
        if uname not in UNITS:
            raise ProfileError(f"{path}: compute unit 'compute_units.{uname}' is unknown; use {', '.join(UNITS)}")
        where = f"compute_units.{uname}."
        desc = _need(spec, "description", where, path, str)
        peaks = {p: _figure(spec, key, where, path) for p, (key, _, _) in PRECISIONS.items() if key in spec}
        if not peaks:
            keys = ", ".join(k for k, _, _ in PRECISIONS.values())
            raise ProfileError(f"{path}: field '{where}' needs at least one peak throughput ({keys})")
        units[uname] = ComputeUnit(uname, desc, peaks)
    if "cpu" not in units:
        raise ProfileError(f"{path}: field 'compute_units.cpu' is missing (every device has a CPU)")
    default = data.get("default_unit", "cpu")
    if default not in units:
        raise ProfileError(f"{path}: field 'default_unit' is {default!r}, which is not one of its compute units "
                           f"({', '.join(units)})")
    if usable.value * _SIZE_UNITS[usable.unit] > total.value * _SIZE_UNITS[total.unit]:
        raise ProfileError(f"{path}: 'memory.app_usable' is larger than 'memory.total_ram'")
    return DeviceProfile(name=name, description=description, path=path, app_usable=usable, total_ram=total,
                         bandwidth=bandwidth, units=units, default_unit=default,
                         examples=list(data.get("examples", [])))


def load_profile_file(path: str | Path) -> DeviceProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(f"device profile {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProfileError(f"{path}: cannot read it as JSON: {exc}") from None
    return parse_profile(data, path)


def known_profiles(directory: Path = DEVICE_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.json"))


def load_profile(name_or_path: str, directory: Path = DEVICE_DIR) -> DeviceProfile:
    """A profile by name (``edgekv/profiles/devices/<name>.json``) or by path to a .json file."""
    p = Path(name_or_path)
    if p.suffix == ".json" or p.is_file():
        return load_profile_file(p)
    cand = directory / f"{name_or_path}.json"
    if cand.is_file():
        return load_profile_file(cand)
    raise ProfileError(f"unknown device '{name_or_path}'; known devices in {directory}: "
                       f"{', '.join(known_profiles(directory)) or 'none'} (or a path to a profile .json)")


def load_profiles(names: list[str] | None, directory: Path = DEVICE_DIR) -> list[DeviceProfile]:
    """Profiles for ``--device`` values; ``None``, ``[]`` or ``["all"]`` → every profile in the folder."""
    if not names or names == ["all"]:
        names = known_profiles(directory)
        if not names:
            raise ProfileError(f"no device profiles in {directory}")
    out = []
    for n in names:
        for part in str(n).split(","):
            if part.strip():
                out.append(load_profile(part.strip(), directory))
    return out


def validate_all(directory: Path = DEVICE_DIR) -> list[DeviceProfile]:
    return [load_profile_file(p) for p in sorted(directory.glob("*.json"))]


def main(argv: list[str] | None = None) -> int:
    """``python -m edgekv.simulate.profiles [FILE.json ...]``: validate profiles (default: all shipped)."""
    import sys

    paths = (argv if argv is not None else sys.argv[1:]) or [str(p) for p in sorted(DEVICE_DIR.glob("*.json"))]
    bad = 0
    for path in paths:
        try:
            p = load_profile_file(path)
        except ProfileError as exc:
            print(f"INVALID {exc}")
            bad += 1
            continue
        est = sum(f.estimate for f in [p.app_usable, p.total_ram, p.bandwidth] + [x for u in p.units.values() for x in u.peaks.values()])
        print(f"ok      {path}: {p.name}, app-usable {p.app_usable_bytes / 2**30:.1f} GiB, {p.bandwidth.value:g} GB/s, "
              f"units {', '.join(p.units)} ({est} figures marked as estimates)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
