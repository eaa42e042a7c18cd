"""Packed linear kernels (``engine.kernels``): same numbers as ``F.linear`` to float rounding, repacked when the
weights move, chosen per layer and bucket of query rows by what the engine's own forwards measure, and the exactness
proofs (greedy identity, chi-square) hold with every forward forced through them."""

import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationConfig

from specroll_trl.engine import SpeculativeGenerator, SpeculativeHeads
from specroll_trl.engine import kernels as kernels_mod
from specroll_trl.engine.kernels import (
    TRIALS,
    LinearKernels,
    kernels_of,
    packed_kernel_available,
    rows_bucket,
    siblings_shape,
)
from specroll_trl.engine.streamed import MAX_ROWS, streamed_kernel_available, streamed_linear, streamed_linears

from .conftest import left_padded, make_model, native_kernel_unbuilt
from .test_engine import (
    PROMPTS,
    chi_square_pvalue,
    engine_samples,
    exact_completion_distribution,
    generate_reference,
    noisy_heads,
)

pytestmark = pytest.mark.skipif(not packed_kernel_available(), reason="this torch build has no oneDNN")
needs_streamed = pytest.mark.skipif(not streamed_kernel_available(), reason="no C++ compiler built the streamed kernel")


class Always(dict):
    """A choice for every weight shape and bucket not set otherwise (the heads' and their projection's included)."""

    def __init__(self, packed: bool):
        super().__init__()
        self.packed = packed

    def get(self, key, default=None):
        return super().get(key, self.packed)


def choose(kernels: LinearKernels, packed: bool, rows=None) -> None:
    """``packed`` for every shape and row count, or (``rows``) for the model's shapes at those rows' buckets."""
    if rows is None:
        kernels.choice = Always(packed)
    else:
        kernels.choice.update({(s, rows_bucket(r)): packed for s in shapes_of(kernels) for r in rows})


def shapes_of(kernels: LinearKernels) -> set:
    return {siblings_shape(unit) for unit in kernels.units()}


def learnt(model) -> LinearKernels:
    """The model's kernels once a forward (a prefill's, outside any ``forward(rows)`` block) showed its siblings."""
    kernels = LinearKernels(model)
    with kernels.active():
        logits(model, torch.tensor([[1, 2, 3]]))
    assert kernels.siblings and len(kernels.units()) < len(kernels.modules)
    return kernels


def force(monkeypatch, model, kernel: str) -> list[int]:
    """Every forward of ``model`` through ``kernel`` (``packed``; ``padded``, every call's rows padded; or
    ``streamed`` in chunks of its most rows), whatever its row count (the proofs' worst case); returns the row counts
    of the kernel's calls."""
    calls = []
    monkeypatch.setattr(kernels_mod, "MAX_PACKED_ROWS", 1 << 20)
    if kernel in ("packed", "padded"):
        name = f"{kernel}_linear"
        if kernel == "padded":  # every call padded, the proofs' thousands of rows too
            monkeypatch.setattr(kernels_mod, "PADDED_ROWS", 1 << 16)
        linear = getattr(kernels_mod, name)

        def counted(x, packed, bias):
            calls.append(x.numel() // x.shape[-1])
            return linear(x, packed, bias)

        monkeypatch.setattr(kernels_mod, name, counted)
        kernels_of(model).choice = Always(kernels_mod.PACKED if kernel == "packed" else kernels_mod.PADDED)
        return calls

    def chunked(x, weights, biases):
        rows = x.reshape(-1, x.shape[-1])
        calls.append(len(rows))
        chunks = [streamed_linears(chunk, weights, biases) for chunk in rows.split(MAX_ROWS)]
        return [torch.cat(parts).view(*x.shape[:-1], -1) for parts in zip(*chunks)]

    monkeypatch.setattr(kernels_mod, "MAX_STREAMED_ROWS", 1 << 20)
    monkeypatch.setattr(kernels_mod, "streamed_linears", chunked)
    kernels_of(model).choice = Always(kernels_mod.STREAMED)
    return calls


FORCED = ["packed", "padded", pytest.param("streamed", marks=needs_streamed)]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_packed_forward_matches_f_linear_and_restores_the_modules():
    model = make_model(vocab=64, hidden=64)
    ids = torch.randint(0, 64, (2, 7))
    reference = logits(model, ids)
    kernels = learnt(model)
    assert len(kernels.modules) == len([m for m in model.modules() if isinstance(m, nn.Linear)])
    choose(kernels, True, [14])
    with kernels.active(), kernels.forward(14):
        assert kernels.bucket == 16
        packed = logits(model, ids)
    torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in kernels.modules)
    with pytest.raises(RuntimeError, match="boom"), kernels.active(), kernels.forward(14):
        raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in kernels.modules) and kernels.bucket is None


def test_padded_kernel_matches_f_linear_and_returns_only_the_rows_asked():
    """Fewer rows than ``PADDED_ROWS`` are computed padded with zeros, the padding's outputs dropped (the rows kept
    are a view of the product's first rows); more rows are computed as they are."""
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 3)
    for shape in [(1, 24), (1, 1, 24), (3, 24), (1, 2, 24), (2, 3, 24), (5, 24)]:
        x = torch.randn(shape)
        out = kernels_mod.padded_linear(x, packed, bias)
        assert out.shape == (*shape[:-1], 40) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_siblings_are_the_layers_a_forward_calls_on_one_input():
    """Query, key and value projections, and an MLP's gate and up projections, read the same tensor: each set is
    computed as one product over their stacked weights when packed; the rest stay alone."""
    model = make_model(layers=2)
    kernels = learnt(model)
    expected = [(a.q_proj, a.k_proj, a.v_proj) for a in (layer.self_attn for layer in model.model.layers)]
    expected += [(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in model.model.layers]
    assert set(kernels.siblings.values()) == set(expected)
    assert len(kernels.units()) == len(kernels.modules) - 2 * 3  # per layer 7 layers in 4 products


class TwoReaders(nn.Module):
    """Two linears on one input, unless told to give the second another input or to change the input in place
    between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 5), nn.Linear(8, 3, bias=False)
        self.other_input = self.in_place = False

    def forward(self, x):
        first = self.a(x)
        if self.in_place:
            x.mul_(2)
        return first, self.b(x + 1 if self.other_input else x)


@pytest.mark.parametrize("change", ["other_input", "in_place"])
def test_a_sibling_that_does_not_read_its_first_sibling_s_input_computes_alone(change):
    module = TwoReaders()
    kernels = LinearKernels(module)
    x = torch.randn(5, 8)
    with torch.no_grad(), kernels.active():
        module(x)
    assert kernels.siblings == {module.a: (module.a, module.b), module.b: (module.a, module.b)}
    choose(kernels, True)
    with torch.no_grad(), kernels.active(), kernels.forward(5):
        together = module(x.clone())
        setattr(module, change, True)
        apart = module(x.clone())
    expected = x * 2 if change == "in_place" else x + 1
    torch.testing.assert_close(together[1], F.linear(x, module.b.weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apart[1], F.linear(expected, module.b.weight), rtol=1e-5, atol=1e-5)
    assert kernels.stash == {}


def test_weights_changed_through_data_are_repacked():
    model = make_model(vocab=48, hidden=32)
    ids = torch.randint(0, 48, (1, 5))
    kernels = learnt(model)
    choose(kernels, True, [5])
    with kernels.active(), kernels.forward(5):
        logits(model, ids)
    with torch.no_grad():  # a trainer's update: through .data, which leaves the version counter alone
        for p in model.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
    reference = logits(model, ids)
    with kernels.active(), kernels.forward(5):
        packed = logits(model, ids)
    torch.testing.assert_close(packed, reference, rtol=1e-4, atol=1e-4)
    assert kernels.pack_seconds > 0


def test_only_layers_that_run_packed_are_packed_and_only_during_the_call(monkeypatch):
    model = make_model(vocab=48, hidden=32)
    kernels = learnt(model)
    choose(kernels, False)
    choose(kernels, True, [5])
    packing = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, *a: packing.append(w) or reorder(w, *a))
    with kernels.active():
        with kernels.forward(1):
            logits(model, torch.randint(0, 48, (1, 1)))
        assert packing == [] and kernels.packed == {}  # F.linear chosen at one row: nothing packed
        with kernels.forward(5):
            logits(model, torch.randint(0, 48, (1, 5)))
            logits(model, torch.randint(0, 48, (1, 5)))
        assert len(packing) == len(kernels.units()) == len(kernels.packed)  # once per layer or siblings per call
    assert kernels.packed == {}  # dropped: no second copy while the trainer trains


def slowed(calls: list, kernel, name: str, seconds):
    """``kernel`` recording ``name`` in ``calls`` and sleeping ``seconds(name)`` first."""
    def run(*args):
        calls.append(name)
        time.sleep(seconds(name))
        return kernel(*args)
    return run


def slow_but(monkeypatch, fast: str, calls: list, seconds: float = 0.01) -> None:
    """Every kernel records its calls in ``calls``; all but ``fast`` sleep ``seconds`` first."""
    delay = lambda name: 0 if name == fast else seconds  # noqa: E731
    monkeypatch.setattr(kernels_mod, "packed_linear", slowed(calls, kernels_mod.packed_linear, "packed", delay))
    monkeypatch.setattr(kernels_mod, "streamed_linears", slowed(calls, kernels_mod.streamed_linears, "streamed", delay))
    monkeypatch.setattr(kernels_mod, "padded_linear", slowed(calls, kernels_mod.padded_linear, "padded", delay))
    monkeypatch.setattr(kernels_mod, "F", SimpleNamespace(linear=slowed(calls, F.linear, "f_linear", delay)))


KERNEL_NAMES = {kernels_mod.LINEAR: "f_linear", kernels_mod.PACKED: "packed", kernels_mod.STREAMED: "streamed",
                kernels_mod.PADDED: "padded"}


@pytest.mark.parametrize("fast", [pytest.param(name, marks=needs_streamed) if name == "streamed" else name
                                  for name in KERNEL_NAMES.values()])
def test_each_layer_keeps_the_fastest_kernel_per_bucket_of_rows(monkeypatch, fast):
    """The forwards in a bucket take the kernels in turn for a weight shape's layers until each has run ``TRIALS``
    forwards; the fastest is kept from then on by every layer of that shape."""
    calls = []
    slow_but(monkeypatch, fast, calls)  # 10 ms: far above any kernel here on a loaded machine
    model = make_model()
    ids = torch.randint(0, 32, (1, 3))
    kernels = learnt(model)
    layers, shapes = len(kernels.modules), len(shapes_of(kernels))
    assert shapes < len(kernels.units()) < layers  # the two decoder layers share their shapes
    candidates = kernels.candidates(3)
    with kernels.active():
        for _ in range(len(candidates) * TRIALS + 1):
            with kernels.forward(3):
                logits(model, ids)
        kept = next(k for k, name in KERNEL_NAMES.items() if name == fast)
        assert kernels.choice == {(s, 3): kept for s in shapes_of(kernels)}
        # each shape once, not each layer
        assert {len(kernels.trials[key][k]) for key in kernels.trials for k in candidates} == {TRIALS}
        calls.clear()
        with kernels.forward(3):
            logits(model, ids)
        # packed or streamed: one product per layer alone or siblings together
        assert calls == [fast] * (layers if fast == "f_linear" else len(kernels.units()))
        with kernels.forward(2):  # another bucket: measured anew
            logits(model, ids[:, :2])
        with kernels.forward(10**6):  # past MAX_PACKED_ROWS: F.linear, nothing measured
            logits(model, ids)
    assert {bucket for _, bucket in kernels.trials} == {2, 3}


def test_a_packed_forward_is_timed_only_on_copies_packed_in_an_earlier_forward(monkeypatch):
    """A copy packed just before its call is read from cache: timed, the packed kernel looked faster than it runs
    once its copies stream from memory. Here a fresh copy computes at once, ``F.linear`` in 5 ms and a settled copy
    in 20 (more than three siblings' ``F.linear``): the forward that packed gives no sample."""
    fresh = set()
    reorder, pointwise = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise

    def packing(weight, rows):
        packed = reorder(weight, rows)
        fresh.add(id(packed))
        return packed

    def packed_linear(x, packed, bias):
        if id(packed) in fresh:
            fresh.discard(id(packed))
        else:
            time.sleep(0.02)
        return pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(kernels_mod, "packed_linear", packed_linear)
    monkeypatch.setattr(kernels_mod.torch.ops, "mkldnn",
                        SimpleNamespace(_reorder_linear_weight=packing, _linear_pointwise=pointwise))
    monkeypatch.setattr(kernels_mod, "F", SimpleNamespace(linear=slowed([], F.linear, "f_linear", lambda _: 0.005)))
    monkeypatch.setattr(kernels_mod, "streamed_linears",
                        slowed([], kernels_mod.streamed_linears, "streamed", lambda _: 0.03))
    model = make_model(layers=2)
    kernels = learnt(model)
    with kernels.active():
        for _ in range(len(kernels.candidates(5)) * TRIALS + 1):
            with kernels.forward(5):
                logits(model, torch.randint(0, 32, (1, 5)))
    keys = {(shape, rows_bucket(5)) for shape in shapes_of(kernels)}
    assert keys == set(kernels.choice) and not any(kernels.choice.values())  # F.linear: the settled copies are slow
    assert min(min(kernels.trials[key][1]) for key in keys) >= 0.02


def test_every_layer_of_a_shape_runs_one_kernel_in_a_forward_while_measured(monkeypatch):
    """A forward's sample of a kernel is all the calls of a shape in it: alternated call by call, each kernel was
    timed on other layers and in a cache the other kernel's reads had just disturbed."""
    last = []
    monkeypatch.setattr(kernels_mod, "packed_linear", slowed(last, kernels_mod.packed_linear, "packed", lambda _: 0))
    monkeypatch.setattr(kernels_mod, "padded_linear", slowed(last, kernels_mod.padded_linear, "padded", lambda _: 0))
    monkeypatch.setattr(kernels_mod, "F", SimpleNamespace(linear=slowed(last, F.linear, "f_linear", lambda _: 0)))
    monkeypatch.setattr(kernels_mod, "streamed_linears",
                        slowed(last, kernels_mod.streamed_linears, "streamed", lambda _: 0))
    model = make_model(layers=4)
    kernels = learnt(model)
    used = []
    for module in kernels.modules:
        unit = siblings_shape(kernels.siblings.get(module, (module,)))
        module.register_forward_hook(lambda m, args, out, unit=unit: used[-1].setdefault(unit, set()).add(last[-1]))
    candidates = kernels.candidates(3)
    with kernels.active():
        for _ in range(len(candidates) * TRIALS + 1):
            used.append({})
            with kernels.forward(3):
                logits(model, torch.randint(0, 32, (1, 3)))
    assert kernels.choice.keys() == {(s, 3) for s in shapes_of(kernels)}  # all measured in these forwards
    assert all(len(kinds) == 1 for forward in used for kinds in forward.values())
    assert {kind for forward in used for kinds in forward.values() for kind in kinds} == {
        KERNEL_NAMES[k] for k in candidates}


def test_drafting_layers_are_measured_apart_from_the_model_s_of_the_same_shape():
    """A head's few small weights stay in cache from step to step where a decoder's stream from memory: the same
    shape is not the same cost."""
    model = make_model(vocab=48, hidden=32)
    heads = SpeculativeHeads.from_model(model, num_heads=2, kind="path")
    engine = SpeculativeGenerator(model, heads, GenerationConfig(max_new_tokens=12, eos_token_id=None, pad_token_id=0),
                                  max_nodes=3, capacity=64)
    engine.generate(torch.tensor([[3, 4, 5]]))
    drafting = {shape[:2] for shape, _ in engine.kernels.trials if shape[2]}
    model_shapes = {shape[:2] for shape, _ in engine.kernels.trials if not shape[2]}
    assert drafting & model_shapes  # a head's hidden x hidden layer and the decoder's, measured apart


def test_only_plain_float32_cpu_linears_take_part():
    model = make_model()
    hooked = model.model.layers[0].mlp.down_proj
    hooked.forward = lambda x, original=hooked.forward: original(x)  # e.g. an accelerate hook
    kernels = LinearKernels(model)
    assert hooked not in kernels.modules and len(kernels.modules) > 0
    assert LinearKernels(make_model().to(torch.bfloat16)).modules == []
    assert kernels_of(model) is kernels_of(model)  # one packed copy per model, however many engines


def test_the_heads_and_their_draft_projection_take_part_for_one_call_only(monkeypatch):
    """Drafting computes through the chosen kernels too (the heads, the draft vocabulary's rows of the lm_head); the
    copies are packed inside the call, and the modules are left as they were when it ends."""
    model = make_model(vocab=48, hidden=32)
    heads = SpeculativeHeads.from_model(model, num_heads=2, kind="path", draft_ids=list(range(0, 48, 2)))
    engine = SpeculativeGenerator(model, heads, GenerationConfig(max_new_tokens=6, eos_token_id=None, pad_token_id=0),
                                  max_nodes=3, capacity=64)
    choose(engine.kernels, True)
    packed = []
    pack = LinearKernels._packed
    monkeypatch.setattr(LinearKernels, "_packed", lambda self, unit: packed.extend(unit) or pack(self, unit))
    engine.generate(torch.tensor([[3, 4, 5]]))
    head_linears = [m for m in heads.modules() if isinstance(m, nn.Linear)]
    drafting = [m for m in set(packed) if not any(m is n for n in model.modules())]
    assert any(m in head_linears for m in drafting)
    projection = [m for m in drafting if m not in head_linears]
    assert [tuple(m.weight.shape) for m in projection] == [(24, 32)]  # the draft vocabulary's rows, packed
    assert engine.kernels.adopted == [] and all("forward" not in m.__dict__ for m in head_linears)


@pytest.mark.parametrize("kernel", FORCED)
def test_greedy_identity_with_every_forward_through(monkeypatch, kernel):
    model = make_model(vocab=40, scale=4.0, seed=3)
    calls = force(monkeypatch, model, kernel)
    heads = noisy_heads(model, std=0.3, kind="path")
    ids, mask = left_padded([[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=64, max_nodes=6).generate(ids, mask)
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
    assert kernels_of(model).trials == {}  # nothing measured: every forward ran through the kernel
    assert len(calls) > 100 and max(calls) > MAX_ROWS  # every forward through it, the wide ones (prefill) too
    assert kernel != "padded" or max(calls) < kernels_mod.PADDED_ROWS  # every call padded
    assert len(kernels_of(model).units()) < len(kernels_of(model).modules)  # siblings in one product


def test_greedy_identity_with_every_forward_packed_on_a_lora_policy(monkeypatch):
    """A PEFT LoRA layer's base linear and its ``lora_A`` read the same input: siblings across the adapter."""
    from peft import LoraConfig, get_peft_model

    base = make_model(vocab=40, scale=4.0, seed=3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False)
    model = get_peft_model(base, config).eval().base_model.model
    force(monkeypatch, model, "packed")
    kernels = kernels_of(model)
    heads = noisy_heads(model, std=0.3, kind="path")
    ids, mask = left_padded([[5, 6, 7, 8, 9], [3, 4], [10, 11, 12]])
    gc = GenerationConfig(do_sample=False, max_new_tokens=30, eos_token_id=1, pad_token_id=0)
    out = SpeculativeGenerator(model, heads, gc, capacity=64, max_nodes=6).generate(ids, mask)
    assert out.completion_ids == generate_reference(model, ids, mask, gc)
    lora_a = [m for name, m in model.named_modules() if name.endswith("lora_A.default")]
    assert all(len(kernels.siblings.get(m, ())) > 1 for m in lora_a)


@pytest.mark.parametrize("kernel", FORCED)
@pytest.mark.parametrize("rule", ["top-k", "drawn"])
def test_sampling_is_exact_with_every_forward_through(monkeypatch, rule, kernel):
    model = make_model(vocab=6, hidden=16, seed=11, scale=2.0)
    calls = force(monkeypatch, model, kernel)
    heads = noisy_heads(model, std=0.5, kind="path", num_heads=2)
    gc = GenerationConfig(do_sample=True, temperature=0.9, top_k=4, max_new_tokens=3, eos_token_id=1, pad_token_id=0)
    samples, stats = engine_samples(model, heads, gc, n_per_prompt=4000, seed=2, candidates=rule)
    assert stats.drafted_row_steps > 0 and calls and len(kernels_of(model).units()) < len(kernels_of(model).modules)
    assert kernel != "padded" or max(calls) < kernels_mod.PADDED_ROWS
    for prompt, rows in zip(PROMPTS, samples):
        assert chi_square_pvalue(rows, exact_completion_distribution(model, prompt, gc)) > 1e-3


@needs_streamed
def test_streamed_kernel_matches_f_linear_to_float_rounding():
    """Every row count it has code for, weights whose rows are not a multiple of its block or its vector width, and
    siblings in one call."""
    torch.manual_seed(0)
    for rows in range(1, MAX_ROWS + 1):
        for out_features, in_features in [(576, 576), (33, 17), (7, 100), (1, 5), (50, 1536)]:
            x = torch.randn(in_features, rows).t()  # not contiguous
            weight, bias = torch.randn(out_features, in_features) / in_features**0.5, torch.randn(out_features)
            torch.testing.assert_close(streamed_linear(x, weight, bias), F.linear(x, weight, bias))
            torch.testing.assert_close(streamed_linear(x[None], weight, None), F.linear(x[None], weight))
    x, weights = torch.randn(2, 3, 40), [torch.randn(n, 40) / 40**0.5 for n in (40, 13, 13)]  # query, key, value
    biases = [torch.randn(40), None, torch.randn(13)]
    for out, weight, bias in zip(streamed_linears(x, weights, biases), weights, biases, strict=True):
        torch.testing.assert_close(out, F.linear(x, weight, bias))
    with pytest.raises(ValueError, match=f"1-{MAX_ROWS} float32 rows"):
        streamed_linear(torch.randn(MAX_ROWS + 1, 4), torch.randn(3, 4), None)
    with pytest.raises(ValueError, match="contiguous float32 CPU"):
        streamed_linear(torch.randn(2, 4), torch.randn(4, 3).t(), None)
    with pytest.raises(ValueError, match="of their width"):
        streamed_linears(torch.randn(2, 4), [torch.randn(3, 4), torch.randn(3, 5)], [None, None])


@pytest.mark.parametrize("setting", [{"CXX": "/nonexistent/c++"}, {"SPECROLL_STREAMED_KERNEL": "0"}])
def test_without_the_streamed_kernel_the_choice_is_among_the_others(monkeypatch, tmp_path, caplog, setting):
    """No compiler (or a failed build), or the kernel turned off: nothing raises, the engine generates, and the
    choice is between ``F.linear`` and the packed kernel."""
    from specroll_trl.engine import streamed

    with native_kernel_unbuilt(monkeypatch, tmp_path, streamed, setting):
        assert not streamed.streamed_kernel_available()
        model = make_model()
        engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2),
                                      GenerationConfig(max_new_tokens=8, eos_token_id=None, pad_token_id=0),
                                      max_nodes=3, capacity=64)
        assert engine.kernels.candidates(4) == [kernels_mod.LINEAR, kernels_mod.PACKED]
        assert len(engine.generate(torch.tensor([[3, 4, 5]])).completion_ids[0]) == 8
        assert kernels_mod.STREAMED not in engine.kernels.choice.values()
        assert ("failed" in caplog.text) == ("CXX" in setting) and not list(tmp_path.glob("kernels/*.so"))


def test_engine_without_packing_leaves_the_model_alone():
    model = make_model()
    engine = SpeculativeGenerator(model, SpeculativeHeads.from_model(model, 2),
                                  GenerationConfig(max_new_tokens=4, eos_token_id=1, pad_token_id=0),
                                  capacity=8, pack_linears=False)
    engine.generate(torch.tensor([[3, 4, 5]]))
    assert engine.kernels.modules == [] and engine.kernels.packed == {}


def test_the_budget_does_not_time_steps_that_pack_or_measure_kernels():
    """Such a step costs up to twice a typical one: taken as what its width costs, it kept the budget from drafting
    that width again."""
    model = make_model(vocab=40, seed=5)
    heads = noisy_heads(model, std=0.3, kind="path")
    gc = GenerationConfig(do_sample=True, max_new_tokens=96, eos_token_id=None, pad_token_id=0)
    engine = SpeculativeGenerator(model, heads, gc, max_nodes=4, capacity=64)
    kernels, timed = engine.kernels, []
    observe = engine.budget.observe
    setup = []

    def spy(rows, nodes, seconds, *args):
        timed.append(seconds is not None)
        setup.append(kernels.setup_calls)
        return observe(rows, nodes, seconds, *args)

    engine.budget.observe = spy
    ids, mask = left_padded([[5, 6, 7], [3, 4]])
    torch.manual_seed(0)
    engine.generate(ids, mask)
    changed = [True] + [a != b for a, b in zip(setup, setup[1:])]  # the first step measures the kernels
    assert timed == [not c for c in changed] and not all(timed) and any(timed)
    timed.clear(), setup.clear()
    choose(kernels, True)
    engine.generate(ids, mask)  # choices made: only steps that use a layer first in the call pack it again
    changed = [True] + [a != b for a, b in zip(setup, setup[1:])]
    assert timed == [not c for c in changed] and not timed[0] and sum(timed) > len(timed) / 2


def test_a_step_that_measures_only_the_heads_kernels_is_timed():
    """Measuring a drafting layer costs a step ~1 ms: untimed, the first drafted steps at a rare row count (all of them
    measuring the heads) were the budget's only chances to learn what drafting costs there."""
    model = make_model(vocab=40, seed=5)
    heads = noisy_heads(model, std=0.3, kind="path")
    gc = GenerationConfig(do_sample=True, max_new_tokens=64, eos_token_id=None, pad_token_id=0)
    engine = SpeculativeGenerator(model, heads, gc, max_nodes=4, capacity=64)
    kernels, steps = engine.kernels, []
    ids, mask = left_padded([[5, 6, 7], [3, 4]])
    engine.generate(ids, mask)  # every kernel chosen; then the heads' choices forgotten: only theirs are measured
    for table in (kernels.choice, kernels.trials):
        for key in [key for key in table if key[0][-1]]:  # a shape's last field: a drafting layer's
            del table[key]

    def heads_samples() -> int:
        return sum(len(t) for key, times in kernels.trials.items() if key[0][-1] for t in times)

    before = [kernels.setup_calls, heads_samples()]
    observe = engine.budget.observe

    def spy(rows, nodes, seconds, *args):
        now = [kernels.setup_calls, heads_samples()]
        steps.append((seconds is not None, now[0] != before[0], now[1] != before[1]))
        before[:] = now
        return observe(rows, nodes, seconds, *args)

    engine.budget.observe = spy
    torch.manual_seed(0)
    engine.generate(ids, mask)
    measured_heads_only = [timed for timed, setup, heads_measured in steps if heads_measured and not setup]
    assert measured_heads_only and all(measured_heads_only)
    assert all(not timed for timed, setup, _ in steps if setup)
