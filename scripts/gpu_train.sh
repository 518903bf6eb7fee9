#!/bin/bash
# Trains every drafter for a target on a CUDA machine with the default recipe scaled up
# (the target's own answers to every ShareGPT prompt of PROMPTS, live features), then packs
# the drafters into OUT. Runs where the project is not installed and nothing can be fetched:
# the project is installed from this checkout without dependencies.
#
#   scripts/gpu_train.sh MODEL PROMPTS.json RUN_DIR OUT_DIR [extra `trt-spec train` options]
set -euo pipefail
model=$1 prompts=$2 run=$3 out=$4
shift 4
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m trt_spec.cli train --method all --model "$model" --data "$prompts" --out "$run" \
    --answers target "$@" 2>&1 | tee "$out/train.log"
tar -C "$run" -cf "$run/drafters.tar" eagle3 mtp eagle draft metrics.json
split -b 15000000 -d "$run/drafters.tar" "$out/drafters.tar.part"
gzip -c "$run/answers.jsonl" > "$out/answers.jsonl.gz"
ls -la "$out"
