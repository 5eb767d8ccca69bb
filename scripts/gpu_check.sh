#!/usr/bin/env bash
# The checks only a GPU can do, as one script for a lent device (see docs/results/kernels.md):
#   1. python -m kernels.bench --size 7b   (Triton compiled for real vs the torch references)
#   2. the engine on one CUDA GPU with kernels.backend=triton vs torch (bf16 params, int8 DiLoCo):
#      same losses = the compiled kernels compute what the references compute.
#   3. the compiled training path (hsdp eager vs compiled, fsdp2 eager vs compiled) on one GPU.
#   4. model.arch=llama in bf16 on one GPU: MFU in summary.json, then hsdp.sample on CUDA (same seed, same text).
#   5. the project's Triton kernels inside the compiled graph (bf16): kernels.backend=triton vs torch on the
#      same compiled graph (loaded from the cache the second time) must give the same losses bit for bit,
#      and the generated code must call the hsdp_kernels ops.
# Usage on the device: bash scripts/gpu_check.sh   (writes to $OUT, default /tmp/gpu_check)
set -euo pipefail
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export HSDP_NO_BAR=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python -m kernels.bench --size 7b | tee "$OUT/bench.md"
common=(--config configs/tiny.yaml --set mesh.sync=1 --set mesh.shard=1 --set wandb.mode=disabled
        --set run.steps=60 --set precision.param_dtype=bf16 --set sync.warmup_steps=10 --set sync.every=8
        --set sync.method=diloco --set sync.quantize=int8 --set run.out_dir="$OUT")
python train.py "${common[@]}" --set kernels.backend=triton --set run.name=triton
python train.py "${common[@]}" --set kernels.backend=torch --set run.name=torch
python - "$OUT" <<'PY' | tee "$OUT/engine_check.txt"
import json, sys
out = sys.argv[1]
runs = {n: [json.loads(l) for l in open(f"{out}/{n}/metrics.jsonl")] for n in ("triton", "torch")}
a, b = [m["loss"] for m in runs["triton"]], [m["loss"] for m in runs["torch"]]
err = max(abs(x - y) / abs(y) for x, y in zip(a, b))
for n in runs:
    s = json.load(open(f"{out}/{n}/summary.json"))
    print(f"{n}: final loss {a[-1] if n == 'triton' else b[-1]:.4f}, median step {s['median_step_time_s']*1e3:.1f} ms")
print(f"max relative loss difference triton vs torch: {err:.2e} ({'OK' if err < 1e-3 else 'MISMATCH'})")
PY
# 3. The compiled path on one GPU (nccl, a 1x1 mesh has no collectives to overlap, so this checks the
#    compiled step's numerics and speed; overlap itself needs >= 2 GPUs: rerun with mesh.shard=2 on 2 GPUs):
#    hsdp eager vs compiled (passes none / ours prefetch 1) vs fsdp2 eager / compiled, 60 steps.
ccommon=(--config configs/tiny.yaml --set mesh.sync=1 --set mesh.shard=1 --set wandb.mode=disabled
         --set run.steps=60 --set run.eval_every=0 --set run.out_dir="$OUT")
python train.py "${ccommon[@]}" --set run.name=hsdp-eager
python train.py "${ccommon[@]}" --set run.name=hsdp-compiled-none --set compile.enabled=true --set compile.passes=none
python train.py "${ccommon[@]}" --set run.name=hsdp-compiled-ours --set compile.enabled=true --set compile.passes=ours
python train.py "${ccommon[@]}" --set run.name=fsdp2-eager --set mesh.engine=fsdp2
python train.py "${ccommon[@]}" --set run.name=fsdp2-compiled --set mesh.engine=fsdp2 --set compile.enabled=true
python - "$OUT" <<'PY' | tee "$OUT/compile_check.txt"
import json, sys
out = sys.argv[1]
names = ["hsdp-eager", "hsdp-compiled-none", "hsdp-compiled-ours", "fsdp2-eager", "fsdp2-compiled"]
ref = [json.loads(l)["loss"] for l in open(f"{out}/hsdp-eager/metrics.jsonl")]
print("| run | median step (ms) | compile (s) | peak MiB | max rel loss diff vs hsdp-eager |")
print("|---|---|---|---|---|")
for n in names:
    s = json.load(open(f"{out}/{n}/summary.json"))
    loss = [json.loads(l)["loss"] for l in open(f"{out}/{n}/metrics.jsonl")]
    err = max(abs(a - b) / abs(b) for a, b in zip(loss, ref))
    print(f"| {n} | {s['median_step_time_s']*1e3:.1f} | {s.get('compile_time_s', '-')} | {s['peak_mem_mb']:.0f} | {err:.1e} |")
PY
# 4. llama, bf16, compiled, on one GPU: summary.json's flops_per_token and mfu (the GPU must be in the peak
#    table of hsdp/models/gpt.py), then sampling on CUDA twice with one seed (the texts must match).
lcommon=(--config configs/tiny.yaml --set mesh.sync=1 --set mesh.shard=1 --set wandb.mode=disabled
         --set run.steps=60 --set run.eval_every=0 --set run.out_dir="$OUT" --set model.arch=llama
         --set model.bias=false --set precision.param_dtype=bf16 --set run.checkpoint_every=60)
python train.py "${lcommon[@]}" --set run.name=llama-bf16 --set compile.enabled=true --set compile.passes=ours
python -m hsdp.sample "$OUT/llama-bf16" --device cuda --tokens 64 --seed 1 > "$OUT/sample1.txt"
python -m hsdp.sample "$OUT/llama-bf16" --device cuda --tokens 64 --seed 1 > "$OUT/sample2.txt"
python - "$OUT" <<'PY' | tee "$OUT/llama_check.txt"
import json, sys
out = sys.argv[1]
s = json.load(open(f"{out}/llama-bf16/summary.json"))
same = open(f"{out}/sample1.txt").read() == open(f"{out}/sample2.txt").read()
print(f"llama bf16 compiled: {s['tokens_per_s']:,.0f} tokens/s, {s['flops_per_token']:,} FLOP/token, mfu {s['mfu']}")
print(f"sample on cuda, same seed twice: {'same text' if same else 'DIFFERENT TEXT'}")
PY

# 5. Kernels in the compiled graph on CUDA: the second run loads the first one's graphs (same code, other backend).
kcommon=(--config configs/tiny.yaml --set mesh.sync=1 --set mesh.shard=1 --set wandb.mode=disabled
         --set run.steps=30 --set run.eval_every=0 --set run.out_dir="$OUT" --set precision.param_dtype=bf16
         --set precision.reduce_dtype=fp32 --set compile.enabled=true --set compile.passes=ours)
python train.py "${kcommon[@]}" --set run.name=graph-triton --set kernels.backend=triton
python train.py "${kcommon[@]}" --set run.name=graph-torch --set kernels.backend=torch
python - "$OUT" <<'PY' | tee "$OUT/graph_kernels_check.txt"
import glob, json, sys
out = sys.argv[1]
loss = {n: [json.loads(l)["loss"] for l in open(f"{out}/graph-{n}/metrics.jsonl")] for n in ("triton", "torch")}
code = "".join(open(p).read() for p in glob.glob(f"{out}/graph-triton/compiled/graph*.py"))
ops = [op for op in ("cast_shard", "scale_grad", "scaled_grad_shard") if f"hsdp_kernels.{op}" in code]
for n in loss:
    s = json.load(open(f"{out}/graph-{n}/summary.json"))
    print(f"{n}: compile {s['compile_time_s']} s, cache hits {s.get('compile_cache_hits')}, "
          f"median step {s['median_step_time_s']*1e3:.1f} ms")
print(f"ops in the graph: {ops}; losses triton vs torch: {'bitwise equal' if loss['triton'] == loss['torch'] else 'DIFFER'}")
PY
