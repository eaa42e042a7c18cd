"""``specroll-trl`` command line: demo, train-heads, bench, export-vllm."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path


def _demo(args) -> int:
    from .adapt.distill import REPORT_FILE, format_hit_table
    from .experiments import zoo
    from .experiments.demo import demo_defaults, format_summary, run_demo

    start = time.time()
    print(f"[1/4] policy '{args.model}' (built once, then cached under {zoo.zoo_home()})", flush=True)
    model, tokenizer = zoo.load_policy(args.model)
    info_file = Path(zoo.resolve_policy(args.model)) / "build_info.json"
    info = json.loads(info_file.read_text()) if info_file.is_file() else {}
    print(f"      {info.get('parameters', sum(p.numel() for p in model.parameters())) / 1e6:.2f}M parameters, "
          f"built in {info.get('build_seconds', float('nan'))} s", flush=True)
    if args.model in zoo.PRETRAINED and args.eval_prompts is not None:
        print("specroll-trl demo: error: --eval-prompts applies to the toy policies (tiny, nano) only", file=sys.stderr)
        return 2
    task = args.task or zoo.preset_task(args.model)
    run = {k: v if getattr(args, k, None) is None else getattr(args, k) for k, v in demo_defaults(args.model).items()}
    if args.model in zoo.PRETRAINED:
        print(f"[2/4] pretrained chat policy: GRPO on the '{task}' task in chat form, rewards correctness + format "
              f"(its GSM8K score is about 1-2%: the format reward carries the signal)", flush=True)
    else:
        eval_prompts = args.eval_prompts or 256
        print(f"[2/4] held-out evaluation on {eval_prompts} '{task}' prompts at temperature 1", flush=True)
        examples = zoo.task_examples(task, eval_prompts, seed=0, split="test")
        metrics = zoo.evaluate_policy(model, tokenizer, examples, temperature=1.0)
        print(f"      loss {metrics['heldout_loss']:.3f} nats/token, entropy {metrics['entropy']:.3f} nats/token, "
              f"correct {100 * metrics['accuracy']:.1f}% of {metrics['num_prompts']} prompts", flush=True)
    del model
    heads_path = args.heads
    if heads_path is None:
        print("[3/4] speculative heads (shipped for this exact policy, else self-distilled on its own samples; "
              "cached)", flush=True)
        heads_path = str(zoo.build_heads(args.model))
        report = json.loads((Path(heads_path) / REPORT_FILE).read_text())
        print(format_hit_table(report["hit_rates"], report.get("target_mass"), report.get("drawn_accept")))
    else:
        print(f"[3/4] speculative heads from {heads_path}", flush=True)
    print(f"[4/4] {' vs '.join(run['trainers'])}: {run['steps']} GRPO steps x {run['repeats']} runs each, "
          f"{args.prompts_per_step} prompts x 8 completions, up to {run['max_completion_length']} tokens at "
          f"temperature {run['temperature']}", flush=True)
    summary = run_demo(args.model, heads_path, task, prompts_per_step=args.prompts_per_step, out_dir=args.out,
                       progress=not args.quiet, **run)
    print(format_summary(summary))
    print(f"done in {time.time() - start:.0f} s; wrote {' and '.join(summary['files'])}")
    return 0


# train-heads settings of a toy preset or a model folder (a pretrained preset's recipe is fixed)
TOY_HEAD_FLAGS = {"task": "arithmetic", "num_heads": 4, "num_samples": 512, "steps": 600, "max_new_tokens": 192,
                  "temperature": 1.0, "max_seconds": None, "seed": 0, "draft_vocab_size": 4096}


def _train_preset_heads(args) -> int:
    """A pretrained preset: the recipe of its shipped heads, on the shipped samples unless ``--resample``."""
    from .adapt.distill import REPORT_FILE, format_hit_table
    from .adapt.distill_cache import policy_fingerprint
    from .experiments import onpolicy_heads, zoo

    given = [f"--{name.replace('_', '-')}" for name in TOY_HEAD_FLAGS if getattr(args, name) is not None]
    if given:
        print(f"specroll-trl train-heads: error: {', '.join(given)} do not apply to {args.model!r}, whose heads "
              "come from a fixed recipe (onpolicy_heads.onpolicy_distill_config)", file=sys.stderr)
        return 2
    model, tokenizer = zoo.load_policy(args.model)
    key = policy_fingerprint(model)
    samples = None if args.resample else onpolicy_heads.shipped_samples(args.model, key)
    cache = zoo.policy_dir(args.model) / "onpolicy_samples"
    config = dataclasses.replace(onpolicy_heads.onpolicy_distill_config(), kind=args.kind or "path")
    print(f"{'reusing the shipped samples' if samples else f'sampling the policy into {cache} (resumable)'}; "
          f"recipe: {config}", flush=True)
    out = Path(args.out)
    onpolicy_heads.distill_preset_heads(model, tokenizer, out, cache, key=key, samples=samples, config=config)
    report = json.loads((out / REPORT_FILE).read_text())
    print(format_hit_table(report["hit_rates"], report.get("target_mass"), report.get("drawn_accept")))
    print(f"heads saved to {args.out}")
    return 0


def _train_heads(args) -> int:
    from .adapt.distill import HeadDistillConfig, distill_heads, format_hit_table, save_distilled
    from .experiments import zoo

    if args.model in zoo.PRETRAINED:
        return _train_preset_heads(args)
    if args.resample:
        print("specroll-trl train-heads: error: --resample applies to a pretrained preset only", file=sys.stderr)
        return 2
    run = {name: default if getattr(args, name) is None else getattr(args, name)
           for name, default in TOY_HEAD_FLAGS.items()}
    model, tokenizer = zoo.load_policy(args.model)
    config = HeadDistillConfig(
        num_heads=run["num_heads"], num_samples=run["num_samples"], steps=run["steps"],
        temperature=run["temperature"], max_new_tokens=run["max_new_tokens"], max_seconds=run["max_seconds"],
        seed=run["seed"], kind=args.kind or "independent", draft_vocab_size=run["draft_vocab_size"],
    )
    prompts = zoo.task_prompt_ids(tokenizer, run["task"], config.num_samples, seed=run["seed"] + 20_000,
                                  conversational=tokenizer.chat_template is not None)
    heads, report = distill_heads(model, prompts, tokenizer.pad_token_id, config)
    save_distilled(heads, report, args.out)
    print(format_hit_table(report["hit_rates"], report.get("target_mass"), report.get("drawn_accept")))
    print(f"heads saved to {args.out}")
    return 0


# Per benchmark: the full run's and the quick run's settings; a flag given on the command line overrides both.
BENCH_RUNS = {
    "generation": (dict(batch_sizes=[1, 8, 32, 64], repeats=3, max_new_tokens=256, temperatures=[0.7, 1.0]),
                   dict(batch_sizes=[1, 8], repeats=1, max_new_tokens=64, temperatures=[0.7])),
    "e2e": (dict(steps=4, repeats=2, max_new_tokens=256, prompts_per_step=4),
            dict(steps=2, repeats=1, max_new_tokens=128, prompts_per_step=2)),
    "ablation": (dict(steps=30, max_new_tokens=192, prompts_per_step=1),
                 dict(steps=6, max_new_tokens=96, prompts_per_step=1)),
    "reflex": (dict(steps=8, repeats=3, max_new_tokens=192), dict(steps=4, repeats=1, max_new_tokens=128)),
    "shift": (dict(sft_steps=24, grpo_steps=6), dict(sft_steps=4, grpo_steps=2)),
    "counts": (dict(batch_sizes=[1, 8], max_new_tokens=64), dict(batch_sizes=[1, 8], max_new_tokens=24)),
    "heads": (dict(nodes=[2, 4, 8, 16, 32], temperatures=[0.7, 1.0], prompts=8, max_new_tokens=256,
                   cost_batch_sizes=[1, 8, 32]),
              dict(nodes=[4, 16], temperatures=[0.7], prompts=2, max_new_tokens=64, cost_batch_sizes=[1])),
}


def _bench_settings(args) -> dict:
    """The run's settings: each flag as given, else the quick or the full run's default."""
    full, quick = BENCH_RUNS[args.what]
    return {k: v if getattr(args, k) is None else getattr(args, k) for k, v in (quick if args.quick else full).items()}


def _bench(args) -> int:
    from .experiments.bench import bench_e2e, bench_generation, bench_reflex, format_table, write_results

    run = _bench_settings(args)
    if args.what == "shift":
        from .experiments.shift import bench_shift

        records = bench_shift(args.model, moves=tuple(args.moves), sft_steps=run["sft_steps"], sft_lr=args.sft_lr,
                              grpo_steps=run["grpo_steps"], grpo_lr=args.grpo_lr)
        if args.out:
            write_results(records, args.out, plot=False)
        return 0
    if args.what == "heads":
        return _bench_heads(args, run)
    if args.what == "counts":
        import torch

        from .experiments.step_counts import bench_counts

        records = bench_counts(args.model, batch_sizes=tuple(run["batch_sizes"]), nodes=tuple(args.nodes),
                               max_new_tokens=run["max_new_tokens"], temperature=args.temperature,
                               device=args.device, dtype=getattr(torch, args.dtype))
        if args.out:
            write_results(records, args.out, plot=False)
        return 0
    if args.what == "ablation":
        from .experiments.ablation import bench_ablation, format_ablation, plot_ablation
        from .experiments.zoo import PRETRAINED

        shift = args.shift or ("sft-capitals" if args.model in PRETRAINED else "none")
        records = bench_ablation(args.model, steps=run["steps"], max_completion_length=run["max_new_tokens"],
                                 prompts_per_step=run["prompts_per_step"], capacity=args.capacity,
                                 learning_rate=args.lr, variants=tuple(args.variants),
                                 shift=None if shift == "none" else shift, shift_at=args.shift_at)
        print(format_ablation(records))
        if args.out:
            write_results(records, args.out, plot=False)
            plot_ablation(records, Path(args.out).with_suffix(".png"))
            print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
        return 0
    if args.what == "reflex":
        records = bench_reflex(args.model, grpo_steps=run["steps"], repeats=run["repeats"],
                               max_new_tokens=run["max_new_tokens"], max_nodes=args.max_nodes, capacity=args.capacity,
                               group=args.group, variants=args.variants)
        if args.out:
            write_results(records, args.out, plot=False)
        return 0
    if args.what == "e2e":
        records = bench_e2e(args.model, steps=run["steps"], repeats=run["repeats"],
                            max_completion_length=run["max_new_tokens"], prompts_per_step=run["prompts_per_step"],
                            capacity=args.capacity, temperature=args.temperature)
        for key, value in records[0].items():
            print(f"{key:>24}: {value}")
        if args.out:
            write_results(records, args.out, plot=False)
        return 0
    import torch

    records = bench_generation(args.model, batch_sizes=tuple(run["batch_sizes"]), repeats=run["repeats"],
                               max_new_tokens=run["max_new_tokens"], temperatures=tuple(run["temperatures"]),
                               max_nodes=args.max_nodes, fixed_nodes=tuple(args.fixed_nodes), rules=tuple(args.rules),
                               unpacked=args.unpacked, online=args.online,
                               dtype=getattr(torch, args.dtype), device=args.device)
    print(format_table(records))
    if args.out:
        write_results(records, args.out)
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0


def _bench_heads(args, run: dict) -> int:
    import torch

    from .experiments import zoo
    from .experiments.bench import write_results
    from .experiments.heads_bench import plot_heads, step_cost, tau_sweep

    if args.cost_repeats < 1:
        print(f"specroll-trl bench heads: error: --cost-repeats must be at least 1, got {args.cost_repeats}",
              file=sys.stderr)
        return 2
    model, tokenizer = zoo.load_policy(args.model, dtype=getattr(torch, args.dtype))
    if args.heads:
        heads = dict(item.split("=", 1) if "=" in item else (Path(item).name, item) for item in args.heads)
    else:
        heads = {f"{args.model} (default)": str(zoo.build_heads(args.model))}
    records = []
    if run["prompts"]:
        records += tau_sweep(model, tokenizer, heads, node_counts=run["nodes"], temperatures=run["temperatures"],
                             num_prompts=run["prompts"], max_new_tokens=run["max_new_tokens"], rules=tuple(args.rules),
                             groups=args.groups, device=args.device)
    if run["cost_batch_sizes"]:
        records += step_cost(model, tokenizer, next(iter(heads.values())), batch_sizes=run["cost_batch_sizes"],
                             node_counts=[0, *run["nodes"]], repeats=args.cost_repeats, device=args.device,
                             unpacked=args.unpacked, rules=tuple(args.rules))
    if args.out:
        write_results(records, args.out, plot=False)
        plot_heads(records, Path(args.out).with_suffix(".png"))
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')}")
    return 0


def _export_vllm(args) -> int:
    from .experiments import zoo
    from .export import export_vllm

    model = zoo.resolve_policy(args.model)
    try:
        out = export_vllm(args.heads, model, args.out, adapter=args.adapter, share_lm_head=not args.lm_head_per_head,
                          overwrite=args.overwrite)
    except (OSError, ValueError) as err:
        print(f"specroll-trl export-vllm: error: {err}", file=sys.stderr)
        return 2
    num_heads = json.loads((out / "config.json").read_text())["num_heads"]
    spec = {"method": "medusa", "model": str(out.resolve()), "num_speculative_tokens": num_heads}
    print(f"vLLM Medusa speculator ({num_heads} heads) written to {out}; serve it with\n"
          f"  --speculative-config '{json.dumps(spec)}'")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specroll-trl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="build the default policy and its heads, then GRPO vs SpecGRPO side by side")
    demo.add_argument("--model", default="smollm2-135m",
                      help="zoo preset or HF model folder (default: SmolLM2-135M-Instruct; toys: tiny, nano)")
    demo.add_argument("--heads", default=None, help="heads folder (default: the zoo preset's distilled heads)")
    demo.add_argument("--task", default=None, choices=["arithmetic", "gsm8k"],
                      help="GRPO prompts (default: the preset's task)")
    demo.add_argument("--eval-prompts", type=int, default=None, help="toy policies: held-out prompts (256)")
    demo.add_argument("--steps", type=int, default=None, help="GRPO steps per run (smollm2: 3, toys: 8)")
    demo.add_argument("--repeats", type=int, default=None, help="runs of each trainer, alternating (1 / 2)")
    demo.add_argument("--trainers", nargs="+", default=None, choices=["vanilla", "spec_static", "spec"],
                      help="vanilla GRPOTrainer, SpecGRPOTrainer with static heads, and with Reflex + slow path "
                      "(smollm2: vanilla and spec, the main job's time; toys: all three)")
    demo.add_argument("--temperature", type=float, default=None, help="sampling temperature (0.7 / 1.0)")
    demo.add_argument("--prompts-per-step", type=int, default=1, help="prompts per step (x 8 completions)")
    demo.add_argument("--capacity", type=int, default=None,
                      help="C_hw of the fixed node budget (toys: 40); the online budget when omitted for smollm2")
    demo.add_argument("--max-completion-length", type=int, default=None, help="(128 / 256)")
    demo.add_argument("--out", default="runs/demo", help="folder for demo.json and demo.png")
    demo.add_argument("--quiet", action="store_true", help="no per-step trainer logs or progress bars")
    demo.set_defaults(func=_demo)

    heads = sub.add_parser(
        "train-heads", help="self-distil speculative heads for a policy",
        description="A pretrained preset (smollm2-135m) runs the recipe of its shipped heads on the shipped samples "
                    "(about 30 minutes on 2 cores; --resample draws new ones first, about an hour more); the flags "
                    "below then do not apply. A toy preset or a model folder: the settings below (a folder whose "
                    "tokenizer has a chat template distils on chat-rendered prompts, as its GRPO run sees them).")
    heads.add_argument("--model", required=True, help="zoo preset or HF model folder")
    heads.add_argument("--resample", action="store_true",
                       help="pretrained preset: sample the policy again instead of reusing the shipped samples")
    heads.add_argument("--kind", default=None, choices=["independent", "path"],
                       help="head kind (default: path for a pretrained preset, independent otherwise)")
    heads.add_argument("--out", required=True, help="folder for config.json + model.safetensors")
    toy = TOY_HEAD_FLAGS
    heads.add_argument("--task", default=None, choices=["arithmetic", "gsm8k"], help=f"(toy: {toy['task']})")
    heads.add_argument("--num-heads", type=int, default=None, help=f"(toy: {toy['num_heads']})")
    heads.add_argument("--num-samples", type=int, default=None, help=f"(toy: {toy['num_samples']})")
    heads.add_argument("--steps", type=int, default=None, help=f"(toy: {toy['steps']})")
    heads.add_argument("--max-new-tokens", type=int, default=None, help=f"(toy: {toy['max_new_tokens']})")
    heads.add_argument("--temperature", type=float, default=None, help=f"(toy: {toy['temperature']})")
    heads.add_argument("--max-seconds", type=float, default=None, help="(toy: no limit)")
    heads.add_argument("--seed", type=int, default=None, help=f"(toy: {TOY_HEAD_FLAGS['seed']})")
    heads.add_argument("--draft-vocab-size", type=int, default=None,
                       help=f"the heads propose from the policy's most frequent tokens only; 0: the whole vocabulary "
                            f"(toy: {TOY_HEAD_FLAGS['draft_vocab_size']}, which a toy's vocabulary is smaller than)")
    heads.set_defaults(func=_train_heads)

    bench = sub.add_parser("bench", help="benchmarks (JSON records, see README)")
    kinds = bench.add_subparsers(dest="what", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default="tiny", help="zoo preset (smollm2-135m, tiny, nano) or HF folder")
    common.add_argument("--quick", action="store_true",
                        help="reduced run: about 3 minutes on 2 cores once the policy and its heads are cached; a "
                             "first run builds them (in $SPECROLL_HOME): tiny trains its policy and distils its heads "
                             "(~10 minutes), smollm2-135m de-quantises its GGUF and installs its shipped heads "
                             "(~1 minute); flags given still apply")
    common.add_argument("--out", default=None, help="JSON file (a PNG is written beside it)")

    def kind(name: str, help: str):
        parser = kinds.add_parser(name, parents=[common], help=help)
        parser.set_defaults(func=_bench)
        full, quick = BENCH_RUNS[name]
        return parser, lambda key: f"(full run: {full[key]}, --quick: {quick[key]})"

    gen, says = kind("generation", "SpeculativeGenerator (online and fixed budget, no draft) vs model.generate")
    gen.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=says("batch_sizes"))
    gen.add_argument("--repeats", type=int, default=None, help=f"alternating runs per cell {says('repeats')}")
    gen.add_argument("--max-new-tokens", type=int, default=None, help=says("max_new_tokens"))
    gen.add_argument("--temperatures", type=float, nargs="+", default=None, help=says("temperatures"))
    gen.add_argument("--max-nodes", type=int, default=16, help="N_max, draft nodes per row per step")
    gen.add_argument("--rules", nargs="*", default=[], choices=["top-k", "drawn"],
                     help="also run the online budget held to each of these verification rules (spec_<rule>)")
    gen.add_argument("--unpacked", action="store_true",
                     help="also run spec and every fixed_N with the model's own linear kernels (<mode>_unpacked)")
    gen.add_argument("--fixed-nodes", type=int, nargs="*", default=[0, 2, 4, 8],
                     help="draft nodes per row of the fixed-tree modes (fixed_N; 0: the loop without drafting)")
    gen.add_argument("--no-online", dest="online", action="store_false",
                     help="leave out the online budget's arm (spec): generate against the fixed trees alone")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    gen.add_argument("--device", default="cpu", help="device (cpu, cuda)")

    counts, says = kind("counts", "per decoding step: tensor ops, host reads and engine Python lines outside the "
                                  "forward, for generate, the no-draft loop and N-node trees (both rules)")
    counts.add_argument("--batch-sizes", type=int, nargs="+", default=None, help=says("batch_sizes"))
    counts.add_argument("--max-new-tokens", type=int, default=None, help=says("max_new_tokens"))
    counts.add_argument("--nodes", type=int, nargs="+", default=[4], help="draft nodes per row of the drafted modes")
    counts.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    counts.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    counts.add_argument("--device", default="cpu", help="device (cpu, cuda)")

    e2e, says = kind("e2e", "TRL GRPOTrainer vs SpecGRPOTrainer, same seed, 8 completions per prompt")
    e2e.add_argument("--steps", type=int, default=None, help=f"GRPO steps per run {says('steps')}")
    e2e.add_argument("--repeats", type=int, default=None, help=f"alternating runs per trainer {says('repeats')}")
    e2e.add_argument("--max-new-tokens", type=int, default=None, help=f"max_completion_length {says('max_new_tokens')}")
    e2e.add_argument("--prompts-per-step", type=int, default=None, help=f"x 8 completions {says('prompts_per_step')}")
    e2e.add_argument("--capacity", type=int, default=None, help="C_hw of a fixed node budget (default: online)")
    e2e.add_argument("--temperature", type=float, default=None,
                     help="sampling temperature (default: 0.7 for a pretrained policy, 1.0 for a toy)")

    abl, says = kind("ablation", "vanilla / static / reflex / slow / both / every_round over one GRPO run each")
    abl.add_argument("--steps", type=int, default=None, help=f"GRPO steps per run {says('steps')}")
    abl.add_argument("--max-new-tokens", type=int, default=None, help=f"max_completion_length {says('max_new_tokens')}")
    abl.add_argument("--prompts-per-step", type=int, default=None, help=f"x 8 completions {says('prompts_per_step')}")
    abl.add_argument("--capacity", type=int, default=None, help="C_hw of a fixed node budget (default: online)")
    abl.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate (drives the drift)")
    abl.add_argument("--shift", default=None, choices=["none", "sft", "sft-capitals"],
                     help="run every variant on the unmoved policy and on one moved by a short SFT after --shift-at "
                          "steps (sft: another answer style; sft-capitals: the same in capitals, the default for a "
                          "pretrained preset); 'none': the run's lr only (the default for toys)")
    abl.add_argument("--shift-at", type=int, default=2, help="steps before the moved policy is loaded")
    abl.add_argument("--variants", nargs="+", default=["vanilla", "static", "reflex", "slow", "both", "every_round"],
                     choices=["vanilla", "static", "reflex", "slow", "both", "every_round"], help="runs, in order")

    ref, says = kind("reflex", "Reflex presets vs static heads on stale targets, generation only")
    ref.add_argument("--steps", type=int, default=None, help=f"GRPO steps that make the heads stale {says('steps')}")
    ref.add_argument("--repeats", type=int, default=None, help=says("repeats"))
    ref.add_argument("--max-new-tokens", type=int, default=None, help=says("max_new_tokens"))
    ref.add_argument("--max-nodes", type=int, default=16, help="N_max, draft nodes per row per step")
    ref.add_argument("--capacity", type=int, default=None, help="C_hw of a fixed node budget (default: online)")
    ref.add_argument("--group", type=int, default=1, help="completions per prompt in the batch (num_generations)")
    ref.add_argument("--variants", nargs="+", default=None,
                     help="Reflex presets to compare with static heads (specroll_trl.adapt.reflex.REFLEX_PRESETS; "
                          "default: baseline lookup)")

    shift, says = kind("shift", "how far a moved policy is from its base: KL, and tau of the base's heads on both")
    shift.add_argument("--moves", nargs="+", default=["sft", "sft-capitals"], choices=["sft", "sft-capitals", "grpo"],
                       help="sft: a short SFT toward another answer style; sft-capitals: the same in capitals "
                            "(a vocabulary shift); grpo: plain GRPO on the preset's task")
    shift.add_argument("--sft-steps", type=int, default=None, help=f"SFT steps (8 rows each) {says('sft_steps')}")
    shift.add_argument("--sft-lr", type=float, default=1e-4, help="SFT learning rate")
    shift.add_argument("--grpo-steps", type=int, default=None,
                       help=f"GRPO steps (2 prompts x 8 completions of up to 128 tokens) {says('grpo_steps')}")
    shift.add_argument("--grpo-lr", type=float, default=5e-5, help="GRPO learning rate")

    hb, says = kind("heads", "tau against tree size for heads folders (same prompts and seed), and a decoding step's "
                             "cost against tree size: the tau each tree size must reach to break even")
    hb.add_argument("--heads", nargs="+", default=None,
                    help="NAME=FOLDER (or FOLDER) of each heads set to compare (default: the preset's heads)")
    hb.add_argument("--nodes", type=int, nargs="+", default=None, help=f"draft nodes per row {says('nodes')}")
    hb.add_argument("--temperatures", type=float, nargs="+", default=None, help=says("temperatures"))
    hb.add_argument("--rules", nargs="+", default=["drawn"],
                    help="verification rules to compare, in tau and in step cost: top-k, drawn, drawn+F (F fixed "
                         "top-of-q children per node)")
    hb.add_argument("--groups", type=int, default=1, help="run the prompts as this many batches (tau per group)")
    hb.add_argument("--prompts", type=int, default=None,
                    help=f"GSM8K-test chat prompts from row 1000 on, 0 to skip the tau sweep {says('prompts')}")
    hb.add_argument("--max-new-tokens", type=int, default=None, help=says("max_new_tokens"))
    hb.add_argument("--unpacked", action="store_true",
                    help="step costs also with the model's own linear kernels (kernels: f_linear)")
    hb.add_argument("--cost-batch-sizes", type=int, nargs="*", default=None,
                    help=f"batch sizes of the step-cost curve, none to skip it {says('cost_batch_sizes')}")
    hb.add_argument("--cost-repeats", type=int, default=3,
                    help="step-cost calls per node count, the node counts alternating; each ratio is of medians")
    hb.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="model dtype")
    hb.add_argument("--device", default="cpu", help="device (cpu, cuda)")

    export = sub.add_parser("export-vllm", help="write heads as a vLLM Medusa speculator (config.json + safetensors)")
    export.add_argument("--heads", required=True, help="heads folder (e.g. a checkpoint's spec_heads/)")
    export.add_argument("--model", required=True, help="zoo preset or HF folder of the target policy (its lm_head)")
    export.add_argument("--out", required=True, help="empty (or previous export) folder to write to")
    export.add_argument("--adapter", default=None, help="PEFT LoRA adapter folder for the heads, merged before export")
    export.add_argument("--lm-head-per-head", action="store_true",
                        help="one lm_head copy per head instead of one shared copy (original_lm_head)")
    export.add_argument("--overwrite", action="store_true", help="replace a previous export in --out")
    export.set_defaults(func=_export_vllm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
