"""Regenerate docs/policies.md from the per-policy sections in docs/policies/<name>.md,
in registry order, so each policy's text lives next to the others' but is written once."""

from __future__ import annotations

import argparse
from pathlib import Path

from edgekv.policies import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
HEADER = """# Eviction policies

Every policy keeps at most N entries per layer and KV head after each block (B tokens)
and each decode step; tokens keep their original RoPE positions. Ties are broken toward
the older entry. `edgekv policies` lists the parameters; `--policy-arg key=value` sets them.

Common to all: with N ≥ prompt + output every policy is exactly full attention; block size
changes nothing while nothing is evicted (both are tested for every registered policy in
`tests/test_policy_properties.py`).

## Reading a document knowing its question (`--question`)

When the question is known before the document is read (`edgekv run --question Q`, `edgekv eval
--question`, `BlockEngine.prefill(doc, question=ids)`), the question's tokens run after every
evicting block at their true future positions, as extra rows that never enter the cache, and the
query-aware policies score that block's candidates with the question's queries instead of the
block's own last rows: SnapKV and SnapKV++ take the question's last `window` rows as the
observation window (nothing is pinned: the question is not a candidate), TOVA its last row, H2O
adds the question's column sums to the accumulated ones at scoring time (they never enter its
state), DapQ's pseudo rows become the question. KeyDiff, LagKV, streaming, D2O and RocketKV do not
read the question and run unchanged, so one reading serves every question; a query-aware policy
reads the document once per question. Compiled: `edgekv compile --question-rows N` (questions of
up to N tokens; SnapKV, SnapKV++, TOVA, H2O, DapQ, CPU targets; docs/COMPILER.md; the Android app
uses them too). The effect on long passkeys on the repeated filler: [results](results/question_sweep_repeat.md) (N = 512,
4K-token prompts: SnapKV++ 2 of 10 without the question, 10 of 10 with it, as the full cache, and
so do SnapKV and DapQ; at 2K every query-aware policy answers 10 of 10 with it; at 7K tokens
SnapKV, SnapKV++ and DapQ answer 10 of 10 with it at N = 1K). At 7K with N = 512 the
answer takes longer to come: within the eval's 10 new tokens DapQ answers 8 of 10, SnapKV 6 and
SnapKV++ 3 (7 at κ = 7, 15 or 31: its κ = 63 pools too coarsely for 480 free slots —
[kernels](results/question_kappa_7k.md)); with 24 new tokens SnapKV and DapQ answer 10 of 10 and
SnapKV++ 7. The prompts missed within 10 tokens (needle at depth 0.5–0.7) are the same for every
policy and kernel, and they are not lost needles: the answer is " mentioned in the text as "The
pass key is 17636"", the key at tokens 11–16. Forcing the needle's 40 tokens into every layer and
KV head changes nothing, while the same document read as one block (its keys and values computed
over the whole past, then cut to N = 512 once by the question) answers " 17636." at once
([misses](results/question_misses.md)). So what block-wise reading costs there is not the choice of
what to keep but how the kept entries were made: each later block's keys and values attend only to
the N entries kept before it. Why the query-aware policies fail without it:
each block's candidates are scored by that block's own last rows, which attend to their own
neighbourhood and have not seen the question, so the needle leaves the cache in the block after it
arrives, long before the question does; its retention shows it (SnapKV++ at 4K, N = 512: 59 % of
the layer × head caches keep the key without the question, 76 % with it). KeyDiff keeps diverse
keys whatever is asked and holds at 4K (6 of 10 at N = 512, 9 of 10 at 1K) but not at 7K. DapQ
needs the question least: its pseudo rows are the prompt's last tokens, which are the question when
the question ends the prompt, so without `--question` it answers 10 of 10 at 2K and 4K (N = 512
and 1K); at 7K it drops to 0 of 10 at N = 512 and 4 of 10 at 1K, where the question's own rows
give 8 and 10 of 10. A likely part of that drop is the cut after the last block: DapQ pins no
recent window (the paper's default), so the question's own tokens, which sit in that block,
compete for the N slots. Pinning the prompt's last 32 tokens (`keep_recent=32`) gives 4 of 10 at
7K, N = 512, and KeyDiff with `recent_window=32` goes from 0 to 2 of 10 (`7k_noq_recent` in the
results) — suggestive at 10 prompts (the intervals overlap), not shown; the question's rows while
the document is read give 8 of 10. On natural text as the haystack (2K, N = 512, with the question) the full
cache itself finds 5 of 10; DapQ finds 5 too (not the same five), SnapKV++ 4, KeyDiff none.

## full

No eviction; refuses with the size it needs when cache ⊕ block exceeds N.

## streaming

StreamingLLM: keep `sinks` (default 4) first positions plus the most recent N − sinks.
Positions are not re-indexed into cache slots (the paper re-indexes); score-free, so
block-wise and one-shot give the same set.
"""


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    parts = [HEADER]
    for name in REGISTRY:
        section = ROOT / "docs" / "policies" / f"{name.replace('+', '_p').replace('_p_p', '_pp')}.md"
        if section.is_file():
            parts.append(section.read_text().strip() + "\n")
    # how the policies are evaluated and what that showed of their limits (not a policy)
    evaluation = ROOT / "docs" / "policies" / "evaluation.md"
    if evaluation.is_file():
        parts.append(evaluation.read_text().strip() + "\n")
    (ROOT / "docs" / "policies.md").write_text("\n".join(parts))
    print("wrote docs/policies.md")


if __name__ == "__main__":
    main()
