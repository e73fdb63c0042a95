#!/bin/bash
# The multi-node launch behind recipes/slurm/*.sbatch: the sbatch file sets the variables (RECIPE, ACCELERATE_CONFIG,
# MODEL, OUTPUT_DIR, GPUS_PER_NODE, SERVER_TP, MAIN_PORT, VLLM_PORT, MAX_MODEL_LEN, SERVER_WAIT_S, STOP_GRACE_S,
# EXTRA_ARGS, REPO)
# and runs this script, which
#   (no argument)     in the batch step: starts the vLLM server on the last node, waits for its /health, runs the
#                     preflight on every training node, then training; stops training if the server exits,
#                     and the server when training ends;
#   --dry-run         prints every node's exact command and the srun lines that start them; starts nothing;
#   task-server | task-preflight | task-train
#                     inside an srun task: runs this node's command (computed as --dry-run prints it).
# Node roles: the job's nodes in Slurm's order; the first TRAIN_NODES train (the first is machine rank 0 and hosts the
# c10d rendezvous), the last one serves. TRAIN_NODES defaults to the job's node count minus one.
set -euo pipefail

mode=${1:-run}
if [[ $mode == --dry-run ]]; then
    # Outside Slurm: host names from DRY_RUN_NODES, else node0..node4 (the default job's 5 nodes).
    read -r -a NODES <<< "${DRY_RUN_NODES:-$(echo node{0..4})}"
elif [[ -n ${SLURM_JOB_NODELIST:-} ]]; then
    mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
else
    echo "dfpo_multinode.sh: not inside a Slurm job (no SLURM_JOB_NODELIST); submit with sbatch, or use --dry-run" >&2
    exit 2
fi
TRAIN_NODES=${TRAIN_NODES:-$(( ${#NODES[@]} - 1 ))}
if (( TRAIN_NODES < 1 || TRAIN_NODES + 1 > ${#NODES[@]} )); then
    echo "dfpo_multinode.sh: TRAIN_NODES=$TRAIN_NODES needs $(( TRAIN_NODES + 1 )) nodes (training + 1 server), the" \
         "job has ${#NODES[@]}; fix: sbatch --nodes=$(( TRAIN_NODES + 1 )), or set TRAIN_NODES" >&2
    exit 2
fi
TRAIN_HOSTS=("${NODES[@]:0:TRAIN_NODES}")
SERVER_NODE=${NODES[${#NODES[@]}-1]}
SERVER_HOST=${SERVER_HOST:-$SERVER_NODE}   # the address training nodes reach the server at (a host name or an IP)
MASTER_HOST=${MASTER_HOST:-${TRAIN_HOSTS[0]}}
NUM_PROCESSES=$(( TRAIN_NODES * GPUS_PER_NODE ))
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

server_command() {
    CMD=(env VLLM_SERVER_DEV_MODE=1 vllm serve "$MODEL" --host 0.0.0.0 --port "$VLLM_PORT"
         --tensor-parallel-size "$SERVER_TP" --data-parallel-size 1 --gpu-memory-utilization 0.9 --dtype auto
         --kv-cache-dtype auto --model-impl vllm --uvicorn-log-level info --max-model-len "$MAX_MODEL_LEN"
         --weight-transfer-config '{"backend": "nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1)
}

# Flags both the preflight and dfpo-train read: the same node counts, ports and server on every node.
shared_flags() {  # $1: machine rank
    FLAGS=(--config_file "$ACCELERATE_CONFIG" --num_machines "$TRAIN_NODES" --num_processes "$NUM_PROCESSES"
           --machine_rank "$1" --main_process_ip "$MASTER_HOST" --main_process_port "$MAIN_PORT")
}

preflight_command() {  # $1: machine rank
    shared_flags "$1"
    CMD=(python -m dfpo_trl.cli.preflight "$RECIPE" "${FLAGS[@]}" --vllm_server_host "$SERVER_HOST"
         --vllm_server_port "$VLLM_PORT" --output_dir "$OUTPUT_DIR" "${EXTRA[@]}")
}

train_command() {  # $1: machine rank
    shared_flags "$1"
    CMD=(accelerate launch "${FLAGS[@]}" --rdzv_backend c10d --max_restarts 0 -m dfpo_trl "$RECIPE"
         --vllm_server_host "$SERVER_HOST" --vllm_server_port "$VLLM_PORT" --output_dir "$OUTPUT_DIR" "${EXTRA[@]}")
}

quoted() { printf '%q ' "$@" | sed 's/ $//'; }

# srun: one task per node; --kill-on-bad-exit ends every task when one exits non-zero (a crashed rank, a stalled
# weight sync's exit 124), so no node waits forever on a dead peer.
SRUN_TRAIN=(srun --nodes="$TRAIN_NODES" --ntasks="$TRAIN_NODES" --ntasks-per-node=1
            --nodelist="$(IFS=,; echo "${TRAIN_HOSTS[*]}")" --kill-on-bad-exit=1)
SRUN_SERVER=(srun --nodes=1 --ntasks=1 --nodelist="$SERVER_NODE" --kill-on-bad-exit=1)

task_env() {  # inside an srun task: the repository, and VLLM_HOST_IP from VLLM_HOST_IFACE when given
    cd "$REPO"
    if [[ -n ${VLLM_HOST_IFACE:-} && -z ${VLLM_HOST_IP:-} ]]; then
        VLLM_HOST_IP=$(ip -4 -o addr show "$VLLM_HOST_IFACE" | awk '{print $4}' | cut -d/ -f1 | head -n1)
        export VLLM_HOST_IP
    fi
}

case $mode in
--dry-run)
    echo "# dry run: $TRAIN_NODES training node(s) x $GPUS_PER_NODE GPUs ($NUM_PROCESSES processes) + vLLM server on" \
         "$SERVER_NODE (tensor parallel $SERVER_TP); nothing is started"
    echo "# $(quoted "${SRUN_SERVER[@]}") bash $REPO/recipes/slurm/dfpo_multinode.sh task-server &"
    echo "# wait for http://$SERVER_HOST:$VLLM_PORT/health (up to $SERVER_WAIT_S s)"
    echo "# $(quoted "${SRUN_TRAIN[@]}") bash $REPO/recipes/slurm/dfpo_multinode.sh task-preflight"
    echo "# $(quoted "${SRUN_TRAIN[@]}") bash $REPO/recipes/slurm/dfpo_multinode.sh task-train"
    server_command
    echo "server $SERVER_NODE: $(quoted "${CMD[@]}")"
    for rank in "${!TRAIN_HOSTS[@]}"; do
        preflight_command "$rank"
        echo "preflight ${TRAIN_HOSTS[$rank]} (machine rank $rank): $(quoted "${CMD[@]}")"
    done
    for rank in "${!TRAIN_HOSTS[@]}"; do
        train_command "$rank"
        echo "train ${TRAIN_HOSTS[$rank]} (machine rank $rank): $(quoted "${CMD[@]}")"
    done
    ;;
task-server)
    task_env
    server_command
    exec "${CMD[@]}"
    ;;
task-preflight | task-train)
    task_env
    rank=${SLURM_PROCID:?inside srun, one task per training node}
    if [[ $mode == task-preflight ]]; then preflight_command "$rank"; else train_command "$rank"; fi
    exec "${CMD[@]}"   # exec: Slurm's SIGTERM reaches accelerate's launcher and dfpo-train directly
    ;;
run)
    "${SRUN_SERVER[@]}" bash "$REPO/recipes/slurm/dfpo_multinode.sh" task-server &
    server_pid=$!
    trap 'kill "$server_pid" 2>/dev/null || true' EXIT
    url="http://$SERVER_HOST:$VLLM_PORT/health"
    start=$SECONDS
    until curl -sf -o /dev/null --max-time 10 "$url"; do
        if ! kill -0 "$server_pid" 2>/dev/null; then
            echo "dfpo_multinode.sh: the vLLM server on $SERVER_NODE exited before $url answered; see its log above" >&2
            exit 1
        fi
        if (( SECONDS - start > SERVER_WAIT_S )); then
            echo "dfpo_multinode.sh: $url did not answer within SERVER_WAIT_S=$SERVER_WAIT_S s; fix: check the" \
                 "server's log above, or raise SERVER_WAIT_S if it is still loading" >&2
            exit 1
        fi
        sleep "${HEALTH_POLL_S:-10}"
    done
    echo "dfpo_multinode.sh: vLLM server up at $url after $(( SECONDS - start )) s"
    "${SRUN_TRAIN[@]}" bash "$REPO/recipes/slurm/dfpo_multinode.sh" task-preflight
    set +e
    "${SRUN_TRAIN[@]}" bash "$REPO/recipes/slurm/dfpo_multinode.sh" task-train &
    train_pid=$!
    # A server that exits mid-run (crashed, OOM, its node lost) would leave the trainers retrying or blocked: stop
    # training then (SIGTERM, dfpo-train's clean stop; SIGKILL after STOP_GRACE_S). Polled: `wait -n PID` needs
    # bash 5.1.
    while kill -0 "$train_pid" 2>/dev/null && kill -0 "$server_pid" 2>/dev/null; do sleep "${MONITOR_POLL_S:-5}"; done
    if kill -0 "$train_pid" 2>/dev/null; then
        echo "dfpo_multinode.sh: the vLLM server on $SERVER_NODE exited during training; stopping training (SIGTERM," \
             "SIGKILL after STOP_GRACE_S=$STOP_GRACE_S s)" >&2
        kill -TERM "$train_pid"
        for (( waited = 0; waited < STOP_GRACE_S; waited++ )); do
            kill -0 "$train_pid" 2>/dev/null || break
            sleep 1
        done
        kill -KILL "$train_pid" 2>/dev/null
    fi
    wait "$train_pid"
    code=$?
    echo "dfpo_multinode.sh: training ended with exit code $code (0 done, 143 stopped by SIGTERM, 124 stalled sync)"
    exit "$code"
    ;;
*)
    echo "dfpo_multinode.sh: unknown mode '$mode' (use --dry-run, or none inside sbatch)" >&2
    exit 2
    ;;
esac
