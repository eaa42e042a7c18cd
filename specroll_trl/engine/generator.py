"""``SpeculativeGenerator``: batched, exact speculative generation on a plain Hugging Face causal LM.

One decoding step, for all rows still generating (``generate`` reads as these stages):
  * draft: the heads propose from the hidden state that produced each row's root token and keep the best ``N_t``
    nodes per row (``N_t`` shrinks as rows grow): independent heads all at once, ``select_tree``; path-conditioned
    heads depth by depth over the tree's frontier, ``grow_tree``; hooks may adjust every draft call's proposals;
  * verify: one target forward over root + tree (4D ancestor mask, logical positions); every node's
    distribution goes through ``generate``'s own logits processors and gets one sample;
  * commit: each row follows its tree along those samples (``emit``); accepted KV entries are kept, the rest
    become holes; hooks get the step's feedback;
  * retire: finished rows leave the batch.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

import torch
from transformers import GenerationConfig

from .attention import grouped_attention
from .budget import FixedBudget, NodeBudget, OnlineBudget
from .compat import any_rank_active, check_model_supported, local_copies, should_sync
from .drawn import AcceptanceByRank, DrawnDraft, draw_tree, expected_accepted_drawn
from .heads import SpeculativeHeads, VocabProjection, lm_head_of
from .hooks import DraftSlots, GenerationContext, StepFeedback, StepHook
from .kernels import LinearKernels, kernels_of
from .kvcache import RaggedCache, displaced, roomy_cache
from .tree import DraftTree, GrownTree, PathTable, grow_tree, select_tree
from .verify import (
    Emission,
    TargetDistribution,
    UnsupportedOptionsError,
    check_decoding_options,
    cut,
    emit,
    expected_accepted,
    path_probability,
)
from .walk_kernel import walk, walk_kernel_available

logger = logging.getLogger(__name__)


CANDIDATE_RULES = ("auto", "drawn", "top-k")


@dataclass
class SpeculativeConfig:
    """Engine options.

    Args:
        candidates: how a node's children are proposed and verified (``docs/engine.md``): ``"drawn"``, drawn from
            the heads' distribution ``q`` and verified by recursive rejection sampling (``engine.drawn``; the tree's
            shape follows the verifier's measured acceptance by depth and rank); ``"top-k"``, the heads' top-k,
            verified by sample-then-match (what is emitted then does not depend on the drafts); ``"auto"``, each step
            the one the node budget predicts to commit more tokens per second, from what both have been measured to
            accept. Greedy decoding always matches top-k candidates.
        fixed_children: with ``"drawn"``, how many children of each node are the top tokens of ``q`` (point masses
            to the verifier) before the rest are drawn.
        topk_per_head: children per node at most: the tree's branching factor.
        max_nodes: ``N_max``, draft nodes per row per step besides the root.
        capacity: ``None`` (default): the node budget is learnt online from the engine's own steps
            (:class:`OnlineBudget`); an int ``C_hw``: query tokens per forward the hardware absorbs at about the cost
            of one token per row, for the fixed formula ``N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)``.
        return_logprobs: also return the target's ``log_softmax(logits / T)`` of each emitted token.
        compact_ratio: squeeze holes out of the KV cache when they exceed this share of its length.
        fallback_to_generate: on an unsupported model, log and fall back to ``model.generate`` instead of
            raising; likewise, for one call, on generation options whose logits processors the engine cannot
            reproduce per tree node (one warning per option set).
        synced_gpus: keep issuing forwards until every rank has finished (needed when parameters are sharded
            and each forward all-gathers them: ZeRO-3 without gathering, FSDP). ``None``: as ``generate``
            decides, i.e. on when ZeRO-3 or FSDP manages the model and the world size is above 1.
        track_expected_acceptance: also sum ``E[accepted nodes] = sum_v P(path to v)`` under the target (stats
            ``expected_accepted`` next to the realised ``accepted``): a bias detector for the verifier.
        pack_linears: compute the model's linear layers, the heads' and their vocabulary projection (float32, on
            CPU) with weights packed once for oneDNN, or with the streamed kernel (``engine.streamed``: the weights
            read in place, row by row, for up to 8 query rows), where that measures faster than ``F.linear`` for the
            layer's shape and row count (``engine.kernels``): a forward over a few query tokens then reads each
            weight once; packed, layers that read one input (query, key and value projections; gate and up) are one
            product. A layer is packed at its first packed call of each ``generate`` call and the copy dropped at
            its end. ``False``: every layer as the model computes it.
    """

    candidates: str = "auto"
    fixed_children: int = 0
    topk_per_head: int = 4
    max_nodes: int = 16
    capacity: int | None = None
    return_logprobs: bool = False
    compact_ratio: float = 0.25
    fallback_to_generate: bool = False
    synced_gpus: bool | None = None
    track_expected_acceptance: bool = False
    pack_linears: bool = True

    def __post_init__(self):
        if self.candidates not in CANDIDATE_RULES:
            raise ValueError(f"candidates must be one of {CANDIDATE_RULES}, got {self.candidates!r}")
        for name in ("fixed_children", "topk_per_head", "max_nodes", "capacity"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.topk_per_head < 1:
            raise ValueError(f"topk_per_head must be >= 1, got {self.topk_per_head}")
        if not 0 <= self.fixed_children <= self.topk_per_head:
            raise ValueError(f"fixed_children must be in [0, topk_per_head={self.topk_per_head}], got "
                             f"{self.fixed_children}")
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.capacity is not None and self.capacity < 1:
            raise ValueError(f"capacity (C_hw) must be >= 1 or None (online budget), got {self.capacity}")
        if not 0 < self.compact_ratio <= 1:
            raise ValueError(f"compact_ratio must be in (0, 1], got {self.compact_ratio}")


@dataclass
class GenerationStats(Mapping):
    """Counters of one ``generate`` call. Also a read-only mapping (``stats["tau"]``), where hook metrics and hook
    times (``"<hook name>_seconds"``) appear beside the fields.

    Attributes:
        tau: committed tokens per target forward per row (root included), the mean accepted length.
        forwards: target forwards (prefill included).
        row_forwards: rows summed over forwards.
        tokens: completion tokens committed.
        seconds: wall time of the call.
        accept_per_head: per depth ``d``, the share of drafted row-steps that accepted at least ``d`` nodes.
        nodes_per_row: draft nodes per row, per step.
        active_rows: rows generating, per step.
        drafted_row_steps: row-steps that drafted at least one node.
        drawn_row_steps: those whose candidates were drawn from the heads (the rest: top-k).
        accepted: draft nodes accepted (counted with ``track_expected_acceptance``).
        expected_accepted: their expectation under the target (likewise).
        sync_forwards: throwaway forwards that kept this rank in step with the others.
        pack_seconds: time of the call spent packing weights for the packed linear kernels (``engine.kernels``).
        capacity: ``C_hw`` of a fixed budget (``None``: the online budget).
        fallback: the call went through ``model.generate`` (``reason`` says why).
        hook_seconds: wall time spent in each hook, by hook name.
        hook_metrics: what each hook's ``metrics()`` returned, by hook name (hooks sharing a name merge); the mapping
            view lists every metric by its own name too (``stats["reflex_gate"]``).
    """

    tau: float = 1.0
    forwards: int = 0
    row_forwards: int = 0
    tokens: int = 0
    seconds: float = 0.0
    accept_per_head: list[float] = field(default_factory=list)
    nodes_per_row: list[int] = field(default_factory=list)
    active_rows: list[int] = field(default_factory=list)
    drafted_row_steps: int = 0
    drawn_row_steps: int = 0
    accepted: int = 0
    expected_accepted: float = 0.0
    sync_forwards: int = 0
    pack_seconds: float = 0.0
    capacity: int | None = None
    fallback: bool = False
    reason: str | None = None
    hook_seconds: dict[str, float] = field(default_factory=dict)
    hook_metrics: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("hook_seconds", "hook_metrics")}
        flat.update({f"{name}_seconds": s for name, s in self.hook_seconds.items()})
        for metrics in self.hook_metrics.values():
            flat.update(metrics)
        return flat

    def __getitem__(self, key: str):
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


@dataclass
class GenerationOutput:
    """``completion_ids`` (each cut after its first eos), optional ``logprobs``, and ``stats``."""

    completion_ids: list[list[int]]
    logprobs: list[list[float]] | None
    stats: GenerationStats = field(default_factory=GenerationStats)


class TimedHooks:
    """The engine's hooks, called in order, each one's time added to ``stats.hook_seconds[hook.name]``."""

    def __init__(self, hooks: list[StepHook], stats: GenerationStats):
        self.hooks, self.stats = hooks, stats

    def _timed(self, hook: StepHook, method: str, *args):
        start = time.perf_counter()
        result = getattr(hook, method)(*args)
        seconds = self.stats.hook_seconds
        seconds[hook.name] = seconds.get(hook.name, 0.0) + time.perf_counter() - start
        return result

    def call(self, method: str, *args) -> None:
        for hook in self.hooks:
            self._timed(hook, method, *args)

    def chain(self, method: str, rows: torch.Tensor, value: torch.Tensor, slots: DraftSlots) -> torch.Tensor:
        """Pass ``value`` through every hook's ``method(rows, value, slots)``, like a logits-processor list."""
        for hook in self.hooks:
            value = self._timed(hook, method, rows, value, slots)
        return value


@dataclass
class DecodeState:
    """One ``generate`` call in flight: per-call tensors over all ``B`` rows, and the rows still generating."""

    prompt_ids: torch.Tensor  # [B, T]
    pad_len: torch.Tensor  # [B] left padding of each prompt
    target: TargetDistribution
    eos: torch.Tensor  # eos ids
    max_new: int
    completion: torch.Tensor  # [B, max_new + H + 1]: committed tokens, then scratch a step may overwrite
    logprobs: torch.Tensor | None  # like completion
    done_len: torch.Tensor  # [B] completion tokens committed (the root included)
    accepted_at_depth: torch.Tensor  # [H] drafted row-steps that accepted at least d + 1 nodes
    rows: torch.Tensor  # [B_t] the rows still generating
    root: torch.Tensor  # [B_t] their roots: sampled, not yet in the cache
    hidden: torch.Tensor  # [B_t, D] the final hidden state that produced each root
    kv: RaggedCache
    uniforms: torch.Tensor  # [B, max_new] one uniform per completion position: what samples that position
    projection: VocabProjection  # the heads' vocabulary projection for this call
    lm_head: torch.nn.Module  # the target's lm_head as drafting reads it (``local_copies``)
    embed: torch.nn.Module | None  # the input embedding path heads read (idem); None for independent heads
    steps: int = 0


@dataclass
class Draft:
    """One step's proposals: the trees, and what the heads proposed them from (``None`` when nothing was drafted):
    independent heads' ``z [B, H, D]`` and ``candidates [B, H, K]``, or the grown tree of path heads."""

    tree: DraftTree
    num_nodes: int
    z: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    grown: GrownTree | None = None
    drawn: DrawnDraft | None = None
    rule: str = "top-k"

    def proposals(self, accepted: torch.Tensor):
        """``(z, candidates, proposed)`` of ``StepFeedback`` once the accepted paths are known."""
        if self.grown is not None:
            return self.grown.along(accepted)
        if self.z is None:
            return None, None, None
        return self.z, self.candidates, torch.ones(self.z.shape[:2], dtype=torch.bool, device=self.z.device)


@dataclass
class Verification:
    """The target's verdict on one step's trees."""

    logits: torch.Tensor  # [B_t, n, V]
    hidden: torch.Tensor  # [B_t, n, D]
    sampled: torch.Tensor | None  # [B_t, n] one sample per node (top-k candidates; None for drawn ones)
    probs: torch.Tensor  # [B_t, n, V] the target's processed distribution at every node
    finite: torch.Tensor  # [B_t] every logit of the row is finite


@dataclass
class StepRead:
    """What the host reads of one step, all at once: the longest accepted path (root included) and the longest row
    after it (the KV cache's bookkeeping), tokens committed, draft nodes accepted, whether a row finished, whether a
    row accepted a node outside its own position (``moved``: the cache then gathers slots), and
    (``accepted_by_width``, for the node budget) the expected accepted nodes per row of the step's tree cut to its
    best ``0 .. N`` nodes (empty when nothing was drafted)."""

    width: int
    longest: int
    tokens: int
    accepted: int
    finished: bool
    moved: bool
    accepted_by_width: list[float]


@contextmanager
def final_hidden_of(lm_head: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside the block, every input the ``lm_head`` is called on (the final hidden states, normed) is appended to
    the yielded list. Read this way a forward keeps no other layer's states: ``output_hidden_states`` would keep
    every layer's, over a prompt rows x tokens x hidden per layer (a third of a GB at 32 rows on SmolLM2)."""
    seen: list[torch.Tensor] = []
    handle = lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        yield seen
    finally:
        handle.remove()


def sampling_temperature(generation_config: GenerationConfig) -> float | None:
    """The temperature a config samples at (``None`` for greedy decoding): what the heads draft at."""
    if not generation_config.do_sample:
        return None
    return float(generation_config.temperature if generation_config.temperature is not None else 1.0)


def eos_ids(generation_config: GenerationConfig) -> list[int]:
    """The eos ids of a generation config as a list (``eos_token_id`` may be ``None``, an int or a list)."""
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos if e is not None] if isinstance(eos, (list, tuple)) else [int(eos)]


def check_topk_fits(topk_per_head: int, heads: SpeculativeHeads, name: str = "topk_per_head") -> None:
    """Raise ``ValueError`` (naming the option ``name``) when the heads cannot propose ``topk_per_head`` tokens."""
    proposable = heads.config.draft_vocab_size or heads.config.vocab_size
    if topk_per_head > proposable:
        what = "heads' draft vocabulary" if heads.config.draft_vocab_size else "model's vocab"
        raise ValueError(f"{name} ({topk_per_head}) exceeds the {what} size ({proposable})")


class SpeculativeGenerator:
    """Exact batched speculative sampling with Medusa-style heads and sparse, budgeted trees."""

    def __init__(self, model, heads: SpeculativeHeads, generation_config: GenerationConfig | None = None,
                 config: SpeculativeConfig | None = None, hooks: list[StepHook] | None = None, **options):
        if config is not None and options:
            raise ValueError("pass engine options either as `config` or as keyword arguments, not both")
        self.model = model
        self.heads = heads
        self.hooks = list(hooks or [])
        self.config = config or SpeculativeConfig(**options)
        self.generation_config = copy.deepcopy(generation_config or model.generation_config)
        if not self.config.fallback_to_generate:
            check_decoding_options(self.generation_config)  # beams, several sequences, ...: refused, never ignored
        self.lm_head = lm_head_of(model)
        heads.check_compatible(model)
        check_topk_fits(self.config.topk_per_head, heads)
        # how trees are drafted: path heads grow them depth by depth through the input embedding (``grow_tree``),
        # independent heads pick them from a static table of every candidate path (``select_tree``)
        self.embed = model.get_input_embeddings() if heads.reads_path else None
        self.table = None if self.embed is not None else PathTable.build(heads.num_heads, self.config.topk_per_head)
        rules = ("drawn", "top-k") if self.config.candidates == "auto" else (self.config.candidates,)
        self.budget: NodeBudget = (OnlineBudget(self.config.max_nodes, rules) if self.config.capacity is None
                                   else FixedBudget(self.config.capacity, self.config.max_nodes, rules))
        # what the rejection verifier accepts by depth and rank: the shape of drawn trees (kept across calls)
        self.acceptance = AcceptanceByRank(heads.num_heads, self.config.topk_per_head)
        if "drawn" in rules and self.lm_head.weight.is_cpu:
            walk_kernel_available()  # built (once per machine and source) here, not inside a timed step
        self.kernels = kernels_of(model) if self.config.pack_linears else LinearKernels(None)
        self.supported_error: str | None = None
        self._warned_options: set[tuple[str, ...]] = set()
        try:
            check_model_supported(model)
        except ValueError as err:
            if not self.config.fallback_to_generate:
                raise
            self.supported_error = str(err)
            logger.warning("speculative engine falls back to model.generate: %s", err)

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
        try:
            target = TargetDistribution(self.model, gen, attention_mask)  # refuses what it cannot reproduce first
        except UnsupportedOptionsError as err:
            if not self.config.fallback_to_generate:
                raise
            if tuple(err.options) not in self._warned_options:
                self._warned_options.add(tuple(err.options))
                warnings.warn(f"speculative engine: generation option(s) {err.options} cannot be reproduced per "
                              "tree node; these calls use model.generate", stacklevel=2)
            return self._fallback(input_ids, attention_mask, gen, max_new, start, reason=str(err))
        stats = GenerationStats(capacity=self.config.capacity)
        pack_seconds = self.kernels.pack_seconds
        synced = should_sync(self.model, self.config.synced_gpus)
        with self.kernels.active(), grouped_attention(self.model):
            state = self._prefill(input_ids, attention_mask, target, stats)
            self.kernels.adopt(self.heads)
            if state.projection.linear is not None:
                self.kernels.adopt(state.projection.linear)
            hooks = TimedHooks(self.hooks, stats)
            hooks.call("start", GenerationContext(input_ids, attention_mask, self.heads.num_heads, state.lm_head,
                                                  state.projection, sampling_temperature(gen)))
            while self._has_work(state, synced, stats):
                step_start, setup_calls = time.perf_counter(), self.kernels.setup_calls
                draft = self._draft(state, hooks, stats)
                verdict = self._verify(state, draft.tree, draft.drawn is not None)
                step, host = self._commit(state, draft, verdict, stats)
                hooks.call("feedback", step)
                timed = self.kernels.setup_calls == setup_calls  # nothing packed, none of the model's kernels measured
                self._observe_budget(draft, step, host, step_start if timed else None)
                self._retire(state, step, verdict, host)
        stats.pack_seconds = self.kernels.pack_seconds - pack_seconds
        return self._finish(state, hooks, stats, start)

    def _prefill(self, input_ids, attention_mask, target: TargetDistribution, stats: GenerationStats) -> DecodeState:
        """Run the prompts (positions as ``generate`` computes them for left padding) and sample every row's root."""
        device, batch, max_new = input_ids.device, input_ids.shape[0], target.generation_config.max_new_tokens
        eos = torch.tensor(eos_ids(target.generation_config), device=device, dtype=torch.long)
        pad_len = (attention_mask != 0).int().argmax(1)
        if self.table is not None and self.table.depth.device != device:
            self.table = self.table.to(device)
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        cache = roomy_cache(self.model.config)
        with final_hidden_of(self.lm_head) as final:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]
        rows = torch.arange(batch, device=device)
        self._check_finite(logits, 0, rows)
        uniforms = torch.rand((batch, max_new), device=device, dtype=torch.float64)
        root, _ = target.sample(target.scores(logits, input_ids, pad_len), uniforms[:, 0])
        # a step writes all its H + 1 tokens without reading how many it keeps: the rest lands past `done_len`
        completion = torch.zeros((batch, max_new + self.heads.num_heads + 1), dtype=torch.long, device=device)
        completion[:, 0] = root
        logprobs = None
        if self.config.return_logprobs:
            logprobs = torch.zeros(completion.shape, dtype=torch.float32, device=device)
            logprobs[:, 0] = target.logprobs(logits).gather(1, root[:, None]).squeeze(1)
        kv = RaggedCache(cache, attention_mask.bool(), attention_mask.long().sum(1), self.config.compact_ratio)
        lm_head, embed = local_copies(self.lm_head, self.embed)
        state = DecodeState(
            prompt_ids=input_ids, pad_len=pad_len, target=target, eos=eos, max_new=max_new, completion=completion,
            logprobs=logprobs, done_len=torch.ones(batch, dtype=torch.long, device=device),
            accepted_at_depth=torch.zeros(self.heads.num_heads, dtype=torch.long, device=device), rows=rows,
            root=root, hidden=final[-1][:, -1], kv=kv, uniforms=uniforms,
            projection=self.heads.projection(lm_head, sampling_temperature(target.generation_config)),
            lm_head=lm_head, embed=embed)
        stats.forwards, stats.row_forwards, stats.tokens = 1, batch, batch
        self._keep(state, ~torch.isin(root, eos) & (state.done_len < max_new))
        return state

    def _has_work(self, state: DecodeState, synced: bool, stats: GenerationStats) -> bool:
        """Whether to run another step. Under sharded parameters a rank with no rows left keeps issuing throwaway
        forwards until every rank is done, so the all-gathers inside each forward stay in step."""
        if not synced:
            return state.rows.numel() > 0
        while any_rank_active(state.rows.numel() > 0, state.prompt_ids.device):
            if state.rows.numel():
                return True
            self.model(input_ids=state.prompt_ids[:1, -1:], use_cache=False)
            stats.sync_forwards += 1
        return False

    def _draft(self, state: DecodeState, hooks: TimedHooks, stats: GenerationStats) -> Draft:
        """The heads' candidates (after the hooks' adjustments) and the best ``N_t`` tree nodes per row."""
        active = state.rows.numel()
        rule, num_nodes = self.budget.plan(active, None if state.target.do_sample else ("top-k",))
        stats.nodes_per_row.append(num_nodes)
        stats.active_rows.append(active)
        if not num_nodes:
            return Draft(select_tree(state.root, None, None, self.table, 0, self.heads.num_heads), 0)
        if rule == "drawn" and state.target.do_sample:  # greedy decoding matches top-k candidates only
            stats.drawn_row_steps += active
            return self._draw(state, hooks, num_nodes)
        if self.embed is not None:
            grown = grow_tree(state.root, state.hidden, self._head_step(state, hooks), state.embed,
                              self.heads.num_heads, self.config.topk_per_head, num_nodes)
            return Draft(grown.tree, num_nodes, grown=grown)
        z, head_logp = self._independent_proposals(state, hooks)
        topk_logp, topk_index = head_logp.topk(self.config.topk_per_head, dim=-1)
        topk_ids = state.projection.target_ids(topk_index)
        return Draft(select_tree(state.root, topk_ids, topk_logp, self.table, num_nodes), num_nodes, z, topk_ids)

    def _independent_proposals(self, state: DecodeState, hooks: TimedHooks):
        """Independent heads' states ``z [B, H, D]`` and log-probabilities ``[B, H, V']``, all heads at once, after the
        hooks."""
        slots = DraftSlots.all_heads(self.heads.num_heads, state.rows.device)
        with self.kernels.forward(state.rows.numel()):
            z = self.heads(state.hidden)
        z = hooks.chain("adjust", state.rows, z, slots)  # [B, H, D]
        with self.kernels.forward(z.numel() // z.shape[-1]):
            logits = state.projection(z)
        return z, hooks.chain("adjust_logprobs", state.rows, torch.log_softmax(logits.float(), dim=-1), slots)

    def _draw(self, state: DecodeState, hooks: TimedHooks, num_nodes: int) -> Draft:
        """A tree of the shape the verifier's measured acceptance favours, its children drawn from the heads' ``q``."""
        shape = self.acceptance.shape(num_nodes, state.rows.device)
        fixed, draft_ids = self.config.fixed_children, state.projection.draft_ids
        if self.embed is not None:
            step = self._head_step(state, hooks)

            def propose(depth, frontier, path, path_tokens):
                z, logp, _ = step(depth, state.hidden[:, None].expand(-1, frontier.numel(), -1), path, path_tokens)
                return z, logp

            drawn = draw_tree(state.root, shape, propose, draft_ids, fixed, state.embed, self.heads.num_heads)
            return Draft(drawn.tree, shape.size - 1, grown=drawn.grown, drawn=drawn, rule="drawn")
        z, head_logp = self._independent_proposals(state, hooks)

        def propose(depth, frontier, path, path_tokens):
            f = frontier.numel()
            return z[:, None, depth - 1].expand(-1, f, -1), head_logp[:, None, depth - 1].expand(-1, f, -1)

        drawn = draw_tree(state.root, shape, propose, draft_ids, fixed, None, self.heads.num_heads)
        candidates = state.projection.target_ids(head_logp.topk(self.config.topk_per_head, dim=-1).indices)
        return Draft(drawn.tree, shape.size - 1, z, candidates, drawn=drawn, rule="drawn")

    def _head_step(self, state: DecodeState, hooks: TimedHooks):
        """One depth of a path-heads tree: head ``d`` over the frontier's paths -> its states and log-probabilities,
        each adjusted by the hooks."""
        projection = state.projection

        def step(depth: int, hidden: torch.Tensor, path: torch.Tensor, path_tokens: torch.Tensor):
            slots = DraftSlots(torch.full((path.shape[1],), depth - 1, device=hidden.device), path_tokens)
            with self.kernels.forward(hidden.numel() // hidden.shape[-1]):
                z = self.heads.head_state(depth, hidden, path)
            z = hooks.chain("adjust", state.rows, z, slots)
            with self.kernels.forward(z.numel() // z.shape[-1]):
                logits = projection(z)
            logp = hooks.chain("adjust_logprobs", state.rows, torch.log_softmax(logits.float(), dim=-1), slots)
            return z, logp, projection.target_ids

        return step

    def _verify(self, state: DecodeState, tree: DraftTree, drawn: bool = False) -> Verification:
        """One target forward over every row's root + tree, every node's processed distribution, and (top-k
        candidates) one sample per node from it."""
        kv, active, n = state.kv, state.rows.numel(), tree.size
        with final_hidden_of(self.lm_head) as final, self.kernels.forward(active * n):
            out = self.model(input_ids=tree.tokens, position_ids=kv.lengths[:, None] + tree.depth,
                             attention_mask=kv.tree_attention_mask(tree.ancestors, self.lm_head.weight.dtype),
                             cache=kv.cache, use_cache=True)
        logits = out.logits  # [B, n, V]
        state.steps += 1
        flat = logits.reshape(active * n, -1)
        if state.target.needs_sequences:
            scores = torch.empty(flat.shape, dtype=torch.float32, device=flat.device)
            for index, ids, ignore in self._node_sequences(state, tree):
                scores[index] = state.target.scores(flat[index], ids, ignore)
        elif state.target.needs_input_ids:
            scores = state.target.scores(flat, *self._node_input_ids(state, tree))
        else:
            scores = state.target.scores(flat, None, None)
        # a sum is one pass over the logits where an elementwise test is three (0.3 ms of a 5-row step here); it is
        # read with the step's other counts, and an overflow only sends the step to the exact check
        finite = torch.isfinite(flat.sum())
        if drawn and tree.size > 1:
            return Verification(logits, final[-1], None, torch.softmax(scores, dim=-1).view(active, n, -1), finite)
        position = (state.done_len[state.rows][:, None] + tree.depth).clamp(max=state.max_new - 1)  # what it samples
        uniforms = state.uniforms[state.rows[:, None], position].reshape(-1)
        sampled, probs = state.target.sample(scores, uniforms)
        return Verification(logits, final[-1], sampled.view(active, n), probs.view(active, n, -1), finite)

    def _commit(self, state: DecodeState, draft: Draft, verdict: Verification,
                stats: GenerationStats) -> tuple[StepFeedback, StepRead]:
        """Write each row's emitted tokens (and their logprobs), keep the accepted KV entries, count."""
        rows, tree = state.rows, draft.tree
        root_index = state.done_len[rows] - 1
        room = state.max_new - state.done_len[rows]
        if verdict.sampled is None:
            shape = draft.drawn.shape
            uniforms = torch.rand((rows.numel(), shape.max_depth + 2, shape.children.shape[1]), device=rows.device,
                                  dtype=torch.float64)
            outcome = walk(draft.drawn, verdict.probs, self.config.fixed_children, uniforms)
            self.acceptance.observe(outcome.alpha_sum, outcome.tried)
            step = cut(tree, outcome.accepted, outcome.next_root, state.eos, room)
            reach = outcome.reach[:, 1:]  # each draft node's chance of acceptance; drawn trees list them best first
        else:
            step = emit(tree, verdict.sampled, state.eos, room)
            reach = None
            if draft.num_nodes:
                best_first = tree.path_scores.gather(1, tree.source[:, 1:]).argsort(1, descending=True)
                reach = path_probability(tree, verdict.probs)[:, 1:].gather(1, best_first)
        num_acc = (step.accepted >= 0).sum(1)  # the root included
        by_width = None if reach is None else torch.cat([reach.new_zeros(1), reach.sum(0).cumsum(0)]) / len(rows)
        host = self._read_step(state, verdict, step, num_acc, by_width)
        dest = state.done_len[rows][:, None] + torch.arange(step.tokens.shape[1], device=rows.device)[None]
        state.completion[rows[:, None], dest] = step.tokens  # past `count`: scratch, overwritten by the next step
        if state.logprobs is not None:  # token j was sampled from the logits at accepted node j
            at = step.accepted.clamp(min=0)[..., None].expand(-1, -1, verdict.logits.shape[-1])
            lp = state.target.logprobs(verdict.logits.gather(1, at)).gather(2, step.tokens[..., None]).squeeze(2)
            state.logprobs[rows[:, None], dest] = lp
        state.done_len[rows] += step.count
        state.kv.commit(step.accepted, host.width, host.longest, host.moved)
        self._count(state, stats, draft, verdict, step, num_acc, host)
        z, candidates, proposed = draft.proposals(step.accepted) if self.hooks else (None, None, None)
        return StepFeedback(rows=rows, root_index=root_index, z=z, candidates=candidates, tree=tree,
                            probs=verdict.probs, accepted=step.accepted, emitted=step.tokens, count=step.count,
                            finished=step.finished, hidden=state.hidden, proposed=proposed,
                            next_root=step.next_root), host

    def _read_step(self, state: DecodeState, verdict: Verification, step: Emission, num_acc: torch.Tensor,
                   by_width: torch.Tensor | None) -> StepRead:
        """The step's few numbers the host needs, in one device-to-host read; raises on non-finite logits before
        anything of the step is committed."""
        counts = torch.stack([
            num_acc.max(), (state.kv.lengths + num_acc).max(), step.count.sum(), num_acc.sum() - num_acc.numel(),
            step.finished.any().long(), verdict.finite.all().long()])
        if by_width is not None:  # a drafted step: exact in float64, the counts are far below 2 ** 53
            counts = torch.cat([counts.double(), displaced(step.accepted).any().double()[None], by_width.double()])
        read = counts.tolist()
        width, longest, tokens, accepted, finished, finite = (int(v) for v in read[:6])
        if not finite:
            self._check_finite(verdict.logits, state.steps, state.rows)
        moved = by_width is not None and bool(read[6])  # a step without a draft appended its root alone: nothing moves
        return StepRead(width, longest, tokens, accepted, bool(finished), moved, read[7:])

    def _count(self, state: DecodeState, stats: GenerationStats, draft: Draft, verdict: Verification,
               step: Emission, num_acc: torch.Tensor, host: StepRead) -> None:
        active = step.count.numel()
        stats.forwards += 1
        stats.row_forwards += active
        stats.tokens += host.tokens
        if not draft.num_nodes:
            return
        num_acc = num_acc - 1
        stats.drafted_row_steps += active
        depths = torch.arange(self.heads.num_heads, device=num_acc.device)
        state.accepted_at_depth += (num_acc[:, None] > depths).sum(0)
        if self.config.track_expected_acceptance:
            expected = (expected_accepted(draft.tree, verdict.probs) if draft.drawn is None
                        else expected_accepted_drawn(draft.drawn, verdict.probs, self.config.fixed_children))
            stats.expected_accepted += float(expected.sum())
            stats.accepted += int(num_acc.sum())

    def _observe_budget(self, draft: Draft, step: StepFeedback, host: StepRead, start: float | None) -> None:
        """Report the step to the node budget: its width, wall time and acceptance (no time where ``start`` is
        ``None``: a step that packed weights or measured the model's linear kernels, up to twice as slow as a
        typical one, would be the only sample of its width for a while and keep the budget from drafting it)."""
        if start is not None and step.count.is_cuda:
            torch.cuda.synchronize()
        scores = draft.tree.path_scores
        if draft.drawn is not None:  # every width's tree is a prefix of the widest one's
            scores = self.acceptance.shape(self.config.max_nodes, scores.device).log_reach[None, 1:]
        seconds = None if start is None else time.perf_counter() - start
        self.budget.observe(step.count.numel(), draft.num_nodes, seconds, host.accepted_by_width, scores, draft.rule)

    def _retire(self, state: DecodeState, step: StepFeedback, verdict: Verification, host: StepRead) -> None:
        """Advance every row to its next root (and the hidden state that produced it); drop finished rows."""
        last = step.accepted.gather(1, ((step.accepted >= 0).sum(1) - 1)[:, None]).squeeze(1)
        state.hidden = verdict.hidden.gather(1, last[:, None, None].expand(-1, 1, verdict.hidden.shape[-1])).squeeze(1)
        state.root = step.next_root
        if host.finished:
            self._keep(state, ~step.finished)

    @staticmethod
    def _keep(state: DecodeState, alive: torch.Tensor) -> None:
        keep = state.kv.leave(alive)
        state.rows, state.root, state.hidden = state.rows[keep], state.root[keep], state.hidden[keep]

    def _finish(self, state: DecodeState, hooks: TimedHooks, stats: GenerationStats, start: float) -> GenerationOutput:
        lengths = state.done_len.tolist()
        ids = state.completion.tolist()
        completions = [ids[b][: lengths[b]] for b in range(len(lengths))]
        logprobs = None
        if state.logprobs is not None:
            logprobs = [state.logprobs[b, : lengths[b]].tolist() for b in range(len(lengths))]
        stats.tau = stats.tokens / stats.row_forwards
        stats.accept_per_head = (state.accepted_at_depth.double() / max(1, stats.drafted_row_steps)).tolist()
        hooks.call("finish", state.done_len)
        for hook in self.hooks:
            stats.hook_metrics.setdefault(hook.name, {}).update(hook.metrics())
        stats.seconds = time.perf_counter() - start
        return GenerationOutput(completions, logprobs, stats)

    def _node_input_ids(self, state: DecodeState, tree: DraftTree):
        """Per node: prompt + committed completion + path, the gaps filled with the row's root token (a token
        already on every node's path, so the *set* of ids, all repetition penalty reads, is exact)."""
        rows, (active, n) = state.rows, tree.tokens.shape
        comp = state.completion[rows]
        filled = torch.arange(comp.shape[1], device=comp.device)[None] < state.done_len[rows][:, None]
        comp = torch.where(filled, comp, state.root[:, None])
        base = torch.cat([state.prompt_ids[rows], comp], dim=1)  # [B, L]
        ids = torch.cat([base[:, None].expand(-1, n, -1), tree.path_tokens], dim=2)
        return ids.reshape(active * n, -1), state.pad_len[rows].repeat_interleave(n)

    def _node_sequences(self, state: DecodeState, tree: DraftTree):
        """Per node, its true sequence: padded prompt + committed completion + path below the root, grouped by
        length (what order- and length-reading processors see in ``generate``). Yields ``(node index, input_ids,
        prompt padding)`` per group, node indices into the flattened ``[B_t * n]`` nodes."""
        rows, (active, n) = state.rows, tree.tokens.shape
        done = state.done_len[rows]  # completion tokens committed, the root included
        length = done[:, None] + tree.depth  # [B_t, n] completion tokens before each node's sample
        width = int(length.max())
        j = torch.arange(width, device=done.device)
        comp = torch.nn.functional.pad(state.completion[rows], (0, max(0, width - state.max_new)))[:, :width]
        below_root = (j[None, None] - done[:, None, None] + 1).clamp(0, tree.path_tokens.shape[2] - 1)
        path = tree.path_tokens.gather(2, below_root.expand(active, n, width))
        seq = torch.where(j[None, None] < done[:, None, None], comp[:, None], path).reshape(active * n, width)
        prompts = state.prompt_ids[rows].repeat_interleave(n, dim=0)
        pad = state.pad_len[rows].repeat_interleave(n)
        length = length.reshape(-1)
        for size in torch.unique(length).tolist():
            index = (length == size).nonzero().squeeze(1)
            yield index, torch.cat([prompts[index], seq[index, :size]], dim=1), pad[index]

    @staticmethod
    def _check_finite(logits: torch.Tensor, step: int, rows: torch.Tensor) -> None:
        bad = ~torch.isfinite(logits).reshape(logits.shape[0], -1).all(1)
        if bad.any():
            raise FloatingPointError(
                f"target logits contain NaN or inf at decoding step {step} for batch rows {rows[bad].tolist()}"
            )

    def _fallback(self, input_ids, attention_mask, gen, max_new, start, reason=None) -> GenerationOutput:
        seqs = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen,
                                   max_new_tokens=max_new)[:, input_ids.shape[1]:].tolist()
        eos = set(eos_ids(gen))
        result = [s[: next((i + 1 for i, t in enumerate(s) if t in eos), len(s))] for s in seqs]
        stats = GenerationStats(forwards=max(map(len, result)), fallback=True, reason=reason or self.supported_error,
                                tokens=sum(map(len, result)), seconds=time.perf_counter() - start)
        return GenerationOutput(result, None, stats)
