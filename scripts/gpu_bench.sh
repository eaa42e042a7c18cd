#!/usr/bin/env bash
# GPU benchmark of the default real policy (SmolLM2-135M-Instruct, bf16): TRL's generate vs the speculative engine
# (online and fixed node budgets), 1 to 256 rows, 256 new tokens, temperatures 0.7 and 1.0, GSM8K chat prompts.
# Writes benchmarks/gpu/generation_smollm2_bf16.json (+ .png), then the heads' tau against tree size (2-32 nodes)
# and a step's cost against tree size at 1, 8, 32 and 128 rows: benchmarks/gpu/heads_smollm2_bf16.json (+ .png), and
# what a decoding step does besides the forward (tensor ops, host reads, engine Python lines per step, for generate,
# the no-draft loop and 4-node trees, as benchmarks/step_counts_smollm2.json counts them on CPU):
# benchmarks/gpu/step_counts_smollm2_bf16.json. Needs the project installed with a CUDA torch, and
# the zoo cache (policy + heads) built or buildable offline: `specroll-trl train-heads` is not needed, the bench
# builds what it lacks. Sized to fit a 10-minute device slot on one H100/H200-class GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/gpu/generation_smollm2_bf16.json}
mkdir -p "$(dirname "$out")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "${out%.json}.gpu.txt"
specroll-trl bench generation --model smollm2-135m --dtype bfloat16 --device cuda \
    --batch-sizes 1 8 32 64 128 256 --repeats 3 --max-new-tokens 256 --temperatures 0.7 1.0 \
    --capacity 512 --out "$out"
specroll-trl bench heads --model smollm2-135m --dtype bfloat16 --device cuda \
    --nodes 2 4 8 16 32 --temperatures 0.7 1.0 --prompts 16 --max-new-tokens 256 \
    --cost-batch-sizes 1 8 32 128 --out "$(dirname "$out")/heads_smollm2_bf16.json"
specroll-trl bench counts --model smollm2-135m --dtype bfloat16 --device cuda --batch-sizes 1 8 --nodes 4 \
    --out "$(dirname "$out")/step_counts_smollm2_bf16.json"
