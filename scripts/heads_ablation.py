"""Heads ablation on SmolLM2-135M-Instruct: what each step of the on-policy recipe buys, on one held-out set.

Every variant is fitted to the same streams (the shipped recipe's on-policy samples, one teacher-forced forward,
cached in ``--work``) with the same settings (``onpolicy_heads.onpolicy_distill_config``) except what the variant
changes, and measured on the same held-out whole sequences (hit rates with 95% bootstrap intervals):

  old              the heads main shipped before (48 own samples + 96 teacher-forced gold solutions, 1,956-token
                   draft vocabulary, residual SiLU heads), built by that commit's code into ``--old-heads``
  independent      the on-policy recipe with residual SiLU heads (each reads only h_t)
  path-no-out      path-conditioned heads without the outer projection U: z = h + SiLU(W [h; e..]) (can not leave
                   h's next-token direction; not a kind the library keeps, built here by removing U)
  path             path-conditioned heads, z = h + U SiLU(W [h; e..] + b): the shipped recipe

With ``--ship`` the ``path`` and ``independent`` heads, and the samples, are written to the package.

  python scripts/heads_ablation.py --old-heads OLD_FOLDER --out benchmarks/heads_ablation_smollm2.json --ship

Resumable: a variant whose folder under ``--work`` holds a report is not refitted; records already in ``--out`` are
kept unless their variant runs again.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from torch import nn

from specroll_trl.adapt.distill import (
    REPORT_FILE,
    distill_on_streams,
    draft_vocab_coverage,
    draft_vocabulary,
    format_hit_table,
    measure_heads,
    new_heads,
    save_distilled,
)
from specroll_trl.adapt.distill_cache import policy_fingerprint
from specroll_trl.engine.heads import SpeculativeHeads
from specroll_trl.experiments import onpolicy_heads, zoo


def without_outer_projection(heads: SpeculativeHeads) -> SpeculativeHeads:
    """Path heads as ``h + SiLU(W [h; e..] + b)``, ``W, b`` zero: the outer projection removed."""
    for head in heads.heads:
        head.outer = nn.Identity()
        nn.init.zeros_(head.inner.weight)
        nn.init.zeros_(head.inner.bias)
    return heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--old-heads", default=None, help="folder of the previously shipped heads, to measure")
    parser.add_argument("--variants", nargs="+", default=["path", "independent", "path-no-out"])
    parser.add_argument("--work", default="runs/heads_ablation")
    parser.add_argument("--out", default="benchmarks/heads_ablation_smollm2.json")
    parser.add_argument("--ship", action="store_true", help="write the 'path' variant as the package's heads")
    args = parser.parse_args()

    model, tokenizer = zoo.load_policy(args.model)
    config = onpolicy_heads.onpolicy_distill_config()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    samples = onpolicy_heads.sample_plan(model, tokenizer, zoo.policy_dir(args.model) / "onpolicy_samples", config)
    train = onpolicy_heads.cached_stream(model, samples["train"], config.temperature, config.target_topk,
                                         work / "train_stream.safetensors")
    heldout = onpolicy_heads.cached_stream(model, samples["heldout"], config.temperature, config.target_topk,
                                           work / "heldout_stream.safetensors")
    print(f"{int(train.anchor_ok.sum())} training anchors, {int(heldout.anchor_ok.sum())} held-out anchors from "
          f"{len(samples['heldout'])} sequences", flush=True)

    key = policy_fingerprint(model)
    eos = model.generation_config.eos_token_id
    coverage = {size: draft_vocab_coverage(draft_vocabulary(train, size, list(eos if isinstance(eos, list) else [eos])),
                                           heldout) for size in (1024, 2048, 4096, 8192, 16384)}
    print("draft vocabulary size -> share of held-out tokens it covers:", coverage, flush=True)
    distinct = int(train.ids.unique().numel())
    results = {"draft_vocab_coverage": {"variant": "draft_vocab_coverage", "distinct_train_tokens": distinct,
                            "coverage": coverage}}
    if args.old_heads:
        old = SpeculativeHeads.from_pretrained(args.old_heads)
        results["old"] = {"variant": "old", **measure_heads(old, model, heldout, config.hit_ks, config.temperature)}
    for variant in args.variants:
        folder = work / variant
        if (folder / REPORT_FILE).is_file():
            results[variant] = json.loads((folder / REPORT_FILE).read_text())
            continue
        kind = "independent" if variant == "independent" else "path"
        variant_config = dataclasses.replace(config, kind=kind)
        heads = without_outer_projection(new_heads(model, train, variant_config)) if variant == "path-no-out" else None
        heads, report = distill_on_streams(model, train, heldout, variant_config, heads=heads, fp16_weights=True)
        report["variant"] = variant
        results[variant] = report
        table = format_hit_table(report["hit_rates"], report["target_mass"], report.get("drawn_accept"))
        print(variant, table, sep="\n", flush=True)
        if variant == "path-no-out":
            (folder).mkdir(exist_ok=True)
            (folder / REPORT_FILE).write_text(json.dumps(report, indent=2, default=str) + "\n")
        else:
            save_distilled(heads, report, folder)
        if variant in ("path", "independent") and args.ship:
            onpolicy_heads.save_preset_heads(heads, report, samples, model,
                                             onpolicy_heads.shipped_folder(args.model, kind), key)
    if args.ship:
        onpolicy_heads.ship_samples(samples, args.model, key)
    out = Path(args.out)
    kept = [r for r in (json.loads(out.read_text()) if out.is_file() else []) if r["variant"] not in results]
    out.write_text(json.dumps(kept + list(results.values()), indent=2, default=str) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
