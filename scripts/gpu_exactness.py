"""The engine's exactness on a GPU, on random-init tiny Llama configs (grouped-query attention, tied embeddings):
the chi-square proofs of ``tests/test_llama.py`` and ``tests/test_engine.py`` (every verification rule against the
exact completion distribution, enumerated with ``generate`` on a CPU copy of the model) and greedy token-for-token
identity with ``generate`` on the device. CI has no GPU; this is what a GPU session runs first, in seconds, before it
spends time on benchmarks. It reuses the tests' helpers (run it from a checkout).

  python scripts/gpu_exactness.py --device cuda --out benchmarks/gpu/exactness_llama_fp32.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' helpers

from specroll_trl.engine import SpeculativeGenerator  # noqa: E402
from tests.conftest import cut_after_eos, left_padded  # noqa: E402
from tests.test_engine import PROMPTS, RULES, SAMPLING_SETTINGS, chi_square_pvalue, exact_completion_distribution  # noqa: E402
from tests.test_llama import make_llama, noisy  # noqa: E402


def sampled_pvalues(device: str, samples: int) -> list[dict]:
    records = []
    cpu_model = make_llama(scale=3.0, seed=11)
    model = copy.deepcopy(cpu_model).to(device)
    heads = noisy(cpu_model).to(device)
    for name in ("t1.0", "t0.7-minp-rep", "t1.0-rep-topk-topp"):
        gc = GenerationConfig(do_sample=True, max_new_tokens=3, eos_token_id=1, pad_token_id=0,
                              **SAMPLING_SETTINGS[name])
        exact = [exact_completion_distribution(cpu_model, prompt, gc) for prompt in PROMPTS]
        for rule, options in RULES.items():
            ids, mask = left_padded([p for p in PROMPTS for _ in range(samples)])
            torch.manual_seed(5)
            engine = SpeculativeGenerator(model, heads, gc, capacity=10**9, max_nodes=7, topk_per_head=2, **options)
            out = engine.generate(ids.to(device), mask.to(device))
            rows = out.completion_ids
            pvalues = [chi_square_pvalue(rows[i * samples:(i + 1) * samples], dist) for i, dist in enumerate(exact)]
            records.append({"setting": name, "rule": rule, "pvalues": pvalues, "tau": out.stats.tau})
            print(f"{name:<20} {rule:<14} p = {', '.join(f'{p:.3f}' for p in pvalues)}  tau {out.stats.tau:.2f}",
                  flush=True)
    return records


def greedy_identity(device: str) -> list[dict]:
    records = []
    model = make_llama(vocab=64, hidden=64, layers=3, seed=2, scale=4.0).to(device)
    heads = noisy(model, std=0.2).to(device)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 9, (6,), generator=gen)
    prompts = [torch.randint(2, 64, (int(n),), generator=gen).tolist() for n in lengths]
    ids, mask = (t.to(device) for t in left_padded(prompts))
    gc = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=1, pad_token_id=0)
    reference = cut_after_eos(model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
                              [:, ids.shape[1]:].tolist(), {1})
    for nodes in (2, 8, 16):
        for rule in ("top-k", "drawn"):
            out = SpeculativeGenerator(model, heads, gc, max_nodes=nodes, candidates=rule).generate(ids, mask)
            same = out.completion_ids == reference
            records.append({"max_nodes": nodes, "rule": rule, "identical": same, "tau": out.stats.tau})
            print(f"greedy, up to {nodes:>2} nodes, {rule:<6}: {'identical' if same else 'DIFFERS'} "
                  f"(tau {out.stats.tau:.2f})", flush=True)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=8000, help="samples per prompt of each chi-square test")
    parser.add_argument("--out", default="benchmarks/gpu/exactness_llama_fp32.json")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    greedy = greedy_identity(args.device)
    sampled = sampled_pvalues(args.device, args.samples)
    worst = min(p for r in sampled for p in r["pvalues"])
    summary = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
               "greedy_identical": sum(r["identical"] for r in greedy), "greedy_compared": len(greedy),
               "chi_square_tests": sum(len(r["pvalues"]) for r in sampled), "worst_pvalue": worst,
               "greedy": greedy, "sampled": sampled}
    print(f"greedy identical {summary['greedy_identical']} / {len(greedy)}; {summary['chi_square_tests']} chi-square "
          f"tests, worst p {worst:.4f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
