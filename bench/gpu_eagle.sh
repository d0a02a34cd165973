#!/usr/bin/env bash
# The SmolLM2 EAGLE-3 head's data and training on a lent GPU, time-boxed, in one command:
#   MODEL=/path/SmolLM2-135M-Instruct.Q4_1.gguf BUDGET=480 bash bench/gpu_eagle.sh [OUT]
# 1. data (spec_engine.training.eagle_data --device "$DEVICE"): the features of answers made elsewhere, if ANSWERS names
#    files of them (eagle_data --save-answers: a CPU's answers travel in ~1 MB), then for each of PASSES (default
#    "greedy 1 2 3") the target's answers to the prompt set, greedy or sampled at temperature 0.8 with that seed,
#    until DATA_SHARE of the budget is spent, over PROMPTS in its order (default: the shipped prompt set; a shuffled
#    copy spreads a short pass over all of its kinds), the sampled passes over SAMPLE_PROMPTS (default PROMPTS);
#    GREEDY_SECONDS caps the greedy pass, so the passes after it get the rest (a slow greedy pass took the whole
#    data budget once: bench/RESULTS-log.md, "A GPU fine-tune, not shipped");
# 2. training (spec_engine.training.train_eagle --device "$DEVICE") from the shipped head until EXPORT_SECONDS before the
#    budget ends, at peak learning rate LR (default 5e-4: a fine-tune; the schedule is fitted to the time box);
# 3. the export: the head over K = 4096 with held-out agreement at K = 2048 / 4096 / 8192, into OUT/head, with
#    OUT/report.json, OUT/export.json and OUT/log.txt (copy the head to spec_engine/zoo/models/smollm2-eagle3 and
#    measure it on the CPU before shipping it).
# DEVICE picks the device (default cuda). SMOKE=1 runs the same steps on the embedded target for a few seconds each: a check of the CUDA paths.
# Every step is bounded; a failing step is logged and the export still runs from the last checkpoint.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench/out/gpu_eagle}
BUDGET=${BUDGET:-480}
DATA_SHARE=${DATA_SHARE:-0.45}
EXPORT_SECONDS=${EXPORT_SECONDS:-75}
DEVICE=${DEVICE:-cuda}
ANSWERS=${ANSWERS:-}
PASSES=${PASSES:-greedy 1 2 3}
PROMPTS=${PROMPTS:-spec_engine/training/data/eagle_prompts.jsonl}
SAMPLE_PROMPTS=${SAMPLE_PROMPTS:-$PROMPTS}
GREEDY_SECONDS=${GREEDY_SECONDS:-}
LR=${LR:-5e-4}
WORK=${WORK:-/tmp/gpu_eagle$([ "${SMOKE:-0}" = 1 ] && echo -smoke)}  # data and checkpoints: a rerun resumes
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
LOG="$OUT/log.txt"
if [ "${SMOKE:-0}" = 1 ]; then
    MODEL=spec_engine/zoo/models/target
    DATA_ARGS=(--limit 64 --batch 32 --max-tokens 32)
    TRAIN_ARGS=(--batch-size 8 --eval-every 20 --ckpt-every 20 --draft-vocab 1024)
    EXPORT_ARGS=(--eval-k 512 --draft-vocab 1024)
else
    MODEL=${MODEL:?MODEL: the SmolLM2 gguf}
    DATA_ARGS=(--batch 1024 --max-num-seqs 256 --kv-cache-gib 24)
    TRAIN_ARGS=(--batch-size 32 --lr "$LR" --eval-every 500 --ckpt-every 250 --init spec_engine/zoo/models/smollm2-eagle3)
    EXPORT_ARGS=(--eval-k 2048,8192 --draft-vocab 4096)
fi
left() { echo $((BUDGET - SECONDS)); }
atleast() { echo $(($1 > $2 ? $1 : $2)); }  # value, floor
step() {  # seconds, command...: bounded, logged, never fatal
    local limit=$1
    shift
    echo "== [$SECONDS s] $*" | tee -a "$LOG"
    timeout "$limit" "$@" 2>&1 | tr '\r' '\n' | grep -v -E 'it/s|s/it' | tee -a "$LOG"
    echo "== [$SECONDS s] rc ${PIPESTATUS[0]}" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
data_end=$(awk "BEGIN { print int($BUDGET * $DATA_SHARE) }")
dirs=()
for answers in $ANSWERS; do  # features only: these answers' shards are on the way already, whatever the budget
    dir="$WORK/data/answers-$(basename "$answers")"
    dirs+=("$dir")
    step "$(atleast "$(left)" 120)" "$PY" -m spec_engine.training.eagle_data --target "$MODEL" --out "$dir" \
        --device "$DEVICE" --threads 8 --answers "$answers" "${DATA_ARGS[@]}"
done
for pass in $PASSES; do
    budget=$((data_end - SECONDS))
    [ "$budget" -gt 20 ] || break
    if [ "$pass" = greedy ]; then
        dir="$WORK/data/greedy"
        prompts=$PROMPTS
        sample=()
        [ -z "$GREEDY_SECONDS" ] || budget=$((budget < GREEDY_SECONDS ? budget : GREEDY_SECONDS))
    else
        dir="$WORK/data/t0.8-seed$pass"
        prompts=$SAMPLE_PROMPTS
        sample=(--temperature 0.8 --seed "$pass")
    fi
    dirs+=("$dir")
    step $((budget + 60)) "$PY" -m spec_engine.training.eagle_data --target "$MODEL" --out "$dir" --device "$DEVICE" \
        --prompts "$prompts" --threads 8 --max-seconds "$budget" "${sample[@]}" "${DATA_ARGS[@]}"
done
# training: until EXPORT_SECONDS before the end (its time box counts the data's loading; at least one step), with
# 30 s for its last evaluation and checkpoint before the step's limit
step "$(atleast $(($(left) - EXPORT_SECONDS + 15)) 60)" "$PY" -m spec_engine.training.train_eagle --layout eagle3 \
    --target "$MODEL" --data "${dirs[@]}" --work-dir "$WORK/train" --out "$WORK/head" --device "$DEVICE" \
    --steps 100000 --max-seconds "$(atleast $(($(left) - EXPORT_SECONDS - 15)) 0)" "${TRAIN_ARGS[@]}"
step "$(atleast "$(left)" 30)" "$PY" -m spec_engine.training.train_eagle --layout eagle3 --target "$MODEL" \
    --data "${dirs[@]}" --work-dir "$WORK/train" --export --out "$OUT/head" --device "$DEVICE" "${EXPORT_ARGS[@]}"
cp "$WORK/train/report.json" "$WORK/train/export.json" "$OUT/" 2>/dev/null
echo "== [$SECONDS s] done" | tee -a "$LOG"
