"""Long GRPO runs of the default policy, one per adaptation arm, resumable (``bench adaptation``).

Every arm trains the same policy on the same GSM8K-train prompts with the same seed, TRL settings and heads; only
the adaptation differs (``ARMS``). Tau is measured on a fixed tree (``max_nodes`` nodes per row every round, so
the heads are exercised whatever the online budget would choose); TRL logs the KL to the starting policy with
``beta > 0``. Each arm checkpoints every ``save_steps`` steps into its own folder and resumes from the latest
checkpoint when rerun, and appends one JSON line per logged step to ``steps.jsonl`` there (resumed steps are not
duplicated), so a killed run loses at most ``save_steps`` steps.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

ARMS = {
    "static": {"spec_reflex": None},
    "reflex": {"spec_reflex": "lookup"},
    "slow": {"spec_reflex": None, "spec_consolidation": True},
    "both": {"spec_reflex": "lookup", "spec_consolidation": True},
}

LOGGED = ("reward", "kl", "spec/tau", "spec/generation_seconds", "spec/tree_nodes_per_row", "spec/consolidations",
          "spec/consolidation_seconds", "spec/consolidation_rejected", "spec/consolidation_gain",
          "spec/reflex/seconds", "spec/capture/seconds", "completions/mean_length", "step_seconds")


class StepLog(TrainerCallback):
    """Appends each logged step's metrics (``LOGGED``, and per-head acceptance) to a JSONL file, once per step,
    with the wall seconds of the step (re-fits in ``on_step_end`` included)."""

    def __init__(self, path: Path):
        self.path = path
        self.done = {json.loads(line)["step"] for line in path.read_text().splitlines()} if path.is_file() else set()
        self._start = self._seconds = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_log(self, args, state, control, logs=None, **kwargs):
        step = state.global_step
        if not logs or "reward" not in logs or step in self.done:
            return
        record = {"step": step, **{k: logs[k] for k in logs if k in LOGGED or k.startswith("spec/accept_head_")}}
        record["step_seconds"] = time.perf_counter() - self._start if self._start else None
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.done.add(step)


def run_arm(arm: str, out: str | Path, model_name: str = "smollm2-135m", steps: int = 40, temperature: float = 1.0,
            num_generations: int = 8, max_completion_length: int = 128, learning_rate: float = 1e-5,
            beta: float = 0.02, max_nodes: int = 4, save_steps: int = 5, heads_path: str | None = None,
            model_path: str | None = None, overrides: dict | None = None, progress: bool = True) -> list[dict]:
    """Train one arm (resuming from its latest checkpoint) and return its per-step records."""
    from ..trainer import SpecGRPOConfig, SpecGRPOTrainer
    from .rewards import REWARD_FUNCS
    from .zoo import preset_dataset, resolve_policy

    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {sorted(ARMS)}")
    folder = Path(out) / f"{arm}_t{temperature:g}"
    folder.mkdir(parents=True, exist_ok=True)
    args = SpecGRPOConfig(
        output_dir=str(folder), max_steps=steps, num_generations=num_generations,
        per_device_train_batch_size=num_generations, max_completion_length=max_completion_length,
        learning_rate=learning_rate, beta=beta, temperature=temperature, logging_steps=1, report_to="none",
        bf16=False, save_strategy="steps", save_steps=save_steps, save_total_limit=1, seed=0,
        disable_tqdm=not progress, spec_heads_path=heads_path, spec_capacity=1_000_000, spec_max_nodes=max_nodes,
        **{**ARMS[arm], **(overrides or {})},
    )
    model = model_path or str(resolve_policy(model_name, progress=progress))
    trainer = SpecGRPOTrainer(model=model, reward_funcs=REWARD_FUNCS, args=args,
                              train_dataset=preset_dataset(model_name, steps))
    log = folder / "steps.jsonl"
    trainer.add_callback(StepLog(log))
    resume = any(folder.glob("checkpoint-*"))
    trainer.train(resume_from_checkpoint=True if resume else None)
    return read_steps(log)


def speed_at_end(arm_folder: str | Path, batch_size: int = 8, repeats: int = 3, max_new_tokens: int = 128,
                 max_nodes: int = 16, fixed_nodes: int = 4, progress: bool = True) -> list[dict]:
    """What the arm's last checkpoint (its policy and its heads) generates per token against ``generate``, at the
    arm's temperature on ``batch_size`` GSM8K-train chat prompts: the engine with the online budget (``spec``,
    up to ``max_nodes`` nodes per row), with the arm's fixed tree (``spec_fixed``, ``fixed_nodes`` per row) and
    without drafting (``compaction_only``); the heads alone (Reflex off); runs alternate, same prompts and seeds
    (``bench._alternate``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..adapt.samples import left_pad
    from ..engine import SpeculativeGenerator, SpeculativeHeads
    from .bench import _alternate
    from .zoo import task_prompt_ids, trl_generation_config

    folder = Path(arm_folder)
    checkpoint = max(folder.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    temperature = float(folder.name.rsplit("_t", 1)[1])  # run_arm names it <arm>_t<temperature>
    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    heads = SpeculativeHeads.from_pretrained(checkpoint / "spec_heads")
    gc = trl_generation_config(model, tokenizer, max_new_tokens, temperature)
    engines = {
        "spec": SpeculativeGenerator(model, heads, gc, max_nodes=max_nodes),
        "spec_fixed": SpeculativeGenerator(model, heads, gc, max_nodes=fixed_nodes, capacity=1_000_000),
        "compaction_only": SpeculativeGenerator(model, heads, gc, max_nodes=0, capacity=1),
    }
    prompts = task_prompt_ids(tokenizer, "gsm8k", batch_size, seed=0, conversational=True)
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    with torch.no_grad():
        for engine in engines.values():
            engine.generate(ids[:, -64:], mask[:, -64:], max_new_tokens=8)  # warm-up, untimed
        records = _alternate(model, engines, [(ids, mask)] * repeats, gc)
    for r in records:
        r.update(arm=folder.name, checkpoint=checkpoint.name, batch_size=batch_size, temperature=temperature,
                 max_new_tokens=max_new_tokens)
        if progress:
            print(f"{folder.name} {checkpoint.name} {r['mode']:<16} per token {r['per_token_speedup']:.2f}x  tau "
                  f"{r['tau'] or float('nan'):.2f}  nodes {r['nodes_per_row']:.1f}", flush=True)
    return records


def read_steps(path: str | Path) -> list[dict]:
    """The per-step records of one arm, by step."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return sorted({r["step"]: r for r in rows}.values(), key=lambda r: r["step"])


def block_means(records: list[dict], key: str, block: int = 5) -> list[float]:
    """Means of ``key`` over consecutive blocks of ``block`` steps."""
    values = [r[key] for r in records if key in r]
    return [statistics.mean(values[i : i + block]) for i in range(0, len(values), block)]


def summarise_arms(folder: str | Path, block: int = 5) -> dict:
    """Every arm under ``folder`` (``<arm>_t<temperature>/steps.jsonl``): its per-step records, tau and KL by block
    of ``block`` steps, tau relative to the static arm of the same temperature over the steps both ran, and what
    each adaptation part cost as a share of the arm's step time."""
    arms = {}
    for log in sorted(Path(folder).glob("*/steps.jsonl")):
        records = read_steps(log)
        step_s = sum(r["step_seconds"] for r in records if r.get("step_seconds"))
        parts = {"reflex": "spec/reflex/seconds", "capture": "spec/capture/seconds",
                 "consolidation": "spec/consolidation_seconds"}
        arms[log.parent.name] = {
            "steps": len(records), "records": records,
            "tau_blocks": block_means(records, "spec/tau", block), "kl_blocks": block_means(records, "kl", block),
            "reward_mean": statistics.mean(r["reward"] for r in records),
            "step_s_median": statistics.median(r["step_seconds"] for r in records if r.get("step_seconds")),
            "cost_share": {name: sum(r.get(key, 0.0) for r in records) / step_s for name, key in parts.items()},
            "consolidations": [(r["step"], r.get("spec/consolidation_gain")) for r in records
                               if "spec/consolidation_seconds" in r],
        }
    for name, arm in arms.items():
        static = arms.get("static_" + name.split("_", 1)[1])
        if static and name != "static_" + name.split("_", 1)[1]:
            n = min(arm["steps"], static["steps"])
            ratio = [a["spec/tau"] / s["spec/tau"] for a, s in zip(arm["records"][:n], static["records"][:n])]
            arm["tau_vs_static_blocks"] = [statistics.mean(ratio[i : i + block]) for i in range(0, n, block)]
            arm["tau_vs_static_from_20"] = statistics.mean(ratio[19:]) if n > 19 else None
    return arms


def format_arms(arms: dict) -> str:
    """A markdown table of ``summarise_arms``: tau by block of 5 steps, its ratio to the static arm, the re-fits and
    what each part cost as a share of a step."""
    lines = ["| arm | steps | tau by 5 steps | vs static by 5 steps | vs static, step 20 on | KL at the end | "
             "re-fits (step: held-out gain) | Reflex / capture / re-fit share of a step |", "|---" * 8 + "|"]
    for name, arm in arms.items():
        late = arm.get("tau_vs_static_from_20")
        refits = ", ".join(f"{step}: {100 * gain:+.1f}%" if gain is not None else f"{step}: rejected"
                           for step, gain in arm["consolidations"]) or "-"
        cost = arm["cost_share"]
        lines.append(
            f"| {name} | {arm['steps']} | {' / '.join(f'{v:.2f}' for v in arm['tau_blocks'])} | "
            f"{' / '.join(f'{v:.3f}' for v in arm.get('tau_vs_static_blocks', [])) or '-'} | "
            f"{'-' if late is None else f'{late:.3f}'} | {arm['records'][-1].get('kl', 0.0):.4f} | {refits} | "
            f"{100 * cost['reflex']:.2f}% / {100 * cost['capture']:.2f}% / {100 * cost['consolidation']:.2f}% |")
    return "\n".join(lines)


def plot_arms(arms: dict, path: str | Path) -> None:
    """tau per step (a 5-step running mean beside the raw points) and KL to the start policy, every arm."""
    from .plots import pyplot, save_figure

    plt = pyplot()
    fig, (ax_tau, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, arm in arms.items():
        steps = [r["step"] for r in arm["records"]]
        tau = [r["spec/tau"] for r in arm["records"]]
        smooth = [statistics.mean(tau[max(0, i - 4) : i + 1]) for i in range(len(tau))]
        (line,) = ax_tau.plot(steps, smooth, label=name, lw=1.6)
        ax_tau.scatter(steps, tau, s=6, color=line.get_color(), alpha=0.4)
        ax_kl.plot(steps, [r.get("kl", 0.0) for r in arm["records"]], label=name, lw=1.2)
    ax_tau.set(xlabel="GRPO step", ylabel="tau (4-node trees; 5-step mean)", title="Acceptance during GRPO")
    ax_kl.set(xlabel="GRPO step", ylabel="KL to the start policy (nats/token)", title="How far the policy moved")
    ax_tau.legend(fontsize=8)
    ax_kl.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("arms", nargs="*", help=f"arms to run, of {sorted(ARMS)}")
    parser.add_argument("--report", default=None, help="write the arms under --out as this JSON (and a PNG beside)")
    parser.add_argument("--out", default="runs/adaptation")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--heads", default=None, help="heads folder (default: the trainer's choice)")
    parser.add_argument("--model-path", default=None, help="policy folder (default: the smollm2-135m preset)")
    parser.add_argument("--speed", nargs="*", default=None, metavar="ARM_FOLDER",
                        help="time generation with each arm folder's last checkpoint (policy and heads) against "
                             "generate, 8 rows; with --report, the records go to that JSON")
    cli = parser.parse_args()
    if cli.speed:
        speed = [r for folder in cli.speed for r in speed_at_end(folder)]
        if cli.report:
            Path(cli.report).write_text(json.dumps(speed, indent=1) + "\n")
        raise SystemExit(0)
    for name in cli.arms:
        records = run_arm(name, cli.out, steps=cli.steps, temperature=cli.temperature, heads_path=cli.heads,
                          model_path=cli.model_path)
        print(name, "tau by 5 steps", [round(v, 3) for v in block_means(records, "spec/tau")], flush=True)
    if cli.report:
        summary = summarise_arms(cli.out)
        Path(cli.report).write_text(json.dumps(summary, indent=1) + "\n")
        plot_arms(summary, Path(cli.report).with_suffix(".png"))
        print(format_arms(summary))
