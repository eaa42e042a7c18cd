"""Moved policies for the adaptation benchmarks, and how far they moved (``specroll-trl bench shift``).

* ``sft_policy``: a fast, controlled shift: a short SFT of the policy toward another answer style (``STYLES``:
  GSM8K solutions rewritten as ``Step 1: ...`` lines without calculator annotations, then ``#### <answer>``;
  or the same in capitals, which also moves the vocabulary: most capitalised tokens lie outside the heads'
  draft vocabulary);
* ``drifted_policy``: the policy after plain GRPO (TRL's ``GRPOTrainer``) on its task;
* ``perturbed_policy``: noise on one MLP projection (a persistent local mismatch, for generation-only checks);
* ``measure_shift``: mean per-token KL between a base and a moved policy on completions the moved one samples
  from held-out prompts, and the acceptance of heads distilled on the base with a full draft tree on both, then
  after one slow-path consolidation on tuples captured from the moved policy.

Moved policies are cached under ``$SPECROLL_HOME/drifted/``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time

import torch

from ..engine import SpeculativeGenerator
from ..files import atomic_folder
from .zoo import (
    PRETRAINED,
    load_policy,
    preset_dataset,
    preset_task,
    preset_temperature,
    resolve_policy,
    teacher_forced_text,
    trl_generation_config,
    zoo_home,
)


def restyle_solution(solution: str) -> str:
    """A GSM8K solution in the ``step-lines`` style: calculator annotations dropped, each reasoning line numbered
    ``Step k:``, the final ``#### <answer>`` line kept (so the task's rewards still score it)."""
    lines = [re.sub(r"<<[^>]*>>", "", line).strip() for line in solution.strip().splitlines()]
    body = [line for line in lines if line and not line.startswith("####")]
    final = next((line for line in lines if line.startswith("####")), "")
    return "\n".join([*(f"Step {k}: {line}" for k, line in enumerate(body, 1)), final]).strip()


STYLES = {"step-lines": restyle_solution, "capitals": lambda solution: restyle_solution(solution).upper()}


def sft_policy(model_name: str, steps: int = 24, lr: float = 1e-4, batch_size: int = 8, style: str = "step-lines",
               progress: bool = True) -> str:
    """The policy after ``steps`` AdamW steps of SFT on an answer style of ``STYLES`` (cached); heads distilled on
    ``model_name`` are now stale. Loss on reply tokens only."""
    from tqdm.auto import tqdm

    if style not in STYLES:
        raise ValueError(f"unknown SFT style {style!r}; choose from {sorted(STYLES)}")
    suffix = "" if style == "step-lines" else f"-{style}"
    out = zoo_home() / "drifted" / f"{model_name}-sft{steps}-lr{lr:g}{suffix}"
    if (out / "config.json").is_file():
        return str(out)
    model, tokenizer = load_policy(model_name, progress=progress)
    model.train()
    # rows from 2000 on: away from the rows the zoo heads were distilled on
    pairs = teacher_forced_text(tokenizer, steps * batch_size, offset=2000, restyle=STYLES[style])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id
    for step in tqdm(range(steps), desc="SFT shift", disable=not progress):
        batch = pairs[step * batch_size:(step + 1) * batch_size]
        width = max(len(p) + len(r) for p, r in batch)
        ids = torch.full((len(batch), width), pad)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, r) in enumerate(batch):  # right padding: positions stay those of the unpadded text
            ids[i, :len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p):len(p) + len(r)] = torch.tensor(r)
            mask[i, :len(p) + len(r)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    model.eval()
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return str(out)


def drifted_policy(model_name: str, grpo_steps: int, lr: float = 5e-5, prompts_per_step: int = 2,
                   max_completion_length: int = 128, progress: bool = True) -> str:
    """The policy after ``grpo_steps`` of plain GRPO on its task (cached), ``prompts_per_step`` x 8 completions of up
    to ``max_completion_length`` tokens per step: its zoo heads may now be stale."""
    from trl import GRPOConfig, GRPOTrainer

    from .rewards import REWARD_FUNCS

    name = f"{model_name}-grpo{grpo_steps}-lr{lr:g}-{8 * prompts_per_step}x{max_completion_length}"
    out = zoo_home() / "drifted" / name
    if (out / "config.json").is_file():
        return str(out)
    args = GRPOConfig(output_dir=str(out) + ".run", max_steps=grpo_steps, num_generations=8,
                      per_device_train_batch_size=8 * prompts_per_step, max_completion_length=max_completion_length,
                      learning_rate=lr, logging_steps=1, report_to="none", bf16=False, save_strategy="no", seed=0,
                      disable_tqdm=not progress, beta=0.0, temperature=preset_temperature(model_name))
    trainer = GRPOTrainer(model=str(resolve_policy(model_name)), reward_funcs=REWARD_FUNCS, args=args,
                          train_dataset=preset_dataset(model_name, grpo_steps * prompts_per_step, seed=99))
    trainer.train()
    with atomic_folder(out) as tmp:
        trainer.save_model(str(tmp))
        trainer.processing_class.save_pretrained(str(tmp))
    return str(out)


def perturbed_policy(model, scale: float = 0.05, seed: int = 0):
    """A copy of ``model`` whose last MLP output projection got Gaussian noise: a persistent local mismatch."""
    target = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    weight = target.model.layers[-1].mlp.down_proj.weight
    with torch.no_grad():
        weight.add_(torch.randn(weight.shape, generator=gen) * scale * weight.std())
    return target


@torch.no_grad()
def mean_token_kl(moved, base, ids: torch.Tensor, mask: torch.Tensor, completion_mask: torch.Tensor) -> float:
    """Mean over completion tokens of ``KL(p_moved || p_base)`` of the next-token distributions (temperature 1)."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logp = torch.log_softmax(moved(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float(), -1)
    logq = torch.log_softmax(base(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float(), -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)[:, :-1]  # position t predicts token t + 1
    weight = completion_mask[:, 1:].float()
    return float((kl * weight).sum() / weight.sum().clamp(min=1))


def _completion_batch(ids, mask, completions: list[list[int]], pad: int):
    """Left-padded prompts + right-padded completions: ``(sequences, attention_mask, completion_mask)``."""
    width = max(map(len, completions))
    tail = torch.tensor([c + [pad] * (width - len(c)) for c in completions])
    completion = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    completion_mask = torch.cat([torch.zeros_like(mask), completion], 1)
    return torch.cat([ids, tail], 1), torch.cat([mask, completion], 1), completion_mask


def measure_shift(model_name: str, moved_path: str, num_prompts: int = 8, max_new_tokens: int = 128,
                  refit_prompts: int = 16, progress: bool = True) -> dict:
    """How far ``moved_path`` is from ``model_name`` and what it does to the base policy's heads: mean per-token
    KL on the moved policy's own samples from held-out prompts, and tau / acceptance per depth / candidate regret
    of the heads with a full tree (``max_nodes`` 16 per row) on the base and on the moved policy, same prompts
    and seed; then (``refit_prompts`` > 0) one consolidation with ``ConsolidationConfig``'s defaults on tuples
    captured while the moved policy answers ``refit_prompts`` other prompts, and the refitted heads' tau."""
    from .zoo import load_heads

    heads = load_heads(model_name, progress=progress)  # the preset's default kind (path heads for a pretrained one)
    with torch.no_grad():
        return _measure_shift(model_name, moved_path, heads, num_prompts, max_new_tokens, refit_prompts, progress)


def _measure_shift(model_name, moved_path, heads, num_prompts, max_new_tokens, refit_prompts, progress) -> dict:
    from transformers import AutoModelForCausalLM

    from ..adapt.buffer import BufferCapture, HeadBuffer
    from ..adapt.consolidation import ConsolidationConfig, consolidate_heads
    from ..adapt.samples import left_pad
    from .zoo import task_prompt_ids

    base, tokenizer = load_policy(model_name, progress=progress)
    moved = AutoModelForCausalLM.from_pretrained(moved_path).eval()
    chat = model_name in PRETRAINED
    temperature = preset_temperature(model_name)

    def run(model, heads, seed: int, n: int, buffer: HeadBuffer | None = None):
        prompts = task_prompt_ids(tokenizer, preset_task(model_name), n, seed=seed, conversational=chat)
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        gc = trl_generation_config(model, tokenizer, max_new_tokens, temperature=temperature)
        if buffer is None:  # regret only
            buffer = HeadBuffer(1, heads.num_heads, heads.config.hidden_size, 1)
        capture = BufferCapture(buffer)
        engine = SpeculativeGenerator(model, heads, gc, max_nodes=16, capacity=17 * n, hooks=[capture])
        torch.manual_seed(0)
        out = engine.generate(ids, mask)
        return ids, mask, out, capture.regret()

    record = {"model": model_name, "moved": moved_path, "prompts": num_prompts, "max_new_tokens": max_new_tokens,
              "temperature": temperature, "max_nodes": 16}
    measured = {"base": (base, heads), "moved": (moved, heads)}
    if refit_prompts:
        config = ConsolidationConfig()
        buffer = HeadBuffer(config.buffer_size, heads.num_heads, heads.config.hidden_size, config.buffer_topk)
        run(moved, heads, seed=5151, n=refit_prompts, buffer=buffer)
        refitted = copy.deepcopy(heads)
        report = consolidate_heads(refitted, moved.get_output_embeddings(), buffer,
                                   dataclasses.replace(config, min_buffer=min(config.min_buffer, len(buffer))),
                                   embed=moved.get_input_embeddings())
        record.update({"refit_tuples": len(buffer), "refit_seconds": report.seconds, "refit_steps": report.steps,
                       "refit_ok": report.ok,
                       "refit_vocab_swapped": report.vocab_swapped, "refit_heldout_before": report.heldout_before,
                       "refit_heldout_after": report.heldout_after, "refit_reason": report.reason})
        measured["refit"] = (moved, refitted)
    for name, (model, use) in measured.items():
        start = time.perf_counter()
        ids, mask, out, regret = run(model, use, seed=4242, n=num_prompts)
        record.update({f"{name}_tau": out.stats.tau, f"{name}_accept_per_head": out.stats.accept_per_head,
                       f"{name}_candidate_regret": regret, f"{name}_seconds": time.perf_counter() - start})
        if name == "moved":
            batch = _completion_batch(ids, mask, out.completion_ids, tokenizer.pad_token_id)
            record["kl_moved_base"] = mean_token_kl(moved, base, *batch)
            record["completion_tokens"] = int(batch[2].sum())
            record["moved_sample"] = tokenizer.decode(out.completion_ids[0], skip_special_tokens=True)[:400]
        if progress:
            print(f"{name:<6} tau {out.stats.tau:.3f}  accept/depth "
                  + " ".join(f"{100 * a:.0f}%" for a in out.stats.accept_per_head)
                  + "  regret " + " ".join(f"{r:.2f}" for r in regret), flush=True)
    record["tau_drop"] = 1 - record["moved_tau"] / record["base_tau"]
    return record


MOVES = ("sft", "sft-capitals", "grpo")


def moved_policy(model_name: str, move: str, sft_steps: int = 24, sft_lr: float = 1e-4, grpo_steps: int = 6,
                 grpo_lr: float = 5e-5, progress: bool = True) -> tuple[str, dict]:
    """``(folder, settings)`` of a move in ``MOVES``: ``"sft"`` / ``"sft-capitals"`` (``sft_policy`` in the
    step-lines / capitals style) or ``"grpo"`` (``drifted_policy``); built on first use, then cached."""
    if move in ("sft", "sft-capitals"):
        if model_name not in PRETRAINED:
            raise ValueError(f"move {move!r} trains on chat-form GSM8K and needs a pretrained chat preset "
                             f"({sorted(PRETRAINED)}), got {model_name!r}; toys can take 'grpo'")
        style = "capitals" if move == "sft-capitals" else "step-lines"
        return (sft_policy(model_name, sft_steps, sft_lr, style=style, progress=progress),
                {"steps": sft_steps, "lr": sft_lr, "style": style})
    if move == "grpo":
        return drifted_policy(model_name, grpo_steps, grpo_lr, progress=progress), {"steps": grpo_steps, "lr": grpo_lr}
    raise ValueError(f"unknown move {move!r}; choose from {MOVES}")


def bench_shift(model_name: str, moves: tuple[str, ...] = ("sft",), sft_steps: int = 24, sft_lr: float = 1e-4,
                grpo_steps: int = 6, grpo_lr: float = 5e-5, progress: bool = True) -> list[dict]:
    """One ``measure_shift`` record per move of ``MOVES`` (``moved_policy``), with the seconds the move took (about 0
    when it came from the cache)."""
    records = []
    for move in moves:
        start = time.perf_counter()
        path, settings = moved_policy(model_name, move, sft_steps, sft_lr, grpo_steps, grpo_lr, progress)
        seconds = time.perf_counter() - start
        record = {"move": move, **settings, "move_seconds": seconds, **measure_shift(model_name, path,
                                                                                    progress=progress)}
        records.append(record)
        if progress:
            print(f"{move}: KL {record['kl_moved_base']:.4f} nats/token, tau {record['base_tau']:.3f} -> "
                  f"{record['moved_tau']:.3f} ({100 * record['tau_drop']:+.1f}% drop), after one re-fit "
                  f"({record.get('refit_seconds', 0):.1f}s) {record.get('refit_tau', float('nan')):.3f}", flush=True)
    return records
