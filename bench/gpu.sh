#!/usr/bin/env bash
# Everything this project checks on a GPU, in one device call of at most 8 minutes, most valuable first:
#   bash bench/gpu.sh [--dry-run]     # BUDGET=450 seconds in all; MODEL=PATH for SmolLM2's own weights
# 1. the C++/CUDA extension (the engine's compaction and the CUDA tests need it);
# 2. bench/gpu_decode.py's figures (its docstring): SmolLM2-shaped plain decoding eager vs CUDA graphs in bf16 and
#    fp32, bf16 greedy parity of speculative and plain decoding (5 requests), launches per step, the embedded pair's
#    speculative speedup. SmolLM2 itself (270 MB in bf16, 94 MB as Q4_1) does not fit the 64 MiB a call carries:
#    without MODEL its shape runs with random weights written on the device (timing and parity need no real text);
# 3. the captured path's CUDA tests (tests/test_cuda_graphs.py, tests/test_simulated_cuda.py: same tokens and cache);
# 4. the other graph mechanisms (torch.compile's) timed beside the manual capture;
# 5. the rest of the CUDA tests, the AOT compile table's quick set and the op benchmarks, as time allows.
# Every step runs under one global deadline (BUDGET seconds from the start; a step is given what is left and skipped
# under 20 s). Logs, the JSON and summary.txt go to $OUT when it is set (the device tool brings back 8 files: the
# logs come as one gpu_logs.tar.gz), else to bench/out/gpu. Exit status 1 if a step failed (a step cut at the
# deadline shows rc 124 in the summary and is not a failure; a Triton spill the AOT table reports is a warning). --dry-run runs steps 2 and 4 on the CPU with tiny models and
# the graph stand-in (the script's logic, no GPU). PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
BUDGET=${BUDGET:-450}
DEADLINE=$((SECONDS + BUDGET))
DEST=${OUT:-bench/out/gpu}
LOGS=$(mktemp -d)
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$DEST"
status=0
summary=""
run() {  # name, command...: log each step under what is left of the budget; keep going after a failure
    local name=$1 rc start left=$((DEADLINE - SECONDS))
    shift
    if [ "$left" -lt 20 ]; then
        summary+=$(printf '%-16s skipped (%ss left)' "$name" "$left")$'\n'
        return
    fi
    echo "== $name ($left s left)"
    start=$SECONDS
    timeout "$left" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || status=1  # (124: cut at the deadline, reported, not a failure)
    summary+=$(printf '%-16s rc %-4s %5ss' "$name" "$rc" $((SECONDS - start)))$'\n'
}
finish() {  # the summary, the decode figures and one archive of the logs under $DEST
    if [ -f "$LOGS/gpu_decode.json" ]; then  # the figures again, last, where the caller reads the output's tail
        echo "== gpu_decode rows"
        "$PY" -c "import json, sys
for f in sys.argv[1:]:
    for row in json.load(open(f))['rows']:
        print('   ' + ' | '.join(f'{k} {v:.4g}' if isinstance(v, float) else f'{k} {v}' for k, v in row.items()))" \
            "$LOGS/gpu_decode.json" $(ls "$LOGS"/mechanisms/gpu_decode.json 2>/dev/null) | tee "$LOGS/rows.txt"
    fi
    echo "== summary (rc 124: the step ran into the deadline)"
    printf '%s' "$summary" | tee "$LOGS/summary.txt"
    cp "$LOGS/summary.txt" "$DEST/summary.txt"
    [ -f "$LOGS/gpu_decode.json" ] && cp "$LOGS/gpu_decode.json" "$DEST/"
    tar -czf "$DEST/gpu_logs.tar.gz" -C "$LOGS" . 2>/dev/null
    rm -rf "$LOGS"
    exit $status
}
trap 'status=1; finish' TERM INT
DECODE_SECTIONS=decode,parity,launches,speedup
if [ "$DRY" -eq 1 ]; then
    run gpu_decode "$PY" bench/gpu_decode.py --dry-run --out "$LOGS" --sections "$DECODE_SECTIONS"
    run mechanisms "$PY" bench/gpu_decode.py --dry-run --out "$LOGS/mechanisms" --sections mechanisms
    finish
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$LOGS/gpu.txt"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device: this script is for a GPU machine'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || exit 1
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")  # spreads the Triton compiles over the cores
# The extension first, in one process (the tests' workers would otherwise queue on its build lock).
run ext_build "$PY" -c "from spec_kernels._ext import load_ext; m = load_ext(); print('extension', m.__name__)"
# the decode figures get what is left but ~120 s (the captured path's tests and the mechanisms after them)
run gpu_decode "$PY" bench/gpu_decode.py ${MODEL:+--model "$MODEL"} --out "$LOGS" --sections "$DECODE_SECTIONS" \
    --deadline-s $((DEADLINE - SECONDS - 120))
run graph_tests "$PY" -m pytest -q -m cuda $XDIST -p no:cacheprovider tests/test_cuda_graphs.py \
    tests/test_simulated_cuda.py
run mechanisms "$PY" bench/gpu_decode.py ${MODEL:+--model "$MODEL"} --out "$LOGS/mechanisms" --sections mechanisms \
    --deadline-s $((DEADLINE - SECONDS - 10))
# The other test files with CUDA cases (collecting all of tests/ needs the server and peer packages too).
run tests "$PY" -m pytest -q -m cuda $XDIST -p no:cacheprovider $(grep -l -i cuda tests/test_*.py | \
    grep -v -e test_cuda_graphs -e test_simulated_cuda)
run aot "$PY" bench/aot_compile.py --quick --out "$LOGS/aot_compile.json"
run tree_attention "$PY" bench/bench_tree_attention.py --device cuda --quick
run verify_tree "$PY" bench/bench_verify_tree.py --quick
run compact_kv "$PY" bench/bench_compact_kv.py --quick
run linear "$PY" bench/bench_linear_gpu.py --reps 100
finish
