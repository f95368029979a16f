"""The compiled decode step (utils/generation/compiled.py) and the measured thread count of decode
steps (utils/generation/threads.py ``DecodeThreads``). The compiled step: where ``inference.compile`` turns it
on, greedy tokens equal to the eager step's for a lone row and for rows joining and leaving a
batch, every step served by the graphs compiled at load for the callers' shapes (no
recompile while generating, but once for a longer capacity), and on CUDA the real thing
(inductor, CUDA graphs). On CPU the tests trace with dynamo's "eager" backend: the graphs and
their shapes are dynamo's, while inductor's C++ code generation takes about a minute per
graph of SmolLM2 on this machine."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import utils.generation.compiled as compiled
import utils.generation.cpu as cpu
from tests.test_model import V, build, cuda
from utils.generation.engine import Engine, SamplingParams, Sequence

PROMPTS = [[1, 5, 9, 33, 2, 7], [1, 40, 41, 42, 43, 44, 45, 46], [1, 3], [1, 70, 71, 72, 73]]


def test_auto_compiles_on_cuda_only_and_never_infini_models():
    assert compiled.compile_applies("auto", "cuda", None) and not compiled.compile_applies("auto", "cpu", None)
    assert compiled.compile_applies("on", "cpu", None) and not compiled.compile_applies("on", "cpu", 64)
    assert not compiled.compile_applies("off", "cuda", None)
    assert Engine(build(), compile="auto").compile_now() is None         # CPU: the eager step
    assert Engine(build(attention="infini", segment_length=8), compile="on").compile_now() is None


def test_compiled_step_equals_the_eager_one_on_the_shapes_compiled_at_load(monkeypatch):
    """Static shapes, traced with dynamo's eager backend: ``generate``'s batchers take
    power-of-two capacities, so prompts of every length up to 256 positions run on the one
    graph compiled at load (infer's: one prompt) and a longer one compiles its capacity once;
    serve's warm-up covers its lane's own slots and capacity at every batch size, so rows
    joining and leaving never compile; the tokens are the eager step's."""
    monkeypatch.setattr(compiled, "BACKEND", "eager")
    torch._dynamo.reset()
    counters.clear()
    m = build(seed=2, n_layers=1, max_seq_len=1024)
    eager, comp = Engine(m), Engine(m, compile="on")
    assert comp.compile_now() > 0
    assert counters["stats"]["unique_graphs"] == 1                  # one prompt, 256 positions
    for p in PROMPTS:                                                 # 2..8 tokens + 20 new
        assert comp.generate([p], 20, temperature=0) == eager.generate([p], 20, temperature=0)
    assert counters["stats"]["unique_graphs"] == 1
    g = torch.Generator().manual_seed(3)
    for k in (250, 300):                                              # 257..512 positions: one more
        p = [1] + torch.randint(3, V, (k,), generator=g).tolist()
        assert comp.generate([p], 12, temperature=0) == eager.generate([p], 12, temperature=0)
    assert counters["stats"]["unique_graphs"] == 2
    lane = Engine(m, compile="on")                                    # serve: 3 slots of 64 positions
    lane.compile_now(3, 64)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2 + 3                                            # batch sizes 1, 2, 3
    want = [eager.generate([p], n, temperature=0)[0] for p, n in zip(PROMPTS, (12, 5, 9, 7))]
    b = lane.batcher(3, 64)
    seqs = [b.add(Sequence(p, SamplingParams(n, temperature=0))) for p, n in zip(PROMPTS, (12, 5, 9, 7))]
    list(lane.run(b))
    assert [s.tokens for s in seqs] == want
    assert counters["stats"]["unique_graphs"] == graphs
    blas = Engine(m, compile="on", product="blas")                    # traced with torch's products
    step = blas.compiled_step(blas.decode_pack())
    assert isinstance(blas.decode_pack().mm, cpu.BlasProduct) and all(p.mm is cpu.panel_mm for p in step.packs)
    assert compiled.static_capacity(9, 64) == 64 and compiled.static_capacity(300, None) == 512
    assert compiled.static_capacity(1000, 1000) == 1000                # never below what is needed


@cuda
def test_compiled_step_with_cuda_graphs_equals_the_eager_one_on_cuda():
    m = build(seed=2).cuda()
    eager, comp = Engine(m), Engine(m, compile="auto")
    assert comp.compile_now() > 0
    for p in PROMPTS[:2]:
        assert comp.generate([p], 20, temperature=0) == eager.generate([p], 20, temperature=0)
    assert comp.generate(PROMPTS, 16, temperature=0) == eager.generate(PROMPTS, 16, temperature=0)


@cuda
def test_compiled_decode_records_cuda_graphs_over_its_caches():
    """The step writes its KV caches in place: CUDA graph trees record a graph over mutated
    inputs only when their addresses are static, so the engine marks a batcher's caches
    (``Engine.static_caches``); unmarked, inductor skips the graphs ("mutated inputs") and every
    step launches each kernel. No skip is counted, in bf16 autocast too."""
    torch._dynamo.reset()
    counters.clear()
    m = build(seed=2).cuda()
    for amp in (None, torch.bfloat16):
        comp = Engine(m, compile="on", amp=amp)
        comp.compile_now()
        assert len(comp.generate([PROMPTS[0]], 8, temperature=0)[0]) == 8
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


def test_decode_threads_follow_the_faster_count_and_a_change_of_load(monkeypatch):
    """utils/generation/threads.py DecodeThreads: each count measured, then the faster one
    used, the other tried again after a pause as long as it was slow, and a change of which
    count is faster followed."""
    import utils.generation.threads as threads
    clock = [0.0]
    monkeypatch.setattr(threads.time, "perf_counter", lambda: clock[0])
    cost = {1: 1.0, 2: 5.0}                     # two threads slow: cores shared with other work
    chooser = threads.DecodeThreads(2)
    T, E = chooser.TRY, chooser.EXPLORE

    def steps(k, n=1):
        picked = []
        for _ in range(k):
            t = chooser.pick(n)
            clock[0] += cost[t]
            chooser.done()
            picked.append(t)
        return picked

    first = steps(2 * T + 5 * E)
    assert first[:2 * T - 1] == [1] * T + [2] * (T - 1)    # each count's first step not measured
    assert first[2 * T:].count(2) == T          # one try in 5 x EXPLORE steps: it was 5x slower
    cost.update({1: 3.0, 2: 1.0})               # the load went away: two threads faster
    later = steps(20 * E)
    assert later[-E // 2:] == [2] * (E // 2) and later.count(1) < 8 * E
    assert steps(2 * T - 1, n=4) == [1] * T + [2] * (T - 1)   # each batch size measured on its own
    assert threads.DecodeThreads(1).pick(1) == 1
