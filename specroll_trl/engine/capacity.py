"""The node budget: how many draft nodes per row a step may verify, and the hardware capacity ``C_hw`` behind it."""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from .heads import lm_head_of, lm_head_shape


def node_budget(capacity: int, active_rows: int, max_nodes: int) -> int:
    """``N_t = clamp(floor(C_hw / B_t) - 1, 0, N_max)``: draft nodes per row besides the root."""
    if active_rows <= 0:
        return 0
    return max(0, min(capacity // active_rows - 1, max_nodes))


@torch.no_grad()
def profile_capacity(model, batch_size: int = 8, context: int = 128, eps: float = 0.3, max_tokens: int = 64,
                     repeats: int = 7) -> int:
    """``C_hw``: the largest total query-token count per forward whose latency stays within ``1 + eps`` of a
    one-token-per-row forward (``batch_size`` rows, ``context`` cached tokens)."""
    device = next(model.parameters()).device
    vocab = lm_head_shape(lm_head_of(model))[0]
    prompt = torch.randint(0, vocab, (batch_size, context), device=device)

    def latency(k: int) -> float:
        times = []
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(input_ids=prompt, cache=cache, use_cache=True)
            ids = torch.randint(0, vocab, (batch_size, k), device=device)
            pos = torch.arange(context, context + k, device=device).expand(batch_size, -1)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)  # the least disturbed run: other load on the machine only ever adds time

    # Every k is measured (no early exit) so all ranks run the same number of forwards.
    sizes = [2**i for i in range(max_tokens.bit_length()) if 2**i <= max_tokens]
    latency(1)  # warm-up
    times = {k: latency(k) for k in sizes}
    best = 1
    for k in sizes[1:]:  # the largest width whose every smaller width also stays cheap (noise can't skip ahead)
        if times[k] > (1 + eps) * times[1]:
            break
        best = k
    return best * batch_size
