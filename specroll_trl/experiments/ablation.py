"""The slow-path / Reflex ablation over a real GRPO run (``specroll-trl bench ablation``).

One GRPO run per variant, same config, seed and prompts, with heads distilled on the starting policy. The
policy moves away from them either through the run's learning rate or, with ``shift``, all at once: after
``shift_at`` steps a ``PolicySwitch`` loads a moved policy's weights (``shift.moved_policy``) into the model being
trained, the same in every variant. With a shift, every variant runs twice: on the ``moved`` policy and on the
``unmoved`` one (no switch).

* ``static``: heads never change; ``reflex``: Reflex on; ``slow``: drift-triggered consolidation;
  ``both``: Reflex and the slow path; ``every_round``: consolidation after every generation round
  (the always-train baseline, FastGRPO-style);
* ``vanilla``: TRL's own ``GRPOTrainer``, the reference for speed and for the reward curve.

Per variant: tau and per-head acceptance per round, generation and step seconds, consolidations, rewards.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from transformers import TrainerCallback

from .bench import _timed
from .plots import pyplot, save_figure
from .shift import moved_policy
from .zoo import DEFAULT_PRESET, PRETRAINED, preset_dataset, preset_heads, preset_task, preset_temperature

VARIANTS = {
    "static": {"spec_reflex": None},
    "reflex": {"spec_reflex": "lookup"},
    "slow": {"spec_reflex": None, "spec_consolidation": True},
    "both": {"spec_reflex": "lookup", "spec_consolidation": True},
    "every_round": {"spec_reflex": None, "spec_consolidation": True,
                    "spec_consolidation_kwargs": {"trigger": "every_round"}},
}


SHIFTS = ("sft", "sft-capitals")  # the moves of ``shift.MOVES`` fast enough to build inside a benchmark


class PolicySwitch(TrainerCallback):
    """Loads ``path``'s weights into the trained model at the end of step ``at_step``: a controlled policy shift
    inside a run (the optimizer keeps its state; the heads, outside the model, are untouched)."""

    def __init__(self, path: str, at_step: int):
        from safetensors.torch import load_file

        self.at_step = at_step
        self.state = load_file(f"{path}/model.safetensors")

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at_step:
            missing, unexpected = model.load_state_dict(self.state, strict=False)
            tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
            if unexpected or set(missing) - tied:
                raise ValueError(f"moved policy does not match the model: missing {missing}, unexpected {unexpected}")
        return control


def grpo_run(variant: str, model_path: str, heads_path: str | None, dataset, overrides: dict, steps: int,
             num_generations: int = 8, prompts_per_step: int = 1, max_completion_length: int = 192,
             learning_rate: float = 1e-4, capacity: int | None = None, output_dir: str = "runs/grpo",
             progress: bool = True, temperature: float = 1.0, switch: PolicySwitch | None = None) -> dict:
    """One timed GRPO run (``variant == "vanilla"``: TRL's ``GRPOTrainer``, else ``SpecGRPOTrainer`` with
    ``overrides``; ``switch``: a shift during the run); its record: per-round tau, acceptance and rewards,
    generation / step / re-fit seconds."""
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from ..trainer import SpecGRPOConfig, SpecGRPOTrainer
    from .rewards import REWARD_FUNCS

    args = SpecGRPOConfig(
        output_dir=f"{output_dir}/{variant}", max_steps=steps, num_generations=num_generations,
        per_device_train_batch_size=num_generations * prompts_per_step,
        max_completion_length=max_completion_length, learning_rate=learning_rate, logging_steps=1,
        report_to="none", bf16=False, save_strategy="no", seed=0, disable_tqdm=not progress, temperature=temperature,
        spec_heads_path=heads_path, spec_capacity=capacity, **overrides,
    )
    cls = GRPOTrainer if variant == "vanilla" else SpecGRPOTrainer
    trainer = _timed(cls)(model=model_path, reward_funcs=REWARD_FUNCS, args=args, train_dataset=dataset)
    if not progress:
        trainer.remove_callback(PrinterCallback)  # no per-step log dicts either
    if switch is not None:
        trainer.add_callback(switch)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "reward" in r]
    taus = [r.get("spec/tau", 1.0) for r in rows]
    heads = sorted(k for k in rows[0] if k.startswith("spec/accept_head_")) if rows else []
    callback = getattr(trainer, "spec_consolidation", None)
    refit_s = callback.seconds if callback else 0.0
    gen_s = sum(trainer.generation_seconds)
    step_s = sum(trainer.timer.step_seconds) + refit_s  # re-fits run in on_step_end, after the step timer
    reflex_s = sum(r.get("spec/reflex/seconds", 0.0) for r in rows)
    capture_s = sum(r.get("spec/capture/seconds", 0.0) for r in rows)
    return {
        "variant": variant, "steps": steps, "learning_rate": learning_rate,
        "rows_per_round": num_generations * prompts_per_step, "max_completion_length": max_completion_length,
        "tau": statistics.median(taus), "tau_mean": statistics.mean(taus), "tau_per_round": taus,
        "accept_per_head": [statistics.mean(r[k] for r in rows) for k in heads],
        "accept_per_round": [[r[k] for k in heads] for r in rows],
        "nodes_per_row": statistics.mean(r.get("spec/tree_nodes_per_row", 0.0) for r in rows),
        "reflex_gate": statistics.mean(r.get("spec/reflex/reflex_gate", 0.0) for r in rows),
        "reflex_lookup_hit": statistics.mean(r.get("spec/reflex/reflex_lookup_hit", 0.0) for r in rows),
        "generation_s": gen_s, "total_s": step_s, "generation_s_per_step": trainer.generation_seconds,
        "step_s_per_step": trainer.timer.step_seconds, "reflex_overhead_share": reflex_s / gen_s if gen_s else 0.0,
        "capture_overhead_share": capture_s / gen_s if gen_s else 0.0,
        "consolidations": callback.count if callback else 0, "consolidation_s": refit_s,
        "consolidation_failures": callback.failures if callback else 0,
        "consolidation_rejected": callback.rejected if callback else 0,
        "consolidation_steps": [r["step"] for r in trainer.state.log_history if "spec/consolidation_seconds" in r],
        "consolidation_s_each": [r["spec/consolidation_seconds"] for r in trainer.state.log_history
                                 if "spec/consolidation_seconds" in r],
        "reward_per_step": [r["reward"] for r in rows],
        "completion_tokens_per_step": [r["completions/mean_length"] * num_generations * prompts_per_step
                                       for r in rows],
    }


def add_speedups(records: list[dict]) -> list[dict]:
    """``speedup_vs_static`` / ``speedup_vs_vanilla`` (and their generation-only twins) where those runs exist, within
    each ``policy`` (moved / unmoved)."""
    for name in ("static", "vanilla"):
        for r in records:
            ref = next((x for x in records if x["variant"] == name and x.get("policy") == r.get("policy")), None)
            if ref:
                r[f"speedup_vs_{name}"] = ref["total_s"] / r["total_s"]
                r[f"generation_speedup_vs_{name}"] = ref["generation_s"] / r["generation_s"]
    return records


def bench_ablation(model_name: str = DEFAULT_PRESET, steps: int = 30, num_generations: int = 8,
                   prompts_per_step: int = 1, max_completion_length: int = 192, learning_rate: float = 1e-4,
                   variants: tuple[str, ...] = ("vanilla", *VARIANTS), capacity: int | None = None,
                   consolidation: dict | None = None, task: str | None = None, shift: str | None = None,
                   shift_at: int = 2, output_dir: str = "runs/bench_ablation", progress: bool = True) -> list[dict]:
    """One record per variant (the documented bench fields plus per-round curves); ``consolidation``: extra
    ``ConsolidationConfig`` fields for the slow-path variants. ``shift`` (one of ``SHIFTS``, pretrained presets):
    every variant on the ``unmoved`` policy, then on the ``moved`` one (``shift.moved_policy`` loaded after step
    ``shift_at``)."""
    from .zoo import resolve_policy

    unknown = set(variants) - set(VARIANTS) - {"vanilla"}
    if unknown:
        raise ValueError(f"unknown ablation variants {sorted(unknown)}; choose from {['vanilla', *VARIANTS]}")
    if shift not in (None, *SHIFTS):
        raise ValueError(f"unknown shift {shift!r}: expected None or one of {SHIFTS}")
    if shift and model_name not in PRETRAINED:
        raise ValueError(f"shift={shift!r} needs a pretrained chat preset ({sorted(PRETRAINED)}), got {model_name!r}")
    if shift and not 0 < shift_at < steps:
        raise ValueError(f"shift_at must be in [1, steps - 1] = [1, {steps - 1}], got {shift_at}")
    model_path = str(resolve_policy(model_name, progress=progress))
    heads_path = preset_heads(model_name, progress=progress)
    dataset = preset_dataset(model_name, steps * prompts_per_step, task=task)
    moved = moved_policy(model_name, shift, progress=progress)[0] if shift else None
    records = []
    for policy in ("unmoved", "moved") if moved else (None,):
        for variant in variants:
            overrides = {} if variant == "vanilla" else dict(VARIANTS[variant])
            if overrides.get("spec_consolidation"):
                overrides["spec_consolidation_kwargs"] = {**overrides.get("spec_consolidation_kwargs", {}),
                                                          **(consolidation or {})}
            switch = PolicySwitch(moved, shift_at) if policy == "moved" else None
            record = grpo_run(variant, model_path, heads_path, dataset, overrides, steps, num_generations,
                              prompts_per_step, max_completion_length, learning_rate, capacity,
                              f"{output_dir}/{policy or 'run'}", progress,
                              temperature=preset_temperature(model_name), switch=switch)
            records.append({**record, "model": model_name, "task": task or preset_task(model_name),
                            "policy": policy or "unmoved", "shift": shift if policy == "moved" else None,
                            "shift_at": shift_at if policy == "moved" else None})
            if progress:
                r = records[-1]
                print(f"{r['policy']:<8} {variant:<12} tau {r['tau_mean']:.3f}  generation {r['generation_s']:7.2f}s  "
                      f"total {r['total_s']:7.2f}s  consolidations {r['consolidations']}  "
                      f"reward {statistics.mean(r['reward_per_step']):.3f}", flush=True)
    return add_speedups(records)


def format_ablation(records: list[dict]) -> str:
    lines = [f"{'policy':<8} {'variant':<12} {'tau':>5} {'gen_s':>7} {'total_s':>8} {'vs static':>9} "
             f"{'vs vanilla':>10} {'refits':>6} {'refit_s':>7} {'reward':>6}  accept/head"]
    for r in records:
        acc = " ".join(f"{100 * a:3.0f}%" for a in r["accept_per_head"])
        vs_static, vs_vanilla = r.get("speedup_vs_static", float("nan")), r.get("speedup_vs_vanilla", float("nan"))
        lines.append(f"{r.get('policy', 'unmoved'):<8} {r['variant']:<12} {r['tau_mean']:5.2f} "
                     f"{r['generation_s']:7.1f} {r['total_s']:8.1f} {vs_static:8.2f}x {vs_vanilla:9.2f}x "
                     f"{r['consolidations']:>6} {r['consolidation_s']:7.1f} "
                     f"{statistics.mean(r['reward_per_step']):6.3f}  {acc}")
    return "\n".join(lines)


def plot_ablation(records: list[dict], path: str | Path) -> None:
    """Per policy (moved / unmoved): acceptance (tau) per round for every variant, and the reward curves."""
    plt = pyplot()
    policies = list(dict.fromkeys(r.get("policy", "unmoved") for r in records))
    fig, axes = plt.subplots(len(policies), 2, figsize=(11, 4 * len(policies)), squeeze=False)
    for (ax_tau, ax_reward), policy in zip(axes, policies):
        for r in (r for r in records if r.get("policy", "unmoved") == policy):
            rounds = range(1, len(r["tau_per_round"]) + 1)
            if r["variant"] != "vanilla":
                ax_tau.plot(rounds, r["tau_per_round"], label=r["variant"], lw=1.2)
            ax_reward.plot(rounds, r["reward_per_step"], label=r["variant"], lw=1.0,
                           color="black" if r["variant"] == "vanilla" else None)
            if r.get("shift_at") and r["variant"] == "vanilla":
                for ax in (ax_tau, ax_reward):
                    ax.axvline(r["shift_at"] + 0.5, color="grey", ls=":", lw=1)
        ax_tau.set(xlabel="GRPO step (one generation round)", ylabel="tau (tokens per target forward per row)",
                   title=f"Acceptance, {policy} policy")
        ax_tau.legend(fontsize=8)
        ax_reward.set(xlabel="GRPO step", ylabel="mean reward", title=f"Reward, {policy} policy")
        ax_reward.legend(fontsize=8)
    save_figure(fig, path)
