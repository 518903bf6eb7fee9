#!/bin/bash
# Data -> training -> packed drafters, all four, on a CUDA machine that cannot reach the
# network (~12 minutes on one H200 at the defaults; a device call runs 10 minutes at most,
# so there it is two calls on the same warm machine: STAGE=data, then STAGE=train):
#
#   1. answers   the target answers every human turn of TURNS (scripts/prompt_subset.py
#                --all-turns), greedy and 2 sampled variants, DATA_MIN minutes at most
#                (train/batch_generate.py, SLOTS sequences at a time, bf16)
#   2. training  eagle3, mtp, eagle, draft on those answers, live fp32 features, the drafters
#                under bf16 autocast, TRAIN_MIN minutes each at most, a held-out learning
#                curve every EVAL_EVERY tokens
#   3. packing   OUT/drafters.tar.part* (split under 15 MB) and OUT/results.tar.gz (the
#                curves, metrics.json, the logs): 5 files, inside what a device run returns
#                (8 files of 16 MiB); with RETURN=answers instead the answers' shards (a
#                second call on the same warm machine)
#
#   scripts/gpu_drafters.sh MODEL TURNS.json[.gz] OUT [extra `trt-spec train` options]
#
# Environment: STAGE (all | data | train), DEVICE (cuda), DATA_MIN (2.5), TRAIN_MIN (1.5),
# SLOTS (1024), EPOCHS (3), EVAL_EVERY (2M), MAX_CONV (all), RUN (runs/gpu-drafters: ignored
# by git, so a warm device machine keeps it between calls), RETURN (drafters | answers).
# The CPU check of this script runs it small: DEVICE=cpu SLOTS=8 MAX_CONV=4 ... (see
# docs/training.md).
set -euo pipefail
model=$1 turns=$2 out=$3
shift 3
STAGE=${STAGE:-all} DEVICE=${DEVICE:-cuda} DATA_MIN=${DATA_MIN:-2.5} TRAIN_MIN=${TRAIN_MIN:-1.5}
SLOTS=${SLOTS:-1024} EPOCHS=${EPOCHS:-3} EVAL_EVERY=${EVAL_EVERY:-2M}
RUN=${RUN:-runs/gpu-drafters} RETURN=${RETURN:-drafters}
case "$STAGE" in all|data|train) ;; *) echo "STAGE=$STAGE: expected all, data or train" >&2; exit 2 ;; esac
mkdir -p "$out" "$RUN"
out=$(cd "$out" && pwd) RUN=$(cd "$RUN" && pwd)
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

if [ "$RETURN" = answers ]; then  # the shards of an earlier call, compressed, in parts
    tar -C "$RUN" -cf - answers | split -b 15000000 -d - "$out/answers.tar.part"
    ls -la "$out"
    exit 0
fi
$py -c "import trt_spec" 2>/dev/null ||
    $py -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
case "$turns" in
    *.gz) gunzip -c "$turns" > "$RUN/turns.json"; turns=$RUN/turns.json ;;
esac
common=(--model "$model" --data "$turns" --out "$RUN" --device "$DEVICE" --answers distill
        --samples 2 --temperatures 0.6,1.0 --answer-tokens 256 --max-len 1024
        --heldout-conversations 200)
[ -n "${MAX_CONV:-}" ] && common+=(--max-conversations "$MAX_CONV")
start=$(date +%s)
if [ "$STAGE" != train ]; then
    $py -m trt_spec.cli train --method all "${common[@]}" --gen-slots "$SLOTS" \
        --answers-minutes "$DATA_MIN" --data-only "$@" 2>&1 | tee "$RUN/data.log"
    echo "answers: $(( $(date +%s) - start )) s" | tee -a "$RUN/data.log"
    [ "$STAGE" = data ] && { cp "$RUN/data.log" "$out/"; exit 0; }
fi
# --answers-minutes 0: train on the shards written, generate no more
$py -m trt_spec.cli train --method eagle3,mtp,eagle,draft "${common[@]}" --answers-minutes 0 \
    --bf16 --features live --epochs "$EPOCHS" --max-minutes "$TRAIN_MIN" \
    --max-tokens 1000000000 --heldout-tokens 40000 --eval-every "$EVAL_EVERY" \
    --eval-sequences 64 --batch-size 64 --lr 1e-3 --ttt-steps 5 --head-intermediate 768 \
    --draft-vocab 8192 --checkpoint-every 200 --fit-schedule --resume "$@" 2>&1 | tee "$RUN/train.log"
echo "total: $(( $(date +%s) - start )) s" | tee -a "$RUN/train.log"
(cd "$RUN" && tar -czf "$out/results.tar.gz" metrics.json ./*-curve.jsonl ./*.log)
tar -C "$RUN" -cf - eagle3 mtp eagle draft | split -b 15000000 -d - "$out/drafters.tar.part"
ls -la "$out"
