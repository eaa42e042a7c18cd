"""``SpecGRPOTrainer``: TRL's ``GRPOTrainer`` whose plain-``generate`` rollouts go through the speculative engine.

Only TRL's generation hook (``_generate_single_turn``) is overridden; vLLM, transformers continuous
batching and multimodal prompts are handed back to ``super()``. Everything else (rewards, advantages, loss,
PEFT policy, logging, checkpointing) is TRL's. The heads live outside the policy module: the optimizer,
PEFT and sharding never see them; they are saved with every checkpoint and the final model.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import torch
import trl
from transformers import GenerationMixin, Trainer
from trl import GRPOConfig, GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from .adapt.consolidation import ConsolidationCallback, ConsolidationConfig
from .adapt.reflex import REFLEX_PRESETS, reflex_hooks
from .engine import GenerationStats, SpeculativeConfig, SpeculativeGenerator, StepHook
from .engine.generator import check_topk_fits
from .engine.heads import (
    HEAD_KINDS,
    SpeculativeHeads,
    apply_adapter_state,
    check_heads_folder,
    is_peft_wrapped,
    read_adapter_state,
    save_heads,
)

logger = logging.getLogger(__name__)

TESTED_TRL = "1.16"
HEADS_SUBDIR = "spec_heads"
CONSOLIDATION_STATE = "consolidation_state.json"
DISTILL_DRAFT_VOCAB = 4096  # heads distilled by the trainer draft over the policy's 4,096 most frequent tokens
_HF_GENERATE = GenerationMixin.generate  # captured at import, before any test can patch it

if not trl.__version__.startswith(TESTED_TRL + "."):
    raise ImportError(
        f"specroll_trl.trainer overrides TRL's private generation hook and was tested with trl=={TESTED_TRL}.*; "
        f"found trl=={trl.__version__}. Install 'trl>={TESTED_TRL},<1.17'."
    )


@dataclass
class SpecGRPOConfig(GRPOConfig):
    r"""``GRPOConfig`` plus the speculative-rollout fields (all prefixed ``spec_``).

    Every ``GRPOConfig`` field keeps its meaning; a plain ``GRPOConfig`` given to ``SpecGRPOTrainer`` gets the
    defaults below. All ``spec_`` fields are validated once, when the config is built (``check_spec_fields``).

    > Heads

    Parameters:
        spec_enabled (`bool`, *optional*, defaults to `True`):
            Generate rollouts with the speculative engine. `False`: TRL's own generation path.
        spec_heads_path (`str` or `None`, *optional*):
            Folder of trained heads (`config.json` + `model.safetensors`). `None`: see `spec_init_heads`.
        spec_heads_kind (`str`, *optional*, defaults to `"auto"`):
            Which head kind the run drafts with: `"path"` (path-conditioned: head `d` also reads the tokens on its
            path; they accept the most), `"independent"` (Medusa: every head reads only the hidden state; the kind
            vLLM's export takes), or `"auto"`: the kind of the heads given (`heads=` or `spec_heads_path`), else
            `"path"`. Shipped, distilled and zero-initialised heads are built of this kind; given heads of another
            kind are refused. Reflex and the slow path work on both kinds.
        spec_init_heads (`str`, *optional*, defaults to `"distill"`):
            Without `spec_heads_path`: `"distill"` self-distils heads on the training prompts before step 1,
            `"zeros"` starts from zero-initialised heads (they predict the next token only: low acceptance).
        spec_num_heads (`int`, *optional*, defaults to `4`):
            Heads to build when none are loaded.
        spec_distill_samples (`int`, *optional*, defaults to `256`):
            Policy samples for the initial distillation.
        spec_distill_steps (`int`, *optional*, defaults to `300`):
            Optimiser steps of the initial distillation.
        spec_distill_max_seconds (`float` or `None`, *optional*, defaults to `120.0`):
            Wall-time bound of the initial distillation: half for sampling (no new batch after it), half for
            training. `None`: no bound (samples and steps only). Heads cut short by it are cached too (the bound
            is part of the cache key).
        spec_distill_cache (`bool`, *optional*, defaults to `True`):
            Cache distilled heads under `$SPECROLL_HOME/heads/`, keyed by the policy's weights, the distillation
            prompts and settings: a second run on the same policy and data loads them instead of distilling.

    > Engine (fields of `SpeculativeConfig`)

    Parameters:
        spec_candidates (`str`, *optional*, defaults to `"auto"`):
            How a tree node's children are proposed and verified: `"drawn"` from the heads' distribution and
            verified by recursive rejection sampling; `"top-k"` the heads' top-k, verified by sample-then-match
            (then the rollouts of a seed do not depend on the drafts); `"auto"`: each step the one the node budget
            predicts to commit more tokens per second. All are exact. Greedy decoding always uses `"top-k"`.
        spec_fixed_children (`int`, *optional*, defaults to `0`):
            With `"drawn"`: children of each node taken as the heads' top tokens before the rest are drawn.
        spec_topk_per_head (`int`, *optional*, defaults to `4`):
            Children per tree node at most.
        spec_max_nodes (`int`, *optional*, defaults to `16`):
            `N_max`: draft nodes per row per step besides the root.
        spec_capacity (`int` or `None`, *optional*):
            `None`: the node budget is learnt online from the engine's own steps. An int `C_hw`: the fixed
            formula `N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)`.
        spec_fallback_to_generate (`bool`, *optional*, defaults to `True`):
            On a model the engine cannot run (e.g. FlashAttention-2 only), log and use `generate`.
        spec_pack_linears (`bool`, *optional*, defaults to `True`):
            On CPU, compute the policy's float32 linear layers from weights packed once for oneDNN, or with the
            streamed kernel (weights read in place, up to 8 query rows; built once with the system's C++ compiler),
            wherever the engine's own forwards measure that faster (per bucket of query rows). A layer is packed at
            its first packed call of each generation call (logged as `spec/pack_seconds`) and the copy dropped at
            its end.

    > Adaptation

    Parameters:
        spec_reflex (`str` or `None`, *optional*, defaults to `"lookup"`):
            Reflex preset, the gradient-free per-trajectory correction of the heads' proposals: `"lookup"`,
            `"lookup-group"`, `"baseline"`, ... (`specroll_trl.adapt.reflex.REFLEX_PRESETS`). `None`: off. On by
            default: on the default policy it raised tau by about 4% for under 0.5% of a GRPO step.
        spec_reflex_kwargs (`dict`, `str` or `None`, *optional*):
            Settings of the preset's hooks (their config fields), e.g. `{"prior": 0.5}`; a JSON string also works.
        spec_consolidation (`bool`, *optional*, defaults to `False`):
            The slow path: head-only re-fits on records captured during verification, when a drift monitor fires
            or while re-fits still pay (young heads), run by `ConsolidationCallback` at the end of a training step.
        spec_consolidation_kwargs (`dict`, `str` or `None`, *optional*):
            Fields of `ConsolidationConfig` (e.g. `{"trigger": "every_round", "min_buffer": 512}`); JSON string ok.
    """

    spec_enabled: bool = field(default=True, metadata={"help": "Generate rollouts with the speculative engine."})
    spec_heads_path: str | None = field(default=None, metadata={"help": "Folder of trained heads."})
    spec_heads_kind: str = field(default="auto", metadata={"help": "'auto', 'path' or 'independent'."})
    spec_init_heads: str = field(default="distill", metadata={"help": "Without heads: 'distill' or 'zeros'."})
    spec_num_heads: int = field(default=4, metadata={"help": "Heads to build when none are loaded."})
    spec_distill_samples: int = field(default=256, metadata={"help": "Policy samples for the initial distillation."})
    spec_distill_steps: int = field(default=300, metadata={"help": "Optimiser steps of the initial distillation."})
    spec_distill_max_seconds: float | None = field(
        default=120.0, metadata={"help": "Wall-time bound of the initial distillation; None: no bound."})
    spec_distill_cache: bool = field(default=True, metadata={"help": "Reuse heads distilled for the same policy."})
    spec_candidates: str = field(default="auto", metadata={"help": "'auto', 'drawn' or 'top-k'."})
    spec_fixed_children: int = field(default=0, metadata={"help": "With 'drawn': top-of-q children per node."})
    spec_topk_per_head: int = field(default=4, metadata={"help": "Children per tree node at most."})
    spec_max_nodes: int = field(default=16, metadata={"help": "N_max: draft nodes per row per step."})
    spec_capacity: int | None = field(default=None, metadata={"help": "C_hw of the fixed budget; None: online."})
    spec_fallback_to_generate: bool = field(default=True, metadata={"help": "Unsupported model: use generate."})
    spec_pack_linears: bool = field(default=True, metadata={"help": "CPU: faster linear kernels, measured."})
    spec_reflex: str | None = field(default="lookup", metadata={"help": "Reflex preset name; None: off."})
    spec_reflex_kwargs: dict | str | None = field(default=None, metadata={"help": "Settings of the Reflex hooks."})
    spec_consolidation: bool = field(default=False, metadata={"help": "Enable the slow path."})
    spec_consolidation_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Fields of ConsolidationConfig."})

    def __post_init__(self):
        super().__post_init__()
        for name in ("spec_reflex_kwargs", "spec_consolidation_kwargs"):
            if isinstance(getattr(self, name), str):  # from the command line, as TRL does with model_init_kwargs
                setattr(self, name, json.loads(getattr(self, name)))
        check_spec_fields(self)  # fail now, not at the first rollout


SPEC_FIELDS = {f.name: f.default for f in fields(SpecGRPOConfig) if f.name.startswith("spec_")}


def spec_fields(args) -> SimpleNamespace:
    """The ``spec_`` fields of a training config: a ``SpecGRPOConfig``'s own (validated when it was built), the
    defaults for a plain ``GRPOConfig``."""
    return SimpleNamespace(**{name: getattr(args, name, default) for name, default in SPEC_FIELDS.items()})


HEADS_KIND_CHOICES = ("auto", *HEAD_KINDS)


def check_spec_fields(spec) -> None:
    """Raise ``ValueError`` / ``TypeError`` naming the ``spec_`` field whose value is invalid."""
    if spec.spec_heads_kind not in HEADS_KIND_CHOICES:
        raise ValueError(f"spec_heads_kind must be one of {HEADS_KIND_CHOICES}, got {spec.spec_heads_kind!r}")
    if spec.spec_init_heads not in ("distill", "zeros"):
        raise ValueError(f"spec_init_heads must be 'distill' or 'zeros', got {spec.spec_init_heads!r}")
    for name in ("spec_num_heads", "spec_distill_samples", "spec_distill_steps"):
        value = getattr(spec, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise (ValueError if type(value) is int else TypeError)(f"{name} must be an int >= 1, got {value!r}")
    seconds = spec.spec_distill_max_seconds
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0):
        raise ValueError(f"spec_distill_max_seconds must be a number > 0 or None, got {seconds!r}")
    engine_config(spec)
    reflex_hooks_of(spec)
    consolidation_config(spec, seed=0)


def resolve_heads_kind(spec, given: SpeculativeHeads | None = None) -> str:
    """The head kind a run drafts with: ``spec_heads_kind``, or with ``"auto"`` the given heads' kind (else
    ``"path"``, the kind that accepts the most). Raises ``ValueError`` when given heads contradict the field."""
    given_kind = None if given is None else getattr(given, "config", SimpleNamespace(kind=None)).kind
    if spec.spec_heads_kind == "auto":
        return given_kind or "path"
    if given_kind is not None and given_kind != spec.spec_heads_kind:
        raise ValueError(f"spec_heads_kind={spec.spec_heads_kind!r} but the heads given are {given_kind!r} heads; "
                         "set spec_heads_kind='auto' or to their kind")
    return spec.spec_heads_kind


def engine_config(spec) -> SpeculativeConfig:
    """The engine's options from the ``spec_`` fields (``SpeculativeConfig``'s messages start with its field name,
    here the user's ``spec_`` one)."""
    try:
        return SpeculativeConfig(candidates=spec.spec_candidates, fixed_children=spec.spec_fixed_children,
                                 topk_per_head=spec.spec_topk_per_head, max_nodes=spec.spec_max_nodes,
                                 capacity=spec.spec_capacity, fallback_to_generate=spec.spec_fallback_to_generate,
                                 pack_linears=spec.spec_pack_linears)
    except (TypeError, ValueError) as err:
        raise type(err)(f"spec_{err}") from err


def reflex_hooks_of(spec) -> list[StepHook]:
    """A fresh list of the Reflex hooks ``spec_reflex`` / ``spec_reflex_kwargs`` name (empty when Reflex is off)."""
    preset, kwargs = spec.spec_reflex, dict(spec.spec_reflex_kwargs or {})
    if preset is None:
        if kwargs:
            raise ValueError("spec_reflex_kwargs given but spec_reflex is None (Reflex off)")
        return []
    if not isinstance(preset, str):
        raise TypeError(f"spec_reflex takes a preset name ({sorted(REFLEX_PRESETS)}) or None, got {preset!r}")
    if preset not in REFLEX_PRESETS:
        raise ValueError(f"spec_reflex must be one of {sorted(REFLEX_PRESETS)} or None, got {preset!r}")
    try:
        return reflex_hooks(preset, **kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(f"spec_reflex_kwargs: {err}") from err


def consolidation_config(spec, seed: int) -> ConsolidationConfig | None:
    """The slow path's settings (``None`` when ``spec_consolidation`` is off)."""
    if not spec.spec_consolidation:
        if spec.spec_consolidation_kwargs:
            raise ValueError("spec_consolidation_kwargs given but spec_consolidation is False")
        return None
    try:
        return ConsolidationConfig(**{"seed": seed, **(spec.spec_consolidation_kwargs or {})})
    except (TypeError, ValueError) as err:
        raise type(err)(f"spec_consolidation_kwargs: {err}") from err


class SpecGRPOTrainer(GRPOTrainer):
    """Drop-in ``GRPOTrainer`` with exact speculative rollouts (same signature, plus ``heads`` and ``step_hooks``).

    Args (besides ``GRPOTrainer``'s):
        heads: the speculative heads (default: ``spec_heads_path``, heads shipped for this exact policy, or heads
            distilled on the first training prompts).
        step_hooks: your own engine step hooks (``specroll_trl.engine.StepHook``), run every generation round after
            Reflex's hooks and before the slow path's buffer capture; each hook's ``metrics()`` are logged as
            ``spec/<hook name>/<metric>`` and its time as ``spec/<hook name>/seconds``. Hooks change proposals
            only: the rollouts stay exactly on-policy.

    Overridable methods: ``_initial_heads`` (where the heads come from), ``_build_engine`` (the generator),
    ``_round_hooks`` (a round's hooks), ``_log_spec_stats`` (what each round logs).
    """

    def __init__(self, *args, heads: SpeculativeHeads | None = None, step_hooks: list[StepHook] | None = None,
                 **kwargs):
        for hook in step_hooks or []:
            if not isinstance(hook, StepHook):
                raise TypeError(f"step_hooks takes StepHook instances, got {type(hook).__name__}")
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        spec = spec_fields(config) if config is not None else None
        if heads is None and spec is not None and spec.spec_enabled and spec.spec_heads_path:
            check_heads_folder(spec.spec_heads_path)  # a bad path fails before the policy is loaded
        super().__init__(*args, **kwargs)
        self.spec = spec_fields(self.args)
        self.spec_heads = heads
        self.spec_distill_report: dict | None = None  # what the initial distillation measured (when it ran)
        self._spec_engine: SpeculativeGenerator | None = None
        self._spec_reflex = reflex_hooks_of(self.spec)
        self.spec_step_hooks = list(step_hooks or [])
        self.spec_consolidation: ConsolidationCallback | None = None
        if not self.spec.spec_enabled:
            return
        if self.spec_heads is None:
            self.spec_heads = self._initial_heads()
        self.spec_heads_kind = resolve_heads_kind(self.spec, self.spec_heads)  # refuses heads of another kind
        check_topk_fits(self.spec.spec_topk_per_head, self.spec_heads, "spec_topk_per_head")
        # the engine checks heads and model support now, not at the first rollout
        self._engine(self._policy_for_heads())
        consolidation = consolidation_config(self.spec, self.args.seed)
        if consolidation is not None:
            policy = self._policy_for_heads()
            self.spec_consolidation = ConsolidationCallback(
                self.spec_heads, policy.get_output_embeddings(), consolidation,
                log=lambda metrics: self._log_metrics("train", metrics), embed=policy.get_input_embeddings())
            self.add_callback(self.spec_consolidation)

    # ------------------------------------------------------------------ heads
    def _policy_for_heads(self):
        """The bare HF causal LM under accelerate and PEFT wrappers."""
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _initial_heads(self) -> SpeculativeHeads:
        policy = self._policy_for_heads()
        lm_head = policy.get_output_embeddings()
        path = self.spec.spec_heads_path
        if path:
            heads = SpeculativeHeads.from_pretrained(path)
            heads.check_compatible(policy)
            resolve_heads_kind(self.spec, heads)
            return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        shipped = self._shipped_heads(policy) if self.spec.spec_init_heads == "distill" else None
        if shipped is not None:
            return shipped.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        prompts = self._distill_prompts() if self.spec.spec_init_heads == "distill" else []
        if not prompts:
            why = ("spec_init_heads='zeros'" if self.spec.spec_init_heads == "zeros" else
                   "no plain prompts to distil on (environments render their own, or no 'prompt' column)")
            warnings.warn(f"SpecGRPOTrainer: no spec_heads_path given and {why}; starting from zero-initialised "
                          "heads (low acceptance until they are trained)", stacklevel=3)
            return SpeculativeHeads.from_model(policy, num_heads=self.spec.spec_num_heads,
                                               kind=resolve_heads_kind(self.spec))
        warnings.warn("SpecGRPOTrainer: no spec_heads_path given; self-distilling heads on the first training "
                      "prompts before the first step (cached for the next run: spec_distill_cache)", stacklevel=3)
        heads = self._distill_initial_heads(prompts)
        return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def _shipped_heads(self, policy) -> SpeculativeHeads | None:
        """The package's heads for this exact policy (same weights), of the run's kind."""
        from .adapt.distill_cache import find_shipped_heads

        folder = find_shipped_heads(policy, kind=resolve_heads_kind(self.spec))
        if folder is None:
            return None
        heads = SpeculativeHeads.from_pretrained(folder)
        heads.check_compatible(policy)
        logger.info("speculative heads shipped for this policy: %s", folder)
        return heads

    def _distill_prompts(self) -> list[list[int]]:
        """Token ids of the first ``spec_distill_samples`` distinct prompts in the order the trainer's first batches
        take them (its own sampler, or the shuffled stream of an ``IterableDataset``; the same on every rank),
        rendered by TRL's own prompt tokenisation. Empty when environments render the prompts or rows have none."""
        if getattr(self, "environment_factories", None) is not None:
            return []
        dataset = self.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            if self.shuffle_dataset and hasattr(dataset, "shuffle"):
                dataset = dataset.shuffle(seed=self.args.seed)
            rows = iter(dataset)
        else:
            rows = (dataset[i] for i in dict.fromkeys(self._get_train_sampler(dataset)))
        prompts = [row["prompt"] for row in itertools.islice(rows, self.spec.spec_distill_samples) if "prompt" in row]
        return [list(ids) for ids in self._tokenize_prompts(prompts)[0]] if prompts else []

    def _distill_initial_heads(self, prompts: list[list[int]]) -> SpeculativeHeads:
        from .adapt.distill import HeadDistillConfig
        from .adapt.distill_cache import cached_distill_heads, default_cache_dir

        seconds = self.spec.spec_distill_max_seconds
        config = HeadDistillConfig(
            num_heads=self.spec.spec_num_heads, num_samples=len(prompts), steps=self.spec.spec_distill_steps,
            temperature=self.args.temperature, max_new_tokens=self.args.max_completion_length,
            seed=self.args.seed, batch_size=512, target_topk=16, draft_vocab_size=DISTILL_DRAFT_VOCAB,
            kind=resolve_heads_kind(self.spec),
            sampling_max_seconds=None if seconds is None else seconds / 2,
            max_seconds=None if seconds is None else seconds / 2,
        )
        policy = self._policy_for_heads()
        was_training = policy.training
        requires_grad = {n: p.requires_grad for n, p in policy.named_parameters()}
        policy.eval()
        try:
            heads, report = cached_distill_heads(policy, prompts, self._tokenizer.pad_token_id, config,
                                                 default_cache_dir() if self.spec.spec_distill_cache else None,
                                                 progress=not self.args.disable_tqdm)
        finally:
            for n, p in policy.named_parameters():
                p.requires_grad_(requires_grad[n])
            policy.train(was_training)
        logger.info("initial heads (%s prompts, cache %s): hit rates %s", len(prompts), report["cache"],
                    report["hit_rates"])
        self.spec_distill_report = report
        return heads

    def _engine(self, model) -> SpeculativeGenerator:
        """The generator for ``model`` (the policy as unwrapped for this round), built once per model."""
        if self._spec_engine is None or self._spec_engine.model is not model:
            self._spec_engine = self._build_engine(model)
        return self._spec_engine

    def _build_engine(self, model) -> SpeculativeGenerator:
        return SpeculativeGenerator(model, self.spec_heads, self.generation_config, config=engine_config(self.spec))

    def _round_hooks(self, training: bool) -> list[StepHook]:
        """This round's engine hooks, in order: Reflex's, the user's ``step_hooks``, then the slow path's capture on
        training rounds."""
        hooks = [*self._spec_reflex, *self.spec_step_hooks]
        if training and self.spec_consolidation is not None:
            hooks.append(self.spec_consolidation.capture)
        return hooks

    def _custom_generate(self) -> bool:
        """True when the policy's ``generate`` was replaced (patched on the instance, as tests that mock it do, or
        overridden by its class): its semantics are the user's, so generation goes through it, unchanged."""
        model = self._policy_for_heads()
        generate = type(model).generate  # a class-level patch replaces GenerationMixin.generate itself
        return "generate" in vars(model) or generate is not _HF_GENERATE or not inspect.isfunction(generate)

    # ------------------------------------------------------------------ the one overridden TRL hook
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if (not self.spec.spec_enabled or self.use_vllm or self.use_transformers_continuous_batching
                or images is not None and any(img is not None for img in images) or multimodal_fields
                or has_tool_images or self._custom_generate()):
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations,
                                                 has_tool_images)
        device = self.accelerator.device
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {
            "input_ids": pad(tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left",
                             pad_to_multiple_of=self.pad_to_multiple_of),
            "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left",
                                  pad_to_multiple_of=self.pad_to_multiple_of),
        }
        inputs = Trainer._prepare_inputs(self, inputs)  # device placement only; GRPOTrainer's override generates
        start = time.perf_counter()
        with (
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            self.spec_heads.to(device)
            engine = self._engine(unwrapped_model)
            engine.hooks = self._round_hooks(self.model.training)
            out = engine.generate(inputs["input_ids"].to(device), inputs["attention_mask"].to(device))
        self._log_spec_stats(out.stats, time.perf_counter() - start)
        return out.completion_ids, out.logprobs

    def _log_metrics(self, mode: str, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._metrics[mode][key].append(value)

    def _log_spec_stats(self, stats: GenerationStats, seconds: float) -> None:
        nodes, active = stats.nodes_per_row or [0], stats.active_rows or [0]
        metrics = {"spec/tau": stats.tau, "spec/generation_seconds": seconds,
                   "spec/tokens_per_s": stats.tokens / max(seconds, 1e-9), "spec/forwards": float(stats.forwards),
                   "spec/tree_nodes_per_row": sum(nodes) / len(nodes), "spec/active_rows": sum(active) / len(active),
                   "spec/drawn_share": stats.drawn_row_steps / max(1, stats.drafted_row_steps),
                   "spec/pack_seconds": stats.pack_seconds}
        for name, seconds in stats.hook_seconds.items():
            metrics[f"spec/{name}/seconds"] = seconds
        for name, values in stats.hook_metrics.items():
            for key, value in values.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[f"spec/{name}/{key}"] = float(value)
        for d, rate in enumerate(stats.accept_per_head):
            metrics[f"spec/accept_head_{d + 1}"] = rate
        self._log_metrics("train" if self.model.training else "eval", metrics)

    # ------------------------------------------------------------------ persistence
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call=_internal_call)
        if self.spec_heads is not None and self.args.should_save:
            folder = os.path.join(output_dir or self.args.output_dir, HEADS_SUBDIR)
            save_heads(self.spec_heads, folder)
            if self.spec_consolidation is not None:
                with open(os.path.join(folder, CONSOLIDATION_STATE), "w") as f:
                    json.dump(self.spec_consolidation.state_dict(), f, indent=1)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None):
        # The heads are read and validated first: a corrupted checkpoint is refused before anything is loaded.
        folder = os.path.join(resume_from_checkpoint, HEADS_SUBDIR)
        loaded = draft_ids = None
        if self.spec_heads is not None and os.path.isdir(folder):
            try:
                if is_peft_wrapped(self.spec_heads):
                    loaded = read_adapter_state(folder)
                    draft_ids = SpeculativeHeads.from_pretrained(folder).draft_ids  # outside the adapter
                else:
                    loaded = SpeculativeHeads.from_pretrained(folder)
                    loaded.check_compatible(self._policy_for_heads())
                    if loaded.config != self.spec_heads.config:
                        raise ValueError(f"its heads have config {loaded.config}, this trainer's heads "
                                         f"{self.spec_heads.config}; pass spec_heads_path={folder!r} to resume "
                                         "with them")
            except (OSError, ValueError) as err:
                raise ValueError(f"refusing to resume from {resume_from_checkpoint!r}: its speculative heads "
                                 f"({HEADS_SUBDIR}/) cannot be loaded: {err}") from err
        elif self.spec_heads is not None:
            warnings.warn(f"checkpoint {resume_from_checkpoint!r} has no {HEADS_SUBDIR}/ folder; resuming with the "
                          "current speculative heads", stacklevel=2)
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        if isinstance(loaded, dict):
            apply_adapter_state(self.spec_heads, loaded, draft_ids)
        elif loaded is not None:
            self.spec_heads.load_state_dict(loaded.state_dict())
        state = os.path.join(folder, CONSOLIDATION_STATE)
        if self.spec_consolidation is not None and os.path.isfile(state):
            with open(state) as f:
                self.spec_consolidation.load_state_dict(json.load(f))
