#!/usr/bin/env bash
# Everything this project checks on a GPU, in one command, for a machine with CUDA torch and one GPU:
#   bash bench/gpu.sh            # writes bench/out/gpu/*.json and *.log
# 1. the CUDA tests (the `cuda`-marked parametrisations: Triton and CUDA kernels against their references);
# 2. the AOT compile table (registers / stack / shared memory per Triton configuration, sm_80 and sm_90a);
# 3. the op benchmarks on the GPU (tree_attention, verify_tree, compact_kv_), each against its reference;
# 4. the engine on CUDA: the main job (speculative vs plain, same tokens) and the end-to-end benchmark.
# Record what it prints in bench/RESULTS.md ("GPU" section) with the GPU's name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=bench/out/gpu
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'" || exit 1
status=0
run() {  # name, command...: log each step, keep going after a failure, fail at the end
    local name=$1; shift
    echo "== $name"
    "$@" 2>&1 | tee "$OUT/$name.log" || status=1
}
run tests python -m pytest -q -m cuda tests/
run aot python bench/aot_compile.py --out "$OUT/aot_compile.json"
run tree_attention python bench/bench_tree_attention.py --device cuda --quick
run verify_tree python bench/bench_verify_tree.py --quick
run compact_kv python bench/bench_compact_kv.py --quick
run main_job specdec generate --prompt "def fibonacci(n):" --compare --device cuda --max-tokens 128
run main_job_bf16 specdec generate --prompt "def fibonacci(n):" --compare --device cuda --dtype bfloat16 --max-tokens 128
run e2e python bench/bench_e2e.py --quick --device cuda --no-hf --out "$OUT"
exit $status
