#!/usr/bin/env bash
# The accuracy sweeps behind docs/results/accuracy.md: two lanes in parallel, one torch
# thread each, at low priority (this box is a shared 2-core machine). Then:
#   python tools/results_accuracy.py build/eval/*/results.json --notes docs/results/accuracy_notes.md
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/eval
E="nice -n 10 edgekv eval --policies all --threads 1 --seeds 0"
(
  $E --task passkey --budgets 128,256,512,1k --block 128 --lengths 1536 --depths 0.25 --out build/eval/passkey_block
  $E --task passkey --budgets 256,512 --block one --lengths 1536 --depths 0.25 --out build/eval/passkey_one
) > build/eval/laneA.log 2>&1 &
(
  $E --task fidelity --budgets 128,256,512,1k --block 128 --fidelity-lengths 1536 --fidelity-window 384 --out build/eval/fidelity_block
  $E --task fidelity --budgets 256,512 --block one --fidelity-lengths 1536 --fidelity-window 384 --out build/eval/fidelity_one
) > build/eval/laneB.log 2>&1 &
wait
