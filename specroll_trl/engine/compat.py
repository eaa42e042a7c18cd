"""What the engine can run on: models whose attention takes a 4D tree mask over a full-attention cache, and
ranks that must step in lockstep when parameters are sharded."""

from __future__ import annotations

import torch

SUPPORTED_ATTENTION = ("eager", "sdpa")
# Layer kinds whose cache cannot hold a ragged tree (windowed, chunked or recurrent state); MLP/MoE kinds are fine.
UNSUPPORTED_LAYER_KINDS = ("sliding", "chunk", "linear", "mamba", "recurrent", "ssm", "conv")


def check_model_supported(model) -> None:
    """Raise ``ValueError`` if the model cannot run tree verification with a 4D mask over a DynamicCache."""
    config = model.config
    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"attention implementation {attn!r} cannot take the 4D tree mask; load the model with "
            f"attn_implementation in {SUPPORTED_ATTENTION}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder models are not supported by the speculative engine")
    layer_types = getattr(config, "layer_types", None) or []
    odd = sorted({t for t in layer_types if any(k in str(t) for k in UNSUPPORTED_LAYER_KINDS)})
    if odd:
        raise ValueError(f"layer types {odd} (sliding-window or recurrent) are not supported; need full attention")
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise ValueError("sliding-window attention is not supported by the speculative engine")


def should_sync(model, requested: bool | None) -> bool:
    """Whether ranks must stay in lockstep (sharded parameters gathered inside every forward)."""
    if requested is not None:
        return requested
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)


def any_rank_active(local_active: bool, device) -> bool:
    """All-reduce (max) of "this rank still has rows", so finished ranks keep stepping with the others."""
    flag = torch.tensor([1.0 if local_active else 0.0], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item() > 0)
