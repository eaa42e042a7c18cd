"""Sharded training on CPU for real: DeepSpeed ZeRO-2 / ZeRO-3 (with and without gathering for generation, with
and without zero.Init) under a 2-process ``accelerate launch``, running tests/sharded_grpo_run.py on the nano
policy; and the engine on an FSDP2 (``fully_shard``) model over gloo. Under sharded parameters the engine must keep
both ranks issuing forwards until both are done.

accelerate 1.15 enables FSDP only for GPU-like device types, so an FSDP ``accelerate launch`` on CPU runs unsharded
processes; the FSDP2 test therefore shards with torch directly.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import GenerationConfig

from specroll_trl import SpeculativeHeads
from specroll_trl.engine.generator import SpeculativeGenerator, should_sync  # patched by the sharded test
from specroll_trl.engine.heads import lm_head_shape

from .conftest import left_padded, make_model

ROOT = Path(__file__).resolve().parents[1]
requires_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (pip install '.[deepspeed]')"
)


def test_heads_size_themselves_from_a_zero3_partitioned_lm_head():
    """ZeRO-3 leaves each rank an empty local weight and records the full shape in ``ds_shape``."""
    model = make_model(vocab=40, hidden=32)
    full_shape = tuple(model.lm_head.weight.shape)
    model.lm_head.weight.data = torch.empty(0)
    model.lm_head.weight.ds_shape = torch.Size(full_shape)
    assert lm_head_shape(model.lm_head) == (40, 32)
    heads = SpeculativeHeads.from_model(model, num_heads=2)
    assert (heads.config.vocab_size, heads.config.hidden_size) == (40, 32)
    heads.check_compatible(model)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_sharded_run(config: str, tmp_path, launch_opts=(), script_opts=()) -> list[dict]:
    """Run tests/sharded_grpo_run.py on two CPU processes; returns each rank's record, rank 0 first."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "accelerate_configs" / config), "--main_process_port", str(_free_port()), *launch_opts,
           str(ROOT / "tests" / "sharded_grpo_run.py"), "--output-dir", str(tmp_path / "run"), *script_opts]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    # both ranks share stdout: two records can land on one line, so decode each from its marker on
    records = [json.JSONDecoder().raw_decode(part)[0] for part in proc.stdout.split("SHARDED_RUN ")[1:]]
    assert sorted(r["rank"] for r in records) == [0, 1], proc.stdout[-2000:]
    return sorted(records, key=lambda r: r["rank"])


def check_trained(records: list[dict]) -> None:
    for r in records:
        assert r["world"] == 2 and r["distributed_type"] == "DistributedType.DEEPSPEED"
        assert r["steps"] == 2 and r["finite"] and len(r["losses"]) == 2
        assert len(r["calls"]) == 2 and all(max(c["lengths"]) > 0 for c in r["calls"])
        assert all(tau >= 1.0 for tau in r["taus"])


def check_lockstep(records: list[dict]) -> None:
    """Every generate call: both ranks decided to sync and issued the same number of target forwards."""
    rank0, rank1 = records
    assert all(rank0["synced"]) and all(rank1["synced"])
    for c0, c1 in zip(rank0["calls"], rank1["calls"], strict=True):
        assert c0["forwards"] + c0["sync_forwards"] == c1["forwards"] + c1["sync_forwards"], (c0, c1)


@pytest.mark.slow
@requires_deepspeed
def test_deepspeed_zero2_two_processes(nano, tmp_path):
    records = launch_sharded_run("deepspeed_zero2_cpu.yaml", tmp_path)
    check_trained(records)
    for r in records:  # parameters are replicated: each rank generates alone, no throwaway forwards
        assert not any(r["synced"]) and all(c["sync_forwards"] == 0 for c in r["calls"])


@pytest.mark.slow
@requires_deepspeed
@pytest.mark.parametrize(("zero3_init", "heads"), [("false", "independent"), ("true", "independent"),
                                                   ("false", "path")])
def test_deepspeed_zero3_without_gather_keeps_ranks_in_lockstep(nano, tmp_path, zero3_init, heads):
    """Path heads also read the (partitioned) input embedding while drafting."""
    records = launch_sharded_run("deepspeed_zero3_cpu.yaml", tmp_path, launch_opts=["--zero3_init_flag", zero3_init],
                                 script_opts=["--no-ds3-gather"] + (["--path-heads"] if heads == "path" else []))
    check_trained(records)
    check_lockstep(records)
    # rank 1 drafts nothing and rank 0 does: the rank done first kept stepping, by exactly the ranks' difference
    for c0, c1 in zip(records[0]["calls"], records[1]["calls"]):
        assert c0["sync_forwards"] + c1["sync_forwards"] == abs(c0["forwards"] - c1["forwards"])
    assert sum(c["sync_forwards"] for r in records for c in r["calls"]) > 0
    assert any(c["drafted"] for c in records[0]["calls"]) and not any(c["drafted"] for c in records[1]["calls"])


@pytest.mark.slow
@requires_deepspeed
def test_deepspeed_zero3_with_gather_for_generation(nano, tmp_path):
    records = launch_sharded_run("deepspeed_zero3_cpu.yaml", tmp_path)
    check_trained(records)
    check_lockstep(records)  # ZeRO-3 is detected either way, as transformers' generate does


def _fsdp2_rank(rank: int, port: int, results):
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = make_model(vocab=40, scale=3.0, seed=0)
    heads = SpeculativeHeads.from_model(model, 2)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    # rank 0 stops after 3 tokens, rank 1 generates 25: a rank that stopped forwarding would hang the other
    gc = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=3 if rank == 0 else 25, eos_token_id=None,
                          pad_token_id=0)
    engine = SpeculativeGenerator(model, heads, gc, capacity=16)  # synced_gpus left to auto-detection
    torch.manual_seed(rank)
    ids, mask = left_padded([[5, 6, 7], [8, 9]])
    out = engine.generate(ids, mask)
    results[rank] = (should_sync(model, None), forwards[0], [len(c) for c in out.completion_ids],
                     out.stats.get("sync_forwards", 0))
    dist.destroy_process_group()


def _on_two_ranks(target) -> dict:
    """Run ``target(rank, port, results)`` in two spawned processes (gloo); their ``results`` by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Manager().dict()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0
    return dict(results)


@pytest.mark.slow
def test_fsdp2_fully_shard_on_cpu_keeps_ranks_in_lockstep():
    results = _on_two_ranks(_fsdp2_rank)
    (synced0, forwards0, lengths0, extra0), (synced1, forwards1, lengths1, extra1) = results[0], results[1]
    assert synced0 and synced1  # FSDP2 detected without being told
    assert max(lengths0) <= 3 and max(lengths1) > 10
    assert forwards0 == forwards1 and extra0 > 0 and extra1 == 0


def _refit_rank(rank: int, port: int, results):
    from specroll_trl.adapt.consolidation import ConsolidationCallback, ConsolidationConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = make_model(vocab=40, scale=3.0, seed=0)
    heads = SpeculativeHeads.from_model(model, 2, kind="path")
    callback = ConsolidationCallback(heads, model.lm_head, ConsolidationConfig(
        min_buffer=10, learn_min_new=10, steps=5, holdout_fraction=0.0, mu=0.0, lr=1e-2, seed=rank),
        embed=model.get_input_embeddings())
    gc = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(rank)  # each rank its own rollouts, hence its own buffer
    ids, mask = left_padded([[5 + rank, 6, 7], [8, 9 + rank]])
    SpeculativeGenerator(model, heads, gc, capacity=16, hooks=[callback.capture], candidates="top-k").generate(ids,
                                                                                                            mask)
    if rank == 1:
        callback.buffer.add(callback.buffer.take(torch.arange(len(callback.buffer))))  # rank 1 alone: even more
    callback.on_step_end(None, None, None)
    results[rank] = (callback.learning, {k: v.clone() for k, v in heads.state_dict().items()})
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_refit_leaves_identical_heads_on_every_rank():
    results = _on_two_ranks(_refit_rank)
    (fired0, state0), (fired1, state1) = results[0], results[1]
    assert fired0 == fired1 == 1  # both ranks re-fitted, on rank 0's decision
    assert all(torch.equal(state0[k], state1[k]) for k in state0)
    assert any(v.abs().sum() > 0 for k, v in state0.items() if "outer" in k)  # the re-fit moved the heads
