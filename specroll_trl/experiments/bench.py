"""Generation benchmark: TRL's vanilla ``generate`` call against the speculative engine, side by side.

Runs alternate (vanilla, engine, vanilla, engine, ...) on the same prompts with the same seeds, and
report medians and their ratio, because timings on shared CPUs are noisy.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..adapt.samples import left_pad
from ..engine import SpeculativeGenerator
from .plots import pyplot, save_figure
from .zoo import (
    DEFAULT_PRESET,
    PRETRAINED,
    load_heads,
    load_policy,
    preset_task,
    preset_temperature,
    task_prompt_ids,
    trl_generation_config,
)


def _vanilla(model, ids, mask, gc, **generate_kwargs) -> tuple[float, int]:
    """Seconds of one ``model.generate`` call and the completion tokens it produced (each cut after eos)."""
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc, **generate_kwargs)
    seconds = time.perf_counter() - start
    eos = set(gc.eos_token_id)
    tokens = 0
    for row in out[:, ids.shape[1]:].tolist():
        tokens += next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
    return seconds, tokens


def bench_generation(model_name: str = DEFAULT_PRESET, batch_sizes=(1, 8, 32, 64), repeats: int = 3,
                     max_new_tokens: int = 256, temperatures: Sequence[float] = (0.7, 1.0), max_nodes: int = 16,
                     fixed_nodes: Sequence[int] = (0, 2, 4, 8), rules: Sequence[str] = (), task: str | None = None,
                     dtype: torch.dtype = torch.float32, device: str = "cpu", progress: bool = True,
                     unpacked: bool = False, online: bool = True) -> list[dict]:
    """One record per (temperature, batch size, mode): TRL's ``generate`` against the engine with the online node
    budget and its defaults (``spec``), with the online budget held to one verification rule (``spec_<rule>``, for
    each of ``rules``: ``top-k``, ``drawn``), with a fixed number of draft nodes per row (``fixed_N``; ``fixed_0`` is
    the engine's loop without drafting) and HF's prompt-lookup assisted decoding (``assisted_prompt_lookup``, batch
    1); with ``unpacked``, ``spec`` and every ``fixed_N`` also with the model's own linear kernels throughout
    (``<mode>_unpacked``: ``pack_linears=False``, the engine before ``engine.kernels``); without ``online``, no ``spec``
    arm (``generate`` against the fixed trees alone: every arm changes what the others share, the machine's caches
    and the order of the rounds). Each repeat
    is one alternating round on its own prompts (a pretrained preset's: GSM8K-test chat prompts from row 1000 on,
    never used for its heads), the same prompts and seed for every mode; records hold medians and the spread over
    repeats. Each engine keeps its budget across calls, as in a training run, after one untimed warm-up call per
    batch size."""
    if not (online or fixed_nodes or rules):
        raise ValueError("nothing to compare with generate: online=False with no fixed_nodes and no rules")
    model, tokenizer = load_policy(model_name, progress=progress, dtype=dtype)  # may build it: outside no_grad
    heads = load_heads(model_name, progress=progress)
    model, heads = model.to(device), heads.to(device=device, dtype=dtype)
    # a pretrained preset runs the benches' GSM8K-test chat prompts (_prompt_sets), whatever its training task
    task = "gsm8k-test" if model_name in PRETRAINED else task or preset_task(model_name)
    records = []
    for temperature in temperatures:
        gc = trl_generation_config(model, tokenizer, max_new_tokens, temperature)
        modes = {"spec": SpeculativeGenerator(model, heads, gc, max_nodes=max_nodes)} if online else {}
        modes.update({f"spec_{rule}": SpeculativeGenerator(model, heads, gc, max_nodes=max_nodes, candidates=rule)
                      for rule in rules})
        modes.update({f"fixed_{n}": SpeculativeGenerator(model, heads, gc, max_nodes=n, capacity=10**9)
                      for n in fixed_nodes})
        if unpacked:
            modes.update({f"{mode}_unpacked": SpeculativeGenerator(model, heads, gc, config=dataclasses.replace(
                engine.config, pack_linears=False)) for mode, engine in list(modes.items())
                if mode == "spec" or mode.startswith("fixed_")})
        for batch_size in batch_sizes:
            inputs = [tuple(t.to(device) for t in left_pad(prompts, tokenizer.pad_token_id))
                      for prompts in _prompt_sets(model_name, tokenizer, task, batch_size, repeats)]
            wanted = {**modes, **({"assisted_prompt_lookup": None} if batch_size == 1 else {})}
            with torch.no_grad():
                for engine in modes.values():
                    ids, mask = inputs[0]
                    engine.generate(ids[:, -64:], mask[:, -64:], max_new_tokens=8)  # warm-up, untimed
                records += _alternate(model, wanted, inputs, gc)
            for r in records[-len(wanted):]:
                r.update(batch_size=batch_size, temperature=temperature, max_new_tokens=max_new_tokens,
                         model=model_name, task=task, dtype=str(dtype).removeprefix("torch."), device=device)
                if progress:
                    print(f"T={temperature} batch {batch_size:>3} {r['mode']:<24} vanilla {r['vanilla_s']:7.2f}s  "
                          f"engine {r['spec_s']:7.2f}s  per token {r['per_token_speedup']:.2f}x "
                          f"[{min(r['per_token_speedups']):.2f}-{max(r['per_token_speedups']):.2f}]  "
                          f"tau {r['tau'] or float('nan'):.2f}  nodes {r['nodes_per_row']:.1f}", flush=True)
    return records


def _prompt_sets(model_name: str, tokenizer, task: str, batch_size: int, repeats: int) -> list[list[list[int]]]:
    """One prompt set of ``batch_size`` per repeat, all different."""
    if model_name in PRETRAINED:
        from .heads_bench import BENCH_ROW, bench_prompts

        return [bench_prompts(tokenizer, batch_size, start=BENCH_ROW + r * batch_size) for r in range(repeats)]
    return [task_prompt_ids(tokenizer, task, batch_size, seed=4242 + batch_size + 1000 * r) for r in range(repeats)]


GENERATE = object()  # TRL's `generate`, the reference arm of every round


def _alternate(model, engines: dict, inputs: list, gc) -> list[dict]:
    """One round per ``(ids, mask)`` of ``inputs``, each of one vanilla ``generate`` and every engine (``None``:
    HF's prompt-lookup assisted decoding) on those prompts and the same seed, the order rotated by one arm each
    round (in a fixed order the online budget always ran right after ``generate``, so a slow spell of the machine
    spanning the two flattered every other arm against it); one record per engine, with medians
    over rounds (``per_token_speedups``: each round's). All sample the same distribution but not the same draws,
    so completion lengths differ: ``per_token_speedup`` compares seconds per generated token as well as
    ``speedup`` whole calls."""
    vanilla_s, vanilla_tokens = [], []
    runs = {mode: {"s": [], "tokens": [], "tau": [], "accept": [], "nodes": []} for mode in engines}
    arms = [GENERATE, *engines]
    for r, (ids, mask) in enumerate(inputs):
        for mode in arms[r % len(arms):] + arms[:r % len(arms)]:  # a slow spell of the machine hits each arm in turn
            torch.manual_seed(r)
            if mode is GENERATE:
                seconds, n = _vanilla(model, ids, mask, gc)
                vanilla_s.append(seconds)
                vanilla_tokens.append(n)
                continue
            engine, run = engines[mode], runs[mode]
            if engine is None:
                s, n = _vanilla(model, ids, mask, gc, prompt_lookup_num_tokens=4)
            else:
                out = engine.generate(ids, mask)
                s, n = out.stats.seconds, out.stats.tokens
                run["tau"].append(out.stats.tau)
                run["accept"].append(out.stats.accept_per_head)
                run["nodes"].append(sum(out.stats.nodes_per_row) / max(1, len(out.stats.nodes_per_row)))
            run["s"].append(s)
            run["tokens"].append(n)
    v_med = statistics.median(vanilla_s)
    records = []
    for mode, run in runs.items():
        s_med = statistics.median(run["s"])
        accepts = run["accept"]
        per_round = [(vs / max(1, vn)) / (s / max(1, n))
                     for vs, vn, s, n in zip(vanilla_s, vanilla_tokens, run["s"], run["tokens"])]
        records.append({
            "mode": mode, "vanilla_s": v_med, "spec_s": s_med, "speedup": v_med / s_med,
            "per_token_speedup": statistics.median(per_round), "per_token_speedups": per_round,
            "tau": statistics.median(run["tau"]) if run["tau"] else None,
            "accept_per_head": [statistics.mean(a[d] for a in accepts) for d in range(len(accepts[0]))]
            if accepts else [],
            "tokens_per_s": statistics.median(run["tokens"]) / s_med,
            "vanilla_tokens_per_s": sum(vanilla_tokens) / sum(vanilla_s),
            "nodes_per_row": statistics.mean(run["nodes"]) if run["nodes"] else 0.0, "repeats": len(inputs)})
    return records


def write_results(records: list[dict], out: str | Path, plot: bool = True) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=2) + "\n")
    if plot:
        plot_generation(records, out.with_suffix(".png"))


def plot_generation(records: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, temperature in dict.fromkeys((r["mode"], r.get("temperature")) for r in records):
        rows = [r for r in records if r["mode"] == mode and r.get("temperature") == temperature]
        label = mode if temperature is None else f"{mode}, T={temperature}"
        ax.plot([r["batch_size"] for r in rows], [r.get("per_token_speedup", r["speedup"]) for r in rows],
                marker="o", ls="-" if temperature in (None, 0.7) else "--", label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="batch size (rows generating)", ylabel="speedup per generated token vs generate",
           title="Speculative rollouts vs TRL's generate (medians)")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def format_table(records: list[dict]) -> str:
    lines = [f"{'T':>4} {'batch':>5}  {'mode':<24} {'vanilla_s':>9} {'spec_s':>8} {'speedup':>7} {'/token':>7} "
             f"{'tau':>5}  accept/head"]
    for r in records:
        tau = f"{r['tau']:.2f}" if r["tau"] is not None else "  -  "
        acc = " ".join(f"{100 * a:4.0f}%" for a in r["accept_per_head"])
        lines.append(f"{r.get('temperature', ''):>4} {r['batch_size']:>5}  {r['mode']:<24} {r['vanilla_s']:9.2f} "
                     f"{r['spec_s']:8.2f} {r['speedup']:6.2f}x {r.get('per_token_speedup', r['speedup']):6.2f}x "
                     f"{tau:>5}  {acc}")
    return "\n".join(lines)


def _timed(trainer_cls):
    """``trainer_cls`` that records wall seconds of each step and of each generation call."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_seconds, self._start = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.step_seconds.append(time.perf_counter() - self._start)

    class Timed(trainer_cls):
        def __init__(self, *args, **kwargs):
            self.timer = StepTimer()
            self.generation_seconds = []
            super().__init__(*args, callbacks=[self.timer], **kwargs)

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.generation_seconds.append(time.perf_counter() - start)

    return Timed


def bench_e2e(model_name: str = DEFAULT_PRESET, steps: int = 4, repeats: int = 2, num_generations: int = 8,
              prompts_per_step: int = 4, max_completion_length: int = 256, output_dir: str = "runs/bench_e2e",
              task: str | None = None, capacity: int | None = None, temperature: float | None = None,
              progress: bool = True) -> list[dict]:
    """GRPOTrainer vs SpecGRPOTrainer, same config and seed, alternating whole runs; one record. ``temperature``
    defaults to the one the preset's heads were distilled at (``zoo.preset_temperature``)."""
    from trl import GRPOTrainer

    from ..trainer import SpecGRPOConfig, SpecGRPOTrainer
    from .rewards import REWARD_FUNCS
    from .zoo import preset_dataset, preset_heads, resolve_policy

    model_path = str(resolve_policy(model_name, progress=progress))
    heads_path = preset_heads(model_name, progress=progress)
    task = task or preset_task(model_name)
    temperature = temperature or preset_temperature(model_name)
    dataset = preset_dataset(model_name, steps * prompts_per_step, seed=123, task=task)
    results = {"vanilla": {"step": [], "gen": [], "reward": []}, "spec": {"step": [], "gen": [], "reward": []}}
    taus, drawn, nodes = [], [], []
    for r in range(repeats):
        for name, cls in (("vanilla", GRPOTrainer), ("spec", SpecGRPOTrainer)):
            args = SpecGRPOConfig(
                output_dir=f"{output_dir}/{name}{r}", max_steps=steps, num_generations=num_generations,
                per_device_train_batch_size=num_generations * prompts_per_step,
                max_completion_length=max_completion_length, learning_rate=1e-5, logging_steps=1,
                temperature=temperature,
                report_to="none", bf16=False, save_strategy="no", seed=0, disable_tqdm=not progress,
                spec_heads_path=heads_path, spec_capacity=capacity,
            )
            trainer = _timed(cls)(model=model_path, reward_funcs=REWARD_FUNCS, args=args, train_dataset=dataset)
            trainer.train()
            results[name]["step"] += trainer.timer.step_seconds
            results[name]["gen"] += trainer.generation_seconds
            results[name]["reward"] += [row["reward"] for row in trainer.state.log_history if "reward" in row]
            if name == "spec":
                taus += [row["spec/tau"] for row in trainer.state.log_history if "spec/tau" in row]
                drawn += [row["spec/drawn_share"] for row in trainer.state.log_history if "spec/drawn_share" in row]
                nodes += [row["spec/tree_nodes_per_row"] for row in trainer.state.log_history
                          if "spec/tree_nodes_per_row" in row]
            if progress:
                print(f"run {r} {name:<8} step {statistics.median(trainer.timer.step_seconds):6.2f}s  "
                      f"generation {statistics.median(trainer.generation_seconds):6.2f}s", flush=True)
    v_step, s_step = statistics.median(results["vanilla"]["step"]), statistics.median(results["spec"]["step"])
    v_gen, s_gen = statistics.median(results["vanilla"]["gen"]), statistics.median(results["spec"]["gen"])
    return [{
        "steps": steps * repeats, "vanilla_step_s": v_step, "spec_step_s": s_step, "speedup": v_step / s_step,
        "generation_share": v_gen / v_step, "spec_generation_share": s_gen / s_step,
        "vanilla_generation_s": v_gen, "spec_generation_s": s_gen, "generation_speedup": v_gen / s_gen,
        "tau": statistics.median(taus) if taus else None,
        "drawn_share": statistics.mean(drawn) if drawn else None,
        "tree_nodes_per_row": statistics.mean(nodes) if nodes else None,
        "vanilla_reward_mean": statistics.mean(results["vanilla"]["reward"]),
        "spec_reward_mean": statistics.mean(results["spec"]["reward"]),
        "num_generations": num_generations, "prompts_per_step": prompts_per_step,
        "max_completion_length": max_completion_length, "model": model_name, "task": task, "capacity": capacity,
        "temperature": temperature, "vanilla_reward_per_step": results["vanilla"]["reward"],
        "spec_reward_per_step": results["spec"]["reward"],
    }]


def capture_hooks(heads) -> list:
    """The slow path's capture hook alone, with ``ConsolidationConfig``'s default buffer (the ``capture`` variant)."""
    from ..adapt.buffer import BufferCapture, HeadBuffer
    from ..adapt.consolidation import ConsolidationConfig

    c = ConsolidationConfig()
    return [BufferCapture(HeadBuffer(c.buffer_size, heads.num_heads, heads.config.hidden_size, c.buffer_topk))]


def bench_reflex(model_name: str = DEFAULT_PRESET, grpo_steps: int = 8, batch_size: int = 8, repeats: int = 3,
                 max_new_tokens: int = 192, max_nodes: int = 16, capacity: int | None = None,
                 progress: bool = True, variants: Sequence[str] | None = None, group: int = 1) -> list[dict]:
    """Reflex off vs on with stale heads, generation only (alternating): on a moved policy (a pretrained preset:
    ``shift.moved_policy(model, "sft-capitals")``; a toy: ``grpo_steps`` of GRPO), on a perturbed target and on
    the fresh one.

    ``variants``: Reflex presets (``specroll_trl.adapt.reflex.REFLEX_PRESETS``) compared with static heads
    (default: ``baseline`` and ``lookup``; ``static``, no hooks, always runs), and ``capture`` (the slow path's
    buffer capture alone, for its overhead); ``group``: generations per prompt in the batch (GRPO's
    ``num_generations``)."""
    from ..adapt.reflex import reflex_hooks
    from .shift import drifted_policy, moved_policy

    variants = [v for v in dict.fromkeys(variants or ("baseline", "lookup")) if v != "static"]
    for variant in (v for v in variants if v != "capture"):
        reflex_hooks(variant)  # an unknown preset fails here, not after the drift run
    # trains (needs gradients); the rest only generates
    drifted = (moved_policy(model_name, "sft-capitals")[0] if model_name in PRETRAINED
               else drifted_policy(model_name, grpo_steps))
    load_heads(model_name, progress=progress)  # distilled on a first run: needs gradients
    with torch.no_grad():
        return _bench_reflex_runs(model_name, drifted, grpo_steps, batch_size, repeats, max_new_tokens, max_nodes,
                                  capacity, progress, variants, group)


def _bench_reflex_runs(model_name, drifted, grpo_steps, batch_size, repeats, max_new_tokens, max_nodes, capacity,
                       progress, variants, group=1):
    from transformers import AutoModelForCausalLM

    from ..adapt.reflex import reflex_hooks
    from .shift import perturbed_policy

    base, tokenizer = load_policy(model_name, progress=progress)
    heads = load_heads(model_name, progress=progress)
    moved = "sft-capitals" if model_name in PRETRAINED else f"grpo{grpo_steps}"
    targets = {
        moved: AutoModelForCausalLM.from_pretrained(drifted).eval(),
        "perturbed": perturbed_policy(base, scale=1.0),
        "fresh": base,
    }
    prompts = task_prompt_ids(tokenizer, preset_task(model_name), max(1, batch_size // group), seed=777,
                              conversational=model_name in PRETRAINED)
    prompts = [p for p in prompts for _ in range(group)][:batch_size]
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    records = []
    for target_name, model in targets.items():
        gc = trl_generation_config(model, tokenizer, max_new_tokens, temperature=preset_temperature(model_name))
        runs = {"vanilla": [], "static": [], **{name: [] for name in variants}}
        for r in range(repeats):
            torch.manual_seed(r)
            runs["vanilla"].append({"seconds": _vanilla(model, ids, mask, gc)[0]})
            for variant in ("static", *variants):
                hooks = None if variant == "static" else capture_hooks(heads) if variant == "capture" else \
                    reflex_hooks(variant)
                engine = SpeculativeGenerator(model, heads, gc, max_nodes=max_nodes, capacity=capacity, hooks=hooks)
                torch.manual_seed(r)
                runs[variant].append(engine.generate(ids, mask).stats)
        vanilla_s = statistics.median(s["seconds"] for s in runs["vanilla"])
        static_s = statistics.median(s["seconds"] for s in runs["static"])
        for variant in ("static", *variants):
            stats = runs[variant]
            gen_s = statistics.median(s["seconds"] for s in stats)
            record = {
                "variant": variant, "target": target_name, "batch_size": batch_size,
                "tau": statistics.median(s["tau"] for s in stats),
                "accept_per_head": [statistics.mean(s["accept_per_head"][d] for s in stats)
                                    for d in range(heads.num_heads)],
                "generation_s": gen_s, "total_s": gen_s, "vanilla_s": vanilla_s,
                "speedup_vs_vanilla": vanilla_s / gen_s, "speedup_vs_static": static_s / gen_s,
                **{f"{hook}_overhead_share": statistics.median(s.get(f"{hook}_seconds", 0.0) / s["seconds"]
                                                               for s in stats) for hook in ("reflex", "capture")},
                "reflex_gate": statistics.mean(s.get("reflex_gate", 0.0) for s in stats),
                "reflex_lookup_hit": statistics.mean(s.get("reflex_lookup_hit", 0.0) for s in stats),
                "tau_vs_static": statistics.mean(s["tau"] / b["tau"] for s, b in zip(stats, runs["static"])) - 1,
            }
            records.append(record)
            if progress:
                print(f"{target_name:<10} {variant:<15} tau {record['tau']:.3f} "
                      f"({100 * record['tau_vs_static']:+.1f}%)  gen {gen_s:.3f}s  "
                      f"vs vanilla {record['speedup_vs_vanilla']:.2f}x  gate {record['reflex_gate']:.3f}  "
                      f"overhead {100 * record['reflex_overhead_share']:.1f}%", flush=True)
    return records
