#!/usr/bin/env bash
# The GPU check anyone can run on a Linux x86-64 machine with an NVIDIA GPU and its driver, and
# nothing else installed (no Python packages, no network, no compiler; python3's standard library
# and coreutils are used). Its inputs are prepared on any machine with edgekv installed:
#
#     python device_tests/prepare_gpu_check.py build/gpu-check          # writes part1 … partK
#     device_tests/gpu_check.sh build/gpu-check/part1 [build/gpu-check/part2 ...] [--out results.json]
#
# Parts can come one at a time (a machine that takes uploads of limited size): files assemble in
# --work (default /tmp/edgekv-gpu-check) and stay there, and each run checks every case whose files
# are complete. Per case it prints whether the GPU artifact's greedy ids equal the CPU artifact's,
# prefill / decode tok/s against the CPU artifact's, device memory against the plan and the exit
# status; the keydiff case is also opened and closed five times in one process. Exit 1 when a case
# fails. Takes a few minutes on an H200 (most of it the 8K-token SmolLM2 prompts).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v python3 >/dev/null || { echo "gpu_check: python3 (standard library only) is needed" >&2; exit 2; }
exec python3 "$here/gpu_check.py" "$@"
