"""Heads for GRPO's own temperature on SmolLM2-135M-Instruct: which samples, targets, loss and schedule make heads
accept at T=1.0 (TRL's default) without losing T=0.7, and how acceptance grows with data.

Every variant is a path head set fitted by the recipe of ``onpolicy_heads.onpolicy_distill_config`` at T=1.0
except what its name changes, and measured on the same held-out whole sequences (the plan's 48 GSM8K-test chat
prompts sampled at T=1.0 with T=1.0 targets, and sampled at T=0.7 with T=0.7 targets):

  shipped            the package's heads (measured, not refitted): since 2026-12-04 the s10-t10-kl-tv-linear set;
                     from 2026-12-02 (fourth session) the s10-t10-kl-linear set; before, a set fitted to T=0.7
                     samples and targets with a constant learning rate (its numbers are in
                     benchmarks/heads_temperature_smollm2.json)
  s07-t10-kl         the plan sampled at T=0.7, targets at T=1.0, KL + CE, constant learning rate
  s07-t10-lk         the same plus an LK-style acceptance term -log sum min(p, q): measured once (commit eb0f6a2),
                     no better than KL + CE, deleted
  s10-t10-kl         the policy's own T=1.0 samples (the package's samples), T=1.0 targets, constant learning rate
  both-t10-kl        both sample sets, T=1.0 targets
  more-t10-kl        the policy's T=1.0 samples of as much of the whole plan as ``sample-more`` drew (the package's
                     train prompts first), T=1.0 targets; more-t10-kl-linear on 2,944 prompts is shipped since the
                     fifth session of 2026-12-02 (before it, the package's samples were the plan's first 1,152);
                     on 4,800 prompts (sixth session) it was no better, so the rest of the plan stays unsampled
  *-tv               the variant with TV(p, q) = 1 - sum min(p, q) added to KL + CE (weight TV_WEIGHT): heads
                     fitted for what rejection sampling accepts a child drawn from them at (the recipe since
                     2026-12-04: s10-t10-kl-tv-linear is the shipped set)
  *-linear           the variant with the learning rate decayed linearly to zero over the steps (the recipe since
                     2026-12-02, fourth session)
  *-independent      the variant with independent heads (each reads only h_t: the kind vLLM's export takes)

``--ship VARIANT``: write a fitted variant's heads to the package as the shipped set of its kind (fp16, keyed to the
policy's SHA-256, with its held-out slice measured by the recipe); a ``more-*`` variant's samples (every shard drawn)
replace the package's samples beside them.

``--curve``: the variant's data cut to 50k, 100k, 200k anchors (whole sequences drawn at random) and all.

  python scripts/heads_temperature.py sample                  # the plan at T=0.7, resumable (about 1 h, 1 thread)
  python scripts/heads_temperature.py sample-more             # the whole plan at T=1.0 (every GSM8K-train question
                                                              # plus one arithmetic prompt in four), resumable;
                                                              # stop it any time, `fit` takes the shards drawn
  python scripts/heads_temperature.py fit --curve s10-t10-kl   # every variant, then the curve

Resumable: streams are cached in ``--work``; a variant whose folder holds a report is not refitted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from specroll_trl.adapt.distill import (
    REPORT_FILE,
    TokenStream,
    distill_on_streams,
    format_hit_table,
    measure_heads,
    save_distilled,
)
from specroll_trl.adapt.samples import read_folder, sample_to_folder
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import onpolicy_heads, zoo

T_LOW, T_HIGH = 0.7, 1.0
TV_WEIGHT = 1.0  # the *-tv variants' weight of TV(p, q) beside KL + CE
CURVE_ANCHORS = (50_000, 100_000, 200_000)
WHOLE_PLAN = 9964  # 7,473 GSM8K-train questions, every fourth prompt an arithmetic problem
MORE_BLOCK = 16  # shards of the whole plan streamed (teacher-forced) together


def concat_streams(streams: list[TokenStream]) -> TokenStream:
    """One stream of several (sequence ends shifted by the tokens before them)."""
    offsets, total = [], 0
    for s in streams:
        offsets.append(total)
        total += len(s.ids)
    return TokenStream(hidden=torch.cat([s.hidden for s in streams]), ids=torch.cat([s.ids for s in streams]),
                       anchor_ok=torch.cat([s.anchor_ok for s in streams]),
                       seq_end=torch.cat([s.seq_end + o for s, o in zip(streams, offsets)]),
                       top_ids=torch.cat([s.top_ids for s in streams]),
                       top_probs=torch.cat([s.top_probs for s in streams]))


def sequences_for(stream: TokenStream, anchors: int, seed: int = 0) -> TokenStream:
    """Whole sequences of ``stream``, drawn in a seeded random order (the stream lists them by length), until they
    hold at least ``anchors`` anchors."""
    ends, sequence = torch.unique(stream.seq_end, return_inverse=True)
    order = torch.randperm(len(ends), generator=torch.Generator().manual_seed(seed))
    per_sequence = torch.zeros(len(ends), dtype=torch.long).index_add_(0, sequence, stream.anchor_ok.long())
    count = int((per_sequence[order].cumsum(0) < anchors).sum()) + 1
    keep = torch.isin(sequence, order[:count])
    lengths = torch.bincount(sequence[keep], minlength=len(ends))
    lengths = lengths[lengths > 0]
    return TokenStream(hidden=stream.hidden[keep], ids=stream.ids[keep], anchor_ok=stream.anchor_ok[keep],
                       seq_end=torch.repeat_interleave(lengths.cumsum(0), lengths), top_ids=stream.top_ids[keep],
                       top_probs=stream.top_probs[keep])


def sample_more(model, tokenizer, folder: Path, config) -> None:
    """The whole plan's train prompts sampled at ``config.temperature`` into ``folder``, resumable. The plan of
    ``WHOLE_PLAN`` prompts starts with the package's (same shuffle, same shard seeds), so their shipped
    samples are written as its first shards instead of drawn again."""
    plan = onpolicy_heads.prompt_plan(tokenizer, train=WHOLE_PLAN)["train"]
    shipped = onpolicy_heads.shipped_samples("smollm2-135m", onpolicy_heads.policy_fingerprint(model))
    if shipped is None:
        raise SystemExit("the package's samples do not match this policy")
    pairs, size = shipped["train"], config.sample_batch_size
    if [p for p, _ in pairs] != plan[: len(pairs)]:
        raise SystemExit("the package's samples are not the start of the whole plan")
    folder.mkdir(parents=True, exist_ok=True)
    for index, start in enumerate(range(0, len(pairs) - len(pairs) % size, size)):
        chunk = pairs[start : start + size]
        path = folder / f"shard_{index:05d}.json"
        if not path.is_file():
            path.write_text(json.dumps({"prompts": [p for p, _ in chunk], "completions": [c for _, c in chunk],
                                        "seed": index, "temperature": config.temperature, "shipped": True}))
    sample_to_folder(model, plan, folder, tokenizer.pad_token_id, config.temperature, config.max_new_tokens,
                     size, onpolicy_heads.SAMPLE_SEEDS["train"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["sample", "sample-more", "fit"])
    parser.add_argument("--variants", nargs="*", default=["shipped", "s07-t10-kl", "s10-t10-kl", "both-t10-kl"])
    parser.add_argument("--curve", default=None, help="a variant whose data is cut to the curve's anchor counts")
    parser.add_argument("--curve-anchors", type=int, nargs="+", default=list(CURVE_ANCHORS))
    parser.add_argument("--ship", default=None, help="a fitted variant written to the package as its kind's heads")
    parser.add_argument("--work", default="runs/heads_t10")
    parser.add_argument("--out", default="benchmarks/heads_temperature_smollm2.json")
    args = parser.parse_args()

    model, tokenizer = zoo.load_policy("smollm2-135m")
    recipe = onpolicy_heads.onpolicy_distill_config()
    work = Path(args.work)
    high = dataclasses.replace(recipe, temperature=T_HIGH, lr_scheduler_type="constant")
    if args.what == "sample":
        onpolicy_heads.sample_plan(model, tokenizer, work / "samples_t07", dataclasses.replace(high, temperature=T_LOW))
        return
    if args.what == "sample-more":
        sample_more(model, tokenizer, work / "samples_t10_more", high)
        return

    key = onpolicy_heads.policy_fingerprint(model)
    shipped = onpolicy_heads.shipped_samples("smollm2-135m", key)  # the plan at T=1.0
    if shipped is None:
        raise SystemExit("the package's samples do not match this policy")

    def low(name: str):
        """The plan's T=0.7 samples (``sample`` draws the held-out ones first: the s07 variants need the rest)."""
        if not (work / "samples_t07" / name).is_dir():
            raise SystemExit(f"no T=0.7 {name} samples in {work / 'samples_t07'}: run `python {__file__} sample`")
        return read_folder(work / "samples_t07" / name)

    def stream(name: str, pairs, temperature: float) -> TokenStream:
        return onpolicy_heads.cached_stream(model, pairs, temperature, recipe.target_topk,
                                            work / f"{name}.safetensors")

    held_high = stream("heldout_s10_t10", shipped["heldout"], T_HIGH)
    held_low = stream("heldout_s07_t07", low("heldout"), T_LOW)
    train = {"s07": lambda: stream("train_s07_t10", low("train"), T_HIGH),
             "s10": lambda: stream(f"train_s10_t10_{len(shipped['train'])}", shipped["train"], T_HIGH)}
    train["both"] = lambda: concat_streams([train["s10"](), train["s07"]()])

    def more() -> TokenStream:
        """The package's samples' stream, then one per block of ``MORE_BLOCK`` shards drawn after them (each cached
        alone, so a longer draw reuses the blocks already streamed)."""
        size = recipe.sample_batch_size
        first, drawn = len(shipped["train"]) // size, read_folder(work / "samples_t10_more")
        blocks = [train["s10"]()]
        for start in range(first * size, len(drawn), MORE_BLOCK * size):
            pairs = drawn[start : start + MORE_BLOCK * size]
            name = f"train_more_t10_shards{start // size}-{(start + len(pairs) - 1) // size}"
            blocks.append(stream(name, pairs, T_HIGH))
        return concat_streams(blocks)

    train["more"] = more

    def measure(heads) -> dict:
        return {f"heldout_t{t}": measure_heads(heads, model, s, recipe.hit_ks, t)
                for t, s in ((T_HIGH, held_high), (T_LOW, held_low))}

    out = Path(args.out)
    results = {r["variant"]: r for r in (json.loads(out.read_text()) if out.is_file() else [])}

    def fit(variant: str, data: TokenStream, config) -> None:
        folder = work / "heads" / variant
        if (folder / REPORT_FILE).is_file():
            results[variant] = json.loads((folder / REPORT_FILE).read_text())
            return
        heads, report = distill_on_streams(model, data, held_high, config, fp16_weights=True)
        report.update(variant=variant, samples=variant.split("-")[0], target_temperature=config.temperature,
                      **measure(heads))
        save_distilled(heads, report, folder)
        results[variant] = report
        table = format_hit_table(report["hit_rates"], report["target_mass"], report.get("drawn_accept"))
        print(variant, table, sep="\n", flush=True)
        out.write_text(json.dumps(list(results.values()), indent=2, default=str) + "\n")

    if "shipped" in args.variants:
        heads = SpeculativeHeads.from_pretrained(onpolicy_heads.shipped_folder("smollm2-135m", "path"))
        results["shipped"] = {"variant": "shipped", "samples": "more", "target_temperature": T_HIGH, **measure(heads)}
    for variant in (v for v in args.variants if v != "shipped"):
        schedule = "linear" if "-linear" in variant else high.lr_scheduler_type
        kind = "independent" if variant.endswith("-independent") else "path"
        tv_weight = TV_WEIGHT if "-tv" in variant else 0.0
        fit(variant, train[variant.split("-")[0]](), dataclasses.replace(high, lr_scheduler_type=schedule, kind=kind,
                                                                          tv_weight=tv_weight))
    if args.curve:
        data = train[args.curve.split("-")[0]]()
        for anchors in args.curve_anchors:
            if anchors < int(data.anchor_ok.sum()):
                fit(f"{args.curve}@{anchors // 1000}k", sequences_for(data, anchors), high)
    out.write_text(json.dumps(list(results.values()), indent=2, default=str) + "\n")
    print(f"wrote {out}")
    if args.ship:
        folder = work / "heads" / args.ship
        heads = SpeculativeHeads.from_pretrained(folder, dtype=torch.float32)
        report = json.loads((folder / REPORT_FILE).read_text())
        kind = heads.config.kind
        samples = shipped
        if args.ship.startswith("more-"):  # fitted to more than the package's samples: those ship with them
            samples = {"heldout": shipped["heldout"], "train": read_folder(work / "samples_t10_more")}
            onpolicy_heads.ship_samples(samples, "smollm2-135m", key)
        target = onpolicy_heads.shipped_folder("smollm2-135m", kind)
        onpolicy_heads.save_preset_heads(heads, report, samples, model, target, key,
                                         dataclasses.replace(recipe, kind=kind))
        print(f"shipped {args.ship} as {target}")


if __name__ == "__main__":
    main()
