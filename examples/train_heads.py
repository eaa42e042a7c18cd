"""Self-distil speculative heads for a policy (backbone frozen), optionally as LoRA adapters over existing heads.

    python examples/train_heads.py --model tiny --out runs/heads_tiny
    python examples/train_heads.py --model tiny --init runs/heads_tiny --lora-rank 8 --out runs/heads_tiny_lora

``--model`` is a zoo preset or a local HF folder; prompts come from the task's training split. The per-head
top-1/3/5 hit rates on held-out samples of the policy are printed at the end.
"""

import argparse

from specroll_trl import HeadDistillConfig, SpeculativeHeads, distill_heads
from specroll_trl.adapt.distill import format_hit_table, save_distilled
from specroll_trl.experiments import zoo


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--task", default="arithmetic", choices=["arithmetic", "gsm8k"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--init", default=None, help="start from these heads instead of zero-initialised ones")
    parser.add_argument("--lora-rank", type=int, default=0, help="train only LoRA adapters on the head linears")
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    model, tokenizer = zoo.load_policy(args.model)
    config = HeadDistillConfig(num_samples=args.num_samples, steps=args.steps, temperature=args.temperature)
    heads = SpeculativeHeads.from_pretrained(args.init) if args.init else None
    if args.lora_rank:
        from peft import LoraConfig, get_peft_model

        heads = heads or SpeculativeHeads.from_model(model, config.num_heads)
        heads = get_peft_model(heads, LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank,
                                                 target_modules=["linear"]))
    prompts = zoo.task_prompt_ids(tokenizer, args.task, config.num_samples, seed=20_000)
    heads, report = distill_heads(model, prompts, tokenizer.pad_token_id, config, heads=heads)
    save_distilled(heads, report, args.out)  # adapters only when LoRA-wrapped
    print(format_hit_table(report["hit_rates"], report.get("target_mass")))


if __name__ == "__main__":
    main()
