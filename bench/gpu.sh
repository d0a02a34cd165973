#!/usr/bin/env bash
# Everything this project checks on a GPU, in one command, for a machine with CUDA torch and one GPU:
#   bash bench/gpu.sh            # writes bench/out/gpu/*.json and *.log, and prints a summary table last
# 1. the CUDA tests (the `cuda`-marked parametrisations: Triton and CUDA kernels against their references);
# 2. the AOT compile table's quick set (registers / stack / shared memory per Triton configuration, sm_80, sm_90a);
# 3. the op benchmarks on the GPU (tree_attention, verify_tree, compact_kv_), each against its reference;
# 4. the engine on CUDA: the main job (speculative vs plain, same tokens) and the end-to-end benchmark;
# 5. with MODEL=PATH (SmolLM2's GGUF, which a call must carry in parts): the main job's five requests on it in bf16,
#    CUDA's default dtype, where greedy parity needs the batch-invariant kernels (bench_main_job exits 1 otherwise).
# Runs from a source checkout with or without `pip install -e .` (the repository goes first on PYTHONPATH and the
# CLI runs as `python -m spec_engine.cli`); PYTHON picks the interpreter (default python3), STEP_TIMEOUT bounds
# each step in seconds (default 300). A failing or hanging step is logged and the next one runs; the exit status
# is 1 if any step failed. Record what it prints in bench/RESULTS.md ("GPU" section) with the GPU's name.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=bench/out/gpu
PY=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1
# pytest-xdist spreads the Triton compiles over the cores when it is installed.
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
status=0
summary=""
run() {  # name, command...: log each step, keep going after a failure or a timeout, fail at the end
    local name=$1 rc start
    shift
    echo "== $name"
    start=$SECONDS
    timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || status=1
    summary+=$(printf '%-16s rc %-4s %5ss' "$name" "$rc" $((SECONDS - start)))$'\n'
}
# The C++/CUDA extension first, in one process (the tests' workers would otherwise queue on its build lock).
run ext_build "$PY" -c "from spec_kernels._ext import load_ext; m = load_ext(); print('extension', m.__name__)"
# The test files with CUDA cases (collecting all of tests/ needs the server and peer packages too).
run tests "$PY" -m pytest -q -m cuda $XDIST -p no:cacheprovider $(grep -l -i cuda tests/test_*.py)
run aot "$PY" bench/aot_compile.py --quick --out "$OUT/aot_compile.json"
run tree_attention "$PY" bench/bench_tree_attention.py --device cuda --quick
run verify_tree "$PY" bench/bench_verify_tree.py --quick
run compact_kv "$PY" bench/bench_compact_kv.py --quick
run linear "$PY" bench/bench_linear_gpu.py --reps 100
run main_job "$PY" -m spec_engine.cli generate --prompt "def fibonacci(n):" --compare --device cuda --max-tokens 128
run main_job_bf16 "$PY" -m spec_engine.cli generate --prompt "def fibonacci(n):" --compare --device cuda \
    --dtype bfloat16 --max-tokens 128
run e2e "$PY" bench/bench_e2e.py --quick --device cuda --no-hf --out "$OUT"
if [ -n "${MODEL:-}" ]; then
    run smollm2_main_job "$PY" bench/bench_main_job.py --model "$MODEL" --device cuda --repeats 3 \
        --out "$OUT/smollm2_main_job.json"
fi
echo "== summary (rc 124: the step ran past STEP_TIMEOUT)"
printf '%s' "$summary" | tee "$OUT/summary.txt"
exit $status
