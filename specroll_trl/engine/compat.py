"""What the engine can run on: models whose attention takes a 4D tree mask over a full-attention cache, and
ranks that must step in lockstep when parameters are sharded."""

from __future__ import annotations

import copy
from collections import OrderedDict

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


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether DeepSpeed ZeRO-3 holds ``param`` partitioned (each rank an empty local tensor, the shape in
    ``ds_shape``)."""
    return hasattr(param, "ds_shape") and param.numel() == 0


def local_copies(*modules: torch.nn.Module | None) -> list[torch.nn.Module | None]:
    """``modules`` as drafting reads them: a module whose own weights DeepSpeed ZeRO-3 holds partitioned is replaced
    by a frozen copy holding them whole (gathered once, here); any other module is returned as it is.

    Calling a partitioned module gathers its weights inside the call, a collective every rank must join: with the
    heads reading ``lm_head`` (and path heads the input embedding) through such calls, a rank that drafts in a step
    where another does not (its own budget, or no rows left) would wait forever. With the copies, drafting is
    local and the ranks meet only in the target's forwards. A collective itself: every rank calls it at the same
    point of ``generate``. Costs one copy of those weights for the call (shared between tied modules)."""
    partitioned = {id(p): p for m in modules if m is not None for p in m.parameters(recurse=False)
                   if is_partitioned(p)}
    if not partitioned:
        return list(modules)
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(partitioned.values()), modifier_rank=None):
        whole = {key: torch.nn.Parameter(p.detach().clone(), requires_grad=False) for key, p in partitioned.items()}
    return [_with_parameters(m, whole) if m is not None and any(id(p) in whole for p in m.parameters(recurse=False))
            else m for m in modules]


def _with_parameters(module: torch.nn.Module, whole: dict[int, torch.nn.Parameter]) -> torch.nn.Module:
    """A shallow copy of ``module`` (its own class and ``forward``, buffers shared) with ``whole``'s parameters in
    place of the partitioned ones and none of the hooks that would gather them."""
    local = copy.copy(module)
    local._parameters = {name: whole.get(id(p), p) for name, p in module._parameters.items()}
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_hooks",
                  "_backward_pre_hooks"):
        if hasattr(local, hooks):
            setattr(local, hooks, OrderedDict())
    local.__dict__.pop("forward", None)  # an instance forward (a wrapper's) would call the original module
    return local
