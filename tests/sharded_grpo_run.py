"""A tiny SpecGRPOTrainer run for the sharded-training tests, started by ``accelerate launch`` (not collected by
pytest). Each rank prints one ``SHARDED_RUN {json}`` line: the engine's per-call sync decision and forward counts,
so the test can check that ranks stayed in lockstep.

    DS_ACCELERATOR=cpu accelerate launch --config_file accelerate_configs/deepspeed_zero3_cpu.yaml \\
        tests/sharded_grpo_run.py --output-dir /tmp/run --no-ds3-gather
"""

import argparse
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

from specroll_trl import SpecGRPOConfig, SpecGRPOTrainer, SpeculativeHeads
from specroll_trl.engine import generator as engine
from specroll_trl.experiments import zoo
from specroll_trl.experiments.rewards import REWARD_FUNCS
from specroll_trl.experiments.tasks import make_arithmetic_task


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=2)
    parser.add_argument("--no-ds3-gather", action="store_true", help="GRPOConfig(ds3_gather_for_generation=False)")
    parser.add_argument("--path-heads", action="store_true",
                        help="untrained path-conditioned heads (they read the input embedding) instead of the zoo's")
    args = parser.parse_args()
    heads_path = str(zoo.heads_dir("nano"))
    if args.path_heads:  # every rank builds the same heads (fixed seed), each in its own folder
        torch.manual_seed(0)
        heads_path = f"{args.output_dir}/path_heads_rank{os.environ.get('RANK', '0')}"
        policy = AutoModelForCausalLM.from_pretrained(str(zoo.policy_dir("nano")))
        SpeculativeHeads.from_model(policy, num_heads=2, kind="path").save_pretrained(heads_path)

    sync_decisions: list[bool] = []
    decide = engine.should_sync

    def recording_should_sync(model, requested):
        sync_decisions.append(decide(model, requested))
        return sync_decisions[-1]

    engine.should_sync = recording_should_sync
    calls: list[dict] = []
    generate = engine.SpeculativeGenerator.generate

    def recording_generate(self, input_ids, attention_mask):
        out = generate(self, input_ids, attention_mask)
        calls.append({"rows": int(input_ids.shape[0]), "forwards": out.stats["forwards"],
                      "sync_forwards": out.stats.get("sync_forwards", 0),
                      "drafted": sum(out.stats.get("nodes_per_row", [])) > 0,
                      "lengths": [len(c) for c in out.completion_ids]})
        return out

    engine.SpeculativeGenerator.generate = recording_generate

    config = SpecGRPOConfig(
        output_dir=args.output_dir, max_steps=args.max_steps, num_generations=4, per_device_train_batch_size=4,
        max_completion_length=24, learning_rate=1e-4, logging_steps=1, report_to="none", bf16=False,
        save_strategy="no", seed=0, disable_tqdm=True, spec_heads_path=heads_path,
        # rank 1 drafts nothing (a capacity below its rows): the ranks' rollouts take different numbers of forwards,
        # and only rank 0 drafts, so neither the rank done first nor drafting may issue a collective of its own
        spec_capacity=256 if int(os.environ.get("RANK", "0")) == 0 else 4,
        ds3_gather_for_generation=not args.no_ds3_gather,
        # without a GPU accelerate finds no backend for DeepSpeed and would run each rank as a world of one
        ddp_backend=None if torch.cuda.is_available() else "gloo",
    )
    trainer = SpecGRPOTrainer(model=str(zoo.policy_dir("nano")), reward_funcs=REWARD_FUNCS, args=config,
                              train_dataset=make_arithmetic_task(32, seed=3))
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    taus = [row["spec/tau"] for row in trainer.state.log_history if "spec/tau" in row]
    record = {"rank": trainer.accelerator.process_index, "world": trainer.accelerator.num_processes,
              "distributed_type": str(trainer.accelerator.distributed_type), "synced": sync_decisions,
              "calls": calls, "steps": trainer.state.global_step, "losses": losses, "taus": taus,
              "finite": all(torch.isfinite(torch.tensor(losses)).tolist())}
    print("SHARDED_RUN " + json.dumps(record), flush=True)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    # DeepSpeed's CPU backend sometimes aborts in interpreter teardown ("terminate called without an active
    # exception") after the run has finished and reported; the run's outcome is the record above, not that.
    os._exit(0)
