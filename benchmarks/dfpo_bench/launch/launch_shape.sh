#!/usr/bin/env bash
# The launch-shape runs on a 4-GPU machine, after the kit's setup with vLLM (benchmarks/README.md), in two parts
# (each well inside a 10-minute call); results (JSON) and logs (logs_<part>.tar.gz) go to $OUT.
#   bash benchmarks/dfpo_bench/launch/launch_shape.sh A   # TP 2 server + ZeRO-3 trainer; FSDP2 parity; the CLI under FSDP2
#   bash benchmarks/dfpo_bench/launch/launch_shape.sh B   # server mode on 2 GPUs; whole-loop cost with colocated vLLM on 2 GPUs
#   bash benchmarks/dfpo_bench/launch/launch_shape.sh C   # A's shape and B's server check again, after their fixes
set -u
export PYTHONUNBUFFERED=1
M=${MODEL:-/root/models/smollm2-135m-instruct}
OUT=${OUT:-/tmp/launch_shape}
mkdir -p "$OUT" /tmp/ls
nvidia-smi --query-gpu=index,name,memory.total --format=csv > /tmp/ls/cards.csv
case "$1" in
A)
  python -m dfpo_bench.launch.paper_shape --tokenizer "$M" --out-dir /tmp/ls/shape > /tmp/ls/shape.log 2>&1 &
  shape=$!
  (CUDA_VISIBLE_DEVICES=0 python -m dfpo_bench.launch.fsdp2_parity --phase reference --model "$M" --out-dir /tmp/ls/fsdp2 \
   && CUDA_VISIBLE_DEVICES=0,1 accelerate launch --config_file recipes/accelerate/fsdp2_2gpu.yaml --mixed_precision no \
      --main_process_port 29533 benchmarks/dfpo_bench/launch/fsdp2_parity.py --phase fsdp2 --model "$M" --out-dir /tmp/ls/fsdp2 \
   && CUDA_VISIBLE_DEVICES=0 python -m dfpo_bench.launch.fsdp2_parity --phase compare --model "$M" --out-dir /tmp/ls/fsdp2) \
    > /tmp/ls/fsdp2.log 2>&1
  cp /tmp/ls/fsdp2/fsdp2_parity.json "$OUT"/ 2>/dev/null
  # the CLI under FSDP2 as a user runs it: held-out evaluation, 8 steps, evaluation, save
  CUDA_VISIBLE_DEVICES=0,1 timeout 300 accelerate launch --config_file recipes/accelerate/fsdp2_2gpu.yaml \
    --main_process_port 29534 -m dfpo_trl recipes/smollm2_cpu.yaml --model_name_or_path "$M" --use_cpu false \
    --bf16 true --dtype bfloat16 --max_steps 8 --output_dir /tmp/ls/fsdp2_cli > /tmp/ls/fsdp2_cli.log 2>&1
  echo "fsdp2 cli exit $?" >> /tmp/ls/fsdp2_cli.log
  cp /tmp/ls/fsdp2_cli/dfpo_summary.json "$OUT"/fsdp2_cli_summary.json 2>/dev/null
  wait $shape
  cp /tmp/ls/shape/paper_shape.json "$OUT"/ 2>/dev/null
  tail -n 5 /tmp/ls/fsdp2.log /tmp/ls/fsdp2_cli.log /tmp/ls/shape.log
  ;;
B)
  python -m dfpo_bench.launch.vllm_server --model "$M" --out-dir /tmp/ls/vs --steps 16 --server-gpu 1 --trainer-gpu 0 \
    > /tmp/ls/vs.log 2>&1 &
  server=$!
  python -m dfpo_bench.cost.loop_cost --model "$M" --gpus 2 3 --rounds 4 --out /tmp/ls/lc/loop_cost.json > /tmp/ls/lc.log 2>&1
  cp /tmp/ls/lc/loop_cost.json "$OUT"/ 2>/dev/null
  wait $server
  cp /tmp/ls/vs/vllm_server.json "$OUT"/ 2>/dev/null
  tail -n 5 /tmp/ls/vs.log /tmp/ls/lc.log
  ;;
C)
  # the shape again after its first run trained nothing (top-k/top-p, see paper_shape.py), then the server-mode
  # check with its same-weights floor, beside the drift meter's check against sampling on GPU 2
  python -m dfpo_bench.launch.paper_shape --tokenizer "$M" --out-dir /tmp/ls/shape > /tmp/ls/shape.log 2>&1
  cp /tmp/ls/shape/paper_shape.json "$OUT"/ 2>/dev/null
  if [ -d .meters ]; then
    (cd .meters && CUDA_VISIBLE_DEVICES=2 PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks timeout 240 python -m dfpo_bench.studies.drift_meter_check \
      --device cuda --model "$M" --prompts 32 --samples 256 --batch-size 256 --out /tmp/ls/drift_meter_check_gpu.json > /tmp/ls/drift.log 2>&1;
     cp /tmp/ls/drift_meter_check_gpu.json "$OUT"/ 2>/dev/null) &
  fi
  python -m dfpo_bench.launch.vllm_server --model "$M" --out-dir /tmp/ls/vs --steps 16 --runs dfpo --enforce-eager \
    --server-gpu 1 --trainer-gpu 0 > /tmp/ls/vs.log 2>&1
  cp /tmp/ls/vs/vllm_server.json "$OUT"/vllm_server_check.json 2>/dev/null
  wait
  tail -n 5 /tmp/ls/shape.log /tmp/ls/vs.log /tmp/ls/drift.log
  ;;
esac
tar czf "$OUT/logs_$1.tar.gz" -C /tmp/ls --exclude='*.safetensors' --exclude='*.pt' --exclude='*.bin' \
  --exclude='*.pth' --exclude='tokenizer.json' . 2>/dev/null
ls -la "$OUT"
