"""The round-cost machinery (runtime/kernels.py, runtime/cache.py) against what it replaces:
skinny linears against F.linear, preallocated KV slabs against recomputation and against
transformers' concatenating cache, the fast runtime against the reference one."""

import pytest
import torch
from transformers import DynamicCache

import draftsmith.runtime.kernels as kernels
from draftsmith.models.common import KVBuffer, cache_kwargs
from draftsmith.runtime.cache import SlabLayer, StaticKV, decoding_cache
from draftsmith.runtime.generate import TargetRunner, generate
from draftsmith.runtime.kernels import SkinnyLinears, skinny_linear
from draftsmith.runtime.policies import Static
from draftsmith.runtime.proposers import FeatureProposer
from draftsmith.runtime.tree import TreeShape
from tests.runtime.conftest import V
from tests.runtime.test_generate import proposers
from tests.runtime.test_tree import hand_tree


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 13, 16, 25, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear(rows, bias):
    torch.manual_seed(rows)
    layer = torch.nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    with torch.no_grad():
        got = skinny_linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert got.shape == (1, rows, 80) and got.is_contiguous()


def test_skinny_linears_switch_nested_and_restore(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    calls = []
    monkeypatch.setattr(kernels, "skinny_linear", lambda x, w, b=None: calls.append(x.shape) or torch.nn.functional.linear(x, w, b))
    skinny = SkinnyLinears(model)
    x = torch.randn(3, 8)
    with torch.no_grad(), skinny:
        with skinny:  # nested: still on inside, off only after the outermost
            model(x)
        model(x)
    assert len(calls) == 4
    assert all("forward" not in m.__dict__ for m in model)  # the modules are as they were
    model(x)
    assert len(calls) == 4
    assert SkinnyLinears(model, enabled=False).linears == []


def test_skinny_linears_leave_training_alone():
    layer = torch.nn.Linear(8, 4)
    with SkinnyLinears(layer):
        out = layer(torch.randn(2, 8))
    assert out.requires_grad  # with grad on, F.linear itself runs


def test_static_kv_matches_a_concatenating_buffer():
    torch.manual_seed(0)
    static, buffer = StaticKV(capacity=3), KVBuffer()
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
    assert all(isinstance(layer, SlabLayer) for layer in runner.cache.layers)
    prompt, tree, path = [4, 8, 15, 16, 23], hand_tree([42, 7, 9, 11, 30, 2]), [0, 2, 5]
    runner.forward(prompt[:-1])
    runner.forward([prompt[-1], 20, 21, 22])  # a chain of 3: the last two rejected
    runner.rollback(2)
    start = runner.cached()
    runner.forward([24] + tree.tokens.tolist(), tree)  # 24: the round's pending token
    runner.keep_path(start, path)
    sequence = prompt + [20] + [24] + tree.tokens[path].tolist()
    assert runner.cached() == len(sequence)
    fresh = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=torch.tensor([sequence]), use_cache=True, **cache_kwargs(target, fresh))
    for mine, theirs in zip(runner.cache.layers, fresh.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    logits, _, _ = runner.forward([13])
    full = target(torch.tensor([sequence + [13]])).logits[0, -1]
    torch.testing.assert_close(logits[-1], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [None, TreeShape(3, 3, 8), TreeShape(3, 2, 6, lookup=4)])
def test_fast_and_reference_runtimes_decode_the_same_tokens(target, shape):
    drafter = proposers(target)["eagle3"]
    outputs = {}
    for fast in (True, False):
        proposer = FeatureProposer(drafter.drafter, V, drafter.aux_layer_ids, fast=fast)
        runner = TargetRunner(target, proposer.aux_layer_ids, fast=fast)
        assert isinstance(runner.skinny, SkinnyLinears) and bool(runner.skinny.linears) == fast
        out = generate(runner, proposer, [5, 9, 5, 9, 5], 30, Static(3), tree=shape)
        outputs[fast] = out.tokens, [r.accepted for r in out.rounds]
        assert isinstance(proposer.cache, StaticKV if fast else KVBuffer)
    assert outputs[True] == outputs[False]
