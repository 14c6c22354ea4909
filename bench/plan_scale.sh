#!/bin/bash
# Llama-3.1-8B and -70B planned at 8, 32 and 64 ranks of 80 GiB, per optimizer precision:
# every rank splits the state (--state-shards all), full checkpointing with the all-to-alls
# recomputed and the layer inputs offloaded (pinned, rounded as PyTorch's pinned allocator
# rounds them), 192 GiB of host per rank, the default reserve (spdsl.memory.reserve).
# One command at a time; each one's output in bench/results/plan_scale/<model>_sp<N>_<opt>.txt
#   bash bench/plan_scale.sh first; bash bench/plan_scale.sh; bash bench/plan_scale.sh unrounded
set -u
out=bench/results/plan_scale
mkdir -p "$out"
run() {   # name, model, sp, probe, optimizer flags...
    local name=$1 model=$2 sp=$3 probe=$4; shift 4
    local t0=$SECONDS
    echo "\$ ${PYTORCH_ALLOC_CONF:+PYTORCH_ALLOC_CONF=$PYTORCH_ALLOC_CONF }python -m spdsl memory --model spdsl.models.llama:LlamaConfig.$model --sp $sp --state-shards all --offload --recompute-collectives --remat full --max-seq --probe $probe $*" > "$out/$name.txt"
    python -m spdsl memory --model "spdsl.models.llama:LlamaConfig.$model" --sp "$sp" \
        --state-shards all --offload --recompute-collectives --remat full --max-seq \
        --probe "$probe" "$@" >> "$out/$name.txt" 2>&1
    echo "# exit $?, $((SECONDS - t0)) s" >> "$out/$name.txt"
    echo "$name: $((SECONDS - t0)) s"
}
opt() {   # model, sp, probe, bf16 | master | master_host, more flags
    local m=$1 sp=$2 probe=$3 o=$4; shift 4
    case $o in
        bf16) run "${m}_sp${sp}_$o" "$m" "$sp" "$probe" --optimizer adamw-bf16 "$@" ;;
        master) run "${m}_sp${sp}_$o" "$m" "$sp" "$probe" --optimizer adamw-fp32-master "$@" ;;
        master_host) run "${m}_sp${sp}_$o" "$m" "$sp" "$probe" --optimizer adamw-fp32-master \
            --optimizer-on-host "$@" ;;
    esac
}
# in the order they were run (the 70B rows are the slowest); the first with --granularity 1024,
# the rest 65536 (answers a multiple of it: a bisection step less per halving on 2 loaded cores)
if [ "${1:-}" = first ]; then opt llama3_8b 8 4194304 bf16; exit; fi
G="--granularity 65536"
if [ "${1:-}" = unrounded ]; then   # PyTorch's pinned allocator told not to round above 64 MiB
    export PYTORCH_ALLOC_CONF=pinned_max_round_threshold_mb:64
    run llama3_8b_sp8_bf16_unrounded llama3_8b 8 4194304 --optimizer adamw-bf16 $G
    run llama3_8b_sp8_master_host_unrounded llama3_8b 8 4194304 --optimizer adamw-fp32-master \
        --optimizer-on-host $G
    run llama3_70b_sp32_bf16_unrounded llama3_70b 32 4194304 --optimizer adamw-bf16 $G
    exit
fi
opt llama3_8b 8 4194304 master $G
opt llama3_8b 8 4194304 master_host $G
opt llama3_70b 32 4194304 bf16 $G
opt llama3_8b 32 16777216 bf16 $G
opt llama3_8b 64 33554432 bf16 $G
opt llama3_70b 32 4194304 master_host $G
opt llama3_8b 32 16777216 master_host $G
opt llama3_8b 64 33554432 master_host $G
opt llama3_70b 64 8388608 bf16 $G
opt llama3_70b 8 1048576 master_host $G
opt llama3_8b 32 16777216 master $G
opt llama3_8b 64 33554432 master $G
opt llama3_70b 32 4194304 master $G
opt llama3_70b 64 8388608 master $G
opt llama3_70b 64 8388608 master_host $G       # run after the unrounded ones
