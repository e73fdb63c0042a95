#!/bin/bash
# The trained-weights jobs on the GPU machine, after the GPU kit (benchmarks/README.md, "The GPU kit": its setup
# has installed TRL and vLLM and written the Qwen checkpoint). From the repo root:
#   bash benchmarks/trained/gpu_job.sh is        the IS-ratio measurement, one process per sampling setting
#   bash benchmarks/trained/gpu_job.sh learn     starts the learning runs, detached (they outlive the call)
#   bash benchmarks/trained/gpu_job.sh poll 25   waits 25 s, prints progress, aggregates what has finished into $OUT
set -u
export PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
model=/root/models/qwen2.5-coder-0.5b-instruct
case "$1" in
  is)
    for s in untruncated_t1 recipe_8b_lora recipe_32b; do
      timeout 200 python -m benchmarks.trained.is_ratio --model $model --setting $s --out /tmp/is_$s.json \
        > /tmp/is_$s.log 2>&1; echo "$s exit $?"; tail -1 /tmp/is_$s.log
    done
    python -m benchmarks.trained.is_ratio --out "$OUT/is_ratio.json" --merge /tmp/is_*.json > /dev/null
    tar czf "$OUT/is_logs.tgz" /tmp/is_*.log 2>/dev/null ;;
  learn)
    total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    parallel=3; [ "$total" -gt 100000 ] && parallel=6
    mkdir -p /tmp/learn
    setsid nohup python -m benchmarks.trained.learn --model $model --out-dir /tmp/learn --parallel $parallel \
      --seeds 0 1 2 --is-flags "--vllm_importance_sampling_correction false" > /tmp/learn/driver.log 2>&1 < /dev/null &
    echo "learning runs started, $parallel at a time ($total MiB)" ;;
  poll)
    sleep "${2:-20}"
    cat /tmp/learn/driver.log
    for f in /tmp/learn/logs/*.log; do echo "$(basename "$f"): $(grep -c "'step_time'" "$f") steps logged"; done
    python -m benchmarks.trained.learn --aggregate /tmp/learn --out "$OUT/learn_qwen05.json" > /dev/null 2>&1
    tar czf "$OUT/learn_logs.tgz" /tmp/learn/logs /tmp/learn/gpu_memory.csv /tmp/learn/driver.log 2>/dev/null ;;
esac
