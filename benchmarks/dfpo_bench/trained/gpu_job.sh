#!/bin/bash
# The trained-weights jobs on the GPU machine, after the GPU kit (benchmarks/README.md); from the repo root,
# `bash benchmarks/dfpo_bench/trained/gpu_job.sh JOB`: `is` the IS-ratio measurement and its cost (is_ratio.py);
# `cards GPU` the 8B recipe's card rows (cards_8b.py), detached; `poll S` waits S s, prints progress and packs what
# exists into $OUT. A detached job dies with the machine, which goes back 30 s after a call returns: keep polling.
set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
model=/root/models/qwen2.5-coder-0.5b-instruct
case "$1" in
  is)
    timeout 470 python -m dfpo_bench.trained.is_ratio --model $model --out "$OUT/is_ratio.json" > /tmp/is_ratio.log 2>&1
    echo "is_ratio exit $?"; grep -E "^ *(untruncated_t1|recipe_|cost)" /tmp/is_ratio.log | tail -8
    gzip -c /tmp/is_ratio.log > "$OUT/is_ratio.log.gz" ;;
  cards)
    mkdir -p /tmp/cards
    CUDA_VISIBLE_DEVICES=$2 setsid nohup python -m dfpo_bench.trained.cards_8b --out /tmp/cards/cards_8b_as_run.json \
      --work /tmp/cards > /tmp/cards/driver.log 2>&1 < /dev/null &
    echo "cards started on GPU $2" ;;
  poll)
    sleep "${2:-20}"
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
    if [ -d /tmp/cards ]; then
      tail -3 /tmp/cards/driver.log; ls /tmp/cards/*/record.json 2>/dev/null | tr '\n' ' '; echo
      cp /tmp/cards/cards_8b_as_run.json "$OUT/" 2>/dev/null
      tar czf "$OUT/cards.tgz" /tmp/cards/*.json /tmp/cards/*.log /tmp/cards/*/record.json /tmp/cards/*/run.log \
        /tmp/cards/*/peaks.json 2>/dev/null
    fi ;;
esac
