"""What heads are worth: mean accepted length against tree size, and what a step costs against tree size.

``tau_sweep`` runs the engine with a fixed number of draft nodes per row (``capacity`` large enough that every row
gets ``N``), on held-out GSM8K-test chat prompts (rows 1000 on: never sampled for the heads' training or held-out
sets). With a fixed ``N`` a row's acceptance does not depend on the other rows, so the prompts run as one batch and
tau is the per-row figure a 1-row run measures. ``step_cost`` times engine steps at ``B`` rows and ``N`` nodes
against ``N = 0``: the ratio is the tau a tree of ``N`` nodes must reach to break even at that batch size.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..adapt.samples import left_pad, sampling_config
from ..engine.generator import SpeculativeGenerator
from ..engine.heads import SpeculativeHeads
from .tasks import chat_prompt, gsm8k_examples

BENCH_ROW = 1000  # first GSM8K-test row of the benches' prompts (the heads' held-out set is rows 0-47)


def rule_options(rule: str) -> dict:
    """Engine options of a verification rule named ``top-k``, ``drawn`` or ``drawn+F`` (``F`` fixed children)."""
    if rule == "top-k":
        return dict(candidates="top-k")
    name, _, fixed = rule.partition("+")
    if name != "drawn" or (fixed and not fixed.isdigit()):
        raise ValueError(f"unknown rule {rule!r}: top-k, drawn or drawn+F (F top-of-q children per node)")
    return dict(candidates="drawn", fixed_children=int(fixed or 0))


def bench_prompts(tokenizer, n: int, start: int = BENCH_ROW) -> list[list[int]]:
    """``n`` GSM8K-test chat prompts from row ``start`` on."""
    rows = gsm8k_examples("test", limit=start + n)[start:]
    texts = [tokenizer.apply_chat_template(chat_prompt(e["question"]), tokenize=False, add_generation_prompt=True)
             for e in rows]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def tau_sweep(model, tokenizer, heads: dict[str, str | Path], node_counts=(2, 4, 8, 16, 32), temperatures=(0.7, 1.0),
              num_prompts: int = 8, max_new_tokens: int = 256, topk_per_head: int = 4, seed: int = 0,
              rules=("top-k",), groups: int = 1, device: str = "cpu", progress: bool = True) -> list[dict]:
    """One record per (heads, rule, temperature, nodes, prompt group): ``tau``, ``accept_per_head``, tokens and
    forwards, on the same prompts and seed for every heads folder in ``heads`` (name -> folder) and verification rule
    (``rule_options``). The prompts run as ``groups`` consecutive batches (``group`` in the records), so that a
    median over groups comes with the pooled figure."""
    model = model.to(device)
    prompts = bench_prompts(tokenizer, num_prompts)
    size = -(-num_prompts // groups)
    batches = [tuple(t.to(model.device) for t in left_pad(prompts[i:i + size], tokenizer.pad_token_id))
               for i in range(0, num_prompts, size)]
    records = []
    for name, folder in heads.items():
        loaded = SpeculativeHeads.from_pretrained(folder, device=model.device, dtype=model.dtype)
        for temperature in temperatures:
            gc = sampling_config(model, temperature, max_new_tokens)
            for nodes in node_counts:
                for rule in rules:
                    for group, (ids, mask) in enumerate(batches):
                        engine = SpeculativeGenerator(model, loaded, gc, capacity=10**9, max_nodes=nodes,
                                                      topk_per_head=topk_per_head, **rule_options(rule))
                        torch.manual_seed(seed)
                        stats = engine.generate(ids, mask).stats
                        records.append({"heads": name, "kind": loaded.config.kind, "rule": rule,
                                        "temperature": temperature, "nodes": nodes, "group": group, "tau": stats.tau,
                                        "accept_per_head": stats.accept_per_head, "tokens": stats.tokens,
                                        "row_forwards": stats.row_forwards, "prompts": len(ids),
                                        "max_new_tokens": max_new_tokens, "seconds": stats.seconds})
                        if progress:
                            print(f"{name:<24} {rule:<8} T={temperature} nodes {nodes:>2} group {group}: tau "
                                  f"{stats.tau:.2f}  accept/depth " + " ".join(f"{a:.2f}" for a in
                                                                             stats.accept_per_head), flush=True)
    return records


@torch.no_grad()
def step_cost(model, tokenizer, heads_folder: str | Path, batch_sizes=(1, 8, 32), node_counts=(0, 2, 4, 8, 16, 32),
              max_new_tokens: int = 48, repeats: int = 3, temperature: float = 0.7, device: str = "cpu",
              progress: bool = True, unpacked: bool = False, rules=("drawn",)) -> list[dict]:
    """One record per (batch size, rule, nodes): the median seconds of one decoding step (draft + verify + commit, the
    prefill excluded) and its ratio to a step without drafting, alternating node counts within each repeat. Each
    verification rule (``rule_options``) drafts every step of its own engine: a step's cost depends on its rule (a
    top-k tree's frontier is wider than a drawn one's), and an engine left to choose would mix them by its estimates
    (at four nodes, T=0.7, one run's engine drew 1-4 of ~20 steps, another's 18-26). The plain step (0 nodes, rule
    ``None``) is shared by the rules. The
    weights the kernels pack once per call (``pack_s``, per call) are not a step's: ``step_s`` leaves them out and
    ``step_with_packing_s`` spreads them over the call's steps (a ``max_new_tokens`` call); with
    ``unpacked``, the same with the model's own linear kernels (``pack_linears=False``, records ``kernels:
    "f_linear"``) alternated with the engine's measured choice (``"measured"``), each against its own plain step.
    ``relative_by_repeat`` holds each repeat's ratio to that repeat's plain call: the machine's drift over a run,
    which a ratio of medians keeps, cancels there; ``drawn_share``, the share of drafted row-steps whose candidates
    were drawn."""
    if repeats < 1:
        raise ValueError(f"step_cost needs at least one repeat, got repeats={repeats}")
    model = model.to(device)
    heads = SpeculativeHeads.from_pretrained(heads_folder, device=model.device, dtype=model.dtype)
    gc = sampling_config(model, temperature, max_new_tokens)
    records = []
    for batch in batch_sizes:
        ids, mask = (t.to(model.device) for t in left_pad(bench_prompts(tokenizer, batch), tokenizer.pad_token_id))
        kinds = ("measured", "f_linear") if unpacked else ("measured",)
        cells = [(None, 0)] + [(rule, n) for rule in rules for n in node_counts if n]
        engines = {(kind, rule, n): SpeculativeGenerator(model, heads, gc, capacity=10**9, max_nodes=n,
                                                         pack_linears=kind == "measured",
                                                         **(rule_options(rule) if n else {}))
                   for kind in kinds for rule, n in cells}
        for engine in engines.values():  # warm-up: the kernels' choice for each width is measured here
            engine.generate(ids, mask, max_new_tokens=8)
        per_step, with_packing, packing = ({key: [] for key in engines} for _ in range(3))
        drafted = {key: [0, 0] for key in engines}  # row-steps drafted, of them drawn
        for r in range(repeats):
            start = time.perf_counter()
            engines["measured", None, 0].generate(ids, mask, max_new_tokens=1)
            if ids.is_cuda:
                torch.cuda.synchronize()
            prefill = time.perf_counter() - start
            for key, engine in engines.items():
                torch.manual_seed(r)
                stats = engine.generate(ids, mask).stats
                steps = max(1, stats.forwards - 1)
                with_packing[key].append((stats.seconds - prefill) / steps)
                per_step[key].append((stats.seconds - prefill - stats.pack_seconds) / steps)
                packing[key].append(stats.pack_seconds)
                drafted[key][0] += stats.drafted_row_steps
                drafted[key][1] += stats.drawn_row_steps
        for kind in kinds:
            plain = kind, None, 0
            base = statistics.median(per_step[plain])
            base_packing = statistics.median(with_packing[plain])
            for rule, n in cells:
                key = kind, rule, n
                step, packed = statistics.median(per_step[key]), statistics.median(with_packing[key])
                pack = statistics.median(packing[key])
                by_repeat = [a / b for a, b in zip(per_step[key], per_step[plain])]
                records.append({"batch_size": batch, "nodes": n, "rule": rule, "step_s": step, "relative": step / base,
                                "break_even_tau": step / base, "kernels": kind, "pack_s": pack,
                                "step_with_packing_s": packed, "relative_with_packing": packed / base_packing,
                                "relative_by_repeat": by_repeat,
                                "drawn_share": drafted[key][1] / drafted[key][0] if drafted[key][0] else None})
                if progress:
                    print(f"batch {batch:>2} nodes {n:>2} {rule or 'plain':>6} {kind:>8}: step {1000 * step:7.1f} ms = "
                          f"{step / base:.2f}x a plain step (by repeat, median {statistics.median(by_repeat):.2f}x); "
                          f"packing {1000 * pack:.0f} ms a call, {packed / base_packing:.2f}x with it spread over "
                          f"{max_new_tokens} tokens", flush=True)
    return records


def plot_heads(records: list[dict], path: str | Path) -> None:
    """tau against draft nodes per row (the median over prompt groups), one line per heads set, rule and temperature;
    with the step-cost records, the break-even tau at each batch size (dotted)."""
    from .plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    taus = [r for r in records if "tau" in r]
    for name, rule, temperature in dict.fromkeys((r["heads"], r.get("rule"), r["temperature"]) for r in taus):
        rows = [r for r in taus if r["heads"] == name and r.get("rule") == rule and r["temperature"] == temperature]
        nodes = list(dict.fromkeys(r["nodes"] for r in rows))
        tau = [statistics.median(r["tau"] for r in rows if r["nodes"] == n) for n in nodes]
        ax.plot(nodes, tau, marker="o",
                ls="-" if temperature == 0.7 else "--", label=f"{name}{f', {rule}' if rule else ''}, T={temperature}")
    costs = [r for r in records if "break_even_tau" in r]
    batches = sorted({r["batch_size"] for r in costs})
    rules = [r.get("rule") for r in costs if r["nodes"]]
    for batch, kind, rule in dict.fromkeys((r["batch_size"], r.get("kernels", "measured"), r.get("rule"))
                                           for r in costs if r["nodes"]):
        rows = [r for r in costs if r["batch_size"] == batch and r.get("kernels", "measured") == kind
                and (r.get("rule") == rule or not r["nodes"])]  # each rule's line starts at the shared plain step
        shade = batches.index(batch) / max(1, len(batches) - 1)  # more rows, lighter
        ax.plot([r["nodes"] for r in rows], [r["break_even_tau"] for r in rows], ls=":" if rule != "top-k" else "-.",
                color=(0.1 + 0.55 * shade,) * 3 if kind == "measured" else (0.95, 0.5 - 0.3 * shade, 0.5 - 0.3 * shade),
                marker="o^sD"[batches.index(batch) % 4], markersize=4,
                label=f"break-even tau here, {batch} row{'s' * (batch > 1)}{', F.linear' * (kind == 'f_linear')}"
                      f"{f', {rule}' if rule and len(set(rules)) > 1 else ''}")
    ax.set_xscale("symlog", base=2)
    ax.set_xlabel("draft nodes per row")
    ax.set_ylabel("tau (tokens per target forward per row)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)
