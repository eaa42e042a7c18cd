"""Ranks stay in lockstep under sharded parameters: two gloo processes issue the same number of forwards."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import GenerationConfig

from specroll_trl.engine.generator import SpeculativeGenerator
from specroll_trl.engine.heads import SpeculativeHeads

from .conftest import left_padded, make_model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, synced: bool, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = make_model(vocab=40, scale=3.0, seed=0)
    heads = SpeculativeHeads.from_model(model, 2)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    # rank 0 stops after 3 tokens, rank 1 generates 25: without syncing their forward counts differ
    gc = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=3 if rank == 0 else 25, eos_token_id=None,
                          pad_token_id=0)
    eng = SpeculativeGenerator(model, heads, gc, capacity=16, synced_gpus=synced)
    torch.manual_seed(rank)
    ids, mask = left_padded([[5, 6, 7], [8, 9]])
    out = eng.generate(ids, mask)
    results[(synced, rank)] = (forwards[0], [len(c) for c in out.completion_ids])
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("synced", [True, False])
def test_ranks_issue_the_same_number_of_forwards_when_synced(synced):
    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    results = manager.dict()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, synced, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
        assert p.exitcode == 0
    (f0, lens0), (f1, lens1) = results[(synced, 0)], results[(synced, 1)]
    assert max(lens0) <= 3 and max(lens1) > 10  # each rank's own rows are unaffected by the syncing
    if synced:
        assert f0 == f1
    else:
        assert f0 < f1
