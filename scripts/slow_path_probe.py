"""Slow-path settings on the default policy's path heads, judged on a round of prompts the re-fit never saw.

Samples 4 rounds of 8 GSM8K chat prompts x 128 tokens at T=1.0 with the shipped path heads (4-node trees) and the
slow path's capture; re-fits copies of the heads on the first 3 rounds with several settings and reports, for each,
the gain on the buffer's own held-out split and on the 4th round (``true gain``: rollouts of other prompts).
Usage: ``python scripts/slow_path_probe.py`` (about 3 minutes on 2 cores).
"""

import copy
import time

import torch

from specroll_trl.adapt.buffer import BufferCapture, HeadBuffer
from specroll_trl.adapt.consolidation import ConsolidationConfig, _Refit, consolidate_heads
from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.experiments import zoo

SETTINGS = [(3e-3, 60, 0.01), (1e-3, 40, 0.01), (1e-3, 20, 0.01), (3e-4, 40, 0.01), (1e-3, 40, 1.0)]


def main():
    model, tokenizer = zoo.load_policy("smollm2-135m")
    heads = zoo.load_heads("smollm2-135m").float()
    fit, fresh = HeadBuffer(8192, heads.num_heads, 576, 8), HeadBuffer(8192, heads.num_heads, 576, 8)
    gc = zoo.trl_generation_config(model, tokenizer, 128, temperature=1.0)
    prompts = zoo.task_prompt_ids(tokenizer, "gsm8k", 32, seed=5, conversational=True)
    torch.manual_seed(0)
    for i in range(0, 32, 8):
        buffer = fit if i < 24 else fresh
        engine = SpeculativeGenerator(model, heads, gc, capacity=10**6, max_nodes=4, hooks=[BufferCapture(buffer)])
        out = engine.generate(*left_pad(prompts[i : i + 8], tokenizer.pad_token_id))
        print(f"round {i // 8}: tau {out.stats.tau:.3f}, records {len(buffer)}", flush=True)
    embed = model.get_input_embeddings()

    def fresh_loss(h):
        return _Refit(h, model.lm_head, fresh, ConsolidationConfig(holdout_fraction=0.999, min_buffer=1),
                      embed).heldout_loss()

    base = fresh_loss(heads)
    for lr, steps, mu in SETTINGS:
        h = copy.deepcopy(heads)
        start = time.time()
        report = consolidate_heads(h, model.lm_head, fit, ConsolidationConfig(min_buffer=256, lr=lr, steps=steps,
                                                                              mu=mu, vocab_refresh=0.0), embed=embed)
        print(f"lr {lr:g} steps {steps} mu {mu:g}: {time.time() - start:.1f} s, kept {report.ok}, "
              f"buffer held-out gain {report.gain:+.4f}, true gain {(base - fresh_loss(h)) / base:+.4f}", flush=True)


if __name__ == "__main__":
    main()
