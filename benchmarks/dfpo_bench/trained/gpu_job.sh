#!/bin/bash
# The trained-weights jobs on the GPU machine, after the GPU kit (benchmarks/README.md, "The GPU kit": its setup
# has installed TRL and vLLM and written the checkpoints). From the repo root:
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh is               the IS-ratio measurement, one process per sampling setting
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh learn GPUS N      the learning runs, detached, N at a time on each of GPUS ("0 1")
#                                                                  (SEEDS="2 3" CONTRASTS="" for more seeds alone)
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh genpairs GPU      transformers generation under the pre-pass layout
#                                                                  against TRL's, 8B LoRA, 24 GB cap, interleaved rounds
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh v4pilot GPU       study v4's pilot stage alone, detached, 3 processes
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh cards GPU         the 8B recipe's cards (cards_8b.py), detached, on one GPU
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh study GPUS        study v4 (pilot, plan, main, analysis), detached (PILOT_PROCS
#                                                                  on the first of GPUS, MAIN_PROCS on each, MAIN_DEADLINE_S)
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh v4long GPU        study v4 part 3: warm start, then STAGE (pilot|main), detached
#                                                                  (PARALLEL, DEADLINE_S)
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh wait S            waits up to S s for study v4's detached processes (its
#                                                                  driver ends after the analysis), then `poll 1`
#   bash benchmarks/dfpo_bench/trained/gpu_job.sh poll S            waits S s, prints progress, packs what exists into $OUT
#                                                                  (study v4 part 3's archive in 15 MiB parts once larger)
# A detached job dies with the machine, which goes back 30 s after a call returns: keep calling `poll`.
set -u
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
model=/root/models/qwen2.5-coder-0.5b-instruct
smol=/root/models/smollm2-135m-instruct
case "$1" in
  is)
    for s in untruncated_t1 recipe_8b_lora recipe_32b; do
      timeout 200 python -m dfpo_bench.trained.is_ratio --model $model --setting $s --out /tmp/is_$s.json \
        > /tmp/is_$s.log 2>&1; echo "$s exit $?"; tail -1 /tmp/is_$s.log
    done
    python -m dfpo_bench.trained.is_ratio --out "$OUT/is_ratio.json" --merge /tmp/is_*.json > /dev/null
    tar czf "$OUT/is_logs.tgz" /tmp/is_*.log 2>/dev/null ;;
  learn)
    mkdir -p /tmp/learn
    setsid nohup python -m dfpo_bench.trained.learn --model $model --out-dir /tmp/learn --gpus $2 --parallel "$3" \
      --seeds ${SEEDS:-0 1 2} --contrasts ${CONTRASTS-min_replace_is_on transformers_eval} --vllm-memory "${4:-0.06}" \
      --is-flags "--vllm_importance_sampling_correction false" > /tmp/learn/driver.log 2>&1 < /dev/null &
    echo "learning runs started, $3 at a time on GPUs $2" ;;
  cards)
    mkdir -p /tmp/cards
    CUDA_VISIBLE_DEVICES=$2 setsid nohup python -m dfpo_bench.trained.cards_8b --out /tmp/cards/cards_8b.json \
      --work /tmp/cards --tokenizer $smol > /tmp/cards/driver.log 2>&1 < /dev/null &
    echo "cards started on GPU $2" ;;
  genpairs)
    # the recipe's 8B LoRA shape at per-device batch 4 (Min-Replace: the pre-pass layout; TRL: none), transformers
    # generation of 768 tokens, PyTorch capped at a 24 GiB card less the 0.73 GiB the process holds outside it
    mkdir -p /tmp/genpairs
    CUDA_VISIBLE_DEVICES=$2 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid nohup python -m \
      dfpo_bench.cost.users_size --shape qwen3-8b --lora --no-vllm --tokenizer $smol --methods trl_b4 min_replace_b4 \
      --rounds "${3:-5}" --budget-s 1e9 --cap-gib 23.25 --out /tmp/genpairs/gen_pairs_8b.json \
      > /tmp/genpairs/driver.log 2>&1 < /dev/null &
    echo "generation pairs started on GPU $2" ;;
  v4pilot)
    mkdir -p /tmp/v4
    for i in 1 2 3; do
      CUDA_VISIBLE_DEVICES=$2 setsid nohup python -m dfpo_bench.studies.study_v4 --stage pilot --model $smol \
        --out-dir /tmp/v4 > /tmp/v4/pilot_$i.log 2>&1 < /dev/null &
      sleep 5
    done
    echo "study v4 pilot started on GPU $2" ;;
  study)
    # PILOT_PROCS processes for the 6 pilot trajectories, then MAIN_PROCS for the planned ones (a 135M float32
    # process held about 13 GiB on an H200, 2026-11-29: four models and their AdamW states; the throughput was the
    # same at 4, 6 and 8 processes, the GPU at 99%); no main trajectory starts after
    # MAIN_DEADLINE_S s, so none is cut by the machine's return (a planned seed never started is not a crash).
    # GPUS is one index or several ("0 1"): the pilot runs on the first, MAIN_PROCS main processes on each; every
    # process claims its trajectories from the same /tmp/v4, and its log is STAGE_GPU_I.log
    mkdir -p /tmp/v4
    OMP_NUM_THREADS=2 setsid nohup bash -c "
      run() { for g in \$4; do for i in \$(seq \$2); do CUDA_VISIBLE_DEVICES=\$g python -m dfpo_bench.studies.study_v4 \
        --stage \$1 --model $smol --out-dir /tmp/v4 \$3 > /tmp/v4/\$1_\${g}_\$i.log 2>&1 & sleep 2; done; done; wait; }
      run pilot ${PILOT_PROCS:-6} '' '${2%% *}' \
        && python -m dfpo_bench.studies.study_v4 --plan /tmp/v4 > /tmp/v4/plan.log 2>&1 \
        && run main ${MAIN_PROCS:-8} '--deadline-s ${MAIN_DEADLINE_S:-1e9}' '$2'
      python -m dfpo_bench.studies.study_v4 --analyse /tmp/v4 --out /tmp/v4/study_v4.json > /tmp/v4/analyse.log 2>&1
    " > /tmp/v4/driver.log 2>&1 < /dev/null &
    echo "study v4 started on GPUs $2" ;;
  v4long)
    # study v4 part 3, detached on GPU $2: the warm start unless /tmp/v4long has one, then STAGE (pilot or main),
    # PARALLEL runs at a time; no run starts that is expected to end after DEADLINE_S s from the stage's start
    # (required: the device time left, less the polls' margin; EXPECTED_RUN_S until a run has ended, default 900).
    # A later session first unpacks the earlier records into /, every layer in order (for f in $(python -m
    # dfpo_bench.lib.record_layers list RESULTS_FOLDER); do tar xzf $f -C /; done): their warm start, whose model
    # does not travel, is moved aside to /tmp/v4long/laid_before/<when>/ and laid again; the stage refuses to
    # launch if the new laying has other weights than its runs started from
    [ -n "${DEADLINE_S:-}" ] || { echo "v4long needs DEADLINE_S (seconds of device time the runs may use)"; exit 2; }
    mkdir -p /tmp/v4long
    if [ -f /tmp/v4long/warmstart/chosen.json ] && ! compgen -G "/tmp/v4long/warmstart/e*/model/*.safetensors" \
        > /dev/null; then
      when=$(python -c "import json; print(json.load(open('/tmp/v4long/warmstart/chosen.json'))['written_at'])")
      when=${when//:/-}
      mkdir -p "/tmp/v4long/laid_before/$when" && mv /tmp/v4long/warmstart "/tmp/v4long/laid_before/$when/"
      [ ! -f /tmp/v4long/warmstart.log ] || mv /tmp/v4long/warmstart.log "/tmp/v4long/laid_before/$when/"
      echo "the earlier warm start (laid $when, its model not here) is now laid_before/$when; laying it again"
    fi
    # REPLAY=1 lays the warm start a second time into /tmp/v4long/replay beside the stage (its hashes against the
    # first: the analysis's warmstart_replay)
    OMP_NUM_THREADS=2 setsid nohup bash -c "
      [ -f /tmp/v4long/warmstart/chosen.json ] || python -m dfpo_bench.studies.study_v4_long --stage warmstart \
        --model $smol --out-dir /tmp/v4long > /tmp/v4long/warmstart.log 2>&1
      [ -z '${REPLAY:-}' ] || python -m dfpo_bench.studies.study_v4_long --stage warmstart --model $smol \
        --out-dir /tmp/v4long/replay > /tmp/v4long/replay.log 2>&1 &
      python -m dfpo_bench.studies.study_v4_long --stage ${STAGE:-pilot} --out-dir /tmp/v4long --gpus $2 \
        --parallel ${PARALLEL:-8} --deadline-s $DEADLINE_S --expected-run-s ${EXPECTED_RUN_S:-900} \
        >> /tmp/v4long/${STAGE:-pilot}.log 2>&1
    " > /tmp/v4long/driver.log 2>&1 < /dev/null &
    echo "study v4 part 3 (${STAGE:-pilot}) started on GPU $2" ;;
  wait)
    # the pattern's [d] keeps pgrep from matching a command line that holds the pattern itself (a shell that runs
    # `pgrep -f "dfpo_bench.studies.study_v4"` would match its own line and wait the whole S)
    for _ in $(seq "${2:-540}"); do pgrep -f "[d]fpo_bench.studies.study_v4" > /dev/null || break; sleep 1; done
    echo "waited; study v4 processes left: $(pgrep -fc "[d]fpo_bench.studies.study_v4")"
    exec bash "$0" poll 1 ;;
  poll)
    sleep "${2:-20}"
    nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader
    if [ -d /tmp/learn ]; then
      tail -4 /tmp/learn/driver.log
      for f in /tmp/learn/logs/*.log; do echo "$(basename "$f"): $(grep -c "'step_time'" "$f") steps"; done
      python -m dfpo_bench.trained.learn --aggregate /tmp/learn --out "$OUT/learn_qwen05.json" > /dev/null 2>&1
      tar czf "$OUT/learn_logs.tgz" /tmp/learn/logs /tmp/learn/gpu_memory.csv /tmp/learn/driver.log /tmp/learn/runs \
        2>/dev/null
    fi
    if [ -d /tmp/cards ]; then
      tail -3 /tmp/cards/driver.log; ls /tmp/cards/*.json 2>/dev/null | xargs -n1 basename | tr '\n' ' '; echo
      tar czf "$OUT/cards.tgz" /tmp/cards/*.json /tmp/cards/*.log 2>/dev/null
    fi
    if [ -d /tmp/genpairs ]; then
      grep -E "^round|Error|error" /tmp/genpairs/driver.log | tail -6
      tar czf "$OUT/gen_pairs.tgz" /tmp/genpairs 2>/dev/null
    fi
    if [ -d /tmp/v4 ]; then
      for f in /tmp/v4/*/*/s*.jsonl; do echo "$f: $(wc -l < "$f") lines"; done 2>/dev/null | tail -12
      tail -2 /tmp/v4/*.log 2>/dev/null | tail -12
      tar czf "$OUT/study_v4.tgz" /tmp/v4 2>/dev/null
    fi
    if [ -d /tmp/v4long ]; then
      tail -2 /tmp/v4long/*.log 2>/dev/null | tail -10
      tar czf "$OUT/study_v4_long.tgz" --exclude='*.safetensors' --exclude='*.bin' --exclude='*.pt' \
        --exclude='checkpoint-*' /tmp/v4long 2>/dev/null
      # a file over 16 MiB does not come back from $OUT (the folder passed that at 18 MB): over 15 MiB the archive
      # travels as parts beside its SHA-256; here `python -m dfpo_bench.lib.return_parts join FILES_AT
      # study_v4_long.tgz DEST` rebuilds and checks it
      [ ! -f "$OUT/study_v4_long.tgz" ] \
        || python -m dfpo_bench.lib.return_parts split "$OUT/study_v4_long.tgz" > /dev/null
    fi ;;
esac
