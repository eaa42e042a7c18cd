"""``specroll-trl demo``: vanilla ``GRPOTrainer`` and ``SpecGRPOTrainer`` side by side on the default policy.

Same config, seed and prompts; whole runs alternate (vanilla, spec, vanilla, spec, ...) so that machine noise
hits both. The speculative runs use Reflex and the slow path. Writes a JSON of both runs and a PNG of the
per-step seconds, tau and rewards; returns the summary the CLI prints.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .ablation import add_speedups, grpo_run
from .data import task_dataset

SPEC_OVERRIDES = {"spec_reflex": True, "spec_consolidation": True}


def run_demo(model: str = "tiny", heads_path: str | None = None, task: str | None = None, steps: int = 8,
             repeats: int = 2, prompts_per_step: int = 1, max_completion_length: int = 256,
             learning_rate: float = 1e-5, capacity: int | None = 40, out_dir: str = "runs/demo",
             progress: bool = True) -> dict:
    from . import zoo

    model_path = str(zoo.resolve_policy(model, progress=progress))
    if heads_path is None:
        if model not in zoo.PRESETS:
            raise ValueError(f"--heads is required for a model outside the zoo ({model!r}); train them with "
                             "`specroll-trl train-heads`")
        heads_path = str(zoo.build_heads(model, progress=progress))
    task = task or (zoo.PRESETS[model].task if model in zoo.PRESETS else "arithmetic")
    dataset = task_dataset(task, steps * prompts_per_step, seed=2024)
    runs: dict[str, list[dict]] = {"vanilla": [], "spec": []}
    for r in range(repeats):
        for name in ("vanilla", "spec"):
            if progress:
                print(f"      run {r + 1}/{repeats}: {'GRPOTrainer' if name == 'vanilla' else 'SpecGRPOTrainer'}",
                      flush=True)
            record = grpo_run(name, model_path, heads_path, dataset, SPEC_OVERRIDES if name == "spec" else {},
                              steps, prompts_per_step=prompts_per_step, max_completion_length=max_completion_length,
                              learning_rate=learning_rate, capacity=capacity, output_dir=f"{out_dir}/run{r}",
                              progress=progress)
            runs[name].append(record)
    summary = summarise(runs, model=model, task=task, heads=heads_path, capacity=capacity)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    plot_demo(runs, out / "demo.png")
    summary["files"] = [str(out / "demo.json"), str(out / "demo.png")]
    return summary


def _per_step_median(records: list[dict], key: str) -> list[float]:
    return [statistics.median(values) for values in zip(*(r[key] for r in records))]


def summarise(runs: dict[str, list[dict]], **info) -> dict:
    v, s = runs["vanilla"], runs["spec"]
    vanilla_gen = statistics.median(x for r in v for x in r["generation_s_per_step"])
    spec_gen = statistics.median(x for r in s for x in r["generation_s_per_step"])
    vanilla_step = statistics.median(r["total_s"] / r["steps"] for r in v)
    spec_step = statistics.median(r["total_s"] / r["steps"] for r in s)
    add_speedups([*v, *s])
    return {
        **info, "steps": v[0]["steps"], "repeats": len(v), "rows_per_round": v[0]["rows_per_round"],
        "max_completion_length": v[0]["max_completion_length"],
        "vanilla_generation_s": vanilla_gen, "spec_generation_s": spec_gen,
        "generation_speedup": vanilla_gen / spec_gen,
        "vanilla_step_s": vanilla_step, "spec_step_s": spec_step, "speedup": vanilla_step / spec_step,
        "generation_share": vanilla_gen / vanilla_step,
        "tau": statistics.mean(r["tau_mean"] for r in s),
        "accept_per_head": [statistics.mean(a) for a in zip(*(r["accept_per_head"] for r in s))],
        "reflex_gate": statistics.mean(r["reflex_gate"] for r in s),
        "reflex_lookup_hit": statistics.mean(r["reflex_lookup_hit"] for r in s),
        "reflex_overhead_share": statistics.mean(r["reflex_overhead_share"] for r in s),
        "consolidations": sum(r["consolidations"] for r in s),
        "vanilla_reward_per_step": _per_step_median(v, "reward_per_step"),
        "spec_reward_per_step": _per_step_median(s, "reward_per_step"),
        "vanilla_reward_mean": statistics.mean(x for r in v for x in r["reward_per_step"]),
        "spec_reward_mean": statistics.mean(x for r in s for x in r["reward_per_step"]),
    }


def format_summary(summary: dict) -> str:
    acc = " / ".join(f"{100 * a:.0f}%" for a in summary["accept_per_head"])
    lines = [
        f"{'':<28}{'vanilla GRPO':>14}{'SpecGRPO':>12}{'speedup':>10}",
        f"{'generation s / step':<28}{summary['vanilla_generation_s']:>14.3f}{summary['spec_generation_s']:>12.3f}"
        f"{summary['generation_speedup']:>9.2f}x",
        f"{'whole step s':<28}{summary['vanilla_step_s']:>14.3f}{summary['spec_step_s']:>12.3f}"
        f"{summary['speedup']:>9.2f}x",
        f"{'mean reward':<28}{summary['vanilla_reward_mean']:>14.3f}{summary['spec_reward_mean']:>12.3f}",
        "",
        f"tau {summary['tau']:.2f} tokens per forward per row; acceptance per head {acc}",
        f"Reflex: gate {summary['reflex_gate']:.3f}, lookup hit {summary['reflex_lookup_hit']:.2f}, "
        f"{100 * summary['reflex_overhead_share']:.1f}% of generation time; consolidations {summary['consolidations']}",
        f"vanilla generation share of a step {100 * summary['generation_share']:.0f}%",
        "",
        f"{'step':>4} {'reward vanilla':>15} {'reward spec':>12}",
    ]
    for i, (a, b) in enumerate(zip(summary["vanilla_reward_per_step"], summary["spec_reward_per_step"]), 1):
        lines.append(f"{i:>4} {a:>15.3f} {b:>12.3f}")
    return "\n".join(lines)


def plot_demo(runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {"vanilla": "black", "spec": "tab:blue"}
    for name, records in runs.items():
        steps = range(1, records[0]["steps"] + 1)
        label = "GRPOTrainer" if name == "vanilla" else "SpecGRPOTrainer"
        axes[0].plot(steps, _per_step_median(records, "generation_s_per_step"), marker="o", color=colors[name],
                     label=label)
        axes[2].plot(steps, _per_step_median(records, "reward_per_step"), marker="o", color=colors[name],
                     label=label)
        if name == "spec":
            axes[1].plot(steps, _per_step_median(records, "tau_per_round"), marker="o", color=colors[name])
    axes[0].set(xlabel="GRPO step", ylabel="generation seconds (median over runs)", title="Rollout time")
    axes[1].set(xlabel="GRPO step", ylabel="tau", title="Tokens per target forward per row")
    axes[2].set(xlabel="GRPO step", ylabel="mean reward", title="Reward: same distribution, same learning")
    axes[0].legend()
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
