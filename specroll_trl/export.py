"""Export speculative heads as a vLLM Medusa speculator checkpoint (``specroll-trl export-vllm``).

vLLM's Medusa draft model (``vllm/model_executor/models/medusa.py``, config class in
``vllm/transformers_utils/configs/medusa.py``) computes, for block ``i`` and layer ``j``,
``x = x + SiLU(W_ij x + b_ij)`` on the target's last hidden state and projects every block through an
lm head. That is exactly our head ``i + 1``, so the weights map one to one:

=====================================  ==========================================
ours (``model.safetensors``)           vLLM Medusa checkpoint
=====================================  ==========================================
``heads.{i}.{j}.linear.weight``        ``blocks.{i}.layers.{j}.weight``
``heads.{i}.{j}.linear.bias``          ``blocks.{i}.layers.{j}.bias`` (``medusa_fc_bias: true``)
target ``lm_head.weight`` (shared)     ``lm_heads.0.weight`` (``original_lm_head: true``) or
                                       ``lm_heads.{i}.weight`` for every ``i`` (one copy per head)
draft vocabulary ``draft_ids``           ``token_map`` with ``truncated_vocab_size``, and the
                                       lm head holds only those rows
=====================================  ==========================================

vLLM feeds the blocks the hidden state whose target logits produced the last sampled token ``x_{t+1}`` and
places block ``i``'s argmax at draft position ``i``, i.e. as ``x_{t+2+i}``: our head ``k = i + 1`` predicts
``x_{t+1+k}``, the same token. vLLM's Medusa has no lm-head bias and no draft-side softcapping, so a target
``lm_head`` with a bias is refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .engine.heads import CONFIG_NAME, WEIGHTS_NAME, SpeculativeHeads, is_peft_wrapped, lm_head_of, merged_copy

ADAPTER_CONFIG_NAME = "adapter_config.json"


def export_vllm(
    heads: SpeculativeHeads | nn.Module | str | os.PathLike,
    model: nn.Module | str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    adapter: str | os.PathLike | None = None,
    share_lm_head: bool = True,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``heads`` (+ the target's ``lm_head``) as a vLLM Medusa speculator folder and return it.

    Args:
        heads: a :class:`SpeculativeHeads`, a PEFT model wrapping one (adapters are merged into a copy; the
            argument is left untouched), or a heads folder written by ``save_pretrained`` (e.g. a checkpoint's
            ``spec_heads/``).
        model: the target policy (a HF causal LM module) or its HF folder. Only its ``lm_head`` is read.
        out_dir: the folder to write ``config.json`` + ``model.safetensors`` to.
        adapter: a PEFT LoRA adapter folder to load onto ``heads`` and merge before export.
        share_lm_head: write the ``lm_head`` once with ``original_lm_head: true`` (vLLM shares it across heads);
            ``False`` writes one copy per head, the layout of checkpoints trained with their own lm heads.
        dtype: dtype of the written tensors (default: the target ``lm_head``'s).
        overwrite: replace an existing export in ``out_dir`` (anything else in the folder is still refused).
    """
    heads = _merged_heads(_load_heads(heads), adapter)
    if heads.reads_path:
        raise ValueError("vLLM's Medusa speculator runs independent heads only; these heads are path-conditioned "
                         "(kind='path') and cannot be exported")
    lm_weight = _lm_head_weight(model)
    vocab, hidden = lm_weight.shape
    if hidden != heads.config.hidden_size:
        raise ValueError(f"heads expect hidden size {heads.config.hidden_size} but the model's lm_head takes {hidden}")
    if vocab != heads.config.vocab_size:
        raise ValueError(f"heads were built for vocab size {heads.config.vocab_size} but the model's lm_head has "
                         f"{vocab}")
    dtype = dtype or lm_weight.dtype
    out = _prepare_out_dir(Path(out_dir), overwrite)

    state = heads.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for i in range(heads.config.num_heads):
        for j in range(heads.config.num_layers):
            for kind in ("weight", "bias"):
                tensors[f"blocks.{i}.layers.{j}.{kind}"] = state[f"heads.{i}.{j}.linear.{kind}"]
    lm_names = ["lm_heads.0.weight"] if share_lm_head else [f"lm_heads.{i}.weight" for i in range(heads.num_heads)]
    draft_ids = getattr(heads, "draft_ids", None)
    for name in lm_names:  # a draft vocabulary exports as vLLM's truncated vocabulary: its rows plus the id map
        tensors[name] = lm_weight if draft_ids is None else lm_weight[draft_ids.cpu()]
    tensors = {name: t.detach().to(device="cpu", dtype=dtype).contiguous().clone() for name, t in tensors.items()}
    if draft_ids is not None:
        tensors["token_map"] = draft_ids.detach().cpu().long().contiguous().clone()
    save_file(tensors, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(medusa_config(heads, dtype, share_lm_head), indent=2) + "\n")
    return out


def medusa_config(heads: SpeculativeHeads, dtype: torch.dtype, share_lm_head: bool) -> dict:
    """The ``config.json`` vLLM's ``MedusaConfig`` reads. Its loader renames every key containing ``num`` and
    ``heads``/``layers`` to ``num_heads``/``num_hidden_layers``, so no other key may contain ``num``."""
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": heads.config.hidden_size,
        "vocab_size": heads.config.vocab_size,
        "num_heads": heads.config.num_heads,
        "num_hidden_layers": heads.config.num_layers,
        "truncated_vocab_size": heads.config.draft_vocab_size or heads.config.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": share_lm_head,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _load_heads(heads) -> nn.Module:
    if isinstance(heads, nn.Module):
        return heads
    path = Path(heads)
    if not path.is_dir():
        raise FileNotFoundError(f"heads folder {str(path)!r} does not exist")
    if not (path / CONFIG_NAME).is_file() and (path / ADAPTER_CONFIG_NAME).is_file():
        raise ValueError(f"{str(path)!r} holds a PEFT adapter, not heads: pass the base heads folder as heads and "
                         f"this folder as adapter")
    return SpeculativeHeads.from_pretrained(path)


def _merged_heads(heads: nn.Module, adapter) -> SpeculativeHeads:
    """Plain :class:`SpeculativeHeads` on CPU with any LoRA merged in (a copy; the caller's object is untouched)."""
    if adapter is not None and is_peft_wrapped(heads):
        raise ValueError("an adapter folder can only be merged onto plain SpeculativeHeads, not onto an already "
                         f"wrapped {type(heads).__name__}")
    heads = merged_copy(heads).cpu()
    if adapter is not None:
        from peft import PeftModel

        if not (Path(adapter) / ADAPTER_CONFIG_NAME).is_file():
            raise FileNotFoundError(f"adapter folder {str(adapter)!r} has no {ADAPTER_CONFIG_NAME}")
        heads = PeftModel.from_pretrained(heads, str(adapter)).merge_and_unload()
    if not isinstance(heads, SpeculativeHeads):
        raise TypeError(f"expected SpeculativeHeads (optionally PEFT-wrapped), got {type(heads).__name__}")
    return heads


def _lm_head_weight(model) -> torch.Tensor:
    """The target's ``lm_head`` weight ``[V, D]``; for a folder, read from its safetensors without loading the
    whole model when the checkpoint stores an untied ``lm_head.weight``."""
    if isinstance(model, nn.Module):
        lm_head = lm_head_of(model)
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("the model's lm_head has a bias, which vLLM's Medusa lm heads cannot hold")
        return lm_head.weight
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} does not exist or has no config.json")
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if "lm_head.weight" in f.keys():
                if "lm_head.bias" in f.keys():
                    raise ValueError(f"{file} has an lm_head.bias, which vLLM's Medusa lm heads cannot hold")
                return f.get_tensor("lm_head.weight")
    from transformers import AutoModelForCausalLM  # tied embeddings or another layout: let transformers resolve it

    return _lm_head_weight(AutoModelForCausalLM.from_pretrained(str(path), dtype="auto", local_files_only=True))


def _prepare_out_dir(out: Path, overwrite: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"export target {str(out)!r} is a file")
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [name for name in present if name not in (CONFIG_NAME, WEIGHTS_NAME)]
    if foreign:
        raise FileExistsError(f"export folder {str(out)!r} holds other files ({foreign}); vLLM would load every "
                              f"*.safetensors in it, so export into an empty folder")
    if present and not overwrite:
        raise FileExistsError(f"export folder {str(out)!r} already holds an export; pass overwrite=True "
                              f"(--overwrite) to replace it")
    out.mkdir(parents=True, exist_ok=True)
    return out
