"""The target's per-node distribution, and what a verified step emits; sample-then-match for top-k candidates.

For every tree node ``v`` the target distribution ``p_v`` is built with Hugging Face's own logits processors, exactly
as ``model.generate`` builds them for the same ``GenerationConfig`` (fp32; input ids = prompt + committed
completion + path to ``v``; processors that read only the *set* of ids get a cheaper filler-padded copy); options
the engine cannot reproduce (beam search, several sequences, unsupported processors) are refused by name.

Top-k candidates (children fixed before sampling, distinct tokens): one sample ``y_v ~ p_v`` is drawn per node;
starting at the root we descend into the child whose token equals ``y_v`` and stop at the first node without one,
emitting its ``y_v``. The accepted path is unique and every emitted token is distributed exactly as the target
would sample it; a node accepts with ``p_v``'s mass on its children. The head's own probabilities never enter the
decision (with ``min(1, p/q)`` top-k candidates would be biased). Candidates drawn from the heads' ``q`` are
verified by rejection sampling instead (``drawn.py``); ``cut`` turns either rule's accepted path into what a row
emits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .tree import DraftTree

# Processors whose output depends only on the scores and on the *set* of tokens in input_ids, so a
# path-dependent, filler-padded input_ids reproduces generate's behaviour exactly.
SET_PROCESSORS = (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
# Processors that read the order or the length of input_ids: they need each node's true sequence.
SEQUENCE_PROCESSORS = (
    NoRepeatNGramLogitsProcessor,
    NoBadWordsLogitsProcessor,
    SequenceBiasLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinLengthLogitsProcessor,
)
SUPPORTED_PROCESSORS = SET_PROCESSORS + SEQUENCE_PROCESSORS
# The ``GenerationConfig`` option behind each processor the engine cannot reproduce (named in the error/warning).
PROCESSOR_OPTIONS = {
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "WatermarkLogitsProcessor": "watermarking_config",
    "SynthIDTextWatermarkLogitsProcessor": "watermarking_config",
}


# Decoding strategies and stopping rules the engine does not implement: ``option -> is it in use``.
UNSUPPORTED_OPTIONS = {
    "num_beams": lambda v: v is not None and v > 1,
    "num_beam_groups": lambda v: v is not None and v > 1,
    "diversity_penalty": lambda v: bool(v),
    "penalty_alpha": lambda v: v is not None and v > 0,
    "dola_layers": lambda v: v is not None,
    "num_return_sequences": lambda v: v is not None and v > 1,
    "constraints": lambda v: bool(v),
    "force_words_ids": lambda v: bool(v),
    "stop_strings": lambda v: bool(v),
    "max_time": lambda v: v is not None,
    "prompt_lookup_num_tokens": lambda v: v is not None,
    "token_healing": lambda v: bool(v),
}


class UnsupportedOptionsError(ValueError):
    """The generation config asks for something the engine does not implement; ``options`` names the
    ``GenerationConfig`` options."""

    def __init__(self, options: list[str], message: str | None = None):
        self.options = sorted(options)
        super().__init__(message or f"generation option(s) {self.options} are not implemented by the speculative "
                                    "engine (it samples or decodes greedily, one sequence per prompt, to eos or "
                                    "max_new_tokens); unset them or use model.generate")


def check_decoding_options(generation_config: GenerationConfig) -> None:
    """Raise ``UnsupportedOptionsError`` naming every option of ``generation_config`` the engine would otherwise
    ignore (beam search, contrastive search, several sequences per prompt, stop strings, ...)."""
    used = [name for name, in_use in UNSUPPORTED_OPTIONS.items() if in_use(getattr(generation_config, name, None))]
    if used:
        raise UnsupportedOptionsError(used)


class UnsupportedProcessorsError(UnsupportedOptionsError):
    """The generation config needs logits processors the engine cannot reproduce per tree node; ``options`` names
    the ``GenerationConfig`` options behind them."""

    def __init__(self, processors: list[str]):
        options = sorted({PROCESSOR_OPTIONS.get(name, name) for name in processors})
        super().__init__(options, f"generation option(s) {options} need logits processors the speculative engine "
                                  f"cannot reproduce per tree node ({processors}). Supported: "
                                  f"{[c.__name__ for c in SUPPORTED_PROCESSORS]}")


class TargetDistribution:
    """The target's per-node sampling distribution, built from ``model.generate``'s own processors."""

    def __init__(self, model, generation_config: GenerationConfig, prompt_attention_mask: torch.Tensor):
        # generate() first merges the model's own generation config and library defaults (e.g. top_k=50)
        generation_config, _ = model._prepare_generation_config(generation_config)
        check_decoding_options(generation_config)
        model._prepare_special_tokens(generation_config, kwargs_has_attention_mask=True,
                                      device=prompt_attention_mask.device)
        self.generation_config = generation_config
        self.do_sample = bool(generation_config.do_sample)
        self.temperature = float(generation_config.temperature or 1.0)
        self.processors: LogitsProcessorList = model._get_logits_processor(
            generation_config,
            input_ids_seq_length=prompt_attention_mask.shape[1],
            device=prompt_attention_mask.device,
            model_kwargs={"attention_mask": prompt_attention_mask},
        )
        unsupported = [type(p).__name__ for p in self.processors if not isinstance(p, SUPPORTED_PROCESSORS)]
        if unsupported:
            raise UnsupportedProcessorsError(unsupported)
        self.repetition = [p for p in self.processors if isinstance(p, RepetitionPenaltyLogitsProcessor)]
        self.needs_sequences = any(isinstance(p, SEQUENCE_PROCESSORS) for p in self.processors)

    @property
    def needs_input_ids(self) -> bool:
        """Whether the processors read input ids at all (``needs_sequences``: their order and length too)."""
        return bool(self.repetition) or self.needs_sequences

    def scores(self, logits: torch.Tensor, input_ids: torch.Tensor | None, ignore_prefix: torch.Tensor | None):
        """Processed fp32 scores for ``logits [N, V]``; ``input_ids [N, L]`` whose first ``ignore_prefix[n]``
        positions are padding (only read when a processor needs input ids)."""
        scores = logits.float()
        if input_ids is None:
            input_ids = torch.zeros((scores.shape[0], 1), dtype=torch.long, device=scores.device)
        for proc in self.repetition:
            proc.prompt_ignore_length = ignore_prefix
        return self.processors(input_ids, scores)

    def sample(self, scores: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of processed ``scores [N, V]`` (argmax when not sampling), and ``p`` itself.

        Sampling inverts each row's CDF at ``uniforms [N]``. The engine gives every completion position of a row
        one uniform, shared by all tree nodes that sample that position: along the accepted path each position
        reads its own fresh uniform once, so every emitted token is an exact draw, and what is emitted does not
        depend on the tree (nor on the node budget) beyond float rounding at CDF boundaries.
        """
        if not self.do_sample:
            tokens = scores.argmax(-1)
            return tokens, torch.nn.functional.one_hot(tokens, scores.shape[-1]).float()
        probs = torch.softmax(scores, dim=-1)
        return inverse_cdf(probs, uniforms), probs

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """What TRL recomputes: ``log_softmax(logits / T)`` in fp32."""
        return torch.log_softmax(logits.float() / self.temperature, dim=-1)


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One index per row of unnormalised ``weights [N, V]``: the inverse of its CDF (float64) at ``uniforms [N]``."""
    cdf = weights.double().cumsum(-1)
    at = (uniforms.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, at, right=True).squeeze(1).clamp(max=weights.shape[-1] - 1)


def path_probability(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """``[B, n]``: ``P(path to v)`` under the target ``probs [B, n, V]``, the chance that sample-then-match accepts
    node ``v`` (every edge on its path matches; the root: 1)."""
    rows = torch.arange(probs.shape[0], device=probs.device)[:, None]
    edge = probs[rows, tree.parent.clamp(min=0), tree.tokens]  # p_parent(v)(token_v), [B, n]
    log_edge = edge.clamp(min=1e-30).log()
    log_edge[:, 0] = 0.0  # the root is always committed
    return torch.bmm(tree.ancestors.float(), log_edge[..., None]).squeeze(-1).exp()


def expected_accepted(tree: DraftTree, probs: torch.Tensor) -> torch.Tensor:
    """``[B]``: expected number of accepted draft nodes, ``sum_v P(path to v)``, under the target ``probs [B, n, V]``.

    The sample-then-match walk accepts node ``v`` exactly when every edge on its path matches, so this is
    the expectation of the realised accepted length; a lossy or biased verifier drifts away from it.
    """
    return path_probability(tree, probs)[:, 1:].sum(1)


def match_tree(tree: DraftTree, sampled: torch.Tensor) -> torch.Tensor:
    """Walk each row's tree along the target's samples.

    Args:
        tree: the draft trees (``tokens``/``parent`` ``[B, n]``).
        sampled: ``[B, n]``, the target's sample ``y_v`` at every node.

    Returns:
        ``[B, D+1]`` node indices of the accepted path from the root (``-1`` past its end); the row emits
        the tokens of accepted nodes after the root, then ``sampled`` at the last accepted node.
    """
    batch = tree.tokens.shape[0]
    max_depth = int(tree.depth.max()) if tree.max_depth is None else tree.max_depth
    current = torch.zeros(batch, dtype=torch.long, device=tree.tokens.device)
    alive = torch.ones(batch, dtype=torch.bool, device=tree.tokens.device)
    path = [current]
    for _ in range(max_depth):
        wanted = sampled.gather(1, current[:, None])
        hit = (tree.parent == current[:, None]) & (tree.tokens == wanted)
        alive = alive & hit.any(-1)
        current = torch.where(alive, hit.int().argmax(-1), current)
        path.append(torch.where(alive, current, -1))
    return torch.stack(path, dim=1)


@dataclass
class Emission:
    """What one verified step commits per row.

    Attributes:
        accepted: ``[B, D+1]`` node indices of the accepted path, root first (``-1`` past its end).
        tokens: ``[B, D+1]`` tokens emitted after the root: the accepted nodes' tokens, then the target's sample at
            the last accepted node (the next root); only the first ``count`` are committed.
        count: ``[B]`` tokens committed: cut after the first eos and at the row's remaining room.
        last: ``[B]`` the last accepted node (its hidden state feeds the next step's heads).
        next_root: ``[B]`` the sample at ``last``.
        finished: ``[B]`` the row emitted an eos or filled its room.
    """

    accepted: torch.Tensor
    tokens: torch.Tensor
    count: torch.Tensor
    last: torch.Tensor
    next_root: torch.Tensor
    finished: torch.Tensor


def emit(tree: DraftTree, sampled: torch.Tensor, eos: torch.Tensor, room: torch.Tensor) -> Emission:
    """Follow each row's tree along the target's samples (``match_tree``) and cut what it emits at the first eos
    (any id in ``eos``) and at ``room [B]``, the completion tokens the row may still add."""
    accepted = match_tree(tree, sampled)
    last = accepted.gather(1, ((accepted >= 0).sum(1) - 1)[:, None]).squeeze(1)
    return cut(tree, accepted, sampled.gather(1, last[:, None]).squeeze(1), eos, room)


def cut(tree: DraftTree, accepted: torch.Tensor, next_root: torch.Tensor, eos: torch.Tensor,
        room: torch.Tensor) -> Emission:
    """What a row emits for its ``accepted [B, D+1]`` path (root first, ``-1`` past its end) and the token sampled
    after it, ``next_root [B]`` (whatever rule verified the tree), cut at the first eos and at ``room [B]``."""
    num_acc = (accepted >= 0).sum(1)
    last = accepted.gather(1, (num_acc - 1)[:, None]).squeeze(1)
    width = accepted.shape[1]
    j = torch.arange(width, device=accepted.device)
    after = torch.cat([accepted[:, 1:], accepted.new_full((accepted.shape[0], 1), -1)], dim=1)
    tokens = torch.where(j[None] < num_acc[:, None] - 1, tree.tokens.gather(1, after.clamp(min=0)), next_root[:, None])
    is_eos = torch.isin(tokens, eos) & (j[None] < num_acc[:, None])
    first_eos = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, width + 1)  # 1-based; width + 1: none
    count = torch.minimum(torch.minimum(num_acc, first_eos), room)
    finished = (first_eos <= num_acc) | (count >= room)
    return Emission(accepted, tokens, count, last, next_root, finished)
