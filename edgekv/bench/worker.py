"""Worker process: `python -m edgekv.bench.worker SPEC.json` runs one system once and prints
one JSON line with its timings and its own peak RSS."""

from __future__ import annotations

import json
import sys

from ..threads import prepare_process

prepare_process()

import torch  # noqa: E402


def main(spec_path: str) -> None:
    from ..memory import current_rss_bytes, peak_rss_bytes
    from .systems import SYSTEMS

    spec = json.loads(open(spec_path).read())
    from ..threads import apply_threads

    apply_threads(spec["threads"])  # torch and TVM (edgekv-compiled) alike
    ids = torch.tensor(spec["ids"], dtype=torch.long)
    interpreter = current_rss_bytes()  # Python, torch and the worker, before the system loads anything
    result = SYSTEMS[spec["system"]](ids, spec)
    own_process = "peak_rss" in result  # a system run in its own child process (edgekv-native) reports its peak
    n = ids.numel()
    result.update({
        "prefill_tok_s": n / result["prefill_seconds"],
        "decode_tok_s": spec["decode_tokens"] / result["decode_seconds"] if spec["decode_tokens"] else None,
        "peak_rss": result["peak_rss"] if own_process else peak_rss_bytes(),
    })
    # the system's own memory: a child process's peak as it is; an in-process peer's (llama.cpp,
    # HF, ...) peak less the interpreter it runs in, which a C program using it would not carry
    result["own_rss"] = result["peak_rss"] if own_process else result["peak_rss"] - interpreter
    print("EDGEKV_BENCH " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
