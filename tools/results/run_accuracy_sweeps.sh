#!/usr/bin/env bash
# The accuracy sweeps behind docs/results/accuracy.md, exactly as run for it (SmolLM2-135M, every
# policy, N = 128/256/512/1K, B = 128), then the section itself. One torch thread per run: this
# box is a shared 2-core machine: two lanes of one worker each (more oversubscribe it; eval
# would otherwise start cores / threads workers per lane).
# An interrupted sweep resumes with the same command plus --resume (finished prompts are reused).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=build/eval
E="edgekv eval --policies all --budgets 128,256,512,1k --threads 1 --workers 1"
(
  # passkey, block-wise: 1K and 2K prompts, needle at depths 0.1/0.5/0.9 (seed 0), and a 4K prompt (seed 1)
  $E --task passkey --block 128 --lengths 1k,2k --depths 0.1,0.5,0.9 --seeds 0 --out $OUT/passkey_block
  # a second seed (haystack offset, key values) for the 1K prompts
  $E --task passkey --block 128 --lengths 1k --depths 0.1,0.5,0.9 --seeds 1 --out $OUT/passkey_block_seed1
  $E --task passkey --block 128 --lengths 4k --depths 0.5 --seeds 1 --out $OUT/passkey_block_long
  # and a 7K prompt (needle at depth 0.5, seed 0): the longest that fits the 8K context with the answer
  $E --task passkey --block 128 --lengths 7k --depths 0.5 --seeds 0 --out $OUT/passkey_block_7k
) &
LANE_A=$!
(
  # fidelity to the full cache (2K natural text, last 512 positions scored), the one-block
  # comparison on the same 2K passkey prompts, and the multi-key variant (pass key + a distractor)
  $E --task fidelity --block 128 --fidelity-lengths 2k --fidelity-window 512 --seeds 0 --out $OUT/fidelity_block
  $E --task passkey --block one --lengths 2k --depths 0.1,0.5,0.9 --seeds 0 --out $OUT/passkey_one
  $E --task multikey --keys 2 --block 128 --lengths 2k --depths 0.5 --seeds 0 --out $OUT/multikey_block
) &
LANE_B=$!
# both lanes end, then a failed one stops the script before stale results are copied
rc=0
wait $LANE_A || rc=$?
wait $LANE_B || rc=$?
[ "$rc" = 0 ] || { echo "a sweep lane failed (exit $rc); nothing copied" >&2; exit "$rc"; }
R=docs/results
for d in passkey_block passkey_block_seed1 passkey_block_long passkey_block_7k passkey_one fidelity_block multikey_block; do
  cp $OUT/$d/results.json $R/accuracy_$d.json  # the raw results live beside the section
done
python tools/results/results_accuracy.py $R/accuracy_passkey_block.json $R/accuracy_passkey_block_seed1.json $R/accuracy_passkey_block_long.json \
  $R/accuracy_passkey_block_7k.json $R/accuracy_passkey_one.json $R/accuracy_fidelity_block.json $R/accuracy_multikey_block.json \
  --notes $R/accuracy_notes.md
python tools/results/make_results.py
