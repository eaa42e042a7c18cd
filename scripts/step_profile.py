"""Where a decoding step's time goes at one row on this CPU, in parts (``--parts``, all by default):

* ``steps``: ms per step of the engine at 0 / 2 / 4 draft nodes against `generate`;
* ``phases``: ms per step in each of the engine's phases (draft, verify, commit, ...), a plain step against a 4-node
  drawn and a 4-node top-k one (``--nodes``: other widths; ``--rows``: other row counts);
* ``drafting``: ms per step of the parts of a 4-node drawn step's draft and commit (the heads' blocks, their vocabulary
  projection, the draw, the rejection walk, the KV commit; ``--nodes``: other widths);
* ``attention``: ms per step at 0 / 4 / 16 draft nodes and 1 / 8 rows with the grouped key/value heads read in place
  (``engine.attention``, what the engine runs) against transformers' own path, which copies them (``repeat_kv``),
  alternating; the second arm replaces the engine's ``grouped_attention`` by a no-op;
* ``cache``: ms per step at 0 / 4 draft nodes and 1 / 8 / 32 rows with cache layers that append in place
  (``engine.kvcache.RoomyLayer``, what the engine runs) against transformers' ``DynamicLayer``, alternating;
* ``commit``: ms per step at 0 / 1 / 4 draft nodes and 1 / 8 rows with a KV commit that moves no slot where every
  accepted node already sits in its own (what the engine runs) against one that gathers every step, alternating;
* ``walk``: ms per step at 0 / 4 / 16 draft nodes and 1 / 8 rows with the rejection walk as one C++ call
  (``engine.walk_kernel``, what the engine runs on CPU) against the PyTorch reference, alternating;
* ``siblings``: ms per step at 0 / 4 / 16 draft nodes and 1 / 8 rows with the layers that read one input (query, key
  and value; gate and up) packed as one product (what the engine runs) against every layer alone, alternating; then
  the decoder's linears alone in both layouts, ``F.linear`` and packed, at 1-17 rows;
* ``leaving``: ms for one row of 32 to leave a cache of 450 slots and for the next step's append, with the rows
  kept in order and copied out of their buffers (what the engine did before), kept in order in place (every row
  after the leaver moves), and with the last row moved into the leaver's place (what the engine does);
* ``profiles``: torch.profiler, per decoding step (the prefill subtracted), of drawn 0- and 2-node runs (``--nodes``,
  ``--rows``: others) and of `generate`;
* ``lm_head``: the lm_head product and the heads' draft-vocabulary projection alone, `F.linear` against the packed
  kernel (and, for the lm_head, `x @ W.T` with a transposed copy), for 1-17 query rows, and what packing costs;
* ``layouts``: the decoder's 210 linears alone at 1-17 query rows in every layout or kernel tried (``F.linear``,
  transposed products, a matrix-vector product per row, rows in chunks, MKL's packed GEMM, oneDNN's packed kernel
  with several batch hints);
* ``gemm``: what these cores compute at best, GFLOP/s of a large fp32 matrix product.

  OMP_NUM_THREADS=1 python scripts/step_profile.py     (shares hold under load; milliseconds do not)
  python scripts/step_profile.py --parts phases gemm  (two threads, quiet machine)
  python scripts/step_profile.py --parts cache siblings --rows 8 --nodes 0 4  (the paired parts at other cells)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from types import SimpleNamespace

import torch
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from specroll_trl.adapt.samples import left_pad
from specroll_trl.engine import SpeculativeGenerator, walk_kernel
from specroll_trl.engine import generator as engine_module
from specroll_trl.engine.heads import SpeculativeHeads, VocabProjection
from specroll_trl.engine.kernels import kernels_of, packed_linear
from specroll_trl.engine.kvcache import RaggedCache, roomy_cache
from specroll_trl.experiments.heads_bench import bench_prompts
from specroll_trl.experiments.zoo import load_heads, load_policy, trl_generation_config


def median_ms(fn, repeats: int = 9, inner: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return 1e3 * statistics.median(times)


def timed(method, spent: dict, label: str):
    """``method`` adding its wall time to ``spent[label]`` at each call."""
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start
    return run


PHASES = ("_draft", "_verify", "_commit", "_observe_budget", "_retire")


def step_times(model, tokenizer, heads, gc, ids, mask) -> None:
    engines = {n: SpeculativeGenerator(model, heads, gc, max_nodes=n, capacity=10**9) for n in (0, 2, 4)}
    per_step = {n: [] for n in [*engines, "generate"]}
    for seed in range(4):
        for n, engine in engines.items():
            torch.manual_seed(seed)
            stats = engine.generate(ids, mask).stats
            per_step[n].append(stats.seconds / stats.forwards)
        torch.manual_seed(seed)
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
        per_step["generate"].append((time.perf_counter() - start) / (out.shape[1] - ids.shape[1]))
    for name, seconds in per_step.items():
        print(f"{name}: {1000 * statistics.median(seconds):.1f} ms per step", flush=True)


def phase_times(model, tokenizer, heads, gc, ids, mask, rounds: int = 4, nodes=(4,), batches=(1,)) -> None:
    """Each phase's wall time summed over ``rounds`` calls per engine (alternating), per decoding step: a plain step
    against drawn and top-k trees of each of ``nodes``, at each of ``batches`` rows."""
    engines = {"plain": dict(max_nodes=0)}
    engines.update({f"{n} nodes, {rule}": dict(max_nodes=n, candidates=rule)
                    for n in nodes for rule in ("drawn", "top-k")})
    for batch in batches:
        ids, mask = left_pad(bench_prompts(tokenizer, batch), tokenizer.pad_token_id)
        cell = {name: SpeculativeGenerator(model, heads, gc, capacity=10**9, **options)
                for name, options in engines.items()}
        spent = {name: dict.fromkeys(PHASES, 0.0) for name in cell}
        for engine in cell.values():
            engine.generate(ids, mask, max_new_tokens=8)  # kernels measured and packed here, untimed
        for name, engine in cell.items():
            for phase in PHASES:
                setattr(engine, phase, timed(getattr(engine, phase), spent[name], phase))
        steps = dict.fromkeys(cell, 0)
        for seed in range(rounds):
            for name, engine in cell.items():
                torch.manual_seed(seed)
                steps[name] += engine.generate(ids, mask).stats.forwards - 1
        for name, phases in spent.items():
            parts = ", ".join(f"{phase.strip('_')} {1000 * seconds / steps[name]:.2f}"
                              for phase, seconds in phases.items())
            print(f"{batch} rows, {name}: ms per step: {parts} ({steps[name]} steps)", flush=True)


def drafting_parts(model, tokenizer, heads, gc, ids, mask, rounds: int = 3, nodes=(4,)) -> None:
    """A drawn step's draft and commit in parts at each of ``nodes``, each function's wall time summed over ``rounds``
    calls, per step (the parts nest: ``draw_tree`` holds the heads' blocks and projection)."""
    for num_nodes in nodes:
        engine = SpeculativeGenerator(model, heads, gc, max_nodes=num_nodes, candidates="drawn", capacity=10**9)
        engine.generate(ids, mask, max_new_tokens=8)  # kernels measured and packed here, untimed
        spent = dict.fromkeys(["head blocks", "projection", "draw_tree", "_draft", "walk", "cut",
                               "kv commit", "_commit"], 0.0)
        targets = [(SpeculativeHeads, "head_state", "head blocks"), (VocabProjection, "__call__", "projection"),
                   (engine_module, "draw_tree", "draw_tree"), (engine, "_draft", "_draft"),
                   (engine_module, "walk", "walk"), (engine_module, "cut", "cut"),
                   (RaggedCache, "commit", "kv commit"), (engine, "_commit", "_commit")]
        originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
        for (owner, name, label), (_, _, method) in zip(targets, originals):
            setattr(owner, name, timed(method, spent, label))
        try:
            steps = 0
            for seed in range(rounds):
                torch.manual_seed(seed)
                steps += engine.generate(ids, mask).stats.forwards - 1
        finally:
            for owner, name, method in originals:
                setattr(owner, name, method)
        parts = ", ".join(f"{label.strip('_')} {1000 * seconds / steps:.2f}" for label, seconds in spent.items())
        print(f"{num_nodes} nodes, drawn: ms per step: {parts} ({steps} steps)", flush=True)


def paired_steps(model, tokenizer, heads, gc, arms: dict, rounds: int = 5, batches=(1, 8), nodes=(0, 4, 16)) -> None:
    """Step ms (the prefill and the call's packing left out) at each number of drawn ``nodes`` and of rows, the two
    ``arms`` (label -> a function that sets the engine up that way) alternating call by call, which goes first
    alternating round by round. The plain step (0 nodes) is always among them: its engine times the prefill."""
    (first, set_first), (second, _) = arms.items()
    nodes = tuple(sorted({0, *nodes}))
    for batch in batches:
        ids, mask = left_pad(bench_prompts(tokenizer, batch), tokenizer.pad_token_id)
        engines = {n: SpeculativeGenerator(model, heads, gc, max_nodes=n, candidates="drawn", capacity=10**9)
                   for n in nodes}
        for engine in engines.values():
            for set_arm in arms.values():  # kernels measured here, untimed: in the timed calls, whichever arm met a
                set_arm()  # new bucket of rows first paid for measuring the kernels the arms share
                torch.manual_seed(0)
                engine.generate(ids, mask)
        per_step = {(n, label): [] for n in engines for label in arms}
        try:
            for seed in range(rounds):
                for n, engine in engines.items():
                    for label, set_arm in list(arms.items())[::1 if seed % 2 == 0 else -1]:
                        set_arm()
                        start = time.perf_counter()
                        engines[0].generate(ids, mask, max_new_tokens=1)
                        prefill = time.perf_counter() - start
                        torch.manual_seed(seed)
                        stats = engine.generate(ids, mask).stats
                        per_step[n, label].append((stats.seconds - prefill - stats.pack_seconds) / (stats.forwards - 1))
        finally:
            set_first()
        for n in engines:
            a, b = (1e3 * statistics.median(per_step[n, label]) for label in arms)
            print(f"{batch} row(s), {n:>2} nodes: {first} {a:6.1f} ms per step, {second} {b:6.1f} ms ({a / b:.3f}x)",
                  flush=True)


def attention_paths(model, tokenizer, heads, gc, ids, mask, **cells) -> None:
    """The grouped key/value heads read in place (what the engine runs) against copied (transformers' path)."""
    in_place = engine_module.grouped_attention
    paired_steps(model, tokenizer, heads, gc, {
        "in place": lambda: setattr(engine_module, "grouped_attention", in_place),
        "copied": lambda: setattr(engine_module, "grouped_attention", lambda model: contextlib.nullcontext())}, **cells)


def cache_layers(model, tokenizer, heads, gc, ids, mask, **cells) -> None:
    """Cache layers that append in place (``RoomyLayer``, what the engine runs) against transformers' ``DynamicLayer``,
    which concatenates (copies every layer's whole cache at every step)."""
    roomy = engine_module.roomy_cache
    paired_steps(model, tokenizer, heads, gc, {
        "in place": lambda: setattr(engine_module, "roomy_cache", roomy),
        "concatenated": lambda: setattr(engine_module, "roomy_cache", lambda config: DynamicCache(config=config))},
        **{"batches": (1, 8, 32), "nodes": (0, 4), **cells})


def commit_moves(model, tokenizer, heads, gc, ids, mask, **cells) -> None:
    """A commit that moves no slot where every accepted node already sits in its own (what the engine runs) against
    one that gathers every step (the engine before 2026-12-07's fifteenth stop); both emit the same tokens."""
    displaced = engine_module.displaced
    paired_steps(model, tokenizer, heads, gc, {
        "skipped": lambda: setattr(engine_module, "displaced", displaced),
        "gathered": lambda: setattr(engine_module, "displaced",
                                    lambda accepted: torch.ones_like(accepted, dtype=torch.bool))},
        **{"batches": (1, 8), "nodes": (0, 1, 4), **cells})


def walk_paths(model, tokenizer, heads, gc, ids, mask, **cells) -> None:
    """The rejection walk as one C++ call (``engine.walk_kernel``, what the engine runs on CPU) against the PyTorch
    reference (``drawn.rejection_walk``); both make the same decisions on the same uniforms."""
    available = walk_kernel.walk_kernel_available
    paired_steps(model, tokenizer, heads, gc, {
        "kernel": lambda: setattr(walk_kernel, "walk_kernel_available", available),
        "reference": lambda: setattr(walk_kernel, "walk_kernel_available", lambda: False)},
        **{"batches": (1, 8), "nodes": (0, 4, 16), **cells})


def sibling_products(model, tokenizer, heads, gc, ids, mask, **cells) -> None:
    """Siblings in one packed product (what the engine runs) against every layer alone, each arm's kernels chosen by
    its own measurements; then the decoder's linears alone in both layouts at 1-17 rows."""
    kernels = kernels_of(model)
    SpeculativeGenerator(model, heads, gc).generate(ids, mask, max_new_tokens=2)  # learns the siblings
    learnt = kernels.siblings
    paired_steps(model, tokenizer, heads, gc, {"together": lambda: setattr(kernels, "siblings", learnt),
                                               "alone": lambda: setattr(kernels, "siblings", {})}, **cells)
    lm_head = model.get_output_embeddings()
    alone = [m.weight.detach() for m in kernels.modules if m is not lm_head]
    together = [torch.cat([m.weight.detach() for m in unit]) for unit in kernels.units() if unit[0] is not lm_head]
    packed = {id(w): torch.ops.mkldnn._reorder_linear_weight(w, 3) for w in alone + together}
    layouts = {"F.linear alone": (alone, False), "F.linear together": (together, False),
               "packed alone": (alone, True), "packed together": (together, True)}
    for rows in range(1, 18):
        inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in alone}}
        times = {name: [] for name in layouts}
        for _ in range(12):  # alternating, the first two rounds a warm-up
            for name, (weights, pack) in layouts.items():
                start = time.perf_counter()
                for w in weights:
                    x = inputs[w.shape[1]]
                    packed_linear(x, packed[id(w)], None) if pack else F.linear(x, w)
                times[name].append(1e3 * (time.perf_counter() - start))
        print(f"{rows:>2} rows: " + ", ".join(f"{n} {statistics.median(t[2:]):.1f}" for n, t in times.items()) + " ms",
              flush=True)


def rows_leaving(model, *_, rows: int = 32, slots: int = 450, rounds: int = 10) -> None:
    config = model.config
    shape = (rows, config.num_key_value_heads, slots, config.hidden_size // config.num_attention_heads)
    alive = torch.ones(rows, dtype=torch.bool)
    alive[rows // 6] = False

    def copied(kv, keep):
        kv._apply(lambda t: t.index_select(0, keep))

    def into_place(kv, _):
        state = SimpleNamespace(rows=torch.arange(rows), root=torch.arange(rows), hidden=torch.zeros(rows, 1), kv=kv)
        SpeculativeGenerator._keep(state, alive)

    arms = {"copied out, in order": copied, "in place, in order": RaggedCache.keep_rows,
            "in place, last into the leaver's place": into_place}
    spent = {arm: ([], []) for arm in arms}
    for _ in range(rounds):
        for arm, leave in arms.items():
            cache = roomy_cache(config)
            for layer in cache.layers:
                layer.update(torch.randn(shape), torch.randn(shape))
            kv = RaggedCache(cache, torch.ones(rows, slots, dtype=torch.bool), torch.full((rows,), slots))
            start = time.perf_counter()
            leave(kv, alive.nonzero().squeeze(1))
            middle = time.perf_counter()
            step = torch.randn(rows - 1, *shape[1:2], 1, shape[3])
            for layer in cache.layers:
                layer.update(step, step)
            spent[arm][0].append(middle - start)
            spent[arm][1].append(time.perf_counter() - middle)
    for arm, (leaving, appending) in spent.items():
        print(f"one row of {rows} leaves, {slots} slots, {arm}: leaving {1e3 * statistics.median(leaving):.1f} ms, "
              f"next append {1e3 * statistics.median(appending):.1f} ms", flush=True)


def profiles(model, tokenizer, heads, gc, ids, mask, nodes=(0, 2), batches=(1,)) -> None:
    """torch.profiler per decoding step (the prefill's own profile subtracted, operator by operator) of drawn trees of
    each of ``nodes`` and of `generate`, at each of ``batches`` rows, after one untimed call each."""
    def self_ms(run, ids, mask, max_new_tokens: int) -> tuple[dict[str, tuple[float, int]], int, float]:
        torch.manual_seed(0)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            out = run(ids, mask, max_new_tokens)
            seconds = time.perf_counter() - start
        # packing the weights, once a call, takes 0.1-0.3 s whatever the call's length: left out of the wall time, or
        # a short call's steps come out at its noise (a negative step time at 8 tokens)
        steps, packing = (out.stats.forwards, out.stats.pack_seconds) if hasattr(out, "stats") else (
            out.shape[1] - ids.shape[1], 0.0)
        return {a.key: (a.self_cpu_time_total / 1000, a.count) for a in prof.key_averages()}, steps, seconds - packing

    runs = {f"nodes {n}": SpeculativeGenerator(model, heads, gc, max_nodes=n, candidates="drawn",
                                               capacity=10**9).generate for n in nodes}
    runs["generate"] = lambda ids, mask, max_new_tokens: model.generate(
        input_ids=ids, attention_mask=mask, generation_config=gc, max_new_tokens=max_new_tokens)
    for batch in batches:
        ids, mask = left_pad(bench_prompts(tokenizer, batch), tokenizer.pad_token_id)
        for name, run in runs.items():
            run(ids, mask, gc.max_new_tokens)  # kernels measured and packed, untimed
            (whole, steps, seconds), (prefill, _, prefill_seconds) = (self_ms(run, ids, mask, n)
                                                                      for n in (gc.max_new_tokens, 1))
            steps -= 1  # the prefill's forward
            # operators the prefill also runs carry its run-to-run noise (~1 ms a step at 32 rows): read the big ones
            decode = {k: (max(0.0, t - prefill.get(k, (0.0, 0))[0]), c - prefill.get(k, (0.0, 0))[1])
                      for k, (t, c) in whole.items()}
            print(f"== {name}, {batch} rows: {1000 * (seconds - prefill_seconds) / steps:.1f} ms a decoding step "
                  f"under the profiler ({steps} steps, the prefill's call and packing subtracted); self time by "
                  "operator (work in the streamed kernel, a library of its own, is in none):", flush=True)
            for key, (t, c) in sorted(decode.items(), key=lambda kv: -kv[1][0])[:20]:
                print(f"  {key[:50]:50s} {t / steps:7.2f} ms  {c / steps:7.1f} calls", flush=True)


def lm_head_products(model, tokenizer, heads, *_) -> None:
    weight = model.get_output_embeddings().weight.detach()
    projections = {"lm_head": weight}
    if heads.draft_ids is not None:
        projections[f"draft projection ({len(heads.draft_ids)} rows)"] = weight[heads.draft_ids]
    for name, w in projections.items():
        pack_ms = median_ms(lambda w=w: torch.ops.mkldnn._reorder_linear_weight(w, 3), repeats=5, inner=1)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        transposed = w.t().contiguous() if name == "lm_head" else None
        print(f"{name}: packing {pack_ms:.1f} ms", flush=True)
        for rows in (1, 2, 3, 5, 9, 17):
            x = torch.randn(rows, w.shape[1])
            line = (f"  {rows:>2} query rows: F.linear {median_ms(lambda x=x, w=w: F.linear(x, w)):6.2f} ms, packed "
                    f"{median_ms(lambda x=x, p=packed: packed_linear(x, p, None)):6.2f} ms")
            if transposed is not None:
                line += f", x @ W.T (transposed copy) {median_ms(lambda x=x, t=transposed: x @ t):6.2f} ms"
            print(line, flush=True)


def decoder_layouts(model, *_) -> None:
    """The decoder's linears alone (its 210 weights in layer order, so that they stream from memory as in a forward),
    ms for all of them at 1-17 query rows, in each layout or kernel PyTorch offers on CPU."""
    weights = [m.weight.detach() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and ".layers." in name]
    transposed = [w.t().contiguous() for w in weights]
    onednn = {hint: [torch.ops.mkldnn._reorder_linear_weight(w, hint) for w in weights] for hint in (1, 3, 8)}

    def chunked(x, w, size=3):
        return torch.cat([F.linear(x[i:i + size], w) for i in range(0, x.shape[0], size)])

    for rows in (1, 3, 5, 9, 17):
        inputs = {n: torch.randn(rows, n) for n in {w.shape[1] for w in weights}}
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, rows) for w in weights]
        layouts = {
            "F.linear": lambda i, x: F.linear(x, weights[i]),
            "(W @ x.T).T": lambda i, x: (weights[i] @ x.t()).t(),
            "x @ Wt (transposed copy)": lambda i, x: x @ transposed[i],
            "one mv per row": lambda i, x: torch.stack([torch.mv(weights[i], r) for r in x]),
            "rows in chunks of 3": lambda i, x: chunked(x, weights[i]),
            "MKL packed for these rows": lambda i, x, m=mkl: torch.ops.mkl._mkl_linear(x, m[i], weights[i], None,
                                                                                          len(x)),
            **{f"oneDNN packed, hint {h}": (lambda i, x, h=h: packed_linear(x, onednn[h][i], None)) for h in onednn},
        }
        times = {name: [] for name in layouts}
        for _ in range(6):  # alternating, the first round a warm-up
            for name, kernel in layouts.items():
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    kernel(i, inputs[w.shape[1]])
                times[name].append(1e3 * (time.perf_counter() - start))
        print(f"{rows:>2} rows: " + ", ".join(f"{n} {statistics.median(t[1:]):.1f}" for n, t in times.items()) + " ms",
              flush=True)


def gemm_rate(*_) -> None:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    ms = median_ms(lambda: a @ b, repeats=7, inner=3)
    print(f"fp32 GEMM 2048^3 at {torch.get_num_threads()} threads: {ms:.1f} ms, {2 * 2048**3 / ms / 1e6:.0f} GFLOP/s")


# which of --rows (``batches``) and --nodes each part takes
CELLS = {"attention": ("batches", "nodes"), "cache": ("batches", "nodes"), "commit": ("batches", "nodes"),
         "siblings": ("batches", "nodes"), "profiles": ("batches", "nodes"), "phases": ("batches", "nodes"),
         "walk": ("batches", "nodes"), "drafting": ("nodes",)}
PARTS = {"steps": step_times, "phases": phase_times, "drafting": drafting_parts, "attention": attention_paths,
         "cache": cache_layers, "commit": commit_moves, "walk": walk_paths, "siblings": sibling_products,
         "leaving": rows_leaving,
         "profiles": profiles, "lm_head": lm_head_products, "layouts": decoder_layouts, "gemm": gemm_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+",
                        help="rows of the paired parts (attention, cache, commit, walk, siblings), of phases and of "
                             "profiles")
    parser.add_argument("--nodes", type=int, nargs="+",
                        help="draft nodes of the side-by-side parts, phases, drafting and profiles")
    args = parser.parse_args()
    cells = {k: tuple(v) for k, v in (("batches", args.rows), ("nodes", args.nodes)) if v}
    model, tokenizer = load_policy("smollm2-135m", progress=False)
    heads = load_heads("smollm2-135m", progress=False)
    gc = trl_generation_config(model, tokenizer, args.max_new_tokens, 1.0)
    ids, mask = left_pad(bench_prompts(tokenizer, 1), tokenizer.pad_token_id)
    with torch.no_grad():
        for part in args.parts:
            options = {k: v for k, v in cells.items() if k in CELLS.get(part, ())}
            PARTS[part](model, tokenizer, heads, gc, ids, mask, **options)


if __name__ == "__main__":
    main()
