"""The cached GGUF conversion when several processes want it at once (xdist workers, two `edgekv
run`s): one converts, the others wait and read its copy (``loader.ensure_converted``), and the
copy is swapped in by renames only (``loader._staged_dir``), so a reader never sees it half there."""

from __future__ import annotations

import threading
import time

from rich.console import Console

from edgekv.models import loader


def _slow_conversion(calls: list, inside: list):
    def convert(path, dest, console):
        calls.append(dest)
        inside.append(1)
        try:
            assert len(inside) == 1, "two conversions of one copy ran at once"
            with loader._staged_dir(dest) as tmp:
                time.sleep(0.3)  # long enough for the other callers to arrive while this one works
                (tmp / "model.safetensors").write_bytes(b"weights")
                (tmp / "edgekv.json").write_text("{}")
        finally:
            inside.pop()
    return convert


def test_callers_at_once_convert_one_copy_and_all_find_it(tmp_path, monkeypatch):
    calls, inside, errors = [], [], []
    monkeypatch.setattr(loader, "convert_gguf", _slow_conversion(calls, inside))
    cached = tmp_path / "converted" / "model-abc-v1"

    def ask():
        try:
            loader.ensure_converted(tmp_path / "model.gguf", cached, Console(quiet=True))
            assert (cached / "edgekv.json").is_file() and (cached / "model.safetensors").read_bytes() == b"weights"
        except BaseException as exc:  # noqa: BLE001 - reported below, from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert calls == [cached]
    # the lock lives in the temporary directory; no staging folder is left
    assert sorted(p.name for p in cached.parent.iterdir()) == ["model-abc-v1"]


def test_a_replaced_copy_is_not_listed_as_a_conversion(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_CACHE", str(tmp_path))
    dest = tmp_path / "converted" / "model-abc-v1"
    for text in ("first", "second"):  # the second replaces the first whole
        with loader.cache_lock(dest), loader._staged_dir(dest) as tmp:
            (tmp / "edgekv.json").write_text(f'{{"source": "{text}", "format": {loader.CONVERSION_FORMAT}}}')
    assert [e["source"] for e in loader.cached_conversions()] == ["second"]
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model-abc-v1"]


def test_an_interrupted_conversion_leaves_the_earlier_copy(tmp_path):
    dest = tmp_path / "model-abc-v1"
    dest.mkdir()
    (dest / "edgekv.json").write_text("earlier")
    try:
        with loader._staged_dir(dest) as tmp:
            (tmp / "edgekv.json").write_text("half")
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert (dest / "edgekv.json").read_text() == "earlier"
    assert [p.name for p in tmp_path.iterdir()] == ["model-abc-v1"]
