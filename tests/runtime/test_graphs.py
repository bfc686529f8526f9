"""The fixed-shape runner of runtime/graphs.py, as a CPU runs it (the same forward a GPU records
into CUDA graphs, run eagerly): rollback and path keeping against recomputation, slab growth,
the plain runner's tokens for chains, trees and lookup branches, and no host sync in the recorded
forward (run on the meta device, where any read of a tensor's value fails)."""

import copy
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from draftsmith import DraftsmithError
from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.cache import KVSlab
from draftsmith.runtime.graphs import DrafterGraphs, compile_blocks
from draftsmith.runtime.cost import CostAware
from draftsmith.runtime.policies import Static
from draftsmith.runtime.proposers import FeatureProposer
from draftsmith.runtime.sampling import SamplingConfig
from draftsmith.runtime.tree import DraftTree, TreeShape
from tests.conftest import make_llama
from tests.runtime.conftest import V, assert_cache_is_recomputation, greedy_cases
from tests.runtime.test_generate import assert_follows_law, exact_law, proposers
from tests.runtime.test_tree import hand_tree, peaky_drafter


def test_fixed_slabs_roll_back_keep_paths_and_grow_as_recomputation(target):
    runner = TargetRunner(target, capacity=8, graphs=True)  # small: it must grow on the way
    runner.reset()
    assert runner.graphs.capacity == 64 and all(isinstance(layer, KVSlab) and layer.owner is runner.graphs for layer in runner.cache.layers)
    prompt, tree, path = [i % 50 for i in range(4, 64)], hand_tree([42, 7, 9, 11, 30, 2]), [0, 2, 5]
    runner.forward(prompt[:-1], last_logits=True)
    runner.forward([prompt[-1], 20, 21, 22])  # a chain of 3: the last two rejected
    runner.rollback(2)
    start = runner.cached()
    runner.forward([24] + tree.tokens.tolist(), tree)  # 24: the round's pending token; 69 rows: grows to 128
    assert runner.graphs.capacity == 128
    runner.keep_path(start, path)
    sequence = prompt + [20] + [24] + tree.tokens[path].tolist()
    assert runner.cached() == len(sequence)
    assert all(layer.keys.shape[2] == 128 for layer in runner.cache.layers)
    assert_cache_is_recomputation(target, runner.cache.layers, sequence)
    logits, final, _ = runner.forward([13, 14])
    full = target(torch.tensor([sequence + [13, 14]]), output_hidden_states=True)
    torch.testing.assert_close(logits, full.logits[0, -2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, full.hidden_states[-1][0, -2:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [None, TreeShape(3, 3, 8), TreeShape(3, 2, 6, lookup=4)])
def test_fixed_runner_decodes_the_plain_runners_tokens(target, shape):
    """Same tokens and acceptances as TargetRunner, over several prompts through one runner (a reset
    keeps the slabs), with the EAGLE-3 drafter's fused aux features read from the fixed forward."""
    proposer = proposers(target)["eagle3"]
    fixed = TargetRunner(target, proposer.aux_layer_ids, capacity=16, graphs=True)
    for prompt, expected in greedy_cases(target, new_tokens=30):
        outputs = []
        for runner in (fixed, TargetRunner(target, proposer.aux_layer_ids)):
            out = generate(runner, proposer, prompt, 30, Static(3), tree=shape)
            outputs.append((out.tokens, [r.accepted for r in out.rounds]))
        assert outputs[0] == outputs[1]
        assert outputs[0][0] == expected


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", [None, TreeShape(3, 2, 10), TreeShape(4, 2, 14, lookup=4)])
def test_fixed_drafter_drafts_what_the_plain_drafter_does(target, kind, shape):
    """A drafter on a fixed slab (its anchors, drafted steps and tree levels written at slots, attention
    over the slab under a padded mask, the slab outgrown on the way) drafts the plain drafter's tokens
    with the same distributions and scores. The trees keep every candidate, so the deepest levels (whose
    nodes must not see their parents' siblings) are compared too."""
    base = proposers(target)[kind]
    fixed = FeatureProposer(base.drafter, V, base.aux_layer_ids)
    fixed.enable_graphs(capture=False)
    fixed.graphs.capacity = 64  # from 1024: the prompts below outgrow it
    assert fixed.cache is fixed.graphs.cache and isinstance(fixed.cache, KVSlab)
    for prompt, expected in greedy_cases(target, prompt_length=40, new_tokens=30):
        outputs = []
        for proposer in (fixed, FeatureProposer(base.drafter, V, base.aux_layer_ids)):
            drafts = recording(proposer)
            out = generate(TargetRunner(target, proposer.aux_layer_ids, graphs=True), proposer, prompt, 30, Static(3), tree=shape)
            outputs.append((out.tokens, drafts))
        assert outputs[0][0] == outputs[1][0] == expected
        assert [tokens for tokens, _ in outputs[0][1]] == [tokens for tokens, _ in outputs[1][1]]
        for (_, mine), (_, plain) in zip(outputs[0][1], outputs[1][1]):
            torch.testing.assert_close(mine, plain, atol=1e-5, rtol=1e-5)
    assert fixed.graphs.capacity == 128


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=5)])
def test_fixed_sampled_chain_draws_what_the_plain_chain_draws(target, cfg):
    """A sampled chain drafted whole at fixed shapes (each token drawn on the device) takes the plain
    drafter's tokens from the same generator, round after round, with the same distributions."""
    base = proposers(target)["eagle3"]
    fixed = FeatureProposer(base.drafter, V, base.aux_layer_ids)
    fixed.enable_graphs(capture=False)
    whole = []
    fixed._fixed_chain = lambda *a, real=fixed._fixed_chain: whole.append(a[0]) or real(*a)
    for prompt, _ in greedy_cases(target, seeds=2, prompt_length=40, new_tokens=30):
        outputs = []
        for proposer in (fixed, FeatureProposer(base.drafter, V, base.aux_layer_ids)):
            drafts = recording(proposer)
            out = generate(TargetRunner(target, proposer.aux_layer_ids, graphs=True), proposer, prompt, 30, Static(3), cfg,
                           generator=torch.Generator().manual_seed(11))
            outputs.append((out.tokens, drafts))
        assert outputs[0][0] == outputs[1][0]
        assert [tokens for tokens, _ in outputs[0][1]] == [tokens for tokens, _ in outputs[1][1]]
        for (_, mine), (_, plain) in zip(outputs[0][1], outputs[1][1]):
            torch.testing.assert_close(mine, plain, atol=1e-5, rtol=1e-5)
    assert whole and set(whole) <= {1, 2, 3} and whole.count(3) > len(whole) // 2  # every chain was drafted whole


@pytest.mark.proof
def test_fixed_sampled_chains_are_lossless():
    """χ² of 4000 sampled 4-token continuations against the target's exact law, every chain drafted whole."""
    tv, length, n = 4, 4, 4000
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    torch.manual_seed(5)
    proposer, cfg = FeatureProposer(peaky_drafter(target), tv), SamplingConfig(temperature=0.9, top_k=3)
    proposer.enable_graphs(capture=False)
    whole = []
    proposer._fixed_chain = lambda *a, real=proposer._fixed_chain: whole.append(a[0]) or real(*a)
    law = exact_law(target, [1, 2], length, cfg)
    g, runner = torch.Generator().manual_seed(0), TargetRunner(target)
    outs = [generate(runner, proposer, [1, 2], length, Static(2), cfg, generator=g) for _ in range(n)]
    assert whole.count(2) >= n and len({r.accepted for o in outs for r in o.rounds}) > 1
    counts = Counter(tuple(o.tokens) for o in outs)
    assert_follows_law(counts, law)


def recording(proposer) -> list[tuple[list[int], torch.Tensor]]:
    """Every draft the proposer makes, as it makes it: a chain's tokens and their raw distributions, or a
    tree's nodes and their path scores."""
    drafts = []
    for name in ("propose", "propose_tree"):
        def record(*args, real=getattr(proposer, name), **kwargs):
            out = real(*args, **kwargs)
            drafts.append((out.tokens.tolist(), out.scores) if isinstance(out, DraftTree) else (list(out[0]), out[2]))
            return out
        setattr(proposer, name, record)
    return drafts


def test_fixed_runner_sizes_trees_by_cost(target):
    """The cost policy times verification forwards of many row counts (one graph each on a GPU)."""
    proposer = proposers(target)["eagle"]
    for prompt, expected in greedy_cases(target, seeds=1, new_tokens=30):
        out = generate(TargetRunner(target, proposer.aux_layer_ids, graphs=True), proposer, prompt, 30, CostAware(4),
                       tree=TreeShape(3, 3, 8, lookup=3))
        assert out.tokens == expected


def test_recorded_forward_reads_no_tensor_value(target):
    """What a CUDA graph records must not synchronize with the host: on the meta device every such
    read (`.item()`, a tensor's truth value, a data-dependent shape) raises. Chains and trees, and the
    drafting of a whole tree and of a whole greedy or sampled chain (each one graph on a GPU)."""
    meta = copy.deepcopy(target).to("meta")
    for kind in ("eagle", "eagle3"):  # the drafters' forwards, as DrafterGraphs records them
        base = proposers(target)[kind]
        drafter = copy.deepcopy(base.drafter).to("meta")
        graphs = DrafterGraphs(drafter, capacity=64, capture=False)
        h = drafter.lm_head.in_features
        tokens, positions = torch.zeros(1, 3, dtype=torch.long, device="meta"), torch.zeros(1, 3, dtype=torch.long, device="meta")
        out = graphs(tokens, torch.zeros(1, 3, h, device="meta"), positions, torch.ones(1, 1, 3, 3, dtype=torch.bool, device="meta"))
        out = graphs(tokens[:, :1], out[:, -1:], positions[:, :1], torch.ones(1, 1, 1, 4, dtype=torch.bool, device="meta"))
        assert out.shape == (1, 1, h) and graphs.cache.length == 4
        # and a whole EAGLE-2 tree: candidates, scores, level masks and the reranking are built as tensors
        proposer = FeatureProposer(drafter, V, base.aux_layer_ids)
        proposer.enable_graphs(capture=False)
        width = target.config.hidden_size * max(1, len(base.aux_layer_ids))
        proposer.observe(list(range(6)), torch.zeros(6, target.config.hidden_size, device="meta"),
                         torch.zeros(6, width, device="meta") if base.aux_layer_ids else None)
        with NoScalarWrites():
            tree = proposer.propose_tree(TreeShape(4, 3, 10))
            tokens, scaled, raw = proposer._fixed_chain(3, SamplingConfig())  # and a greedy chain, read back only after
            drawn, _, _ = proposer._fixed_chain(3, SamplingConfig(temperature=0.8, top_k=5))  # and a sampled one
        assert tree.tokens.device.type == "meta" and tree.tokens.shape == tree.parents.shape == (10,)
        assert tokens.device.type == "meta" and tokens.shape == (3,) and scaled.shape == raw.shape == (3, V)
        assert drawn.device.type == "meta" and drawn.shape == (3,)
    runner = TargetRunner(meta, [0, 1, 2], capacity=64, capture=False, graphs=True)
    runner.reset()
    runner.forward(list(range(10)), last_logits=True)
    recorded = runner.graphs._run  # what a graph records: checked for Python scalars written into tensors too

    def run(*args):
        with NoScalarWrites():
            return recorded(*args)
    runner.graphs._run = run
    logits, final, aux = runner.forward([1, 2, 3])
    assert logits.device.type == "meta" and logits.shape == (3, target.config.vocab_size)
    assert aux.shape == (3, 3 * target.config.hidden_size)
    tree = hand_tree([42, 7, 9, 11, 30, 2])
    logits, _, _ = runner.forward([5] + tree.tokens.tolist(), tree)
    assert logits.shape[0] == 7 and runner.cached() == 20


class NoScalarWrites(TorchFunctionMode):
    """Fails on `tensor[...] = <Python number>`: PyTorch writes that into a CUDA tensor by a copy from the
    host, which a CUDA graph cannot record; the meta device does not show it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__setitem__ and not isinstance(args[2], torch.Tensor):
            raise AssertionError(f"a Python {type(args[2]).__name__} written into a tensor inside a recorded draft")
        return func(*args, **(kwargs or {}))


def test_graph_runner_refuses_what_it_cannot_run(target):
    from draftsmith.eval.evaluate import EvalConfig

    with pytest.raises(DraftsmithError, match="GPU"):
        TargetRunner(target, capture=True, graphs=True)
    with pytest.raises(DraftsmithError, match="set graphs=True too"):
        TargetRunner(target, compile_blocks=True)
    # eval's --compile compiles the decoder; with --graphs its blocks: a whole-decoder mode is refused, not ignored
    with pytest.raises(DraftsmithError, match="drop --compile_mode"):
        EvalConfig(target="", device="cuda", graphs=True, compile=True, compile_mode="frozen")
    assert EvalConfig(target="", device="cuda", graphs=True, compile=True).compile is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("shape", [None, TreeShape(3, 3, 8, lookup=4)])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_graphs_decode_the_plain_runners_tokens(target, shape, fused):
    """On a GPU: replayed graphs (one per row count, the slabs outgrown once on the way) give the
    eager runner's tokens and acceptances; `fused`: with the query heads folded into rows and the
    target's norms and MLPs compiled, recorded into the graphs."""
    gpu, base = copy.deepcopy(target).cuda(), proposers(target)["eagle3"]
    drafter = copy.deepcopy(base.drafter).cuda()
    proposer, graphed = FeatureProposer(drafter, V, base.aux_layer_ids), FeatureProposer(drafter, V, base.aux_layer_ids)
    graphed.enable_graphs()
    graphed.graphs.capacity = 64
    graphs = TargetRunner(gpu, proposer.aux_layer_ids, capacity=16, gqa=fused, compile_blocks=fused, graphs=True)
    if fused:
        assert gpu.get_decoder().layers[0].mlp._compiled_call_impl is not None
    assert graphs.graphs.capture and graphs.graphs.capacity == 64 and graphed.graphs.capture
    for prompt, expected in greedy_cases(target, prompt_length=40, new_tokens=30):
        outputs = []
        for runner, drafting in ((graphs, proposer), (graphs, graphed), (TargetRunner(gpu, proposer.aux_layer_ids), proposer)):
            out = generate(runner, drafting, prompt, 30, Static(3), tree=shape)
            outputs.append((out.tokens, [r.accepted for r in out.rounds]))
        assert outputs[0] == outputs[1] == outputs[2] and outputs[0][0] == expected
    assert graphs.graphs.recorded.graphs and graphs.graphs.capacity == 128
    assert graphed.graphs.recorded.graphs and graphed.graphs.capacity == 128


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_record_a_sampled_chain(target):
    """On a GPU: a sampled chain is one recorded graph per length and sampling setting, drawing from the
    graphs' own generator (seeded from the caller's, registered with the graph): every drafted token has
    q > 0, and the same seed decodes the same tokens again. Without a generator, torch's default one."""
    gpu, base = copy.deepcopy(target).cuda(), proposers(target)["eagle3"]
    drafter = copy.deepcopy(base.drafter).cuda()
    cfg, (prompt, _) = SamplingConfig(temperature=1.0), next(greedy_cases(target, seeds=1, prompt_length=40))
    runs = []
    for generator in (torch.Generator("cuda").manual_seed(3), torch.Generator("cuda").manual_seed(3), None):
        graphed = FeatureProposer(drafter, V, base.aux_layer_ids)
        graphed.enable_graphs()
        drafts = recording(graphed)
        out = generate(TargetRunner(gpu, graphed.aux_layer_ids, graphs=True), graphed, prompt, 30, Static(3), cfg, generator=generator)
        assert ("chain", 3, cfg) in graphed.graphs.recorded.graphs
        assert (graphed.graphs.generator is None) == (generator is None)
        assert all(bool(q[i, t] > 0) for tokens, q in drafts for i, t in enumerate(tokens))
        runs.append(out.tokens)
    assert runs[0] == runs[1]


def test_eval_graphs_setting_is_checked():
    from draftsmith.eval.evaluate import EvalConfig

    assert EvalConfig(target="", graphs=True, device="cuda").graphs
    with pytest.raises(DraftsmithError, match="needs --device cuda"):
        EvalConfig(target="", graphs=True)
    assert EvalConfig(target="", graphs=True, compile=True, device="cuda").compile  # compiled blocks in the graphs


def test_compile_blocks_picks_the_stateless_blocks(target):
    """Each layer's norms and MLP and the final norm are compiled; the attention is not; undone on request."""
    model = copy.deepcopy(target)
    decoder = model.get_decoder()
    blocks = compile_blocks(decoder)
    layer = decoder.layers[0]
    assert {id(b) for b in blocks} >= {id(layer.input_layernorm), id(layer.post_attention_layernorm), id(layer.mlp),
                                        id(decoder.norm)}
    assert all(b._compiled_call_impl is not None for b in blocks) and layer.self_attn._compiled_call_impl is None
    compile_blocks(decoder, enabled=False)
    assert all(b._compiled_call_impl is None for b in blocks)
