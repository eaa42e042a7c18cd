"""GRPO on GSM8K-style math with speculative rollouts (or TRL's plain generate with --no-spec).

    accelerate launch --config_file accelerate_configs/cpu.yaml examples/grpo_gsm8k.py --max-steps 5

By default the real policy, SmolLM2-135M-Instruct (de-quantised from its wheel on first use), on GSM8K-train
questions as chat prompts, sampled at TRL's default temperature (1.0). Everything is offline: ``--model`` is a zoo
preset or a local HF folder (a toy, ``--model tiny``, runs the arithmetic task in seconds), ``--heads`` a heads
folder (default: the heads shipped or distilled for a preset, else distilled before step 1).
"""

import argparse

from trl import GRPOTrainer

from specroll_trl import SpecGRPOConfig, SpecGRPOTrainer
from specroll_trl.experiments import zoo
from specroll_trl.experiments.rewards import REWARD_FUNCS
from specroll_trl.experiments.tasks import chat_task_dataset, load_gsm8k, make_arithmetic_task


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="zoo preset or local HF model folder")
    parser.add_argument("--heads", default=None, help="heads folder (default: zoo heads for a preset)")
    parser.add_argument("--task", default=None, choices=["arithmetic", "gsm8k"],
                        help="default: the preset's (gsm8k for smollm2-135m, as chat prompts), arithmetic otherwise")
    parser.add_argument("--no-spec", action="store_true", help="plain GRPOTrainer (TRL's generate)")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--prompts-per-step", type=int, default=1)
    parser.add_argument("--max-completion-length", type=int, default=256)
    parser.add_argument("--output-dir", default="runs/grpo_gsm8k")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    parser.add_argument("--report-to", default="none")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_path = str(zoo.resolve_policy(args.model))
    heads_path = args.heads or zoo.preset_heads(args.model)
    n_prompts = max(64, args.max_steps * args.prompts_per_step)
    task = args.task or zoo.preset_task(args.model)
    if args.model in zoo.PRETRAINED:  # a chat model: conversational prompts, as TRL users pass them
        dataset = chat_task_dataset(task, n_prompts, seed=args.seed)
    elif task == "arithmetic":
        dataset = make_arithmetic_task(n_prompts, seed=args.seed)
    else:
        dataset = load_gsm8k("train", limit=n_prompts)
    config = SpecGRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, num_generations=args.num_generations,
        per_device_train_batch_size=args.num_generations * args.prompts_per_step,
        max_completion_length=args.max_completion_length, learning_rate=1e-5, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=args.report_to, bf16=False, seed=args.seed, spec_heads_path=heads_path,
        spec_enabled=not args.no_spec,
    )
    trainer_cls = GRPOTrainer if args.no_spec else SpecGRPOTrainer  # GRPOTrainer ignores the spec_* fields
    trainer = trainer_cls(model=model_path, reward_funcs=REWARD_FUNCS, args=config, train_dataset=dataset)
    trainer.train()
    trainer.save_model(args.output_dir)
    if trainer.accelerator.is_main_process:
        for row in (row for row in trainer.state.log_history if "reward" in row):  # the step logs, not the summary
            keys = ("step", "loss", "reward", "spec/tau", "spec/generation_seconds")
            print({k: round(row[k], 4) if isinstance(row.get(k), float) else row.get(k) for k in keys if k in row})


if __name__ == "__main__":
    main()
