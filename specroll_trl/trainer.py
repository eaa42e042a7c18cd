"""``SpecGRPOTrainer``: TRL's ``GRPOTrainer`` whose plain-``generate`` rollouts go through the speculative engine.

Only TRL's generation hook (``_generate_single_turn``) is overridden; vLLM, transformers continuous
batching and multimodal prompts are handed back to ``super()``. Everything else (rewards, advantages, loss,
PEFT policy, logging, checkpointing) is TRL's. The heads live outside the policy module: the optimizer,
PEFT and sharding never see them; they are saved with every checkpoint and the final model.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass, field, fields

import torch
import trl
from transformers import GenerationMixin, Trainer
from trl import GRPOConfig, GRPOTrainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from .adapt.consolidation import ConsolidationCallback, ConsolidationConfig
from .engine import SpeculativeGenerator
from .engine.heads import (
    SpeculativeHeads,
    apply_adapter_state,
    check_heads_folder,
    is_peft_wrapped,
    read_adapter_state,
    save_heads,
)
from .adapt.reflex import Reflex, ReflexConfig

logger = logging.getLogger(__name__)

TESTED_TRL = "1.16"
HEADS_SUBDIR = "spec_heads"
CONSOLIDATION_STATE = "consolidation_state.json"
_HF_GENERATE = GenerationMixin.generate  # captured at import, before any test can patch it

if not trl.__version__.startswith(TESTED_TRL + "."):
    raise ImportError(
        f"specroll_trl.trainer overrides TRL's private generation hook and was tested with trl=={TESTED_TRL}.*; "
        f"found trl=={trl.__version__}. Install 'trl>={TESTED_TRL},<1.17'."
    )


@dataclass
class SpecGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the speculative-rollout fields (all prefixed ``spec_``).

    Every ``GRPOConfig`` field keeps its meaning. A plain ``GRPOConfig`` given to ``SpecGRPOTrainer`` gets the
    defaults below.
    """

    spec_enabled: bool = field(
        default=True,
        metadata={"help": "Generate rollouts with the speculative engine. False: TRL's own generate path."},
    )
    spec_heads_path: str | None = field(
        default=None,
        metadata={"help": "Folder of trained heads (config.json + model.safetensors). None: see spec_init_heads."},
    )
    spec_init_heads: str = field(
        default="distill",
        metadata={
            "help": "Without spec_heads_path: 'distill' self-distils heads on the training prompts before step 1 "
            "(spec_distill_* below), 'zeros' starts from zero-initialised heads (they predict the next token "
            "only, so acceptance starts low). A warning is logged either way."
        },
    )
    spec_num_heads: int = field(default=4, metadata={"help": "Heads to build when none are loaded."})
    spec_topk_per_head: int = field(default=4, metadata={"help": "Candidates each head adds at its tree depth."})
    spec_max_nodes: int = field(default=16, metadata={"help": "N_max: draft nodes per row per step besides the root."})
    spec_capacity: int | None = field(
        default=None,
        metadata={"help": "C_hw: query tokens per forward the hardware absorbs cheaply. None: profiled once at start."},
    )
    spec_distill_samples: int = field(default=256, metadata={"help": "Policy samples for the initial distillation."})
    spec_distill_steps: int = field(default=300, metadata={"help": "Optimiser steps of the initial distillation."})
    spec_reflex: bool = field(
        default=False,
        metadata={"help": "Enable Reflex, the gradient-free per-trajectory correction of the heads (SPEC 2.5)."},
    )
    spec_reflex_eta: float = field(
        default=0.0, metadata={"help": "Reflex hidden-state correction step size (the SPEC baseline: 1.0)."})
    spec_reflex_lam: float = field(default=0.5, metadata={"help": "Reflex memory EMA factor."})
    spec_reflex_rho_min: float = field(default=0.2, metadata={"help": "Reflex gate threshold on reliability."})
    spec_reflex_rho_decay: float = field(default=0.8, metadata={"help": "EMA factor of Reflex's reliability."})
    spec_reflex_kappa: float = field(default=0.5, metadata={"help": "Bound of the correction norm relative to ||z||."})
    spec_reflex_dist_weight: float = field(default=1.0, metadata={"help": "Weight of Reflex's distribution error."})
    spec_reflex_cov_weight: float = field(default=1.0, metadata={"help": "Weight of Reflex's coverage error."})
    spec_reflex_support_k: int = field(default=8, metadata={"help": "Top-K support of Reflex's error terms."})
    spec_reflex_lookup: bool = field(
        default=True, metadata={"help": "Reflex token lookup: offer each head the continuation of the root's latest "
                                        "earlier occurrence in the row's prompt and completion."})
    spec_reflex_lookup_cyclic: bool = field(
        default=True, metadata={"help": "Continue a too-recent lookup match periodically."})
    spec_reflex_lookup_group: bool = field(
        default=False, metadata={"help": "Also look up in the rows sharing the prompt (the GRPO group)."})
    spec_consolidation: bool = field(
        default=False,
        metadata={"help": "Enable the slow path (SPEC 2.6): a drift monitor and head-only re-fits on tuples captured "
                  "during verification, run from ConsolidationCallback at the end of a training step."},
    )
    spec_consolidation_trigger: str = field(
        default="drift",
        metadata={"help": "'drift': re-fit when the monitor fires; 'every_round': after every generation round "
                  "(the always-train baseline)."},
    )
    spec_consolidation_delta: float = field(default=0.08, metadata={"help": "Acceptance drop counted as drift."})
    spec_consolidation_delta_r: float = field(default=0.08, metadata={"help": "Regret rise counted as drift."})
    spec_consolidation_patience: int = field(default=3, metadata={"help": "Drifted rounds in a row before a re-fit."})
    spec_consolidation_cooldown: int = field(default=5, metadata={"help": "Rounds ignored after a re-fit."})
    spec_consolidation_smoothing: float = field(default=0.8, metadata={"help": "EMA factor of monitored values."})
    spec_consolidation_buffer_size: int = field(default=16384, metadata={"help": "Captured tuples kept (ring)."})
    spec_consolidation_buffer_topk: int = field(default=8, metadata={"help": "Target top-K kept per tuple and head."})
    spec_consolidation_min_buffer: int = field(default=2048, metadata={"help": "No re-fit on fewer tuples."})
    spec_consolidation_steps: int = field(default=60, metadata={"help": "Optimiser steps per re-fit."})
    spec_consolidation_max_seconds: float = field(default=30.0, metadata={"help": "Wall-clock bound per re-fit."})
    spec_consolidation_batch_size: int = field(default=256, metadata={"help": "Tuples per re-fit step."})
    spec_consolidation_lr: float = field(default=3e-3, metadata={"help": "Adam learning rate of re-fits."})
    spec_consolidation_lambda_nll: float = field(default=0.5, metadata={"help": "Weight of CE on realised tokens."})
    spec_consolidation_mu: float = field(default=0.01, metadata={"help": "Weight of the proximal term."})
    spec_consolidation_holdout_fraction: float = field(
        default=0.1, metadata={"help": "Buffer share held out; a re-fit that does not lower its loss is undone."})
    spec_fallback_to_generate: bool = field(
        default=True,
        metadata={"help": "On a model the engine cannot run (e.g. FlashAttention-2 only), log and use generate."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.spec_init_heads not in ("distill", "zeros"):
            raise ValueError(f"spec_init_heads must be 'distill' or 'zeros', got {self.spec_init_heads!r}")
        for name in ("spec_num_heads", "spec_topk_per_head", "spec_distill_samples", "spec_distill_steps",
                     "spec_max_nodes", "spec_capacity"):
            value = getattr(self, name)
            optional = value is None and name == "spec_capacity"
            if not optional and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        for name in ("spec_num_heads", "spec_topk_per_head", "spec_distill_samples", "spec_distill_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.spec_max_nodes < 0:
            raise ValueError(f"spec_max_nodes must be >= 0, got {self.spec_max_nodes}")
        if self.spec_capacity is not None and self.spec_capacity < 1:
            raise ValueError(f"spec_capacity must be >= 1 or None, got {self.spec_capacity}")
        if self.spec_reflex:
            reflex_config_from(vars(self))  # validates the spec_reflex_* values now, not at the first rollout
        if self.spec_consolidation:
            consolidation_config_from(vars(self))


SPEC_DEFAULTS = {f.name: f.default for f in fields(SpecGRPOConfig) if f.name.startswith("spec_")}


def reflex_config_from(spec_args: dict) -> ReflexConfig:
    """The ``ReflexConfig`` described by ``spec_reflex_*`` fields."""
    names = [f.name for f in fields(ReflexConfig)]
    return ReflexConfig(**{n: spec_args[f"spec_reflex_{n}"] for n in names if f"spec_reflex_{n}" in spec_args})


def consolidation_config_from(spec_args: dict, seed: int = 0) -> ConsolidationConfig:
    """The ``ConsolidationConfig`` described by ``spec_consolidation_*`` fields."""
    names = [f.name for f in fields(ConsolidationConfig) if f.name != "seed"]
    return ConsolidationConfig(**{n: spec_args[f"spec_consolidation_{n}"] for n in names}, seed=seed)


class SpecGRPOTrainer(GRPOTrainer):
    """Drop-in ``GRPOTrainer`` with exact speculative rollouts (same signature, plus ``heads``)."""

    def __init__(self, *args, heads: SpeculativeHeads | None = None, **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if heads is None and getattr(config, "spec_enabled", False) and getattr(config, "spec_heads_path", None):
            check_heads_folder(config.spec_heads_path)  # a bad path fails before the policy is loaded
        super().__init__(*args, **kwargs)
        self.spec_args = {name: getattr(self.args, name, default) for name, default in SPEC_DEFAULTS.items()}
        self.spec_heads = heads
        self._spec_engine: SpeculativeGenerator | None = None
        if self.spec_args["spec_enabled"] and self.spec_heads is None:
            self.spec_heads = self._initial_heads()
        elif self.spec_heads is not None:
            self.spec_heads.check_compatible(self._policy_for_heads())
        if self.spec_heads is not None and self.spec_args["spec_topk_per_head"] > self.spec_heads.config.vocab_size:
            raise ValueError(f"spec_topk_per_head ({self.spec_args['spec_topk_per_head']}) exceeds the model's "
                             f"vocab size ({self.spec_heads.config.vocab_size})")
        self.spec_consolidation: ConsolidationCallback | None = None
        if self.spec_args["spec_enabled"] and self.spec_args["spec_consolidation"]:
            self.spec_consolidation = ConsolidationCallback(consolidation_config_from(self.spec_args, self.args.seed))
            self.spec_consolidation.bind(self)
            self.add_callback(self.spec_consolidation)

    # ------------------------------------------------------------------ heads
    def _policy_for_heads(self):
        """The bare HF causal LM under accelerate and PEFT wrappers."""
        model = self.accelerator.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _initial_heads(self) -> SpeculativeHeads:
        policy = self._policy_for_heads()
        lm_head = policy.get_output_embeddings()
        path = self.spec_args["spec_heads_path"]
        if path:
            heads = SpeculativeHeads.from_pretrained(path)
            heads.check_compatible(policy)
            return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)
        heads = SpeculativeHeads.from_model(policy, num_heads=self.spec_args["spec_num_heads"])
        if self.spec_args["spec_init_heads"] == "zeros":
            warnings.warn("SpecGRPOTrainer: no spec_heads_path given; starting from zero-initialised heads "
                          "(low acceptance until they are trained)", stacklevel=3)
            return heads
        warnings.warn("SpecGRPOTrainer: no spec_heads_path given; self-distilling heads on the training prompts "
                      "before the first step", stacklevel=3)
        return self._distill_initial_heads(heads)

    def _distill_initial_heads(self, heads: SpeculativeHeads) -> SpeculativeHeads:
        from .adapt.distill import HeadDistillConfig, distill_heads

        prompts = []
        tokenizer = self.processing_class
        count = min(len(self.train_dataset), self.spec_args["spec_distill_samples"])
        for row in self.train_dataset.select(range(count)):
            prompt = row["prompt"]
            if isinstance(prompt, list):
                prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            prompts.append(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        config = HeadDistillConfig(
            num_heads=heads.num_heads, num_samples=len(prompts), steps=self.spec_args["spec_distill_steps"],
            temperature=self.args.temperature, max_new_tokens=self.args.max_completion_length,
            seed=self.args.seed,
        )
        policy = self._policy_for_heads()
        was_training = policy.training
        requires_grad = {n: p.requires_grad for n, p in policy.named_parameters()}
        policy.eval()
        try:
            heads, report = distill_heads(policy, prompts, tokenizer.pad_token_id, config, heads=heads,
                                          progress=not self.args.disable_tqdm)
        finally:
            for n, p in policy.named_parameters():
                p.requires_grad_(requires_grad[n])
            policy.train(was_training)
        logger.info("initial heads distilled: %s", report["hit_rates"])
        return heads

    def _engine(self, model) -> SpeculativeGenerator:
        engine = self._spec_engine
        if engine is None or engine.model is not model:
            hooks = [Reflex(reflex_config_from(self.spec_args))] if self.spec_args["spec_reflex"] else []
            if self.spec_consolidation is not None:
                hooks.append(self.spec_consolidation.capture)
            engine = SpeculativeGenerator(
                model, self.spec_heads, self.generation_config, topk_per_head=self.spec_args["spec_topk_per_head"],
                max_nodes=self.spec_args["spec_max_nodes"], capacity=self.spec_args["spec_capacity"],
                fallback_to_generate=self.spec_args["spec_fallback_to_generate"], hooks=hooks,
            )
            self._spec_engine = engine
        return engine

    def _custom_generate(self) -> bool:
        """True when the policy's ``generate`` was replaced (patched on the instance, as tests that mock it do, or
        overridden by its class): its semantics are the user's, so generation goes through it, unchanged."""
        model = self._policy_for_heads()
        generate = type(model).generate  # a class-level patch replaces GenerationMixin.generate itself
        return "generate" in vars(model) or generate is not _HF_GENERATE or not inspect.isfunction(generate)

    # ------------------------------------------------------------------ the one overridden TRL hook
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if (not self.spec_args["spec_enabled"] or self.use_vllm or self.use_transformers_continuous_batching
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
            out = self._engine(unwrapped_model).generate(inputs["input_ids"].to(device),
                                                          inputs["attention_mask"].to(device))
        self._log_spec_stats(out.stats, time.perf_counter() - start)
        return out.completion_ids, out.logprobs

    def _log_spec_stats(self, stats: dict, seconds: float) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode]
        metrics["spec/tau"].append(float(stats.get("tau", 1.0)))
        metrics["spec/generation_seconds"].append(seconds)
        metrics["spec/tokens_per_s"].append(stats.get("tokens", 0) / max(seconds, 1e-9))
        metrics["spec/forwards"].append(float(stats.get("forwards", 0)))
        nodes, active = stats.get("nodes_per_row") or [0], stats.get("active_rows") or [0]
        metrics["spec/tree_nodes_per_row"].append(sum(nodes) / len(nodes))
        metrics["spec/active_rows"].append(sum(active) / len(active))
        for key in ("reflex_gate", "reflex_norm", "reflex_lookup_hit", "reflex_seconds", "capture_seconds"):
            if key in stats:
                metrics[f"spec/{key}"].append(float(stats[key]))
        for d, rate in enumerate(stats.get("accept_per_head", [])):
            metrics[f"spec/accept_head_{d + 1}"].append(rate)
        if self.spec_consolidation is not None and mode == "train":
            for key, value in self.spec_consolidation.observe(stats).items():
                metrics[key].append(value)

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
        loaded = None
        if self.spec_heads is not None and os.path.isdir(folder):
            try:
                if is_peft_wrapped(self.spec_heads):
                    loaded = read_adapter_state(folder)
                else:
                    loaded = SpeculativeHeads.from_pretrained(folder)
                    loaded.check_compatible(self._policy_for_heads())
            except (OSError, ValueError) as err:
                raise ValueError(f"refusing to resume from {resume_from_checkpoint!r}: its speculative heads "
                                 f"({HEADS_SUBDIR}/) cannot be loaded: {err}") from err
        elif self.spec_heads is not None:
            warnings.warn(f"checkpoint {resume_from_checkpoint!r} has no {HEADS_SUBDIR}/ folder; resuming with the "
                          "current speculative heads", stacklevel=2)
        super()._load_from_checkpoint(resume_from_checkpoint, model=model)
        if isinstance(loaded, dict):
            apply_adapter_state(self.spec_heads, loaded)
        elif loaded is not None:
            if loaded.config == self.spec_heads.config:
                self.spec_heads.load_state_dict(loaded.state_dict())
            else:  # the checkpoint's heads have another shape: they replace the current ones
                ref = next(self.spec_heads.parameters())
                self.spec_heads = loaded.to(device=ref.device, dtype=ref.dtype)
                self._spec_engine = None
                if self.spec_consolidation is not None:
                    self.spec_consolidation.bind(self)  # its monitor and buffer are sized by the heads
        state = os.path.join(folder, CONSOLIDATION_STATE)
        if self.spec_consolidation is not None and os.path.isfile(state):
            with open(state) as f:
                self.spec_consolidation.load_state_dict(json.load(f))
