"""Greedy token-for-token identity of the speculative engine with ``generate`` for the default policy on a GPU.

The chi-square proofs and the greedy identity tests run on CPU (CI has no GPU); this checks the one claim a GPU can
break on its own: kernels, masks and the cache on CUDA. fp32 (TF32 off), the shipped path heads, held-out GSM8K-test
chat prompts, one row at a time and all rows in one batch, ``--nodes`` draft nodes every step (and the defaults).
Near-ties can still split on a GPU (a forward over 1 and over 17 query tokens may round differently); each mismatch
is reported with the first position where the two differ and the policy's logit gap there.

  python scripts/gpu_identity.py --device cuda --out benchmarks/gpu/identity_smollm2_fp32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's package, installed or not

from specroll_trl.adapt.samples import left_pad  # noqa: E402
from specroll_trl.engine import SpeculativeGenerator  # noqa: E402
from specroll_trl.experiments.heads_bench import bench_prompts  # noqa: E402
from specroll_trl.experiments.zoo import load_heads, load_policy  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--out", default="benchmarks/gpu/identity_smollm2_fp32.json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model, tokenizer = load_policy("smollm2-135m")
    model = model.to(args.device)
    heads = load_heads("smollm2-135m").to(device=args.device, dtype=model.dtype)
    eos = model.generation_config.eos_token_id
    gc = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=eos)
    prompts = bench_prompts(tokenizer, args.prompts)
    engines = {"defaults": SpeculativeGenerator(model, heads, gc)}
    engines.update({f"fixed_{n}": SpeculativeGenerator(model, heads, gc, capacity=10**9, max_nodes=n)
                    for n in args.nodes})
    records = []
    with torch.no_grad():
        batches = [[p] for p in prompts] + [prompts]
        for batch in batches:
            ids, mask = (t.to(args.device) for t in left_pad(batch, tokenizer.pad_token_id))
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
            reference = out[:, ids.shape[1]:].tolist()
            for name, engine in engines.items():
                result = engine.generate(ids, mask)
                for row, (want, got) in enumerate(zip(reference, result.completion_ids)):
                    # generate pads a finished row: the engine's completion (eos included) then padding only
                    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
                    tail_padded = all(t == tokenizer.pad_token_id for t in want[len(got):])
                    same = first is None and tail_padded
                    if first is None and not same:
                        first = len(got)
                    records.append({"engine": name, "rows": len(batch), "row": row, "identical": same,
                                    "first_difference": first, "tokens": len(got), "tau": result.stats.tau})
                    print(f"{name:>9} rows {len(batch)} row {row}: {'identical' if same else f'differs at {first}'}"
                          f" ({len(got)} tokens, tau {result.stats.tau:.2f})", flush=True)
    summary = {"identical": sum(r["identical"] for r in records), "compared": len(records),
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
               "dtype": "float32", "records": records}
    print(f"identical: {summary['identical']} / {summary['compared']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
