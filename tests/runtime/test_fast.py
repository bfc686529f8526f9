"""The round-cost machinery (runtime/kernels.py, runtime/cache.py) against what it replaces:
packed linears against F.linear, preallocated KV slabs against recomputation and against
transformers' concatenating cache, the fast runtime against the reference one."""

import copy

import pytest
import torch

import draftsmith.runtime.kernels as kernels
from draftsmith import DraftsmithError
from draftsmith.models.common import KVBuffer
from draftsmith.runtime.cache import KVSlab, decoding_cache
from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.kernels import PackedLinears
from draftsmith.runtime.policies import Static
from draftsmith.runtime.proposers import FeatureProposer
from draftsmith.runtime.tree import DraftTree, TreeShape
from tests.runtime.conftest import V, assert_cache_is_recomputation, greedy_cases
from tests.runtime.test_generate import proposers
from tests.runtime.test_tree import hand_tree


@pytest.mark.parametrize("rows", [1, 2, 3, 13, 64, 65, 400])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_equals_linear(rows, bias, dtype):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80, bias=bias).to(dtype)
    if not kernels.packable(layer.weight):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this machine")
    x = torch.randn(1, rows, 48, dtype=dtype)
    with torch.no_grad():
        packed = kernels.pack(layer.weight)
        got = kernels.packed_linear(x, packed, layer.bias)
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(torch.ops.draftsmith.packed_linear(x, packed, layer.bias, 80), got)  # what compile traces
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert got.shape == (1, rows, 80) and got.dtype == dtype


def test_packed_linears_switch_nested_and_restore(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    calls = []
    real = kernels.packed_linear
    monkeypatch.setattr(kernels, "packed_linear", lambda x, packed, b: calls.append(x.shape) or real(x, packed, b))
    assert PackedLinears(model).linears == []  # weights this small run faster on F.linear
    packed = PackedLinears(model, min_size=0)
    assert len(packed.linears) == 2
    x = torch.randn(3, 8)
    with torch.no_grad(), packed:
        with packed:  # nested: still on inside, off only after the outermost
            model(x)
        model(x)
    assert len(calls) == 4
    assert all("forward" not in m.__dict__ for m in model)  # the modules are as they were
    model(x)
    assert len(calls) == 4
    assert PackedLinears(model, enabled=False).linears == []


def test_packed_linears_follow_weight_writes():
    """A drafter validated while it trains: an optimizer step or load_state_dict writes the weight
    in place, and the next packed call must see it, not the copy packed before."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    packed, x = PackedLinears(layer, min_size=0), torch.randn(2, 16)
    with torch.no_grad(), packed:
        before = layer(x)
    torch.optim.SGD(layer.parameters(), lr=1.0).zero_grad()
    layer(x).square().sum().backward()
    torch.optim.SGD(layer.parameters(), lr=1.0).step()
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        with packed:
            after = layer(x)
    assert not torch.allclose(before, expected)
    torch.testing.assert_close(after, expected)


def test_packed_linears_leave_training_and_autocast_alone(monkeypatch):
    layer = torch.nn.Linear(8, 4)
    monkeypatch.setattr(kernels, "packed_linear", lambda *a: pytest.fail("packed path taken"))
    with PackedLinears(layer, min_size=0):
        out = layer(torch.randn(2, 8))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            assert layer(torch.randn(2, 8)).dtype == torch.bfloat16  # autocast's F.linear ran
    assert out.requires_grad  # with grad on, F.linear itself runs


def test_kv_slab_matches_a_concatenating_buffer():
    torch.manual_seed(0)
    static, buffer = KVSlab(capacity=3), KVBuffer()
    for step, (n, keep) in enumerate([(2, 2), (4, 5), (3, 4), (1, 5), (6, 9), (2, 3)]):
        k, v = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)
        got, expected = static.update(k, v), buffer.update(k, v)
        torch.testing.assert_close(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1])
        static.crop(keep)
        buffer.crop(keep)
        assert static.get_seq_length() == buffer.get_seq_length(), step
    assert static.slab_k.shape[2] >= 9  # grew past its first capacity


def test_slab_cache_rollback_and_path_keeping_equal_recomputation(target):
    runner = TargetRunner(target)
    runner.reset()
    runner.cache = decoding_cache(target.config, capacity=3)  # small: it must grow on the way
    assert all(isinstance(layer, KVSlab) for layer in runner.cache.layers)
    prompt, tree, path = [4, 8, 15, 16, 23], hand_tree([42, 7, 9, 11, 30, 2]), [0, 2, 5]
    runner.forward(prompt[:-1])
    runner.forward([prompt[-1], 20, 21, 22])  # a chain of 3: the last two rejected
    runner.rollback(2)
    start = runner.cached()
    runner.forward([24] + tree.tokens.tolist(), tree)  # 24: the round's pending token
    runner.keep_path(start, path)
    sequence = prompt + [20] + [24] + tree.tokens[path].tolist()
    assert runner.cached() == len(sequence)
    assert all(layer.keys.shape[2] == len(sequence) for layer in runner.cache.layers)  # views of the live rows
    assert_cache_is_recomputation(target, runner.cache.layers, sequence)
    logits, _, _ = runner.forward([13])
    full = target(torch.tensor([sequence + [13]])).logits[0, -1]
    torch.testing.assert_close(logits[-1], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [None, TreeShape(3, 3, 8), TreeShape(3, 2, 6, lookup=4)])
def test_fast_and_reference_runtimes_decode_the_same_tokens(target, shape, monkeypatch):
    monkeypatch.setattr(kernels, "MIN_PACKED_SIZE", 0)  # the test model's weights are small: pack them all
    drafter = proposers(target)["eagle3"]
    outputs = {}
    for fast in (True, False):
        proposer = FeatureProposer(drafter.drafter, V, drafter.aux_layer_ids, fast=fast)
        runner = TargetRunner(target, proposer.aux_layer_ids, fast=fast)
        assert isinstance(runner.linears, PackedLinears) and bool(runner.linears.linears) == fast
        out = generate(runner, proposer, [5, 9, 5, 9, 5], 30, Static(3), tree=shape)
        outputs[fast] = out.tokens, [r.accepted for r in out.rounds]
        assert isinstance(proposer.cache, KVSlab if fast else KVBuffer)
    assert outputs[True] == outputs[False]


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 13])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_equals_transformers_sdpa(rows, masked, dtype):
    """Grouped query heads folded into rows: the same attention as transformers' SDPA path with
    every key and value repeated per head, with and without a (tree-like) mask."""
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(rows)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 3, True
    query = torch.randn(1, 6, rows, 16, dtype=dtype)
    key, value = torch.randn(2, 1, 2, 40 + rows, 16, dtype=dtype)
    mask = None
    if masked or rows > 1:  # several rows always come with a mask in a decode (a chain's or a tree's)
        mask = torch.rand(1, 1, rows, 40 + rows) > 0.3
        mask[..., :40] = True
    got, _ = kernels.decode_attention(module, query, key, value, mask, scaling=0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.float(), repeat_kv(key, 3).float(), repeat_kv(value, 3).float(), attn_mask=mask, scale=0.25).transpose(1, 2)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tolerance, rtol=tolerance)
    assert got.shape == (1, rows, 6, 16)


def test_a_forwards_mask_is_built_once_for_all_its_layers(target, monkeypatch):
    """Every layer of a verification forward gets the same boolean mask; its additive (and folded) form is
    built once per forward, not by torch in each layer, and built again when the mask is written in place,
    with the same logits as transformers' SDPA path."""
    target = copy.deepcopy(target).to(torch.bfloat16)
    build, built = kernels._LayerMask.build, []
    monkeypatch.setattr(kernels._LayerMask, "build", staticmethod(lambda *a: built.append(a[1:]) or build(*a)))
    runners = {fast: TargetRunner(target, fast=fast) for fast in (True, False)}
    tree = DraftTree(tokens=torch.arange(30, 42), parents=torch.tensor([-1, -1, 0, 0, 1] + list(range(4, 11))),
                     depth=torch.tensor([1, 1, 2, 2, 2] + list(range(3, 10))), scores=torch.zeros(12))
    for tokens, shape, folded in (([23, 42, 7], None, True), ([23] + tree.tokens.tolist(), tree, False)):
        logits, builds = {}, {}
        for fast, runner in runners.items():
            runner.reset()
            runner.forward([4, 8, 15, 16])
            built.clear()
            logits[fast], _, _ = runner.forward(tokens, shape)
            builds[fast] = list(built)
        groups = target.config.num_attention_heads // target.config.num_key_value_heads
        assert builds == {True: [(groups if folded else 1, 4 + len(tokens), torch.bfloat16)], False: []}  # once, not a layer
        torch.testing.assert_close(logits[True].float(), logits[False].float(), atol=3e-2, rtol=3e-2)
    mask = torch.ones(1, 1, 2, 6, dtype=torch.bool)
    first = kernels._LayerMask.get(mask, 1, 6, torch.float32)
    assert kernels._LayerMask.get(mask, 1, 6, torch.float32) is first
    mask[..., -1] = False  # a fixed buffer rewritten for the next forward (a runner with graphs rewrites its own)
    again = kernels._LayerMask.get(mask, 1, 6, torch.float32)
    assert again[..., -1].eq(float("-inf")).all()
    # while a CUDA graph records (after an eager warm-up on the same buffer), the build must be in the graph
    monkeypatch.setattr(kernels, "_capturing", lambda tensor: True)
    assert kernels._LayerMask.get(mask, 1, 6, torch.float32) is not again


def test_decode_attention_folds_the_one_token_step(target, monkeypatch):
    """In bf16 the autoregressive step runs every layer's attention as key heads × g rows (no
    grouped-query call, no repeated keys), and gives the reference path's logits."""
    target = copy.deepcopy(target).to(torch.bfloat16)
    sdpa, shapes = torch.nn.functional.scaled_dot_product_attention, []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **kw: shapes.append((tuple(q.shape), kw.get("enable_gqa", False))) or sdpa(q, *a, **kw))
    logits = {}
    for fast in (True, False):
        runner = TargetRunner(target, fast=fast)
        runner.reset()
        runner.forward([4, 8, 15, 16])
        shapes.clear()
        logits[fast], _, _ = runner.forward([23])
        if fast:
            config = target.config
            groups = config.num_attention_heads // config.num_key_value_heads
            head_dim = config.hidden_size // config.num_attention_heads
            assert shapes == [((1, config.num_key_value_heads, groups, head_dim), False)] * config.num_hidden_layers
            assert target.config._attn_implementation == "sdpa"  # switched back after the call
    torch.testing.assert_close(logits[True].float(), logits[False].float(), atol=3e-2, rtol=3e-2)


def decodes_like_eager(target, compile, seeds: int) -> TargetRunner:
    """A runner compiled as `compile` gives the eager runner's forwards and, in chains and in trees with a
    lookup branch (the EAGLE-3 drafter's fused aux layers read through the same graphs), the target's own
    greedy text."""
    proposer = proposers(target)["eagle3"]
    compiled = TargetRunner(target, proposer.aux_layer_ids, compile=compile)
    eager = TargetRunner(target, proposer.aux_layer_ids)
    for runner in (compiled, eager):
        runner.reset()
        runner.forward([4, 8, 15, 16])
    for got, expected in zip(compiled.forward([23, 42]), eager.forward([23, 42])):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    for prompt, expected in greedy_cases(target, seeds=seeds):
        assert generate(compiled, proposer, prompt, 24, Static(3)).tokens == expected
        assert generate(compiled, proposer, prompt, 24, Static(0), tree=TreeShape(3, 2, 5, 3)).tokens == expected
    return compiled


@pytest.mark.compile  # cold inductor compiles: `make test-compile`, which CI runs too
def test_a_frozen_compile_decodes_the_targets_own_greedy_output(target):
    """compile="frozen": the torch.compile'd decoder (inductor, frozen weights) decodes as the eager runner does."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    decodes_like_eager(target, "frozen", seeds=2)
    assert counters["stats"]["unique_graphs"] > graphs  # the decoder did go through inductor


@pytest.mark.compile  # cold inductor compiles: `make test-compile`, which CI runs too
def test_a_cached_compile_decodes_the_targets_own_greedy_output_and_is_stored(target, tmp_path, monkeypatch):
    """compile="cached": the decoder's packed linears traced as draftsmith's operator, the weights inputs of
    the graph. It decodes as the eager runner does, and inductor's graph cache stores every compiled graph
    (a frozen graph it bypasses), so a later process loads them."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "MIN_PACKED_SIZE", 0)  # the test model's weights are small: pack them all
    bypassed, stored = counters["inductor"]["fxgraph_cache_bypass"], counters["inductor"]["fxgraph_cache_miss"]
    compiled = decodes_like_eager(target, "cached", seeds=1)
    assert compiled.linears.linears  # the decoder's linears are packed here (fp32 on a CPU with oneDNN)
    assert counters["inductor"]["fxgraph_cache_miss"] > stored  # compiled and stored ...
    assert counters["inductor"]["fxgraph_cache_bypass"] == bypassed  # ... none refused
    assert any(tmp_path.rglob("*")), "inductor wrote nothing to its cache"


def test_compile_modes_are_checked(target):
    assert TargetRunner(target, compile=True).compile_mode == "cached"  # `--compile` alone: the mode a cache keeps
    with pytest.raises(DraftsmithError, match="compile must be"):
        TargetRunner(target, compile="fast")


@pytest.mark.compile  # cold inductor compiles: `make test-compile`, which CI runs too
def test_a_compiled_tree_forward_is_one_graph(target):
    """A tree's verification (several rows under a mask, the grouped-query case no fold takes) compiles
    without a graph break, so it runs as one compiled graph rather than a graph per layer (transformers
    reaches torch's grouped-query mode under a mask through an environment switch dynamo cannot trace),
    and gives the eager runner's logits."""
    from torch._dynamo.utils import counters

    proposer = proposers(target)["eagle3"]
    compiled = TargetRunner(target, proposer.aux_layer_ids, compile=True)
    eager = TargetRunner(target, proposer.aux_layer_ids)
    tree = DraftTree(tokens=torch.tensor([3, 7, 9] + list(range(10, 20))), parents=torch.tensor([-1, -1, 0] + list(range(2, 12))),
                     depth=torch.tensor([1, 1, 2] + list(range(3, 13))), scores=torch.zeros(13))
    compiled.reset()
    compiled.forward([4])  # a process's first trace breaks once in transformers' output capturing (a lock)
    breaks = sum(counters["graph_break"].values())
    outputs = []
    for runner in (compiled, eager):
        runner.reset()
        runner.forward([4, 8, 15, 16])
        outputs.append(runner.forward([23] + tree.tokens.tolist(), tree))
    assert sum(counters["graph_break"].values()) == breaks
    for got, expected in zip(*outputs):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
