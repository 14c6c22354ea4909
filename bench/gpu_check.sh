#!/usr/bin/env bash
# One-command check of spdsl on one CUDA device, within BUDGET seconds (560: one device call of
# at most 10 minutes, with the start-up). Sections, in the order of what a first device run
# most needs to learn, each in its own process under its own time limit cut to what is left of
# the budget (a failure or a hang in one does not stop the rest), each section's results
# written, and the summary rewritten, as it ends (a device call killed midway keeps them):
#   parity  - one training step of the small Llama and a 1.1B Llama, kernels on vs off: fp32
#             loss and gradient errors, bf16 errors and step time (bench/gpu/train_parity.py);
#   tests   - pytest tests/kernels on the device: the gpu cases in fp32 (IEEE dots), bf16 and
#             fp16 against the fp32 references, plus the plain CPU tests (bench/gpu/summarize.py
#             counts pass/fail per dtype);
#   masked  - masked attention (a mask program of per-token values) on FlexAttention vs the
#             block kernel: fwd+bwd ms and their output/gradient agreement, bf16, S=8192 and
#             32768, padding+causal, documents, HF additive (bench/gpu/masked_attn_check.py);
#   planner - the memory planner's peak vs torch.cuda.max_memory_allocated, small Llama, SP 1,
#             remat none/auto/full (bench/gpu/planner_check.py);
#   bigstep - one training step (forward, backward, AdamW) of an 8B-wide Llama (llama3_8b
#             widths, 2 layers, bf16) at the longest of 614,400 tokens and shorter ones that
#             the planner says fits the device, sp_shard(seq=1, shard_state=True,
#             remat=Remat("full", offload=True)): plan_memory's peak and pinned host bytes vs
#             torch.cuda.max_memory_allocated/max_memory_reserved and the pinned host
#             allocator's peak (bench/gpu/bigstep.py);
#   bench   - fwd+bwd TFLOP/s (GB/s for the memory-bound kernels) of the Triton kernels vs SDPA's
#             flash backend and torch.compile'd references, bf16 (bench/kernel_bench.py).
# Ring attention is not a section: it runs between ranks (NCCL needs a device per rank, the
# lent machine has one); its per-step compute is the block recurrence the masked section and
# the CPU suite check (tests/kernels/test_ring_attn.py).
# Results: bench/results/gpu/{kernel_tests.log,train_parity.json,planner.json,
# kernel_bench.json,masked_attn.json,bigstep.json,gpu_check.json,summary.md}; the summary is
# printed at the end. The dry run uses LlamaConfig.tiny() models (bigstep: tiny widths, 2
# layers, bf16, 512 tokens) and measures the planner against c10's CPU allocator; its timings
# mean nothing.
#
# Usage, from anywhere:
#   bash bench/gpu_check.sh                 # on the GPU machine
#   bash bench/gpu_check.sh --dry-run       # CPU, well under a minute: every section at tiny
#                                           # shapes, kernels under TRITON_INTERPRET=1, fp32
#   bash bench/gpu_check.sh --out DIR       # results elsewhere (dry run default: a temp dir)
#   bash bench/gpu_check.sh --only bench,masked   # these sections only (a second call: the
#                                           # others' results in the folder are kept)
# Env: PYTHON=... (default: the first of python, python3 that imports torch); BUDGET=seconds;
#      LIMIT_ENV/LIMIT_TESTS/LIMIT_PARITY/LIMIT_PLANNER/LIMIT_BENCH/LIMIT_MASKED/LIMIT_BIGSTEP:
#      seconds per section.
# Nothing is installed: torch and triton must be there.
set -u
cd "$(dirname "$0")/.."
DRY=0
OUT=""
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) OUT="$2"; shift ;;
        --only) ONLY=",$2,"; shift ;;
        *) echo "unknown argument $1 (use --dry-run, --out DIR, --only SECTION,...)"; exit 2 ;;
    esac
    shift
done
T0=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPDSL_KERNELS=auto
if [ $DRY = 1 ]; then
    export TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES=""   # the CPU path even where a GPU is
    OUT=${OUT:-${TMPDIR:-/tmp}/spdsl_gpu_check_dry}
    TINY=--tiny
else
    unset TRITON_INTERPRET            # the interpreter would replace the GPU compiler
    OUT=${OUT:-bench/results/gpu}
    TINY=""
fi
mkdir -p "$OUT"
# Section limits only stop a hang: generous on a shared CPU, where the dry run may crawl.
# bigstep: about 3e16 FLOPs at 614,400 tokens (attention, recomputed once under full remat),
# two minutes at 250 TFLOP/s, after a minute of planning, warm-up and Triton compiles; it
# writes its plan before the step, so a timeout still leaves the planned figures.
# BUDGET: the whole run's seconds (a device call is limited to 10 minutes): each section's limit
# is cut to what is left, and a section with under 20 s left is skipped (its rc 125).
if [ $DRY = 1 ]; then DEF=(300 300 300 300 300 300 300); else DEF=(30 150 100 60 90 100 240); fi
BUDGET=${BUDGET:-$([ $DRY = 1 ] && echo 100000 || echo 560)}
L_ENV=${LIMIT_ENV:-${DEF[0]}} L_TESTS=${LIMIT_TESTS:-${DEF[1]}} L_PARITY=${LIMIT_PARITY:-${DEF[2]}}
L_PLANNER=${LIMIT_PLANNER:-${DEF[3]}} L_BENCH=${LIMIT_BENCH:-${DEF[4]}}
L_MASKED=${LIMIT_MASKED:-${DEF[5]}} L_BIGSTEP=${LIMIT_BIGSTEP:-${DEF[6]}}
[ -z "$ONLY" ] && rm -f "$OUT"/kernel_tests.log "$OUT"/*.json "$OUT"/summary.md

PY=""
for c in ${PYTHON:-} python python3 /opt/torch/.venv/bin/python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c "import torch" 2>/dev/null; then PY=$c; break; fi
done
[ -n "$PY" ] || { echo "no python with torch found (set PYTHON=...)"; exit 1; }

SECTIONS=""
wanted() {    # wanted NAME: in --only (or no --only given)
    [ -z "$ONLY" ] || [[ "$ONLY" == *",$1,"* ]]
}
left() {      # left LIMIT: the limit cut to the budget's remaining seconds
    local rem=$(( BUDGET - ($(date +%s) - T0) ))
    echo $(( $1 < rem ? $1 : rem ))
}
section() {   # section NAME LIMIT_S COMMAND...: run it, record exit status and seconds
    local name=$1 limit start rc secs
    limit=$(left "$2")
    shift 2
    wanted "$name" || return 0
    if [ "$limit" -lt 20 ]; then
        echo "== $name: SKIPPED (${limit}s of the ${BUDGET}s budget left; rerun with --only $name)"
        SECTIONS="$SECTIONS${SECTIONS:+,}$name:125:0"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*"
    start=$(date +%s)
    timeout -k 10 "$limit" "$@"
    rc=$?
    secs=$(( $(date +%s) - start ))
    [ $rc = 124 ] && echo "== $name: TIMED OUT after ${limit}s"
    echo "== $name: exit $rc in ${secs}s"
    SECTIONS="$SECTIONS${SECTIONS:+,}$name:$rc:$secs"
    summarize > /dev/null
}
summarize() { # gpu_check.json and summary.md of the sections so far (a killed run keeps them)
    "$PY" -m bench.gpu.summarize --dir "$OUT" --sections "$SECTIONS"
}

echo "== environment ($(date -u +%FT%TZ), $PY, results in $OUT)"
[ $DRY = 0 ] && { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; }
section env "$L_ENV" "$PY" - <<'PY'
import os, sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"available {torch.cuda.is_available()}")
try:
    import triton
    print(f"triton {triton.__version__}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')}")
except ImportError as e:
    print(f"triton missing: {e}")
import spdsl, spdsl.kernels, spdsl.models.llama  # noqa: E401 - the imports every section needs
print("import spdsl: ok")
if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    assert torch.cuda.is_available(), "no CUDA device: use --dry-run on a CPU machine"
    print(f"device {torch.cuda.get_device_name()}")
PY

# In the order of what a first device run most needs to learn: the whole step's parity on
# the device (one training step, kernels on vs off), then the kernels' own tests (bf16 among
# them), ...
section parity "$L_PARITY" "$PY" -m bench.gpu.train_parity $TINY --out "$OUT/train_parity.json"

# The kernel tests run as parallel pytest processes, one per dtype group (Triton compiles
# each kernel variant once per dtype: in parallel they take a third of the time), each
# under the tests limit; their -v logs are joined into kernel_tests.log, which summarize.py
# counts per dtype (a log survives a timeout; a JUnit file would not).
if [ $DRY = 1 ]; then
    # fp32 only, one case of each kernel's interpreter test: a plumbing check (the full
    # interpreter tests also run bf16, except flash attention, whose bf16 tl.dot the
    # interpreter computes wrongly)
    MARK="interpret"
    TEST_GROUPS=("float32 and (mha-s37 or rms_norm or rope or swiglu or fused_linear_ce)")
else
    # gpu cases in every dtype plus the plain CPU tests; the interpreter and the slow sm_90
    # compile-only check (redundant on a real GPU) are left out
    MARK="gpu or not (interpret or slow)"
    TEST_GROUPS=("float32" "bfloat16" "float16 and not bfloat16" "not float32 and not float16")
fi
if wanted tests; then
L_TESTS=$(left "$L_TESTS")
echo "== tests (limit ${L_TESTS}s): ${#TEST_GROUPS[@]} pytest processes, -m '$MARK'"
start=$(date +%s)
rm -rf "$OUT/parts" && mkdir -p "$OUT/parts"
pids=()
for i in "${!TEST_GROUPS[@]}"; do
    timeout -k 10 "$L_TESTS" "$PY" -m pytest tests/kernels -m "$MARK" -k "${TEST_GROUPS[$i]}" \
        -v -rfEs -p no:cacheprovider --durations=5 > "$OUT/parts/kernel_tests_$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    r=$?
    printf "\n== pytest exit %s\n" "$r" >> "$OUT/parts/kernel_tests_$i.log"
    echo "   pytest -k '${TEST_GROUPS[$i]}': exit $r"
    [ $r = 124 ] && echo "   ... TIMED OUT"
    [ $r != 0 ] && [ $r != 5 ] && rc=1          # 5: nothing selected
done
for i in "${!TEST_GROUPS[@]}"; do
    echo "---- pytest -k '${TEST_GROUPS[$i]}'"
    cat "$OUT/parts/kernel_tests_$i.log"
done > "$OUT/kernel_tests.log"
rm -rf "$OUT/parts"
grep -E "^(FAILED|ERROR) |passed|failed" "$OUT/kernel_tests.log" | tail -40
SECTIONS="$SECTIONS${SECTIONS:+,}tests:$rc:$(( $(date +%s) - start ))"
echo "== tests: exit $rc"
summarize > /dev/null
fi

# then what the kernels' memory and speed claims rest on: masked attention, the planner
# against the device's allocator, the 600K-token step, the kernels' speed
section masked "$L_MASKED" "$PY" -m bench.gpu.masked_attn_check $TINY --out "$OUT/masked_attn.json"
section planner "$L_PLANNER" "$PY" -m bench.gpu.planner_check $TINY \
    ${TINY:+--seq 128} --out "$OUT/planner.json"
section bigstep "$L_BIGSTEP" "$PY" -m bench.gpu.bigstep $TINY --out "$OUT/bigstep.json"
section bench "$L_BENCH" "$PY" bench/kernel_bench.py $TINY --json "$OUT/kernel_bench.json"

echo "== summary"
summarize
status=$?
echo "== gpu_check exit status $status (results in $OUT)"
exit $status
