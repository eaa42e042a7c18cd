"""``specroll-trl demo``: vanilla ``GRPOTrainer`` and ``SpecGRPOTrainer`` side by side on the default policy.

Same config, seed and prompts; whole runs alternate (vanilla, optionally spec with static heads, spec with Reflex
and the slow path, then again) so that machine noise hits them all. Writes a JSON of the runs and a PNG of the
per-step seconds, tau and rewards; returns the summary the CLI prints. ``DEMO_DEFAULTS`` sizes a run per policy:
the real SmolLM2 policy gets a short one that fits a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .ablation import grpo_run
from .plots import pyplot, save_figure

RUNS = {  # name -> (trainer label, SpecGRPOConfig overrides; None = TRL's GRPOTrainer)
    "vanilla": ("GRPOTrainer", None),
    "spec_static": ("SpecGRPOTrainer, static heads", {"spec_reflex": None}),
    "spec": ("SpecGRPOTrainer + Reflex + slow path", {"spec_reflex": "lookup", "spec_consolidation": True}),
}


DEMO_DEFAULTS = {  # per policy kind: a run that shows the comparison within the main job's time budget
    # the real policy: GRPOTrainer against the whole method; each arm is ~80 s of the main job on 2 CPU cores, so
    # the static heads' arm (what Reflex and the slow path add) runs on request: --trainers vanilla spec_static spec
    "pretrained": dict(steps=3, repeats=1, max_completion_length=128, capacity=None, trainers=("vanilla", "spec")),
    "toy": dict(steps=8, repeats=2, max_completion_length=256, capacity=40, trainers=tuple(RUNS)),
}


def demo_defaults(model: str) -> dict:
    """The demo's run for ``model``, sampling at the temperature its heads were distilled at."""
    from . import zoo

    return {**DEMO_DEFAULTS["pretrained" if model in zoo.PRETRAINED else "toy"],
            "temperature": zoo.preset_temperature(model)}


def run_demo(model: str = "smollm2-135m", heads_path: str | None = None, task: str | None = None, steps: int = 3,
             repeats: int = 1, prompts_per_step: int = 1, max_completion_length: int = 128,
             learning_rate: float = 1e-5, capacity: int | None = None, temperature: float = 0.7,
             trainers: tuple[str, ...] = ("vanilla", "spec_static"), out_dir: str = "runs/demo",
             progress: bool = True) -> dict:
    from . import zoo

    model_path = str(zoo.resolve_policy(model, progress=progress))
    heads_path = heads_path or zoo.preset_heads(model, progress=progress)
    if heads_path is None:
        raise ValueError(f"--heads is required for a model outside the zoo ({model!r}); train them with "
                         "`specroll-trl train-heads`")
    task = task or zoo.preset_task(model)
    dataset = zoo.preset_dataset(model, steps * prompts_per_step, seed=2024, task=task)
    unknown = set(trainers) - set(RUNS)
    if unknown or "vanilla" not in trainers or len(trainers) < 2:
        raise ValueError(f"trainers must include 'vanilla' and at least one of {sorted(set(RUNS) - {'vanilla'})}, "
                         f"got {list(trainers)}")
    runs: dict[str, list[dict]] = {name: [] for name in RUNS if name in trainers}
    names = list(runs)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # each trainer goes first in turn
            label, overrides = RUNS[name]
            if progress:
                print(f"      run {r + 1}/{repeats}: {label}", flush=True)
            record = grpo_run("vanilla" if overrides is None else name, model_path, heads_path, dataset,
                              overrides or {}, steps, prompts_per_step=prompts_per_step,
                              max_completion_length=max_completion_length,
                              learning_rate=learning_rate, capacity=capacity, temperature=temperature,
                              output_dir=f"{out_dir}/run{r}", progress=progress)
            runs[name].append(record)
    summary = summarise(runs, model=model, task=task, heads=heads_path, capacity=capacity, temperature=temperature)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
    plot_demo(runs, out / "demo.png")
    summary["files"] = [str(out / "demo.json"), str(out / "demo.png")]
    return summary


def _per_step_median(records: list[dict], key: str) -> list[float]:
    return [statistics.median(values) for values in zip(*(r[key] for r in records))]


def _timed_steps(record: dict, key: str) -> list[float]:
    """A run's per-step values of ``key`` without its first step when it has more: the first trainer of a process
    pays one-time warm-up there (measured on SmolLM2: vanilla's first step 59.5 s, then 31.3 and 28.1 s; the
    trainers after it showed no such step), which would otherwise count against whichever trainer runs first."""
    values = record[key]
    return values[1:] if len(values) > 1 else values


def _variant(records: list[dict], vanilla: dict) -> dict:
    gen = statistics.median(x for r in records for x in _timed_steps(r, "generation_s_per_step"))
    # ms per generated token: completions differ in length from run to run (same distribution, other draws)
    ms = 1e3 * sum(sum(_timed_steps(r, "generation_s_per_step")) for r in records) / sum(
        sum(_timed_steps(r, "completion_tokens_per_step")) for r in records)
    # re-fits run in on_step_end, after the step timer: their seconds are spread over the run's steps
    step = statistics.median(x + r["consolidation_s"] / r["steps"] for r in records
                             for x in _timed_steps(r, "step_s_per_step"))
    out = {"generation_s": gen, "ms_per_token": ms, "step_s": step,
           "reward_per_step": _per_step_median(records, "reward_per_step"),
           "reward_mean": statistics.mean(x for r in records for x in r["reward_per_step"]),
           "tau": statistics.mean(r["tau_mean"] for r in records),
           "accept_per_head": [statistics.mean(a) for a in zip(*(r["accept_per_head"] for r in records))],
           "reflex_gate": statistics.mean(r["reflex_gate"] for r in records),
           "reflex_lookup_hit": statistics.mean(r["reflex_lookup_hit"] for r in records),
           "reflex_overhead_share": statistics.mean(r["reflex_overhead_share"] for r in records),
           "consolidations": sum(r["consolidations"] for r in records)}
    if vanilla:
        out.update(generation_speedup=vanilla["generation_s"] / gen, per_token_generation_speedup=vanilla[
            "ms_per_token"] / ms, speedup=vanilla["step_s"] / step)
    return out


def summarise(runs: dict[str, list[dict]], **info) -> dict:
    vanilla = _variant(runs["vanilla"], {})
    variants = {name: _variant(records, vanilla) for name, records in runs.items() if name != "vanilla"}
    first = runs["vanilla"][0]
    summary = {**info, "steps": first["steps"], "repeats": len(runs["vanilla"]),
               "rows_per_round": first["rows_per_round"], "max_completion_length": first["max_completion_length"],
               "generation_share": vanilla["generation_s"] / vanilla["step_s"], "vanilla": vanilla, **variants}
    # flat keys for the most complete speculative trainer run, as the CLI table and scripts read them
    full = variants["spec"] if "spec" in variants else variants["spec_static"]
    summary.update({f"spec_{k}" if k in ("generation_s", "ms_per_token", "step_s", "reward_per_step", "reward_mean")
                    else k: v for k, v in full.items()})
    summary.update({f"vanilla_{k}": vanilla[k] for k in ("generation_s", "ms_per_token", "step_s",
                                                          "reward_per_step", "reward_mean")})
    return summary


def format_summary(summary: dict) -> str:
    names = [n for n in RUNS if n != "vanilla" and n in summary]
    head = f"{'':<24}{'vanilla GRPO':>14}" + "".join(f"{RUNS[n][0].replace('SpecGRPOTrainer', 'Spec'):>36}"
                                                       for n in names)
    lines = [head]
    for key, label, fmt in (("generation_s", "generation s / step", ".3f"), ("ms_per_token", "generation ms / token",
                                                                               ".3f"),
                            ("step_s", "whole step s", ".3f"), ("reward_mean", "mean reward", ".3f")):
        speed = {"generation_s": "generation_speedup", "ms_per_token": "per_token_generation_speedup",
                 "step_s": "speedup"}.get(key)
        cells = "".join(f"{summary[n][key]:>28{fmt}}" + (f" ({summary[n][speed]:.2f}x)" if speed else " " * 8)
                        for n in names)
        lines.append(f"{label:<24}{summary['vanilla'][key]:>14{fmt}}{cells}")
    for n in names:
        v = summary[n]
        acc = " / ".join(f"{100 * a:.0f}%" for a in v["accept_per_head"])
        lines.append(f"{RUNS[n][0]}: tau {v['tau']:.2f}, acceptance per head {acc}")
    if "spec" in summary:
        full = summary["spec"]
        lines.append(f"Reflex: gate {full['reflex_gate']:.3f}, lookup hit {full['reflex_lookup_hit']:.2f}, "
                     f"{100 * full['reflex_overhead_share']:.1f}% of generation time; consolidations "
                     f"{full['consolidations']}")
    lines += [
        f"vanilla generation share of a step {100 * summary['generation_share']:.0f}%",
        "",
        f"{'step':>4} {'reward vanilla':>15}" + "".join(f" {'reward ' + n:>18}" for n in names),
    ]
    for i, a in enumerate(summary["vanilla"]["reward_per_step"]):
        lines.append(f"{i + 1:>4} {a:>15.3f}" + "".join(f" {summary[n]['reward_per_step'][i]:>18.3f}" for n in names))
    return "\n".join(lines)


def plot_demo(runs: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    colors = {"vanilla": "black", "spec_static": "tab:green", "spec": "tab:blue"}
    for name, records in runs.items():
        steps = range(1, records[0]["steps"] + 1)
        label = RUNS[name][0]
        axes[0].plot(steps, _per_step_median(records, "generation_s_per_step"), marker="o", color=colors[name],
                     label=label)
        axes[2].plot(steps, _per_step_median(records, "reward_per_step"), marker="o", color=colors[name],
                     label=label)
        if name != "vanilla":
            axes[1].plot(steps, _per_step_median(records, "tau_per_round"), marker="o", color=colors[name],
                         label=label)
    axes[0].set(xlabel="GRPO step", ylabel="generation seconds (median over runs)", title="Rollout time")
    axes[1].set(xlabel="GRPO step", ylabel="tau", title="Tokens per target forward per row")
    axes[2].set(xlabel="GRPO step", ylabel="mean reward", title="Reward: same distribution, same learning")
    for ax in axes:
        ax.legend(fontsize=7)
    save_figure(fig, path)
