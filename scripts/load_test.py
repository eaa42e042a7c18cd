"""Load test: one large rollout batch on a zoo policy, speculative engine vs. vanilla ``model.generate``.

Each method runs in its own fresh subprocess, so its peak resident memory (``VmHWM`` from /proc/self/status) is
its own. Both see the same prompts, the same sampling settings and the same torch seed. By default eos is
ignored (the model's and the config's eos ids are cleared) so every row really produces ``--new-tokens``
tokens; ``--stop-at-eos`` keeps the policy's eos ids.

    OMP_NUM_THREADS=1 python scripts/load_test.py                  # 256 x 1024 on nano
    OMP_NUM_THREADS=1 python scripts/load_test.py --quick --json out.json

Prints one JSON line per method (``peak_rss_mb``, ``seconds``, ``tokens``, ...) and a summary table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICK = {"batch": 16, "new_tokens": 64}
FULL = {"batch": 256, "new_tokens": 1024}


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_child(args) -> dict:
    """Load the policy, run one method on the whole batch, return its figures."""
    import torch
    from transformers import GenerationConfig

    from specroll_trl.engine.generator import SpeculativeGenerator
    from specroll_trl.experiments import zoo

    model, tokenizer = zoo.load_policy(args.preset, progress=False)
    if args.prompts == "gsm8k":
        from specroll_trl.experiments.heads_bench import bench_prompts

        prompts = bench_prompts(tokenizer, args.batch)
    else:
        prompts = zoo.task_prompt_ids(tokenizer, "arithmetic", args.batch, seed=args.seed)
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    context = model.config.max_position_embeddings
    new_tokens = min(args.new_tokens, context - width)
    eos = model.generation_config.eos_token_id if args.stop_at_eos else None
    if not args.stop_at_eos:
        model.generation_config.eos_token_id = None  # generate merges the model's defaults into the config
    gc = GenerationConfig(do_sample=True, temperature=args.temperature, top_k=0, max_new_tokens=new_tokens,
                          eos_token_id=eos,
                          pad_token_id=pad)
    rss_loaded = peak_rss_mb()
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    stats = {}
    if args.child == "spec":
        heads = zoo.load_heads(args.preset, progress=False)
        engine = SpeculativeGenerator(model, heads, gc, capacity=args.capacity, max_nodes=args.max_nodes)
        out = engine.generate(input_ids, attention_mask)
        completions = out.completion_ids
        stats = {"tau": out.stats["tau"], "forwards": out.stats["forwards"]}
    else:
        with torch.no_grad():
            seqs = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gc)
        eos_set = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        completions = [row[: next((i + 1 for i, t in enumerate(row) if t in eos_set), len(row))]
                       for row in seqs[:, width:].tolist()]
    seconds = time.perf_counter() - start
    return {
        "method": args.child, "preset": args.preset, "batch": args.batch, "prompt_tokens_max": width,
        "new_tokens_requested": args.new_tokens, "new_tokens": new_tokens, "context": context,
        "stop_at_eos": args.stop_at_eos, "tokens": sum(map(len, completions)), "seconds": round(seconds, 2),
        "peak_rss_mb": round(peak_rss_mb(), 1), "rss_after_load_mb": round(rss_loaded, 1),
        "threads": torch.get_num_threads(), **stats,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="nano")
    parser.add_argument("--batch", type=int, default=None, help=f"rows (default {FULL['batch']})")
    parser.add_argument("--new-tokens", type=int, default=None, help=f"tokens per row (default {FULL['new_tokens']})")
    parser.add_argument("--quick", action="store_true", help=f"small size for tests: {QUICK}")
    parser.add_argument("--capacity", type=int, default=None,
                        help="C_hw of a fixed budget (default: the engine's online budget, what users get)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--prompts", choices=("arithmetic", "gsm8k"), default="arithmetic",
                        help="the task's prompts, or GSM8K-test chat prompts (the heads' benches')")
    parser.add_argument("--max-nodes", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-at-eos", action="store_true", help="keep the policy's eos ids (rows may end early)")
    parser.add_argument("--json", default=None, help="also write both records to this file")
    parser.add_argument("--child", choices=("spec", "vanilla"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = QUICK if args.quick else FULL
    args.batch = args.batch or size["batch"]
    args.new_tokens = args.new_tokens or size["new_tokens"]
    if args.batch < 1 or args.new_tokens < 1:
        parser.error("--batch and --new-tokens must be >= 1")

    if args.child:
        print(json.dumps(run_child(args)), flush=True)
        return 0

    from specroll_trl.experiments import zoo

    # built here, once: in an empty SPECROLL_HOME a child would otherwise count the build in its peak
    zoo.resolve_policy(args.preset)
    zoo.build_heads(args.preset)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    common = ["--preset", args.preset, "--batch", str(args.batch), "--new-tokens", str(args.new_tokens),
              "--max-nodes", str(args.max_nodes), "--seed", str(args.seed), "--temperature", str(args.temperature),
              "--prompts", args.prompts]
    if args.capacity is not None:
        common += ["--capacity", str(args.capacity)]
    if args.stop_at_eos:
        common.append("--stop-at-eos")
    records = []
    for method in ("spec", "vanilla"):
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", method, *common], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            print(f"load test: the {method} run failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        record = json.loads(proc.stdout.strip().splitlines()[-1])
        records.append(record)
        print(json.dumps(record), flush=True)
    spec, vanilla = records
    if spec["new_tokens"] < spec["new_tokens_requested"]:
        print(f"note: prompt ({spec['prompt_tokens_max']}) + {spec['new_tokens_requested']} new tokens exceeds the "
              f"context ({spec['context']}); ran {spec['new_tokens']} new tokens")
    print(f"\n{'method':<8} {'peak RSS MiB':>13} {'after load':>11} {'seconds':>9} {'tokens':>9}")
    for r in records:
        print(f"{r['method']:<8} {r['peak_rss_mb']:>13.1f} {r['rss_after_load_mb']:>11.1f} {r['seconds']:>9.2f} "
              f"{r['tokens']:>9}")
    added = {r["method"]: r["peak_rss_mb"] - r["rss_after_load_mb"] for r in records}
    print(f"memory generation adds to the process: spec {added['spec']:.0f} MiB, vanilla {added['vanilla']:.0f} MiB "
          f"({added['spec'] / max(added['vanilla'], 1e-9):.2f}x)")
    print(f"spec/vanilla peak RSS: {spec['peak_rss_mb'] / vanilla['peak_rss_mb']:.2f}x; "
          f"batch {args.batch} x {spec['new_tokens']} new tokens on {args.preset}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
