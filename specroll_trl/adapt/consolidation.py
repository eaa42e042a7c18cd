"""Head-only consolidation, the slow path: re-fit the heads on captured tuples when drift fires.

``consolidate_heads`` minimises, over the heads' trainable parameters only (their LoRA adapters when the
heads are PEFT-wrapped; the backbone and ``lm_head`` are read, never updated),
``sum_d [KL(p_d || q_d) + lambda_nll * CE(x_{t+1+d})] + mu * ||theta - theta_anchor||^2``, where ``p_d`` is the
captured top-K target distribution and ``theta_anchor`` the parameters when the update starts. It is bounded
in steps and seconds; on NaN, an exception or out-of-memory it restores the previous heads and reports why.
Heads with a draft vocabulary first refresh it (``refresh_draft_vocab``): tokens the policy now emits that the heads
cannot propose replace draft tokens it no longer uses. The loss only touches the draft vocabulary's rows of
``lm_head``, never a softmax over the whole vocabulary.

``ConsolidationCallback`` wires a ``BufferCapture`` (an engine hook filling a ``HeadBuffer``), a ``DriftMonitor``
and ``consolidate_heads`` into any Trainer loop: at ``on_step_end`` it reads the rounds the capture saw and
re-fits the heads when the monitor fires.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import TrainerCallback

from ..engine.heads import VocabProjection, lm_head_shape
from .buffer import BufferCapture, HeadBuffer
from .drift import DriftMonitor

logger = logging.getLogger(__name__)


@dataclass
class ConsolidationConfig:
    """Slow-path settings.

    Each field's ``help`` says what it does.
    """

    trigger: str = field(
        default="drift",
        metadata={"help": "``'drift'`` (consolidate when the monitor fires) or ``'every_round'`` (after every "
                          "generation round, the FastGRPO-style always-train baseline)."},
    )
    delta: float = field(
        default=0.05,
        metadata={"help": "relative drop of tau (mean accepted length of drafted steps, averaged over ``window`` "
                          "rounds) below its best since the last re-fit that counts as drift (0.05: 5%)."})
    delta_r: float = field(default=0.08, metadata={"help": "candidate-regret rise (absolute) that counts as drift."})
    patience: int = field(default=2, metadata={"help": "consecutive drifted rounds before consolidating."})
    cooldown: int = field(default=3, metadata={"help": "rounds ignored after a consolidation."})
    window: int = field(default=4, metadata={"help": "rounds averaged into each monitored value (block mean)."})
    buffer_size: int = field(
        default=4096,
        metadata={"help": "tuples kept in the ring buffer (newest first: about 4 rounds of 8 rows x 128 tokens, so "
                          "tuples from before a shift age out quickly)."})
    buffer_topk: int = field(default=8, metadata={"help": "target probabilities kept per tuple and head."})
    min_buffer: int = field(default=2048, metadata={"help": "do not consolidate on fewer tuples than this."})
    steps: int = field(default=60, metadata={"help": "optimiser steps per consolidation."})
    max_seconds: float = field(default=30.0, metadata={"help": "wall-clock bound per consolidation."})
    batch_size: int = field(default=256, metadata={"help": "tuples per optimiser step."})
    lr: float = field(default=3e-3, metadata={"help": "Adam learning rate."})
    lambda_nll: float = field(default=0.5, metadata={"help": "weight of cross-entropy on the realised token."})
    mu: float = field(default=0.01, metadata={"help": "weight of the proximal term ``||theta - theta_anchor||^2``."})
    vocab_refresh: float = field(
        default=0.1,
        metadata={"help": "with a draft vocabulary: at most this share of it is swapped, per consolidation, for tokens "
                          "the buffer's targets emit that it lacks (each seen at least twice and more often than the "
                          "draft token it replaces). 0 keeps the vocabulary fixed."},
    )
    holdout_fraction: float = field(
        default=0.1,
        metadata={"help": "share of the buffer kept out of the re-fit; the new heads are kept only if their loss on it "
                          "improved (otherwise the previous heads are restored: a re-fit that only memorised recent "
                          "tuples is rejected). 0 disables the check."},
    )
    seed: int = field(default=0, metadata={"help": "seeds the minibatch draws."})

    def __post_init__(self):
        if self.trigger not in ("drift", "every_round"):
            raise ValueError(f"consolidation trigger must be 'drift' or 'every_round', got {self.trigger!r}")
        for name in ("buffer_size", "buffer_topk", "min_buffer", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"consolidation {name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_seconds", "lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"consolidation {name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.vocab_refresh <= 1:
            raise ValueError(f"consolidation vocab_refresh must be in [0, 1], got {self.vocab_refresh}")
        if not 0 <= self.holdout_fraction < 1:
            raise ValueError(f"consolidation holdout_fraction must be in [0, 1), got {self.holdout_fraction}")
        if self.lambda_nll < 0 or self.mu < 0:
            raise ValueError(f"lambda_nll and mu must be >= 0, got {self.lambda_nll} and {self.mu}")
        DriftMonitor(1, self.delta, self.delta_r, self.patience, self.cooldown, self.window)  # validates those


@dataclass
class ConsolidationReport:
    """What one consolidation did. ``ok`` False: the heads are unchanged (restored, or ``skipped`` before any
    work, e.g. too few tuples); ``reason`` says why."""

    ok: bool
    skipped: bool = False
    rejected: bool = False
    steps: int = 0
    seconds: float = 0.0
    loss_before: float = math.nan
    loss_after: float = math.nan
    param_step: float = 0.0
    heldout_before: float = math.nan
    heldout_after: float = math.nan
    vocab_swapped: int = 0
    reason: str = ""


def refuse_path_heads(heads: torch.nn.Module) -> None:
    """The buffer keeps, per anchor, ``h_t`` and the targets, not the path tokens path-conditioned heads read: they
    cannot be re-fitted from it."""
    if getattr(heads, "reads_path", False):
        raise ValueError("the slow path (consolidation) re-fits independent heads only; these heads are "
                         "path-conditioned (kind='path'): turn consolidation off or use independent heads")


def consolidation_loss(heads, projection: VocabProjection, batch, lambda_nll: float) -> torch.Tensor:
    """Mean over valid (tuple, head) pairs of ``KL(p || q) + lambda_nll * CE(token)``, ``p`` on its top-K within the
    heads' vocabulary (renormalised there)."""
    hidden, ids, probs, tokens, valid = batch
    logq = torch.log_softmax(projection(heads(hidden)).float(), dim=-1)  # [N, H, V]
    index = projection.index_of(ids)
    p = probs * (index >= 0)
    p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
    kl = (p * (p.clamp(min=1e-12).log() - logq.gather(-1, index.clamp(min=0)))).sum(-1)
    realised = projection.index_of(tokens)
    nll = -logq.gather(-1, realised.clamp(min=0)[..., None]).squeeze(-1) * (realised >= 0)
    weight = valid.float()
    return ((kl + lambda_nll * nll) * weight).sum() / weight.sum().clamp(min=1)


def refresh_draft_vocab(heads, lm_head: torch.nn.Module, tokens: torch.Tensor, max_share: float) -> int:
    """Swap, in place, up to ``max_share`` of ``heads.draft_ids`` for realised ``tokens`` (target ids) it lacks: the
    most frequent missing ones (seen at least twice) replace the draft ids seen least, pair by pair while the
    newcomer is the more frequent. Returns how many were swapped (0 without a draft vocabulary)."""
    ids = heads.draft_ids
    if ids is None or max_share <= 0 or tokens.numel() == 0:
        return 0
    counts = torch.bincount(tokens.flatten().cpu(), minlength=lm_head_shape(lm_head)[0])
    missing = counts.clone()
    missing[ids.cpu()] = 0
    k = min(int(max_share * len(ids)), int((missing >= 2).sum()))
    if k == 0:
        return 0
    new_count, new_ids = missing.topk(k)
    old_count, old_slots = counts[ids.cpu()].topk(k, largest=False)
    swap = new_count > old_count  # both sorted: the i-th most frequent newcomer against the i-th least used
    ids[old_slots[swap].to(ids.device)] = new_ids[swap].to(ids.device)
    return int(swap.sum())


def consolidate_heads(heads: torch.nn.Module, lm_head: torch.nn.Module, buffer: HeadBuffer,
                      config: ConsolidationConfig | None = None) -> ConsolidationReport:
    """Re-fit ``heads``' trainable parameters on ``buffer``; restore them if anything goes wrong.

    Steps: refuse or skip (no trainable parameters, too few tuples); split the buffer into train and held-out
    tuples; refresh the draft vocabulary; fit; keep the new heads only if the held-out loss fell. Any error, or
    non-finite parameters, restores the previous heads (draft vocabulary included)."""
    refuse_path_heads(heads)
    config = config or ConsolidationConfig()
    start = time.perf_counter()
    refit = _Refit(heads, lm_head, buffer, config)
    if refit.skip_reason:
        return ConsolidationReport(ok=False, skipped=True, reason=refit.skip_reason)
    backup = {k: v.detach().clone() for k, v in heads.state_dict().items()}  # draft_ids included
    realised = buffer.tokens[refit.train, 0][buffer.valid[refit.train, 0]]  # head 1's targets: each token once
    report = ConsolidationReport(ok=True, vocab_swapped=refresh_draft_vocab(heads, lm_head, realised,
                                                                         config.vocab_refresh))
    was_training = heads.training
    heads.train()
    try:
        report.heldout_before = refit.heldout_loss()
        refit.fit(report, deadline=start + config.max_seconds)
        refit.judge(report, backup)
    except (FloatingPointError, RuntimeError, ValueError, torch.OutOfMemoryError) as err:
        heads.load_state_dict(backup)
        report = ConsolidationReport(ok=False, steps=report.steps, reason=f"{type(err).__name__}: {err}")
        logger.warning("head consolidation failed, previous heads restored: %s", report.reason)
    finally:
        for p in refit.params:
            p.grad = None
        heads.train(was_training)
    report.seconds = time.perf_counter() - start
    return report


class _Refit:
    """One consolidation's data and optimisation: the buffer split into train / held-out tuples, the proximal
    anchor, and the fitting loop."""

    def __init__(self, heads, lm_head, buffer: HeadBuffer, config: ConsolidationConfig):
        self.heads, self.buffer, self.config = heads, buffer, config
        self.params = [p for p in heads.parameters() if p.requires_grad]
        self.skip_reason = ("heads have no trainable parameters" if not self.params else
                            f"buffer holds {len(buffer)} tuples, fewer than {config.min_buffer}"
                            if len(buffer) < config.min_buffer else "")
        self.weight = lm_head.weight
        self.generator = torch.Generator().manual_seed(config.seed)
        order = torch.randperm(len(buffer), generator=self.generator)
        cut = int(len(buffer) * config.holdout_fraction)
        self.held, self.train = order[:cut], order[cut:]
        self.anchor = [p.detach().clone() for p in self.params]
        self.lm_head = lm_head

    def _on_device(self, batch):
        batch = [t.to(self.weight.device) for t in batch]
        batch[0] = batch[0].to(self.weight.dtype)
        return batch

    def heldout_loss(self) -> float:
        """The fit loss on (up to 4,096) held-out tuples; NaN without a held-out split."""
        if not len(self.held):
            return math.nan
        projection = self.heads.projection(self.lm_head)  # after the vocabulary refresh
        with torch.no_grad():
            batch = self._on_device(self.buffer.take(self.held[:4096]))
            return float(consolidation_loss(self.heads, projection, batch, self.config.lambda_nll))

    def fit(self, report: ConsolidationReport, deadline: float) -> None:
        """``config.steps`` Adam steps (or until ``deadline``) on the fit loss plus the proximal penalty."""
        config, params = self.config, self.params
        projection = self.heads.projection(self.lm_head)  # the shared lm_head: read, never updated
        optimizer = torch.optim.Adam(params, lr=config.lr)
        with torch.enable_grad():
            for step in range(config.steps):
                batch = self._on_device(self.buffer.sample(config.batch_size, self.generator, among=self.train))
                fit = consolidation_loss(self.heads, projection, batch, config.lambda_nll)
                loss = fit + config.mu * sum(((p - a) ** 2).sum() for p, a in zip(params, self.anchor))
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"consolidation loss is {float(loss.detach())} at step {step}")
                if step == 0:
                    report.loss_before = float(fit.detach())
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                report.steps, report.loss_after = step + 1, float(fit.detach())
                if time.perf_counter() > deadline:
                    break
        if not all(torch.isfinite(p).all() for p in params):
            raise FloatingPointError("consolidation produced non-finite head parameters")
        report.param_step = float(sum(((p.detach() - a) ** 2).sum() for p, a in zip(params, self.anchor)).sqrt())

    def judge(self, report: ConsolidationReport, backup: dict) -> None:
        """Keep the new heads only if their held-out loss fell (a re-fit that memorised recent tuples is undone)."""
        report.heldout_after = self.heldout_loss()
        if len(self.held) and not report.heldout_after < report.heldout_before:
            self.heads.load_state_dict(backup)
            report.ok, report.rejected = False, True
            report.reason = (f"held-out loss did not improve ({report.heldout_before:.4f} -> "
                             f"{report.heldout_after:.4f}); previous heads kept")


class ConsolidationCallback(TrainerCallback):
    """Drift-triggered, head-only consolidation as a ``TrainerCallback`` (``SpecGRPOTrainer`` adds it when
    ``spec_consolidation=True``; any Trainer loop can use it).

    Register ``capture`` as a hook of the engine that generates the rollouts. At every ``on_step_end`` the
    callback feeds each generation round the capture saw to the drift monitor and, when it fires (or every
    round with ``trigger="every_round"``), re-fits the heads on the captured tuples: outside generation and the
    policy's backward pass, touching only the heads.

    Args:
        heads: the speculative heads (PEFT-wrapped or not); updated in place.
        lm_head: the target's output projection the heads share (read only).
        config: slow-path settings.
        log: called with a dict of ``spec/...`` metrics after each step's rounds and each consolidation.
    """

    def __init__(self, heads: torch.nn.Module, lm_head: torch.nn.Module, config: ConsolidationConfig | None = None,
                 log: Callable[[dict[str, float]], None] | None = None):
        refuse_path_heads(heads)
        c = self.config = config or ConsolidationConfig()
        self.heads, self.lm_head = heads, lm_head
        self.log = log or (lambda metrics: None)
        num_heads = heads.num_heads
        self.monitor = DriftMonitor(num_heads, c.delta, c.delta_r, c.patience, c.cooldown, c.window)
        self.buffer = HeadBuffer(c.buffer_size, num_heads, lm_head.weight.shape[1], c.buffer_topk)
        self.capture = BufferCapture(self.buffer)
        self.pending = False
        self.count = self.failures = self.rejected = 0
        self.seconds = 0.0
        self.last_report: ConsolidationReport | None = None

    def observe(self, accept_per_head: list[float] | None, regret: list[float] | None) -> dict[str, float]:
        """One generation round (``None`` where it drafted nothing); returns the drift metrics."""
        if self.monitor.update(accept_per_head, regret) or self.config.trigger == "every_round":
            self.pending = True
        metrics = {"spec/drift": self.monitor.drop(), "spec/buffer_size": float(len(self.buffer))}
        finite = [r for r in regret or [] if not math.isnan(r)]
        if finite:
            metrics["spec/candidate_regret"] = sum(finite) / len(finite)
        return metrics

    def consolidate(self) -> ConsolidationReport:
        report = consolidate_heads(self.heads, self.lm_head, self.buffer, self.config)
        self.last_report = report
        self.seconds += report.seconds
        if report.ok:
            self.count += 1
            self.monitor.reset_reference()
        elif report.rejected:
            self.rejected += 1
        elif not report.skipped:
            self.failures += 1
        return report

    def on_step_end(self, args, state, control, **kwargs):
        for accept, regret in self.capture.pop_rounds():
            self.log(self.observe(accept, regret))
        if not self.pending:
            return control
        self.pending = False
        report = self.consolidate()
        metrics = {"spec/consolidations": float(self.count), "spec/consolidation_seconds": report.seconds,
                   "spec/consolidation_failures": float(self.failures),
                   "spec/consolidation_rejected": float(self.rejected)}
        if report.ok:
            metrics.update({"spec/consolidation_loss_before": report.loss_before,
                            "spec/consolidation_loss_after": report.loss_after,
                            "spec/consolidation_vocab_swapped": float(report.vocab_swapped)})
        self.log(metrics)
        return control

    def state_dict(self) -> dict:
        return {"config": asdict(self.config), "monitor": self.monitor.state_dict(), "count": self.count,
                "failures": self.failures, "rejected": self.rejected, "seconds": self.seconds, "pending": self.pending}

    def load_state_dict(self, state: dict) -> None:
        if state.get("monitor") is not None:
            self.monitor.load_state_dict(state["monitor"])
        self.count, self.failures = int(state.get("count", 0)), int(state.get("failures", 0))
        self.rejected = int(state.get("rejected", 0))
        self.seconds, self.pending = float(state.get("seconds", 0.0)), bool(state.get("pending", False))
