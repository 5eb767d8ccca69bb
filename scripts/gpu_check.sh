#!/usr/bin/env bash
# The checks only a GPU can do, as one script for one lent GPU: under 6 minutes on an H200, three files back.
#
#   (a) python -m pytest -q tests/test_cuda_parity.py: every Triton kernel, compiled for real, against its torch
#       reference on the CPU (bitwise) and on the GPU (bitwise, or the bound the test states and derives).
#   (d) the engine on one GPU (configs/tiny.yaml, 1x1 mesh, DiLoCo every 8 steps after 10, 60 steps),
#       kernels.backend=triton vs torch, losses step by step: fp32 params without quantization (bound 1e-6,
#       bitwise expected) and bf16 params with int8 quantization (bound 2^-6; see the note at the stage).
#   (b) python -m kernels.bench --size 7b: each kernel's bandwidth against the device's measured copy.
#   (e) scripts/muon_ns_bench.py: Muon's bf16 Newton–Schulz at gpu-124m's matrix shapes (ms per step).
#   (c) configs/gpu-124m.yaml on one GPU, 30 steps of synthetic tokens: hsdp eager, hsdp compiled (the default
#       compile.scope=blocks), FSDP2 compiled, then hsdp compile.scope=step if time is left; steady and
#       whole-run MFU, compile_time_s and peak memory from each summary.json.
#
# Usage on the device:   bash scripts/gpu_check.sh          (torch + triton; no wandb needed: wandb.mode=disabled)
# $OUT (default /tmp/gpu_check) gets summary.md (every table), summary.json and gpu_check.log, nothing else;
# the run folders and other intermediate files stay in $WORK (default /tmp/gpu_check_work), and
# scripts/gpu_summary.py rebuilds the two summaries from them after every stage, so a stage cut off by the
# time budget still leaves the summaries of the ones before it. The stages share HSDP_GPU_CHECK_BUDGET_S
# seconds (default 330), each also under its own cap; a stage that no longer fits is skipped (SKIP).
# Expected on an H200 (estimates; summary.md's Stages table has what each took): (a) ~30 s, (d) ~20 s (its
# four runs side by side), (b) ~30 s, (c) ~3 min, the two compiles most of it.
#
# HSDP_GPU_CHECK_ONLY="parity d- bench c-hsdp-eager" runs only the stages whose names start with one of
# the words (a rerun of some stages inside what is left of a lease); the others read SKIP.
# On a CPU box, HSDP_GPU_CHECK_CPU=1 runs the same plumbing with tiny settings (gloo, a 1-layer model, the
# Triton interpreter for kernels.backend=triton, bench on the CPU, each stage's cap x4; give it a budget
# such as HSDP_GPU_CHECK_BUDGET_S=1800); the GPU bounds then read SKIP.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-/tmp/gpu_check}
WORK=${WORK:-/tmp/gpu_check_work}
PY=${PYTHON:-python3}
CPU=${HSDP_GPU_CHECK_CPU:-0}
BUDGET=${HSDP_GPU_CHECK_BUDGET_S:-330}
ONLY=${HSDP_GPU_CHECK_ONLY:-}
RESERVE=10  # seconds kept for the last summary
START=$(date +%s)
DEADLINE=$((START + BUDGET))
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK/runs"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1

export HSDP_NO_BAR=1 PYTHONUNBUFFERED=1
SCALE=1  # the stages' own caps times this
if [[ $CPU == 1 ]]; then
    MODE=cpu
    SCALE=4  # a busy 2-core box compiles and runs the interpreter slowly; the budget still bounds the whole
    export TRITON_INTERPRET=1  # kernels.backend=triton on CPU tensors runs the interpreter
else
    MODE=gpu
    export TRITON_INTERPRET=0  # tests/conftest.py would set 1 (the CPU suite's interpreter) if it were unset
fi

summarize() { "$PY" scripts/gpu_summary.py "$WORK" "$OUT" --mode "$MODE" "$@"; }

selected() {  # selected NAME: whether HSDP_GPU_CHECK_ONLY is unset or one of its words starts NAME
    [[ -z $ONLY ]] && return 0
    local w
    for w in $ONLY; do
        [[ $1 == "$w"* ]] && return 0
    done
    return 1
}

# stage NAME CAP_S STDOUT_FILE CMD...: CMD under min(CAP_S, the budget left) seconds (its whole process group
# is killed at the limit), stdout to STDOUT_FILE ("-": the log); its exit code and time go to stages.jsonl.
stage() {
    local name=$1 cap=$(($2 * SCALE)) out=$3
    shift 3
    if ! selected "$name"; then
        printf '{"stage": "%s", "skipped": "not in HSDP_GPU_CHECK_ONLY"}\n' "$name" >>"$WORK/stages.jsonl"
        return
    fi
    local left=$((DEADLINE - RESERVE - $(date +%s)))
    if ((left < 20)); then
        echo "== $name: SKIP (${left} s of the budget left)"
        printf '{"stage": "%s", "skipped": "out of time (%d s left)"}\n' "$name" "$left" >>"$WORK/stages.jsonl"
        return
    fi
    local limit=$((cap < left ? cap : left))
    echo "== $name (limit ${limit} s): $*"
    local t0 rc
    t0=$(date +%s%N)
    if [[ $out == - ]]; then
        timeout --kill-after=10 "$limit" "$@"
    else
        timeout --kill-after=10 "$limit" "$@" >"$out"
    fi
    rc=$?
    local ms=$((($(date +%s%N) - t0) / 1000000))
    [[ $out != - ]] && cat "$out"
    printf '{"stage": "%s", "rc": %d, "seconds": %d.%03d, "limit_s": %d}\n' "$name" "$rc" $((ms / 1000)) \
        $((ms % 1000)) "$limit" >>"$WORK/stages.jsonl"
    echo "== $name: exit code $rc after $((ms / 1000)) s"
    if [[ $BACKGROUND == 0 ]]; then
        summarize --quiet || echo "gpu_summary.py failed"
    fi
}
BACKGROUND=0  # 1 while stages run side by side (`stage ... &`): the summary is written after their `wait`

{
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    else
        echo "no nvidia-smi"
    fi
    "$PY" -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, \
'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    "$PY" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "no triton"
    echo "budget ${BUDGET} s, mode ${MODE}"
} >"$WORK/env.txt" 2>&1
cat "$WORK/env.txt"

# (a) The kernels compiled for real vs their references; the measurements go to parity.json.
export HSDP_PARITY_JSON="$WORK/parity.json"
stage parity 150 - "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_parity.py
unset HSDP_PARITY_JSON

# (d) The engine with kernels.backend=triton vs torch, deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG,
# torch.use_deterministic_algorithms: a repeated run is then bitwise the same, so what differs between the
# two backends is the kernels' arithmetic alone; warn_only for an op without a deterministic version).
#
# Why the bf16 + int8 pair can differ (the earlier check saw 2.27e-3 against its bound of 1e-3): not FMA (the
# kernels launch with FMA contraction off; the references are separate torch ops, one rounding each, with no
# alpha= or addcmul forms that CUDA would contract) and not the bf16 casts (both backends round fp32 -> bf16
# to nearest even, bitwise). Two candidates, which this stage and (a) tell apart: (1) that check ran without
# deterministic algorithms, so the two runs could differ by the accumulation order of atomics in CUDA backward
# kernels whatever the backend (removed here); (2) the int8 quantizer's torch reference computes its scale
# absmax / 127 on the GPU as absmax * fl(1/127) (torch divides a CUDA tensor by a Python number through its
# rounded reciprocal), up to 2^-22 off the kernel's correctly rounded quotient: some blocks' scales differ by
# an ulp, and a rare code by one step ((a) measures both, per kernel). The runs then part at the first param
# sync and the bf16 compute carries the difference on. The bound: the loss is the fp32 cross-entropy of bf16
# logits z and moves by at most 2 max|dz|; logits that round to bf16 at another point differ by up to one bf16
# ulp, 2^-8 |z|, so |d loss| <= 2^-7 max|z|; taking max|z| <= 2 loss (a byte-level model early in training:
# loss 5.5 at the start, ~2-3 after 60 steps), the relative loss difference stays under 2^-6 ~ 1.6e-2. The
# 2.27e-3 seen is ~2^-8.8, inside it. The tight check is the fp32 pair without quantization: every kernel on
# that path is bitwise its GPU reference (copies, and products and sums rounded once), so its losses should be
# bitwise equal; bound 1e-6.
DET='import runpy, sys, torch
torch.use_deterministic_algorithms(True, warn_only=True)
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")'
det=(env CUBLAS_WORKSPACE_CONFIG=:4096:8 "$PY" -c "$DET")  # cuBLAS's deterministic workspace: these runs only
dcommon=(--config configs/tiny.yaml --set mesh.sync=1 --set mesh.shard=1 --set wandb.mode=disabled
    --set run.steps=60 --set run.log_every=1 --set sync.method=diloco --set sync.warmup_steps=10
    --set sync.every=8 --set run.checkpoint_every=0 --set run.out_dir="$WORK/runs")
if [[ $CPU == 1 ]]; then
    dcommon+=(--set run.steps=12 --set sync.warmup_steps=2 --set sync.every=4 --set model.n_layer=1
        --set model.d_model=32 --set model.n_head=2 --set model.seq_len=32 --set data.source=synthetic
        --set run.eval_batches=1)
fi
# On the GPU the four runs go side by side (tiny models: their losses do not depend on what else runs); on a
# CPU box one after another.
dstage() {
    if [[ $MODE == gpu ]]; then
        stage "$@" &
        pids+=($!)
    else
        stage "$@"
    fi
}
BACKGROUND=$([[ $MODE == gpu ]] && echo 1 || echo 0)
pids=()
for backend in triton torch; do
    dstage "d-fp32-$backend" 90 - "${det[@]}" "${dcommon[@]}" --set run.name="d-fp32-$backend" \
        --set precision.param_dtype=fp32 --set sync.quantize=none --set kernels.backend=$backend
    dstage "d-bf16-int8-$backend" 90 - "${det[@]}" "${dcommon[@]}" --set run.name="d-bf16-int8-$backend" \
        --set precision.param_dtype=bf16 --set sync.quantize=int8 --set kernels.backend=$backend
done
((${#pids[@]})) && wait "${pids[@]}"
BACKGROUND=0
summarize --quiet || echo "gpu_summary.py failed"

# (b) Bandwidth of every kernel at a 7B model's unit, against the device's copy.
if [[ $CPU == 1 ]]; then
    stage bench 60 "$WORK/bench.md" "$PY" -m kernels.bench --size small --kernels pack,delta,quantize --device cpu
else
    stage bench 100 "$WORK/bench.md" "$PY" -m kernels.bench --size 7b
fi

# (e) Muon's Newton–Schulz at gpu-124m's matrix shapes in bf16 (scripts/muon_ns_bench.py): the optimizer's
# added compute per step (docs/design.md §6.2).
if [[ $CPU == 1 ]]; then
    stage muon-ns 60 - "$PY" scripts/muon_ns_bench.py --config configs/tiny.yaml --device cpu --reps 3
else
    stage muon-ns 60 - "$PY" scripts/muon_ns_bench.py --config configs/gpu-124m.yaml --device cuda
fi

# (c) gpu-124m on one GPU: the steady rate after compile and warm-up, against the eager step. Each run
# compiles into an inductor cache of its own: a run cut off mid-compile leaves no half-written kernel
# that the next run would load.
ccommon=(--config configs/gpu-124m.yaml --set mesh.sync=1 --set mesh.shard=1 --set wandb.mode=disabled
    --set data.source=synthetic --set model.vocab_size=32768 --set run.steps=30 --set run.log_every=1
    --set run.eval_every=0 --set run.eval_batches=1 --set run.checkpoint_every=0 --set optim.grad_accum=1
    --set run.out_dir="$WORK/runs")
if [[ $CPU == 1 ]]; then
    ccommon+=(--set mesh.backend=gloo --set model.n_layer=1 --set model.d_model=32 --set model.n_head=2
        --set model.seq_len=32 --set model.vocab_size=512 --set data.batch_size=2 --set run.steps=6)
fi
ind="$WORK/inductor"
stage c-hsdp-eager 90 - env TORCHINDUCTOR_CACHE_DIR="$ind/eager" "$PY" train.py "${ccommon[@]}" \
    --set run.name=c-hsdp-eager --set compile.enabled=false
stage c-hsdp-compiled 150 - env TORCHINDUCTOR_CACHE_DIR="$ind/hsdp" "$PY" train.py "${ccommon[@]}" \
    --set run.name=c-hsdp-compiled
stage c-fsdp2-compiled 150 - env TORCHINDUCTOR_CACHE_DIR="$ind/fsdp2" "$PY" train.py "${ccommon[@]}" \
    --set run.name=c-fsdp2-compiled --set mesh.engine=fsdp2
stage c-hsdp-step 180 - env TORCHINDUCTOR_CACHE_DIR="$ind/step" "$PY" train.py "${ccommon[@]}" \
    --set run.name=c-hsdp-step --set compile.scope=step

echo "== summary (after $(($(date +%s) - START)) s)"
summarize
