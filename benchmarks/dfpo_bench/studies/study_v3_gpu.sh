#!/bin/bash
# Study v3 unattended on a GPU machine: the pilot of every pre-registered design at once (the three arms its gates
# read: anchor, gspo, mr_w), the gates written, then the main stage on the first design that passed them (refused
# when none did). Runs stay detached between device calls (setsid), so collect OUT_DIR between calls:
#   setsid nohup bash benchmarks/dfpo_bench/studies/study_v3_gpu.sh /tmp/v3 /root/models/smollm2-135m-instruct "0 1 2 3" 8 1 > /tmp/v3.log 2>&1 &
#   tar czf $OUT/v3.tgz -C /tmp/v3 --exclude=work --exclude=logs .
# Started again it resumes: recorded runs, crashes included, are not rerun.
set -u
out=$1 model=$2 gpus=$3 parallel=${4:-8} round=${5:-1}
python -m dfpo_bench.studies.study_v3 --stage pilot --arms anchor gspo mr_w --model "$model" --out-dir "$out" \
  --gpus $gpus --parallel "$parallel" --round "$round" || exit 1
[ -f "$out/pilot_gates.json" ] || { echo "pilot incomplete: no gates"; exit 1; }
python -m dfpo_bench.studies.study_v3 --stage main --model "$model" --out-dir "$out" --gpus $gpus --parallel "$parallel" \
  --round "$round"
