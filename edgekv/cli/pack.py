"""`edgekv pack ARTIFACT -o model.ekvpkg`: one checksummed file that the Android app imports
through the system file picker (edgekv/artifact/package.py, android/README.md); `--check FILE`
verifies a package, part by part."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ..units import human_bytes
from .common import err, fail, out, say


def _bar():
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=err, transient=True)


def pack_cmd(
    artifact: Annotated[Optional[Path], typer.Argument(help="an artifact directory (`edgekv compile`, linked by "
                                                            "android/finish.sh)")] = None,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="the package file to write "
                                                   "(default: ARTIFACT.ekvpkg beside the artifact)")] = None,
    bundled_library: Annotated[bool, typer.Option(help="leave model.so out: the app carries it in its APK "
                                                  "(android/build.sh --model-lib); the package records its SHA-256 and "
                                                  "the app refuses it with another library")] = False,
    check: Annotated[Optional[Path], typer.Option("--check", help="verify this package instead: every part "
                                                  "against its SHA-256")] = None,
):
    """Pack an artifact into one file for the Android app (import it there with "Import model"),
    or verify a package with --check FILE."""
    from ..artifact import package

    try:
        if check is not None:
            if artifact is not None:
                raise package.PackageError("give either ARTIFACT (to pack) or --check FILE, not both")
            with _bar() as bar:
                task = bar.add_task(f"checking {check.name}", total=None)
                parts = package.check(check, lambda done, total: bar.update(task, completed=done, total=total))
            for p in package.describe(parts):
                where = "in the package" if p["in_package"] else "bundled in the app (not in the package)"
                out.print(f"{p['name']:<24} {human_bytes(p['bytes']):>10}  {p['sha256'][:16]}  {where}",
                          highlight=False)
            say(f"{check}: {len(parts)} parts, every SHA-256 matches")
            return
        if artifact is None:
            raise package.PackageError("give the artifact directory to pack (or --check FILE)")
        if not artifact.is_dir():
            raise package.PackageError(f"{artifact} is not a directory: pack an artifact that `edgekv compile` wrote")
        output = output or artifact.with_name(artifact.name + ".ekvpkg")
        with _bar() as bar:
            task = bar.add_task(f"packing {artifact.name}", total=None)
            parts = package.pack(artifact, output, bundled_library,
                                 lambda done, total: bar.update(task, completed=done, total=total))
    except package.PackageError as exc:
        fail(exc)
    size = output.stat().st_size
    left_out = [p.name for p in parts if p.external]
    say(f"wrote {output} ({human_bytes(size)}, {len(parts)} parts"
        + (f"; {', '.join(left_out)} left to the app's bundled library" if left_out else "") + ")")
    out.print(str(output), highlight=False)
