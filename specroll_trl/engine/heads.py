"""Medusa-style speculative heads, of two kinds.

Head ``k`` (1-based) predicts token ``x_{t+1+k}`` with ``lm_head(z_k)`` from the target's final hidden state
``h_t`` (input of ``lm_head``):

* ``kind="independent"`` (Medusa): ``z_k = h_t + SiLU(W_k h_t + b_k)`` (``num_layers`` such residual blocks); every
  head reads only ``h_t``, so all run at once.
* ``kind="path"`` (Hydra): head ``k`` also reads the input embeddings ``e`` of the tokens before its target on the
  path, ``x_{t+1..t+k}`` (the root ``x_{t+1}`` included): ``z_k = h_t + U_k SiLU(W_k [h_t; e_1; ...; e_k] + b_k)``.
  The tree then grows depth by depth (``tree.grow_tree``), each depth's head run once over that depth's frontier.

The target's ``lm_head`` (and, for path heads, its input embedding) is shared, never copied, never trained here,
and the heads live outside the policy module. The last linear of every head starts at zero, so an untrained head
reproduces the base next-token distribution.

With a draft vocabulary (``draft_ids``, the target ids the heads may propose, as EAGLE-3 drafts over a reduced
vocabulary) the heads project through only those rows of ``lm_head``: on a 49k-token vocabulary the full
projection would cost about as much as the target's own forward. Candidates are mapped back to target ids, so
verification, and what is emitted, never see the draft vocabulary.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F

from .compat import is_partitioned

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass
class SpeculativeHeadsConfig:
    """Shape of a set of heads.

    Args:
        num_heads: number of heads ``H``; head ``k`` predicts the token ``k`` places after the next one.
        hidden_size: the target's hidden size (input and output size of every block).
        vocab_size: rows of the target's ``lm_head``; checked against the model.
        num_layers: residual SiLU blocks per independent head (path heads have one block each: 1 only).
        draft_vocab_size: size of the draft vocabulary the heads propose from (0: the whole vocabulary).
        kind: ``"independent"`` (each head reads ``h_t``) or ``"path"`` (head ``k`` also reads the embeddings of
            the ``k`` path tokens before its target).
        temperature: the sampling temperature of the target distributions the heads were fitted to (``None``:
            unknown). The engine rescales the heads' logits by ``temperature / T`` for a run sampling at ``T``, so
            their probabilities, which rank every tree node against the others, estimate acceptance at ``T``.
    """

    num_heads: int = 4
    hidden_size: int = 0
    vocab_size: int = 0
    num_layers: int = 1
    draft_vocab_size: int = 0
    kind: str = "independent"
    temperature: float | None = None

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"SpeculativeHeadsConfig.kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        for name in ("num_heads", "hidden_size", "vocab_size", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SpeculativeHeadsConfig.{name} must be a positive int, got {value!r}")
        if self.temperature is not None and not (isinstance(self.temperature, (int, float)) and self.temperature > 0):
            raise ValueError(f"SpeculativeHeadsConfig.temperature must be > 0 or None, got {self.temperature!r}")
        if not isinstance(self.draft_vocab_size, int) or not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"SpeculativeHeadsConfig.draft_vocab_size must be an int in [0, vocab_size], got "
                             f"{self.draft_vocab_size!r}")


class ResidualSiLUBlock(nn.Module):
    """``x + SiLU(W x + b)`` with ``W, b`` zero-initialised."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class IndependentHead(nn.Sequential):
    """``num_layers`` residual SiLU blocks over ``h``: one head of the independent kind (it reads no path)."""

    reads_path = False

    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__(*(ResidualSiLUBlock(hidden_size) for _ in range(num_layers)))

    @classmethod
    def for_depth(cls, config: SpeculativeHeadsConfig, depth: int) -> IndependentHead:
        return cls(config.hidden_size, config.num_layers)

    def forward(self, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(hidden)


class PathConditionedHead(nn.Module):
    """``h + U SiLU(W [h; e_1; ...; e_k] + b)``: one head of the path kind, reading ``h`` and ``k`` path embeddings.
    ``U`` starts at zero (the head starts as the base next-token distribution) and, unlike a residual SiLU block, can
    move ``z`` away from ``h``'s own next-token direction."""

    reads_path = True

    def __init__(self, hidden_size: int, path_length: int):
        super().__init__()
        self.path_length = path_length
        self.inner = nn.Linear((path_length + 1) * hidden_size, hidden_size)
        self.outer = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.outer.weight)
        nn.init.zeros_(self.outer.bias)

    @classmethod
    def for_depth(cls, config: SpeculativeHeadsConfig, depth: int) -> PathConditionedHead:
        if config.num_layers != 1:
            raise ValueError(f"SpeculativeHeadsConfig.num_layers={config.num_layers}: path-conditioned heads have one "
                             "block each (num_layers=1); more layers exist for independent heads only")
        return cls(config.hidden_size, depth)

    def forward(self, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [..., D]``, ``path [..., k, D]`` (at least ``k`` embeddings; the first ``k`` are read)."""
        if path is None:
            raise ValueError("path-conditioned heads need the embeddings of the path tokens (`path`)")
        inputs = torch.cat([hidden, path[..., : self.path_length, :].flatten(-2)], dim=-1)
        return hidden + self.outer(F.silu(self.inner(inputs)))


HEAD_MODULES = {"independent": IndependentHead, "path": PathConditionedHead}  # kind -> one head's module
HEAD_KINDS = tuple(HEAD_MODULES)


class SpeculativeHeads(nn.Module):
    """``H`` heads over a shared, external ``lm_head`` (``config.kind``: independent or path-conditioned)."""

    def __init__(self, config: SpeculativeHeadsConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(HEAD_MODULES[config.kind].for_depth(config, k)
                                   for k in range(1, config.num_heads + 1))
        # the draft vocabulary's target ids (saved with the weights), or None: the whole vocabulary
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def reads_path(self) -> bool:
        """Whether head ``k`` reads the embeddings of the path tokens before its target (``kind="path"``)."""
        return HEAD_MODULES[self.config.kind].reads_path

    @classmethod
    def from_model(cls, model: nn.Module, num_heads: int = 4, num_layers: int = 1,
                   draft_ids: torch.Tensor | list[int] | None = None, kind: str = "independent") -> SpeculativeHeads:
        """Heads sized for ``model`` (a HF causal LM) that start as its next-token distribution, on its device and
        dtype; ``draft_ids``: the target ids of a draft vocabulary (distinct), or ``None`` for the whole vocabulary;
        ``kind``: ``"independent"`` or ``"path"``."""
        lm_head = lm_head_of(model)
        vocab, hidden = lm_head_shape(lm_head)
        ids = None if draft_ids is None else torch.as_tensor(draft_ids, dtype=torch.long).flatten()
        config = SpeculativeHeadsConfig(num_heads=num_heads, hidden_size=hidden, vocab_size=vocab,
                                        num_layers=num_layers, draft_vocab_size=0 if ids is None else len(ids),
                                        kind=kind)
        heads = cls(config)
        if ids is not None:
            heads.draft_ids.copy_(ids)
            heads.check_draft_ids()
        return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype)

    def check_draft_ids(self) -> None:
        """Raise ``ValueError`` unless the draft vocabulary holds distinct ids of the target's vocabulary."""
        ids = self.draft_ids
        if ids is None:
            return
        if bool(((ids < 0) | (ids >= self.config.vocab_size)).any()):
            raise ValueError(f"draft vocabulary ids must lie in [0, {self.config.vocab_size})")
        if len(torch.unique(ids)) != len(ids):
            raise ValueError("draft vocabulary ids must be distinct")

    def projection(self, lm_head: nn.Module, temperature: float | None = None) -> VocabProjection:
        """The projection the heads' logits go through (the shared ``lm_head``, or its draft-vocabulary rows); for
        drafting at sampling ``temperature``, with the logits rescaled from the heads' own fitting temperature to
        it (``None``, or heads of unknown temperature: as fitted)."""
        scale = 1.0
        if temperature is not None and self.config.temperature is not None:
            scale = self.config.temperature / temperature
        return VocabProjection(lm_head, self.draft_ids, scale)

    def check_compatible(self, model: nn.Module) -> None:
        """Raise ``ValueError`` naming the mismatch if these heads cannot run on ``model``."""
        vocab, hidden = lm_head_shape(lm_head_of(model))
        if hidden != self.config.hidden_size:
            raise ValueError(
                f"heads expect hidden size {self.config.hidden_size} but the model's lm_head takes {hidden}"
            )
        if vocab != self.config.vocab_size:
            raise ValueError(
                f"heads were built for vocab size {self.config.vocab_size} but the model's lm_head has {vocab}"
            )

    def forward(self, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [..., D]`` -> per-head hidden states ``z [..., H, D]``. Path heads also need ``path [..., H, D]``:
        the input embeddings of ``x_{t+1..t+H}`` (head ``k`` reads the first ``k``), e.g. the realised tokens when
        training (``adapt.records.record_states``)."""
        return torch.stack([head(hidden, path) for head in self.heads], dim=-2)

    def check_path_source(self, embed: nn.Module | None, what: str) -> None:
        """Raise ``ValueError`` when these heads read their path (``kind="path"``) and ``what`` was given no input
        embedding to read it through (training and re-fitting read the realised path tokens' embeddings)."""
        if self.reads_path and embed is None:
            raise ValueError(f"path-conditioned heads (kind='path') read the input embedding: pass `embed` (the "
                             f"policy's get_input_embeddings()) to {what}")

    def head_state(self, depth: int, hidden: torch.Tensor, path: torch.Tensor | None = None) -> torch.Tensor:
        """Head ``depth``'s (1-based) hidden state: ``hidden [..., D]`` (and for path heads ``path [..., depth, D]``)
        -> ``z [..., D]``."""
        return self.heads[depth - 1](hidden, path)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module, path: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [..., D]`` -> head logits ``[..., H, V]`` through the shared ``lm_head`` (``V``: the draft
        vocabulary's size when the heads have one; ``projection(lm_head).target_ids`` maps the indices back)."""
        return self.projection(lm_head)(self(hidden, path))

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        path = Path(save_directory)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        (path / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    @classmethod
    def from_pretrained(
        cls, directory: str | os.PathLike, device: torch.device | str | None = None, dtype=None
    ) -> SpeculativeHeads:
        """Load heads saved by :meth:`save_pretrained`; refuses missing, truncated or foreign files."""
        path = check_heads_folder(directory)
        config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
        try:
            raw = json.loads(config_file.read_text())
            if not isinstance(raw, dict):
                raise ValueError(f"expected a JSON object, got {type(raw).__name__}")
            names = {f.name for f in fields(SpeculativeHeadsConfig)}
            config = SpeculativeHeadsConfig(**{k: v for k, v in raw.items() if k in names})
        except (json.JSONDecodeError, TypeError, KeyError, ValueError) as err:
            raise ValueError(f"{config_file} is not a valid heads config: {err}") from err
        try:
            state = load_file(str(weights_file))
        except Exception as err:  # safetensors raises its own error types for truncated/foreign files
            raise ValueError(f"{weights_file} is not a readable safetensors file: {err}") from err
        heads = cls(config)
        expected = heads.state_dict()
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"{weights_file} does not match its config: missing {missing}, unexpected {unexpected}")
        for name, tensor in state.items():
            if tensor.shape != expected[name].shape:
                raise ValueError(
                    f"{weights_file}: {name} has shape {tuple(tensor.shape)}, config implies "
                    f"{tuple(expected[name].shape)}"
                )
            if not torch.isfinite(tensor).all():
                raise ValueError(f"{weights_file}: {name} contains NaN or inf")
        heads.load_state_dict(state)
        heads.check_draft_ids()
        return heads.to(device=device, dtype=dtype)


class VocabProjection:
    """The heads' output projection: the target's ``lm_head`` weight (detached: head training never moves it), or
    only its rows for a draft vocabulary, times ``scale`` (a change of temperature). It reads the weight once, so
    build one per ``generate`` call or training run: the policy's ``lm_head`` moves as it trains. ``linear`` is that
    weight as a frozen ``nn.Linear`` (``None`` under ZeRO-3), so the engine can choose its kernel
    (``engine.kernels``)."""

    def __init__(self, lm_head: nn.Module, draft_ids: torch.Tensor | None, scale: float = 1.0):
        self.lm_head, self.draft_ids, self.scale, self._inverse = lm_head, draft_ids, scale, None
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        self.partitioned = is_partitioned(weight)  # ZeRO-3 without a gather (outside the engine: `local_copies`)
        self.linear = None
        if not self.partitioned:
            if draft_ids is not None:
                weight = weight.index_select(0, draft_ids)
                bias = None if bias is None else bias.index_select(0, draft_ids)
            self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            self.linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
            if bias is not None:
                self.linear.bias = nn.Parameter(bias.detach(), requires_grad=False)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.partitioned:
            logits = self.lm_head(z)
            logits = logits if self.draft_ids is None else logits.index_select(-1, self.draft_ids)
        else:
            logits = self.linear(z)
        return logits if self.scale == 1.0 else logits * self.scale

    def target_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Target vocabulary ids of projection indices."""
        return index if self.draft_ids is None else self.draft_ids[index]

    def index_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Projection index of each target id (``-1`` where the draft vocabulary lacks it, or the id is ``-1``)."""
        if self.draft_ids is None:
            return ids
        if self._inverse is None:
            self._inverse = torch.full((lm_head_shape(self.lm_head)[0],), -1, dtype=torch.long,
                                       device=self.draft_ids.device)
            self._inverse[self.draft_ids] = torch.arange(len(self.draft_ids), device=self.draft_ids.device)
        return torch.where(ids >= 0, self._inverse[ids.clamp(min=0)], -1)


def check_heads_folder(directory: str | os.PathLike) -> Path:
    """Raise ``FileNotFoundError`` unless ``directory`` is a folder holding a heads config and weights."""
    path = Path(directory)
    if not path.exists():
        raise FileNotFoundError(f"heads folder {str(path)!r} does not exist")
    if not path.is_dir():
        raise FileNotFoundError(f"heads path {str(path)!r} is a file, not a heads folder "
                                f"(expected a folder with {CONFIG_NAME} and {WEIGHTS_NAME})")
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (path / name).is_file():
            raise FileNotFoundError(f"heads folder {str(path)!r} has no {name}")
    return path


def lm_head_of(model: nn.Module) -> nn.Module:
    """The model's output projection, shared by every head."""
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if lm_head is None or not hasattr(lm_head, "weight") or len(lm_head_shape(lm_head)) != 2:
        raise ValueError(f"{type(model).__name__} has no linear output embedding (lm_head) to share with heads")
    return lm_head


def lm_head_shape(lm_head: nn.Module) -> tuple[int, ...]:
    """``(vocab, hidden)`` of the lm_head's weight, also while DeepSpeed ZeRO-3 holds it partitioned (its local
    ``shape`` is then ``(0,)`` and the full one is ``ds_shape``)."""
    return tuple(getattr(lm_head.weight, "ds_shape", lm_head.weight.shape))


ADAPTER_SUBDIR = "adapter"


def is_peft_wrapped(heads: nn.Module) -> bool:
    return hasattr(heads, "peft_config") and hasattr(heads, "merge_and_unload")


def merged_copy(heads: nn.Module) -> nn.Module:
    """A copy of ``heads`` with any PEFT LoRA adapters merged in (the caller's object is untouched)."""
    import copy

    heads = copy.deepcopy(heads)
    return heads.merge_and_unload() if is_peft_wrapped(heads) else heads


def save_heads(heads: nn.Module, directory: str | os.PathLike) -> None:
    """Save plain heads with ``save_pretrained``. PEFT-wrapped heads: the merged heads (loadable by
    ``SpeculativeHeads.from_pretrained`` and ``export-vllm``) plus the adapter alone in ``adapter/``."""
    if not is_peft_wrapped(heads):
        heads.save_pretrained(directory)
        return
    merged_copy(heads).save_pretrained(directory)
    heads.save_pretrained(str(Path(directory) / ADAPTER_SUBDIR))


def read_adapter_state(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapter weights :func:`save_heads` wrote for PEFT-wrapped heads (safetensors, finite)."""
    weights = Path(directory) / ADAPTER_SUBDIR / "adapter_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"PEFT heads checkpoint {str(directory)!r} has no {ADAPTER_SUBDIR}/{weights.name}")
    try:
        state = load_file(str(weights))
    except Exception as err:
        raise ValueError(f"{weights} is not a readable safetensors file: {err}") from err
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"{weights}: {bad[0]} contains NaN or inf")
    return state


def apply_adapter_state(heads: nn.Module, state: dict[str, torch.Tensor],
                        draft_ids: torch.Tensor | None = None) -> None:
    """Load adapter weights into PEFT-wrapped heads, and ``draft_ids`` (the merged checkpoint's: the slow path may
    have refreshed the draft vocabulary, which lives outside the adapter)."""
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(heads, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"adapter checkpoint does not match the heads' adapters: unexpected {result.unexpected_keys}")
    if draft_ids is not None and heads.draft_ids is not None:
        if draft_ids.shape != heads.draft_ids.shape:
            raise ValueError(f"checkpoint draft vocabulary has {len(draft_ids)} ids, the heads {len(heads.draft_ids)}")
        heads.draft_ids.copy_(draft_ids)
