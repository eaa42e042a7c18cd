"""``grouped_attention``: a tree forward's attention reads grouped key/value heads where they are, not copied.

With a mask and more than one query token, transformers' SDPA path copies every layer's cached keys and values once
per query head of a group (``repeat_kv``) before calling ``F.scaled_dot_product_attention``, because CUDA's fused
kernels take no mask with grouped heads. A verification forward always has a mask, so on a policy with grouped-query
attention (SmolLM2: 9 query heads over 3 key/value heads) every drafted step copied the whole cache twice per layer:
60 copies a step, 3-9% of a drafted step's time at one and eight rows (``benchmarks/README.md``, "Grouped key/value
heads read in place"). On CPU torch's own attention kernel takes the mask with grouped heads (``enable_gqa=True``)
and returns bitwise the same output, so inside ``grouped_attention(model)`` the model's SDPA layers run that call
there; everything else (one query token, which transformers already packs; other devices; a position bias or a soft
cap; eager attention) goes through transformers' own function unchanged.

It is the model's ``config._attn_implementation`` that names the attention function its layers call (and the mask
function that turns a 2D padding mask into theirs), so both are registered under ``ATTENTION_NAME``, and the engine
names it for one generation call: the trainer's forwards, and any other model, keep transformers' own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn import functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "specroll_grouped_sdpa"


def grouped_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa_attention_forward``, except that a masked CPU attention over several query tokens and
    grouped key/value heads passes the groups to the kernel instead of copying the keys and values."""
    grouped = (getattr(module, "num_key_value_groups", 1) > 1 and query.shape[2] > 1 and query.device.type == "cpu"
               and isinstance(attention_mask, torch.Tensor) and kwargs.get("position_bias") is None
               and kwargs.get("softcap") is None)
    if not grouped:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # a 2D padding mask becomes what SDPA layers take


@contextmanager
def grouped_attention(model: torch.nn.Module) -> Iterator[None]:
    """Inside, a model loaded with ``attn_implementation="sdpa"`` computes attention with ``grouped_sdpa_forward``;
    any other implementation is left alone."""
    config = model.config
    if config._attn_implementation != "sdpa":
        yield
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
