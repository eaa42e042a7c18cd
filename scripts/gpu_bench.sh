#!/usr/bin/env bash
# GPU benchmark of the default policy (SmolLM2-135M-Instruct) on one CUDA device: about 7 minutes on an
# H100/H200-class GPU with the project installed beside a CUDA torch; the zoo cache ($SPECROLL_HOME) is built
# offline on the way (the policy from its GGUF wheel, its shipped heads). Writes into DIR (default benchmarks/gpu):
#   gpu.txt                             the device
#   exactness_llama_fp32.json           chi-square proofs and greedy identity on tiny random Llama configs
#   identity_smollm2_fp32.json          greedy token-for-token identity with generate on the device (fp32)
#   step_cost_smollm2_bf16.json, .png   a step's cost against draft nodes (0-32) at 1 / 8 / 64 rows
#   step_counts_smollm2_bf16.json       tensor ops, host reads and engine Python lines per step, as
#                                       benchmarks/step_counts_smollm2.json counts them on CPU
#   generation_t{1.0,0.7}_smollm2_bf16.json, .png  per token against TRL's generate: the defaults (online budget),
#                                       4 and 16 draft nodes every step, no drafting; 1 / 8 / 64 rows, 128 new
#                                       tokens, medians of 3 alternating rounds
# usage: scripts/gpu_bench.sh [DIR]
#   DEVICE=cpu DTYPE=float32 SMOKE=1 scripts/gpu_bench.sh /tmp/dry: the same steps, tiny sizes (a dry run on CPU)
set -uo pipefail
cd "$(dirname "$0")/.."
dir=${1:-benchmarks/gpu}
device=${DEVICE:-cuda}
dtype=${DTYPE:-bfloat16}
mkdir -p "$dir"
if [ -n "${SMOKE:-}" ]; then
    rows=(1 2); tokens=16; repeats=1; nodes=(2); identity=(--prompts 1 --max-new-tokens 8 --nodes 2); samples=500
else
    rows=(1 8 64); tokens=128; repeats=3; nodes=(1 2 4 8 16 32); identity=(); samples=8000
fi
status=0
run() { echo "== $*"; "$@" || { echo "!! failed ($?): $*"; status=1; }; }
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$dir/gpu.txt"
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$dir/gpu.txt"
run python3 scripts/gpu_exactness.py --device "$device" --samples "$samples" --out "$dir/exactness_llama_fp32.json"
run python3 scripts/gpu_identity.py --device "$device" "${identity[@]}" --out "$dir/identity_smollm2_fp32.json"
run python3 -m specroll_trl.cli bench heads --model smollm2-135m --dtype "$dtype" --device "$device" --prompts 0 \
    --nodes "${nodes[@]}" --cost-batch-sizes "${rows[@]}" --out "$dir/step_cost_smollm2_bf16.json"
run python3 -m specroll_trl.cli bench counts --model smollm2-135m --dtype "$dtype" --device "$device" \
    --batch-sizes 1 8 --nodes 4 --out "$dir/step_counts_smollm2_bf16.json"
for temperature in 1.0 0.7; do
    run python3 -m specroll_trl.cli bench generation --model smollm2-135m --dtype "$dtype" --device "$device" \
        --batch-sizes "${rows[@]}" --repeats "$repeats" --max-new-tokens "$tokens" --temperatures "$temperature" \
        --fixed-nodes 0 4 16 --out "$dir/generation_t${temperature}_smollm2_bf16.json"
done
exit $status
