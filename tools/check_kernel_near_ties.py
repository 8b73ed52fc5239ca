"""Per eviction event on real model keys: the kept set chosen from a policy's compiled score
kernel vs ``topk_keep`` on its reference scores, each disagreement measured as the fp64 score
gap of the swapped pair (issue 4's rule: kept sets may differ only where scores differ by
< 1e-5 relative). KeyDiff only for now (the kernel reads keys and positions).

    nice -n 10 python tools/check_kernel_near_ties.py --tokens 2048 --budget 1024 --block 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--text", default=str(Path(__file__).resolve().parents[2] / "shared" / "research" / "seed-keydiff.md"))
    args = ap.parse_args(argv)
    import tvm

    from edgekv.engine import BlockEngine
    from edgekv.models import load_model
    from edgekv.policies.base import topk_keep
    from edgekv.compiler.policy_kernels.keydiff import build_keydiff_evict_kernel
    from edgekv.policies.keydiff import KeyDiffPolicy, keydiff_scores

    m = load_model(args.model)
    H, N, B, D = m.config.num_kv_heads, args.budget, args.block, m.config.head_dim
    kernel = tvm.compile(tvm.IRModule({"main": build_keydiff_evict_kernel(H, N, B, D).with_attr("global_symbol", "main")}),
                         target=tvm.target.Target({"kind": "llvm", "num-cores": 2}))["main"]
    events = []

    class Recording(KeyDiffPolicy):
        def select(self, ctx):
            if ctx.must_evict:
                events.append((ctx.keys.clone(), ctx.positions.clone(), ctx.n_cache))
            return super().select(ctx)

    ids = torch.tensor(m.tokenizer.encode(Path(args.text).read_text())[: args.tokens])
    with torch.no_grad():
        BlockEngine(m, Recording(), N, B).prefill(ids)
    differ, worst, kept_total = 0, 0.0, 0
    for keys, pos, nf in events:
        n = keys.shape[1]
        nv = n - nf
        kc = np.zeros((H, N, D), "float32")
        kc[:, :nf] = keys[:, :nf].numpy()
        kb = np.zeros((1, H, B, D), "float32")
        kb[0, :, :nv] = keys[:, nf:].numpy()
        pc = np.zeros((H, N), "int32")
        pc[:, :nf] = pos[:, :nf].numpy()
        pb = np.zeros((B,), "int32")
        pb[:nv] = pos[0, nf:].numpy()
        a = [kc, np.zeros_like(kc), pc, np.array([nf], "int32"), kb, np.zeros_like(kb), pb, np.array([nv], "int32"),
             np.zeros((H, N + B), "float32")]
        t = [tvm.runtime.tensor(x) for x in a]
        kernel(*t)
        ref = topk_keep(keydiff_scores(keys, KeyDiffPolicy.EPS), N).numpy()
        got = topk_keep(torch.from_numpy(t[-1].numpy()[:, :n]), N).numpy()
        s64 = keydiff_scores(keys.double(), KeyDiffPolicy.EPS).numpy()
        kept_total += ref.size
        for h in range(H):
            only_ref = sorted(set(ref[h]) - set(got[h]), key=lambda i: s64[h, i])
            only_got = sorted(set(got[h]) - set(ref[h]), key=lambda i: s64[h, i])
            differ += len(only_ref)
            for i, j in zip(only_ref, only_got):
                gap = abs(s64[h, i] - s64[h, j]) / max(abs(s64[h, i]), abs(s64[h, j]), 1e-30)
                worst = max(worst, float(gap))
    out = {"events": len(events), "kept_entries": kept_total, "differing_kept_entries": differ,
           "worst_relative_score_gap": worst, "near_ties_only": worst < 1e-5}
    print(json.dumps(out, indent=2))
    return 0 if worst < 1e-5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
