"""Head-only consolidation, the slow path: re-fit the heads on captured records when drift fires, or while re-fits
still pay.

``consolidate_heads`` minimises, over the heads' trainable parameters only (their LoRA adapters when the
heads are PEFT-wrapped; the backbone, ``lm_head`` and input embedding are read, never updated),
``mean_d [KL(p_d || q_d) + lambda_nll * CE(x_{t+1+d})] + mu * ||theta - theta_anchor||^2`` (the offline
distillation's loss, ``records.head_fit_loss``, on either head kind: path heads read the records' path tokens
through the input embedding), where ``p_d`` is the captured top-K target distribution and ``theta_anchor`` the
parameters when the update starts. It is bounded in steps and seconds; on NaN, an exception or out-of-memory it
restores the previous heads and reports why.
Heads with a draft vocabulary first refresh it (``refresh_draft_vocab``): tokens the policy now emits that the heads
cannot propose replace draft tokens it no longer uses. The loss only touches the draft vocabulary's rows of
``lm_head``, never a softmax over the whole vocabulary.

``ConsolidationCallback`` wires a ``BufferCapture`` (an engine hook filling a ``HeadBuffer``), a ``DriftMonitor``
and ``consolidate_heads`` into any Trainer loop: at ``on_step_end`` it reads the rounds the capture saw and
re-fits the heads when the monitor fires, or when the buffer holds ``learn_min_new`` records newer than the last
re-fit and that re-fit's held-out gain reached ``learn_min_gain`` (young heads keep learning from the rollouts;
settled ones wait for drift). This second trigger counts records, not drafted rounds, so heads too weak to be
drafted with learn too. Under several processes every rank decides together and rank 0's re-fitted heads are
broadcast, so all ranks draft with identical heads.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import TrainerCallback

from ..engine.heads import lm_head_shape
from .buffer import BufferCapture, HeadBuffer
from .drift import DriftMonitor
from .records import head_fit_loss

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
        default=8192,
        metadata={"help": "records kept in the ring buffer (newest first: about 9 rounds of 8 rows x 128 tokens, so "
                          "records from before a shift age out within a few re-fits)."})
    buffer_topk: int = field(default=8, metadata={"help": "target probabilities kept per record and head."})
    min_buffer: int = field(default=2048, metadata={"help": "do not consolidate on fewer records than this."})
    steps: int = field(default=40, metadata={"help": "optimiser steps per consolidation."})
    max_seconds: float = field(default=30.0, metadata={"help": "wall-clock bound per consolidation."})
    batch_size: int = field(default=256, metadata={"help": "records per optimiser step."})
    lr: float = field(default=1e-3, metadata={"help": "Adam learning rate."})
    lambda_nll: float = field(default=0.5, metadata={"help": "weight of cross-entropy on the realised token."})
    mu: float = field(default=1.0, metadata={"help": "weight of the proximal term ``||theta - theta_anchor||^2``."})
    vocab_refresh: float = field(
        default=0.1,
        metadata={"help": "with a draft vocabulary: at most this share of it is swapped, per consolidation, for tokens "
                          "the buffer's targets emit that it lacks (each seen at least twice and more often than the "
                          "draft token it replaces). 0 keeps the vocabulary fixed."},
    )
    holdout_fraction: float = field(
        default=0.1,
        metadata={"help": "share of the buffer kept out of the re-fit: the newest whole generation rounds covering it "
                          "(rollouts of prompts the fit never saw; the newest records when one round is over half "
                          "the buffer). The new heads are kept only if their loss on it improved (otherwise the "
                          "previous heads are restored: a re-fit that only memorised its records is rejected). 0 "
                          "disables the check."},
    )
    learn_min_new: int = field(
        default=8192,
        metadata={"help": "records added since the last re-fit before a learning re-fit (the trigger that fires "
                          "while re-fits still pay, independent of drift and of drafting)."})
    learn_min_gain: float | None = field(
        default=0.02,
        metadata={"help": "relative fall of the held-out loss the last re-fit must have reached for the next "
                          "learning re-fit (the first one always runs once ``learn_min_new`` records are in). "
                          "``None``: re-fit on drift only."})
    seed: int = field(default=0, metadata={"help": "seeds the minibatch draws."})

    def __post_init__(self):
        if self.trigger not in ("drift", "every_round"):
            raise ValueError(f"consolidation trigger must be 'drift' or 'every_round', got {self.trigger!r}")
        if self.learn_min_gain is not None and not 0 <= self.learn_min_gain < 1:
            raise ValueError(f"consolidation learn_min_gain must be in [0, 1) or None, got {self.learn_min_gain}")
        for name in ("buffer_size", "buffer_topk", "min_buffer", "steps", "batch_size", "learn_min_new"):
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
    work, e.g. too few records); ``reason`` says why."""

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

    @property
    def gain(self) -> float:
        """Relative fall of the held-out loss (NaN without a held-out split or a finished fit)."""
        return (self.heldout_before - self.heldout_after) / self.heldout_before if self.heldout_before else math.nan


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
                      config: ConsolidationConfig | None = None, embed: torch.nn.Module | None = None
                      ) -> ConsolidationReport:
    """Re-fit ``heads``' trainable parameters on ``buffer``; restore them if anything goes wrong. ``embed``: the
    target's input embedding, which path-conditioned heads read (required for them).

    Steps: skip (no trainable parameters, too few records); split the buffer into train and held-out
    records; refresh the draft vocabulary; fit; keep the new heads only if the held-out loss fell. Any error, or
    non-finite parameters, restores the previous heads (draft vocabulary included)."""
    heads.check_path_source(embed, "consolidate_heads")
    config = config or ConsolidationConfig()
    start = time.perf_counter()
    refit = _Refit(heads, lm_head, buffer, config, embed)
    if refit.skip_reason:
        return ConsolidationReport(ok=False, skipped=True, reason=refit.skip_reason)
    backup = {k: v.detach().clone() for k, v in heads.state_dict().items()}  # draft_ids included
    data = buffer.data
    realised = data.tokens[refit.train, 0][data.valid[refit.train, 0]]  # head 1's targets: each token once
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


def heldout_split(buffer: HeadBuffer, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(held, train)`` slots: the newest whole generation rounds covering ``fraction`` of the buffer (rollouts of
    prompts the fit never saw: records of the same sequence are strongly correlated, so a random split would reward
    memorising them), or the newest ``fraction`` of the records when those rounds are over half the buffer."""
    order = buffer.newest_first()
    want = int(len(order) * fraction)
    if want == 0:
        return order[:0], order
    rounds = buffer.round[order]
    cut = int((rounds >= rounds[want - 1]).sum())
    cut = want if cut > len(order) // 2 else cut
    return order[:cut], order[cut:]


class _Refit:
    """One consolidation's data and optimisation: the buffer split into train / held-out records, the proximal
    anchor, and the fitting loop."""

    def __init__(self, heads, lm_head, buffer: HeadBuffer, config: ConsolidationConfig, embed=None):
        self.heads, self.buffer, self.config, self.embed = heads, buffer, config, embed
        self.params = [p for p in heads.parameters() if p.requires_grad]
        self.skip_reason = ("heads have no trainable parameters" if not self.params else
                            f"buffer holds {len(buffer)} records, fewer than {config.min_buffer}"
                            if len(buffer) < config.min_buffer else "")
        self.weight = lm_head.weight
        self.generator = torch.Generator().manual_seed(config.seed)
        self.held, self.train = heldout_split(buffer, config.holdout_fraction)
        self.anchor = [p.detach().clone() for p in self.params]
        self.lm_head = lm_head

    def loss(self, projection, records) -> torch.Tensor:
        """The fit loss of ``records``: the distillation loss (``head_fit_loss``), averaged over heads."""
        records = records.to(self.weight.device, self.weight.dtype)
        return head_fit_loss(self.heads, projection, records, self.embed, 1.0, self.config.lambda_nll).mean()

    def heldout_loss(self) -> float:
        """The fit loss on (up to 4,096) held-out records; NaN without a held-out split."""
        if not len(self.held):
            return math.nan
        projection = self.heads.projection(self.lm_head, self.buffer.temperature)  # after the vocabulary refresh
        with torch.no_grad():
            return float(self.loss(projection, self.buffer.take(self.held[:4096])))

    def fit(self, report: ConsolidationReport, deadline: float) -> None:
        """``config.steps`` Adam steps (or until ``deadline``) on the fit loss plus the proximal penalty."""
        config, params = self.config, self.params
        projection = self.heads.projection(self.lm_head, self.buffer.temperature)  # lm_head: read, never updated
        optimizer = torch.optim.Adam(params, lr=config.lr)
        with torch.enable_grad():
            for step in range(config.steps):
                fit = self.loss(projection, self.buffer.sample(config.batch_size, self.generator, among=self.train))
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
        """Keep the new heads only if their held-out loss fell (a re-fit that memorised recent records is undone)."""
        report.heldout_after = self.heldout_loss()
        if len(self.held) and not report.heldout_after < report.heldout_before:
            self.heads.load_state_dict(backup)
            report.ok, report.rejected = False, True
            report.reason = (f"held-out loss did not improve ({report.heldout_before:.4f} -> "
                             f"{report.heldout_after:.4f}); previous heads kept")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def broadcast_heads(heads: torch.nn.Module) -> None:
    """Give every rank rank 0's heads (weights and draft vocabulary), in place; a no-op in a single process."""
    if _distributed():
        for tensor in heads.state_dict().values():
            torch.distributed.broadcast(tensor, src=0)


class ConsolidationCallback(TrainerCallback):
    """Head-only consolidation as a ``TrainerCallback`` (``SpecGRPOTrainer`` adds it when ``spec_consolidation=True``;
    any Trainer loop can use it).

    Register ``capture`` as a hook of the engine that generates the rollouts. At every ``on_step_end`` the
    callback feeds each generation round the capture saw to the drift monitor and re-fits the heads on the
    captured records when it fires (or every round with ``trigger="every_round"``), or when a learning re-fit is
    due (:meth:`learning_due`): outside generation and the policy's backward pass, touching only the heads.

    Args:
        heads: the speculative heads (PEFT-wrapped or not, either kind); updated in place.
        lm_head: the target's output projection the heads share (read only).
        config: slow-path settings.
        log: called with a dict of ``spec/...`` metrics after each step's rounds and each consolidation.
        embed: the target's input embedding (read only), needed by path-conditioned heads.
    """

    def __init__(self, heads: torch.nn.Module, lm_head: torch.nn.Module, config: ConsolidationConfig | None = None,
                 log: Callable[[dict[str, float]], None] | None = None, embed: torch.nn.Module | None = None):
        heads.check_path_source(embed, "ConsolidationCallback")
        c = self.config = config or ConsolidationConfig()
        self.heads, self.lm_head, self.embed = heads, lm_head, embed
        self.log = log or (lambda metrics: None)
        num_heads = heads.num_heads
        self.monitor = DriftMonitor(num_heads, c.delta, c.delta_r, c.patience, c.cooldown, c.window)
        self.buffer = HeadBuffer(c.buffer_size, num_heads, lm_head.weight.shape[1], c.buffer_topk)
        self.capture = BufferCapture(self.buffer)
        self.pending = False
        self.count = self.failures = self.rejected = self.learning = 0
        self.seconds = 0.0
        self.last_report: ConsolidationReport | None = None
        self.last_gain: float | None = None  # held-out gain of the last re-fit that ran (None: none yet)
        self.added_at_refit = 0  # buffer.added when the last re-fit ran

    def learning_due(self) -> bool:
        """Whether a re-fit still pays: ``learn_min_new`` records arrived since the last re-fit, and that re-fit's
        held-out gain reached ``learn_min_gain`` (or none ran yet). Counts records, not drafted rounds."""
        c = self.config
        if c.learn_min_gain is None or len(self.buffer) < c.min_buffer:
            return False
        if self.buffer.added - self.added_at_refit < c.learn_min_new:
            return False
        return self.last_gain is None or self.last_gain >= c.learn_min_gain

    def _agreed(self, fire: bool) -> bool:
        """Rank 0's decision on every rank: a re-fit runs everywhere, then rank 0's heads are broadcast."""
        if not _distributed():
            return fire
        flag = torch.tensor([1.0 if fire else 0.0], device=self.lm_head.weight.device)
        torch.distributed.broadcast(flag, src=0)
        return bool(flag.item() > 0)

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
        report = consolidate_heads(self.heads, self.lm_head, self.buffer, self.config, self.embed)
        broadcast_heads(self.heads)
        self.last_report = report
        self.seconds += report.seconds
        if not report.skipped:
            self.added_at_refit = self.buffer.added
            self.last_gain = report.gain if report.ok else 0.0
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
        drift = self.pending
        learn = not drift and self.learning_due()
        if not self._agreed(drift or learn):
            return control
        self.pending = False
        report = self.consolidate()
        self.learning += int(learn)
        metrics = {"spec/consolidations": float(self.count), "spec/consolidation_seconds": report.seconds,
                   "spec/consolidation_failures": float(self.failures),
                   "spec/consolidation_rejected": float(self.rejected),
                   "spec/consolidation_learning": float(self.learning)}
        if report.ok:
            metrics.update({"spec/consolidation_loss_before": report.loss_before,
                            "spec/consolidation_loss_after": report.loss_after,
                            "spec/consolidation_gain": report.gain,
                            "spec/consolidation_vocab_swapped": float(report.vocab_swapped)})
        self.log(metrics)
        return control

    def state_dict(self) -> dict:
        return {"config": asdict(self.config), "monitor": self.monitor.state_dict(), "count": self.count,
                "failures": self.failures, "rejected": self.rejected, "seconds": self.seconds, "pending": self.pending,
                "learning": self.learning, "last_gain": self.last_gain}

    def load_state_dict(self, state: dict) -> None:
        if state.get("monitor") is not None:
            self.monitor.load_state_dict(state["monitor"])
        self.count, self.failures = int(state.get("count", 0)), int(state.get("failures", 0))
        self.rejected = int(state.get("rejected", 0))
        self.seconds, self.pending = float(state.get("seconds", 0.0)), bool(state.get("pending", False))
        self.learning, self.last_gain = int(state.get("learning", 0)), state.get("last_gain")
        self.added_at_refit = 0  # the buffer starts empty again
