"""Probe a chat policy's reward signal on chat-form tasks (accuracy and format reward per task and temperature).

Example (the numbers in the smollm2-135m preset's notes)::

    SPECROLL_HOME=/tmp/sphome python scripts/smollm_task_probe.py --model smollm2-135m --n 32 \\
        --max-new-tokens 256 --batch-size 16 --temperatures 0 0.7 --tasks gsm8k arithmetic

Prompts are ``tasks.chat_task_dataset`` rows (held-out split, with ``ANSWER_INSTRUCTION`` unless
``--no-instruction``) rendered with the tokenizer's chat template exactly as TRL's GRPOTrainer renders them.
Temperature 0 means greedy; sampling uses TRL's GRPOConfig defaults otherwise (top_k=0, top_p=1.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specroll_trl.experiments import zoo
from specroll_trl.experiments.rewards import correctness_reward, extract_answer, format_reward
from specroll_trl.experiments.tasks import chat_task_dataset


@torch.no_grad()
def probe(model, tokenizer, task: str, n: int, temperature: float, max_new_tokens: int, batch_size: int,
          instruction: bool = True, seed: int = 0, show: int = 0) -> dict:
    kwargs = {} if instruction else {"instruction": None}
    ds = chat_task_dataset(task, n, split="test", **kwargs)
    texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in ds["prompt"]]
    eos = set(model.generation_config.eos_token_id)
    completions, lengths, truncated = [], [], 0
    torch.manual_seed(seed)
    start = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        enc = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
        sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                    else dict(do_sample=False))
        out = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling)[:, enc["input_ids"].shape[1]:]
        for row in out.tolist():
            cut = next((j + 1 for j, t in enumerate(row) if t in eos), None)
            truncated += cut is None
            row = row[:cut] if cut else row
            lengths.append(len(row))
            completions.append([{"role": "assistant",
                                 "content": tokenizer.decode(row, skip_special_tokens=True)}])
    seconds = time.perf_counter() - start
    correct = correctness_reward(completions, ds["answer"])
    fmt = format_reward(completions)
    for c, a, r in list(zip(completions, ds["answer"], correct))[:show]:
        print(f"--- gold {a} reward {r}\n{c[0]['content']}")
    return {
        "task": task, "temperature": temperature, "instruction": instruction, "num_prompts": len(completions),
        "accuracy": statistics.mean(correct), "format_reward": statistics.mean(fmt),
        "format_full": statistics.mean(f == 1.0 for f in fmt),
        "answer_found": statistics.mean(extract_answer(c[0]["content"]) is not None for c in completions),
        "uses_hashes": statistics.mean("####" in c[0]["content"] for c in completions),
        "mean_tokens": statistics.mean(lengths), "truncated": truncated / len(completions),
        "seconds": round(seconds, 1),
        "completions": [c[0]["content"] for c in completions],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--tasks", nargs="+", default=["gsm8k", "arithmetic"])
    parser.add_argument("--no-instruction", action="store_true", help="bare questions, no answer instruction")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--show", type=int, default=0, help="print this many completions per run")
    parser.add_argument("--out", default=None, help="write the records, with every completion, as JSON here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = zoo.load_policy(args.model)
    print(f"loaded {args.model} in {time.perf_counter() - start:.1f}s", flush=True)
    records = []
    for task in args.tasks:
        for temperature in args.temperatures:
            record = probe(model, tokenizer, task, args.n, temperature, args.max_new_tokens, args.batch_size,
                           instruction=not args.no_instruction, show=args.show)
            records.append(record)
            print(json.dumps({k: v for k, v in record.items() if k != "completions"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
