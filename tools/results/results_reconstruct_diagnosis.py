"""Why `--compress reconstruct` keeps the wrong entries (issue 34): on SmolLM2, eager, for a few
passkey / multi-key documents read once at N, which share of the needles' value tokens survives in
each layer and KV head under reconstruct, against the query-agnostic KeyDiff / SnapKV (its window:
the document's last rows) and the question-aware ceiling (``POLICY:q``), and where reconstruct's
kept entries go (sinks, the chat prefix and the task's intro, the needles' sentences, the last
block, the rest of the haystack).

One reconstruct read also records, per layer, KV head and document token, the score of several
scoring variants computed from the same reconstruction rows (``VARIANTS``) and three cheap
query-agnostic signals (key norm, value norm, KeyDiff's negative cosine to the document's mean key).
Because a block's reconstruction score never changes once written, reconstruct's keep set is the
top N of its score map per (layer, KV head) (sinks first); the same holds for every variant, so the
variants' needle retention is measured from the one read (the rows' hidden states follow the
reference scoring's cache; the variants move them only through later layers). The same maps give
the learned-gates bound (issue item 5): the recall of reconstruct's top N by each cheap signal's
top N.

    nice -n 19 flock /work/wt/heavy.lock python tools/results/results_reconstruct_diagnosis.py \\
        --length 4k --budget 512 --docs passkey:0,passkey:2,passkey:4,multikey:0,multikey:1

Writes docs/results/NAME.{json,md} (default reconstruct_diagnosis).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

VARIANTS = {
    "kvzip": "KVzip's score (the reference): softmax over sinks + own block + rows; max over rows and the group's query heads",
    "kvzip-mean": "the same softmax; mean over rows and query heads (total attention received) instead of max",
    "wide": "softmax over everything the rows see (the kept cache too); max over rows and query heads",
    "prompt": "only the repeat prompt's rows (before the block's copy), wide softmax, max",
    "copy": "only the block-copy rows, wide softmax, max",
    "aligned": "each entry's score from the one row that must reproduce it (the row before its copy), wide softmax, max over the group",
    "aligned2": "as aligned, max over that row and the next (the row holding the entry's copy)",
    "aligned-own": "as aligned, with KVzip's softmax (sinks + own block + rows)",
    "aligned-layer": "as aligned, max over every query head of the layer: one token set for all KV heads of a layer",
    "aligned-layer-mean": "as aligned, mean over every query head of the layer: one token set for all KV heads",
}
# rank combinations, computed from the maps (mean of the per-(layer, head) percentile ranks)
COMBOS = {"kvzip+keydiff": ("kvzip", "keydiff"), "wide+keydiff": ("wide", "keydiff")}
SIGNALS = {
    "key_norm": "L2 norm of the (post-RoPE) key, high kept",
    "value_norm": "L2 norm of the value, high kept",
    "keydiff": "negative cosine of the key to the document's mean key of that layer and KV head (KeyDiff), high kept",
}


def row_probabilities(ctx, wide: bool) -> torch.Tensor:
    """[H, G, e, b] the reconstruction rows' softmax probabilities on the block's entries."""
    from edgekv.policies.attention_rows import kv_groups, softmax_scale

    keys, n_cache = ctx.keys.float(), ctx.n_cache
    num_kv, n, d = keys.shape
    q = ctx.extra_queries.float()
    num_q, e, _ = q.shape
    g = kv_groups(num_q, num_kv)
    k = torch.cat([keys, ctx.extra_keys.float()], dim=1)
    logits = torch.matmul(q.reshape(num_kv, g * e, d), k.transpose(1, 2)).view(num_kv, g, e, n + e)
    logits = logits * softmax_scale(ctx.scale, d)
    if not wide:
        index = torch.arange(n)
        hidden = ~((index[None, :] >= n_cache) | (ctx.positions < 4))
        logits[..., :n] = logits[..., :n].masked_fill(hidden[:, None, None, :], float("-inf"))
    rp = ctx.extra_query_positions
    later = rp[None, :] > rp[:, None]
    logits[..., n:] = logits[..., n:].masked_fill(later[None, None], float("-inf"))
    return torch.softmax(logits, dim=-1)[..., n_cache:n]


def recorder_class():
    from edgekv.policies.reconstruct import ReconstructPolicy

    class RecordingReconstruct(ReconstructPolicy):
        """reconstruct, recording every block's variant scores and signals per layer."""

        def __post_init__(self):
            super().__post_init__()
            self.maps: dict[str, list[list[torch.Tensor]]] = {}
            self.keys_seen: list[list[torch.Tensor]] = []

        def observe(self, ctx):
            super().observe(ctx)
            rows = ctx.extra_queries is not None and not ctx.extra_is_question
            if not rows or ctx.extra_queries.shape[1] == 0:
                return
            layer, b = ctx.layer, ctx.n - ctx.n_cache
            while len(self.keys_seen) <= layer:
                self.keys_seen.append([])
                for v in (*VARIANTS, "value_norm", "positions"):
                    self.maps.setdefault(v, []).append([])
            own, wide = row_probabilities(ctx, False), row_probabilities(ctx, True)
            prompt_rows = ctx.extra_queries.shape[1] - b
            got = {"kvzip": own.amax(dim=(1, 2)), "kvzip-mean": own.mean(dim=(1, 2)), "wide": wide.amax(dim=(1, 2)),
                   "prompt": wide[:, :, :prompt_rows].amax(dim=(1, 2)), "copy": wide[:, :, prompt_rows:].amax(dim=(1, 2)),
                   "aligned": wide[:, :, prompt_rows - 1 + torch.arange(b), torch.arange(b)].amax(dim=1),
                   "aligned2": torch.maximum(wide[:, :, prompt_rows - 1 + torch.arange(b), torch.arange(b)],
                                             wide[:, :, prompt_rows + torch.arange(b), torch.arange(b)]).amax(dim=1),
                   "aligned-layer": wide[:, :, prompt_rows - 1 + torch.arange(b), torch.arange(b)].amax(dim=(0, 1))[None].expand(
                       ctx.keys.shape[0], b),
                   "aligned-layer-mean": wide[:, :, prompt_rows - 1 + torch.arange(b), torch.arange(b)].mean(dim=(0, 1))[None].expand(
                       ctx.keys.shape[0], b),
                   "aligned-own": own[:, :, prompt_rows - 1 + torch.arange(b), torch.arange(b)].amax(dim=1),
                   "value_norm": ctx.values[:, ctx.n_cache:].float().norm(dim=-1),
                   "positions": ctx.positions[:, ctx.n_cache:].clone()}
            for v, t in got.items():
                self.maps[v][layer].append(t)
            self.keys_seen[layer].append(ctx.keys[:, ctx.n_cache:].to(torch.float16))

        def stacked(self) -> dict[str, torch.Tensor]:
            out = {v: torch.stack([torch.cat(per, dim=1) for per in layers]) for v, layers in self.maps.items()}
            keys = torch.stack([torch.cat(per, dim=1) for per in self.keys_seen]).float()  # [L, H, T, d]
            out["key_norm"] = keys.norm(dim=-1)
            mean = keys.mean(dim=2, keepdim=True)
            out["keydiff"] = -torch.nn.functional.cosine_similarity(keys, mean, dim=-1)
            for name, parts in COMBOS.items():
                out[name] = sum(out[p].argsort(-1).argsort(-1).float() for p in parts)
            return out

    return RecordingReconstruct


def top_n_positions(score: torch.Tensor, positions: torch.Tensor, budget: int, sinks: int = 4) -> list[list[set]]:
    """Per (layer, head): the positions of the top ``budget`` scores, sinks first."""
    s = score.clone().float()
    s[positions < sinks] = float("inf")
    idx = s.topk(min(budget, s.shape[-1]), dim=-1).indices
    kept = positions.gather(-1, idx)
    return [[set(kept[la, h].tolist()) for h in range(kept.shape[1])] for la in range(kept.shape[0])]


def needle_stats(kept: list[list[set]], needle) -> dict:
    want = set(needle.value_positions)
    per_layer = [sum(want <= s for s in heads) / len(heads) for heads in kept]
    frac = [sum(len(want & s) for s in heads) / (len(want) * len(heads)) for heads in kept]
    return {"all_value_tokens": sum(per_layer) / len(per_layer), "value_tokens": sum(frac) / len(frac),
            "per_layer_all": per_layer}


def regions(doc, tokenizer) -> list[tuple[str, range]]:
    from edgekv.evaluation.questions import MULTI_INTRO, turn_pieces
    from edgekv.evaluation.tasks import INTRO

    prefix = turn_pieces(tokenizer)[0]
    intro = INTRO if doc.task == "passkey" else MULTI_INTRO
    head = len(tokenizer(prefix + intro, add_special_tokens=False)["input_ids"])
    out = [("sinks (first 4)", range(0, 4)), ("chat prefix + intro", range(4, head))]
    for n in doc.needles:
        out.append(("needle sentences", range(n.position, max(n.value_positions) + 6)))
    out.append(("last block (128)", range(doc.tokens - 128, doc.tokens)))
    return out


def composition(kept: list[list[set]], doc, tokenizer) -> dict:
    regs = regions(doc, tokenizer)
    names = list(dict.fromkeys(r for r, _ in regs)) + ["rest of the haystack"]
    total = {k: 0 for k in names}
    count = 0
    for heads in kept:
        for s in heads:
            for p in s:
                where = next((name for name, r in regs if p in r), "rest of the haystack")
                total[where] += 1
            count += len(s)
    sizes = {k: 0 for k in names}
    for name, r in regs:
        sizes[name] += len(r)
    sizes["rest of the haystack"] = doc.tokens - sum(sizes.values())
    return {k: {"kept_share": total[k] / count, "document_share": sizes[k] / doc.tokens} for k in names}


def kept_sets(engine) -> list[list[set]]:
    return [[set(row.tolist()) for row in engine.kept_positions(la)] for la in range(len(engine.caches))]


def run(args) -> dict:
    from edgekv.engine import BlockEngine
    from edgekv.evaluation.questions import build_document
    from edgekv.models import load_model
    from edgekv.policies import make_policy
    from edgekv.evaluation.command import parse_lengths

    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tok = model.tokenizer
    length, budget = parse_lengths(args.length, "--length")[0], parse_lengths(args.budget, "--budget")[0]
    out = {"model": model.model_id, "length": length, "budget": budget, "block": args.block, "documents": []}
    for spec in args.docs.split(","):
        task, index = spec.split(":")
        doc = build_document(tok, task, length, int(index))
        drow = {"id": doc.id, "tokens": doc.tokens, "needles": [{"kind": n.kind, "depth": n.depth,
                "value_positions": n.value_positions} for n in doc.needles], "methods": {}, "variants": {}}
        for method in args.methods.split(","):
            name, known = method.split(":")[0], method.endswith(":q")
            t0 = time.perf_counter()
            if name == "reconstruct":
                policy = recorder_class()()
            else:
                policy = make_policy(name)
            qs = [doc.questions[0]] if known else [None]
            q = qs[0]
            engine = BlockEngine(model, policy, budget, args.block, question_rows=len(q.ids) if q else 0)
            engine.prefill(torch.tensor(doc.ids), **({"question": torch.tensor(q.ids)} if q else {}))
            kept = kept_sets(engine)
            needles = [doc.needles[q.needle]] if q else doc.needles
            drow["methods"][method] = {
                "needles": {n.kind: needle_stats(kept, n) for n in needles},
                "composition": composition(kept, doc, tok), "seconds": time.perf_counter() - t0}
            print(f"{doc.id} {method}: " + ", ".join(f"{k} {v['all_value_tokens']:.2f}"
                  for k, v in drow["methods"][method]["needles"].items()), flush=True)
            if name == "reconstruct":
                maps = policy.stacked()
                pos = maps.pop("positions")
                ref = top_n_positions(maps["kvzip"], pos, budget)
                ref_aligned = top_n_positions(maps["aligned"], pos, budget)
                same = sum(len(a & b) for la, lb in zip(ref, kept) for a, b in zip(la, lb)) / sum(
                    len(b) for lb in kept for b in lb)
                drow["reference_topn_equals_run"] = same
                for v in list(VARIANTS) + list(SIGNALS) + list(COMBOS):
                    sel = top_n_positions(maps[v], pos, budget)
                    recall = sum(len(a & b) for la, lb in zip(sel, ref) for a, b in zip(la, lb)) / sum(
                        len(b) for lb in ref for b in lb)
                    recall_aligned = sum(len(a & b) for la, lb in zip(sel, ref_aligned) for a, b in zip(la, lb)) / sum(
                        len(b) for lb in ref_aligned for b in lb)
                    pct = {}
                    for n in doc.needles:
                        # the value tokens' percentile in each (layer, head)'s score distribution
                        vp = torch.tensor(n.value_positions)
                        m = torch.isin(pos, vp)
                        rank = (maps[v][..., None, :] <= maps[v][m.nonzero(as_tuple=True)].view(
                            *m.shape[:2], -1)[..., :, None]).float().mean(-1)
                        pct[n.kind] = float(rank.mean())
                    drow["variants"][v] = {"needles": {n.kind: needle_stats(sel, n)["all_value_tokens"]
                                                       for n in doc.needles},
                                           "value_percentile": pct, "recall_of_reconstruct_top_n": recall,
                                           "recall_of_aligned_top_n": recall_aligned,
                                           "composition": composition(sel, doc, tok)}
        out["documents"].append(drow)
    return out


def write_md(res: dict, path: Path, command: str) -> None:
    L = [f"## Why reconstruct keeps the wrong entries: needle survival at {res['length']} tokens, N = {res['budget']}",
         "", f"{res['model']}, eager engine, B = {res['block']}, one read per (document, method). Command: `{command}`.",
         "Retention: share of (layer, KV head) caches holding **every** token of the needle's value after the "
         "document's read (`:q`: the question known, its needle only).", ""]
    methods = list(res["documents"][0]["methods"])
    L += ["| document | needle | " + " | ".join(methods) + " |", "|---|---|" + "---:|" * len(methods)]
    for d in res["documents"]:
        for n in d["needles"]:
            cells = []
            for m in methods:
                st = d["methods"][m]["needles"].get(n["kind"])
                cells.append(f"{st['all_value_tokens']:.0%}" if st else "—")
            L.append(f"| {d['id']} | {n['kind']} @ {n['depth']:.2f} | " + " | ".join(cells) + " |")
    L += ["", "### Where the kept entries go (share of all kept entries, averaged over documents)", ""]
    names = list(res["documents"][0]["methods"][methods[0]]["composition"])
    L += ["| region | share of the document | " + " | ".join(methods) + " |", "|---|---:|" + "---:|" * len(methods)]
    for k in names:
        doc_share = sum(d["methods"][methods[0]]["composition"][k]["document_share"] for d in res["documents"]) / len(res["documents"])
        cells = [f"{sum(d['methods'][m]['composition'][k]['kept_share'] for d in res['documents']) / len(res['documents']):.1%}"
                 for m in methods]
        L.append(f"| {k} | {doc_share:.1%} | " + " | ".join(cells) + " |")
    docs = [d for d in res["documents"] if d["variants"]]
    if docs:
        L += ["", "### Scoring variants and cheap signals, from the same reconstruct read", "",
              "Each variant's keep set is its top N per (layer, KV head), sinks first (a block's score never "
              "changes once written, so this is the set a block-wise read keeps). Retention as above, averaged "
              "over every needle of the documents; percentile: the needle value tokens' mean rank in their "
              "(layer, head) score distribution; recall: the share of reconstruct's (kvzip) keep set that the "
              f"variant's top N holds. Reference top N equals the run's kept set: "
              f"{min(d['reference_topn_equals_run'] for d in docs):.1%} (lowest document).", "",
              "| variant | what | needle retention | value percentile | recall of reconstruct's top N | recall of aligned's top N |",
              "|---|---|---:|---:|---:|---:|"]
        for v, what in list(VARIANTS.items()) + list(SIGNALS.items()) + [(k, "mean percentile rank of " + " and ".join(p)) for k, p in COMBOS.items()]:
            ret = [x for d in docs for x in d["variants"][v]["needles"].values()]
            pct = [x for d in docs for x in d["variants"][v]["value_percentile"].values()]
            rec = [d["variants"][v]["recall_of_reconstruct_top_n"] for d in docs]
            rea = [d["variants"][v].get("recall_of_aligned_top_n", float("nan")) for d in docs]
            L.append(f"| {v} | {what} | {sum(ret) / len(ret):.0%} | {sum(pct) / len(pct):.2f} | {sum(rec) / len(rec):.0%} "
                     f"| {sum(rea) / len(rea):.0%} |")
        L += ["", f"Chance recall (a random N of the document's tokens): {res['budget'] / docs[0]['tokens']:.0%}."]
    path.write_text("\n".join(L) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", default="4k")
    p.add_argument("--budget", default="512")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--docs", default="passkey:0,passkey:2,passkey:4,multikey:0")
    p.add_argument("--methods", default="reconstruct,keydiff,snapkv,snapkv:q,dapq:q")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--name", default="reconstruct_diagnosis")
    p.add_argument("--md-only", action="store_true", help="rewrite the .md from the .json (no model run)")
    args = p.parse_args(argv)
    out = ROOT / "docs" / "results"
    command = "python tools/results/results_reconstruct_diagnosis.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.md_only:
        res = json.loads((out / f"{args.name}.json").read_text())
    else:
        res = run(args)
        from edgekv.evaluation.report import provenance

        res["provenance"] = provenance([sys.argv[0], *sys.argv[1:]])
        (out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    write_md(res, out / f"{args.name}.md", res.get("provenance", {}).get("command", command) if isinstance(
        res.get("provenance", {}).get("command"), str) else command)


if __name__ == "__main__":
    main()
