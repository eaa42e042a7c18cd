"""Batched, exact speculative generation on a plain Hugging Face causal LM (no TRL dependency).

One decoding step, for all rows still generating:
  1. heads propose from the hidden state that produced each row's root token;
  2. ``select_tree`` keeps the best ``N_t`` draft nodes per row (``N_t`` shrinks as rows grow);
  3. one target forward over root + tree with a 4D ancestor mask and logical positions;
  4. every node's distribution goes through ``generate``'s own processors, one sample per node, and the
     row follows its tree along those samples (``match_tree``);
  5. accepted KV entries are kept, the rest become holes; finished rows leave the batch.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationConfig

from .capacity import node_budget, profile_capacity
from .compat import any_rank_active, check_model_supported, should_sync
from .heads import SpeculativeHeads, lm_head_of, lm_head_shape
from .hooks import StepFeedback, StepHook
from .kvcache import RaggedCache
from .tree import PathTable, select_tree
from .verify import TargetDistribution, expected_accepted, match_tree

logger = logging.getLogger(__name__)

@dataclass
class SpeculativeConfig:
    """Engine options.

    Args:
        topk_per_head: candidates each head contributes at its depth (the tree's branching factor).
        max_nodes: ``N_max``, draft nodes per row per step besides the root.
        capacity: ``C_hw``, query tokens per forward the hardware absorbs at about the cost of one token per
            row; ``None`` profiles it once per model with :func:`profile_capacity`.
        capacity_eps: latency tolerance used when profiling ``capacity``.
        return_logprobs: also return the target's ``log_softmax(logits / T)`` of each emitted token.
        compact_ratio: squeeze holes out of the KV cache when they exceed this share of its length.
        fallback_to_generate: on an unsupported model, log and fall back to ``model.generate`` instead of
            raising.
        synced_gpus: keep issuing forwards until every rank has finished (needed when parameters are sharded
            and each forward all-gathers them: ZeRO-3 without gathering, FSDP). ``None``: as ``generate``
            decides, i.e. on when ZeRO-3 or FSDP manages the model and the world size is above 1.
        track_expected_acceptance: also sum ``E[accepted nodes] = sum_v P(path to v)`` under the target (stats
            ``expected_accepted`` next to the realised ``accepted``): a bias detector for the verifier.
    """

    topk_per_head: int = 4
    max_nodes: int = 16
    capacity: int | None = None
    capacity_eps: float = 0.3
    return_logprobs: bool = False
    compact_ratio: float = 0.25
    fallback_to_generate: bool = False
    synced_gpus: bool | None = None
    track_expected_acceptance: bool = False

    def __post_init__(self):
        for name in ("topk_per_head", "max_nodes", "capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.topk_per_head < 1:
            raise ValueError(f"topk_per_head must be >= 1, got {self.topk_per_head}")
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity (C_hw) must be >= 1 or None (profile), got {self.capacity}")
        if not self.capacity_eps >= 0:
            raise ValueError(f"capacity_eps must be >= 0, got {self.capacity_eps}")
        if not 0 < self.compact_ratio <= 1:
            raise ValueError(f"compact_ratio must be in (0, 1], got {self.compact_ratio}")


@dataclass
class GenerationOutput:
    """``completion_ids`` (each cut after its first eos), optional ``logprobs``, and ``stats``."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    stats: dict = field(default_factory=dict)


class SpeculativeGenerator:
    """Exact batched speculative sampling with Medusa-style heads and sparse, budgeted trees."""

    _capacity_cache: dict[int, int] = {}

    def __init__(self, model, heads: SpeculativeHeads, generation_config: GenerationConfig | None = None,
                 config: SpeculativeConfig | None = None, hooks: list[StepHook] | None = None, **options):
        self.model = model
        self.heads = heads
        self.hooks = list(hooks or [])
        self.config = config or SpeculativeConfig(**options)
        if config is not None and options:
            raise ValueError("pass engine options either as `config` or as keyword arguments, not both")
        self.generation_config = copy.deepcopy(generation_config or model.generation_config)
        self.lm_head = lm_head_of(model)
        heads.check_compatible(model)
        if self.config.topk_per_head > heads.config.vocab_size:
            raise ValueError(f"topk_per_head ({self.config.topk_per_head}) exceeds the model's vocab size "
                             f"({heads.config.vocab_size})")
        self.table = PathTable.build(heads.num_heads, self.config.topk_per_head)
        self._table_device = None
        self.supported_error: str | None = None
        try:
            check_model_supported(model)
        except ValueError as err:
            if not self.config.fallback_to_generate:
                raise
            self.supported_error = str(err)
            logger.warning("speculative engine falls back to model.generate: %s", err)

    @property
    def capacity(self) -> int:
        if self.config.capacity is not None:
            return self.config.capacity
        key = id(self.model)
        if key not in self._capacity_cache:
            self._capacity_cache[key] = profile_capacity(self.model, eps=self.config.capacity_eps)
            logger.info("profiled C_hw = %d query tokens per forward", self._capacity_cache[key])
        return self._capacity_cache[key]

    def _eos_ids(self, gen: GenerationConfig) -> list[int]:
        eos = gen.eos_token_id
        if eos is None:
            return []
        return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]

    def _validate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int) -> None:
        if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must be a non-empty [B, T] LongTensor, got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids {tuple(input_ids.shape)}"
            )
        if (attention_mask.sum(1) == 0).any():
            raise ValueError("every prompt needs at least one token (an attention_mask row is all zeros)")
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError("prompts must be left-padded (attention_mask has zeros in its last column)")
        embeddings = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        vocab = getattr(embeddings, "num_embeddings", None) or self.heads.config.vocab_size
        real = input_ids[attention_mask.bool()]
        if bool(((real < 0) | (real >= vocab)).any()):
            bad = sorted({int(t) for t in real[(real < 0) | (real >= vocab)].tolist()})[:5]
            raise ValueError(f"input_ids contain token ids outside the model's vocabulary [0, {vocab}): {bad}")
        if max_new_tokens is None or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and int(attention_mask.sum(1).max()) + max_new_tokens > limit:
            raise ValueError(
                f"prompt ({int(attention_mask.sum(1).max())} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's context of {limit} positions"
            )

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int | None = None) -> GenerationOutput:
        start = time.perf_counter()
        gen = copy.deepcopy(self.generation_config)
        max_new = gen.max_new_tokens if max_new_tokens is None else max_new_tokens  # an explicit 0 is an error
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        self._validate(input_ids, attention_mask, max_new)
        if self.supported_error is not None:
            return self._fallback(input_ids, attention_mask, gen, max_new, start)
        gen.max_new_tokens = max_new
        device = input_ids.device
        batch = input_ids.shape[0]
        target = TargetDistribution(self.model, gen, attention_mask)
        eos = torch.tensor(self._eos_ids(target.generation_config), device=device, dtype=torch.long)
        pad_len = (attention_mask != 0).int().argmax(1)
        if self._table_device != device:
            self.table, self._table_device = self.table.to(device), device
        want_logprobs = self.config.return_logprobs
        capacity = self.capacity  # resolved (maybe profiled) before any rank can finish early

        # Prefill: positions as generate computes them for left padding.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=cache, use_cache=True, output_hidden_states=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        hidden = out.hidden_states[-1][:, -1]
        self._check_finite(logits, 0, torch.arange(batch, device=device))
        root, _ = target.sample(target.scores(logits, input_ids, pad_len))

        completion = torch.zeros((batch, max_new), dtype=torch.long, device=device)
        completion[:, 0] = root
        logprobs = torch.zeros((batch, max_new), dtype=torch.float32, device=device) if want_logprobs else None
        if want_logprobs:
            logprobs[:, 0] = target.logprobs(logits).gather(1, root[:, None]).squeeze(1)
        done_len = torch.ones(batch, dtype=torch.long, device=device)
        rows = torch.arange(batch, device=device)
        kv = RaggedCache(cache, attention_mask.bool(), attention_mask.long().sum(1), self.config.compact_ratio)

        stats = {"forwards": 1, "row_forwards": batch, "tokens": batch, "nodes_per_row": [], "active_rows": [],
                 "drafted_row_steps": 0, "accepted": 0, "expected_accepted": 0.0}
        depths = torch.arange(self.heads.num_heads, device=device)
        accepted_at_depth = torch.zeros(self.heads.num_heads, dtype=torch.long, device=device)
        alive = ~torch.isin(root, eos) & (done_len < max_new)
        keep = alive.nonzero().squeeze(1)
        rows, root, hidden = rows[keep], root[keep], hidden[keep]
        kv.keep_rows(keep)
        for hook in self.hooks:
            hook.start(batch, self.heads.num_heads, lm_head_shape(self.lm_head)[1], self.lm_head)
            hook.observe_prompts(input_ids, attention_mask)
        synced = should_sync(self.model, self.config.synced_gpus)
        step = 0
        while True:
            if synced:
                if not any_rank_active(rows.numel() > 0, device):
                    break
                if not rows.numel():
                    # this rank is done: a throwaway forward keeps the sharded all-gathers in step
                    self.model(input_ids=input_ids[:1, -1:], use_cache=False)
                    stats["sync_forwards"] = stats.get("sync_forwards", 0) + 1
                    continue
            elif not rows.numel():
                break
            step += 1
            active = rows.numel()
            num_nodes = node_budget(capacity, active, self.config.max_nodes)
            stats["nodes_per_row"].append(num_nodes)
            stats["active_rows"].append(active)
            root_index = done_len[rows] - 1
            z = topk_ids = topk_logp = None
            if num_nodes:
                z = self.heads(hidden)  # [B, H, D]
                for hook in self.hooks:
                    z = hook.adjust(rows, z)
                head_logp = torch.log_softmax(self.lm_head(z).float(), dim=-1)
                for hook in self.hooks:
                    head_logp = hook.adjust_logprobs(rows, head_logp)
                topk_logp, topk_ids = head_logp.topk(self.config.topk_per_head, dim=-1)
            tree = select_tree(root, topk_ids, topk_logp, self.table, num_nodes)

            n = tree.size
            out = self.model(
                input_ids=tree.tokens,
                position_ids=kv.lengths[:, None] + tree.depth,
                attention_mask=kv.tree_attention_mask(tree.ancestors, self.lm_head.weight.dtype),
                cache=kv.cache,
                use_cache=True,
                output_hidden_states=True,
            )
            node_logits = out.logits  # [B, n, V]
            self._check_finite(node_logits, step, rows)
            node_ids = ignore = None
            if target.needs_input_ids:
                node_ids, ignore = self._node_input_ids(input_ids, completion, rows, done_len, root, tree, pad_len)
            scores = target.scores(node_logits.reshape(active * n, -1), node_ids, ignore)
            sampled, probs = target.sample(scores)
            sampled = sampled.view(active, n)
            accepted = match_tree(tree, sampled)  # [B, D+1], root first
            num_acc = (accepted >= 0).sum(1)
            if self.config.track_expected_acceptance and num_nodes:
                stats["expected_accepted"] += float(expected_accepted(tree, probs.view(active, n, -1)).sum())
                stats["accepted"] += int((num_acc - 1).sum())
            last = accepted.gather(1, (num_acc - 1)[:, None]).squeeze(1)
            new_root = sampled.gather(1, last[:, None]).squeeze(1)

            # Emitted this step: accepted nodes after the root, then the sample at the last one.
            width = accepted.shape[1]
            j = torch.arange(width, device=device)
            nxt = torch.cat([accepted[:, 1:], accepted.new_full((active, 1), -1)], dim=1)
            emitted = torch.where(j[None] < num_acc[:, None] - 1, tree.tokens.gather(1, nxt.clamp(min=0)),
                                  new_root[:, None])
            count = num_acc.clone()
            is_eos = torch.isin(emitted, eos) & (j[None] < count[:, None])
            first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, width + 1)
            count = torch.minimum(torch.minimum(count, first_eos), max_new - done_len[rows])
            write = j[None] < count[:, None]
            dest = (done_len[rows][:, None] + j[None]).clamp(max=max_new - 1)
            completion[rows[:, None].expand(-1, width)[write], dest[write]] = emitted[write]
            if want_logprobs:
                lp = target.logprobs(node_logits.gather(1, accepted.clamp(min=0)[..., None].expand(
                    -1, -1, node_logits.shape[-1])))  # [B, D+1, V], distribution each emitted token came from
                lp = lp.gather(2, emitted[..., None]).squeeze(2)
                logprobs[rows[:, None].expand(-1, width)[write], dest[write]] = lp[write]
            done_len[rows] += count

            stats["forwards"] += 1
            stats["row_forwards"] += active
            stats["tokens"] += int(count.sum())
            if num_nodes:
                stats["drafted_row_steps"] += active
                accepted_at_depth += ((num_acc - 1)[:, None] > depths).sum(0)

            kv.commit(accepted)
            finished = (first_eos <= num_acc) | (done_len[rows] >= max_new)
            if self.hooks:
                feedback = StepFeedback(rows, root_index, z, topk_ids, tree, probs.view(active, n, -1), accepted,
                                        emitted, count, finished, hidden)
                for hook in self.hooks:
                    hook.feedback(feedback)
            hidden = out.hidden_states[-1].gather(1, last[:, None, None].expand(-1, 1, hidden.shape[-1])).squeeze(1)
            root = new_root
            if finished.any():
                keep = (~finished).nonzero().squeeze(1)
                rows, root, hidden = rows[keep], root[keep], hidden[keep]
                kv.keep_rows(keep)

        lengths = done_len.tolist()
        ids = completion.tolist()
        result = [ids[b][: lengths[b]] for b in range(batch)]
        lps = [logprobs[b, : lengths[b]].tolist() for b in range(batch)] if want_logprobs else None
        drafted = max(1, stats["drafted_row_steps"])
        stats.update(
            tau=stats["tokens"] / stats["row_forwards"],
            accept_per_head=(accepted_at_depth.double() / drafted).tolist(),
            seconds=time.perf_counter() - start,
            capacity=capacity,
        )
        for hook in self.hooks:
            hook.finish(done_len)
            stats.update(hook.metrics())
        return GenerationOutput(result, lps, stats)

    def _node_input_ids(self, prompt_ids, completion, rows, done_len, root, tree, pad_len):
        """Per node: prompt + committed completion + path, the gaps filled with the row's root token (a token
        already on every node's path, so the *set* of ids, all repetition penalty reads, is exact)."""
        active, n = tree.tokens.shape
        comp = completion[rows]
        filled = torch.arange(comp.shape[1], device=comp.device)[None] < done_len[rows][:, None]
        comp = torch.where(filled, comp, root[:, None])
        base = torch.cat([prompt_ids[rows], comp], dim=1)  # [B, L]
        ids = torch.cat([base[:, None].expand(-1, n, -1), tree.path_tokens], dim=2)
        return ids.reshape(active * n, -1), pad_len[rows].repeat_interleave(n)

    @staticmethod
    def _check_finite(logits: torch.Tensor, step: int, rows: torch.Tensor) -> None:
        bad = ~torch.isfinite(logits).reshape(logits.shape[0], -1).all(1)
        if bad.any():
            raise FloatingPointError(
                f"target logits contain NaN or inf at decoding step {step} for batch rows {rows[bad].tolist()}"
            )

    def _fallback(self, input_ids, attention_mask, gen, max_new, start) -> GenerationOutput:
        seqs = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen,
                                   max_new_tokens=max_new)[:, input_ids.shape[1]:].tolist()
        eos = set(self._eos_ids(gen))
        result = [s[: next((i + 1 for i, t in enumerate(s) if t in eos), len(s))] for s in seqs]
        return GenerationOutput(result, None, {"tau": 1.0, "forwards": max(map(len, result)), "fallback": True,
                                               "reason": self.supported_error,
                                               "seconds": time.perf_counter() - start})
