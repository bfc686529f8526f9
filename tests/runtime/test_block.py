"""The block proposer (DFlash, DSpark): the target's own greedy text, the target's exact law when
sampling (with a fixed block, with DSpark's confidence policy, and as trees, P-EAGLE's too), and the block
layout's attention."""

from collections import Counter

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models.block import BlockDrafter, DSparkDrafter, block_attention
from draftsmith.models.eagle3 import PEagleDrafter
from draftsmith.runtime.block import BlockProposer
from draftsmith.runtime.generate import generate
from draftsmith.runtime.policies import BlockConfidence, Static
from draftsmith.runtime.proposers import FeatureProposer
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.sampling import SamplingConfig
from draftsmith.runtime.steps import DraftStep
from draftsmith.runtime.tree import TreeShape, slot_tree
from draftsmith.train.block import block_layout, draw_anchors
from tests.conftest import make_llama
from tests.runtime.conftest import V, greedy_cases
from tests.runtime.test_generate import assert_follows_law, exact_law


def block_drafter(target, kind: str, vocab: int, aux: int, spread: float = 1.0, **options):
    """A random DFlash or DSpark drafter for `target`; DSpark's Markov bias and confidence head made to matter."""
    torch.manual_seed(5)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    cls = DSparkDrafter if kind == "dspark" else BlockDrafter
    extra = {"markov_rank": 4, "confidence_head": True} if kind == "dspark" else {}
    drafter = cls.from_target(target.config, embed, head, None, None, aux, target.config.hidden_size,
                              mask_token_id=vocab - 1, **{**extra, **options})
    if drafter.markov_head is not None:
        with torch.no_grad():
            torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=spread)
            torch.nn.init.normal_(drafter.markov_head.markov_w1.weight, std=spread)
    return drafter.eval()


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
@pytest.mark.parametrize("policy", [lambda: Static(3), lambda: Static(8), lambda: BlockConfidence(threshold=0.3, k=8)])
def test_greedy_output_is_the_targets_own(target, kind, policy):
    if kind == "dflash" and isinstance(policy(), BlockConfidence):
        pytest.skip("DFlash has no confidence head")
    proposer = BlockProposer(block_drafter(target, kind, V, 3, block_size=5), V, [0, 1, 2])
    runner = TargetRunner(target, proposer.aux_layer_ids)
    drafted = 0
    for prompt, expected in greedy_cases(target):
        out = generate(runner, proposer, prompt, 24, policy())
        assert out.tokens == expected
        drafted += sum(r.drafted for r in out.rounds)
        assert max(r.drafted for r in out.rounds) <= proposer.drafter.drafts_per_block
    assert drafted > 0


@pytest.mark.proof
@pytest.mark.parametrize("kind, policy", [("dflash", lambda: Static(3)), ("dspark", lambda: Static(3)),
                                          ("dspark", lambda: BlockConfidence(threshold=0.5, k=3))])
def test_sampling_is_lossless(kind, policy):
    """χ² of 2000 sampled 3-token continuations against the target's exact law at T = 1; DSpark's tokens are
    drawn slot by slot under the Markov bias of the token drawn before, its confidence cutting blocks short."""
    tv, length, n = 4, 3, 2000
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    cfg = SamplingConfig(temperature=1.0)
    prompt = [1, 2]
    law = exact_law(target, prompt, length, cfg)
    drafter = block_drafter(target, kind, tv, 2, spread=2.0, block_size=4)
    if drafter.confidence_head is not None:
        with torch.no_grad():
            drafter.confidence_head.proj.weight.normal_(std=3.0)  # a spread of confidences
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(target, [0, 1])
    proposer = BlockProposer(drafter, tv, [0, 1])
    outs = [generate(runner, proposer, prompt, length, policy(), cfg, generator=g) for _ in range(n)]
    assert any(r.drafted for o in outs for r in o.rounds)
    if isinstance(policy(), BlockConfidence):
        assert len({r.drafted for o in outs for r in o.rounds}) > 1, "the confidence never changed the block"
    assert_follows_law(Counter(tuple(o.tokens) for o in outs), law)


@pytest.mark.proof
def test_parallel_eagle_sampling_is_lossless():
    """P-EAGLE: tokens 2..K drawn from one forward over mask positions (laws fixed before any draw); four
    tokens, so that a round after the first drafts two of them."""
    tv, length, n = 3, 4, 3000
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(target, [1, 2], length, cfg)
    torch.manual_seed(5)
    drafter = PEagleDrafter(target.config, target.model.embed_tokens.weight, target.lm_head.weight, None,
                            torch.arange(tv), 2, 16, mask_token_id=2).eval()
    with torch.no_grad():
        drafter.mask_hidden.mul_(20)  # parallel positions whose laws differ from the first token's
    proposer = FeatureProposer(drafter, tv, [0, 1])
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(target, [0, 1])
    outs = [generate(runner, proposer, [1, 2], length, Static(3), cfg, generator=g) for _ in range(n)]
    assert max(r.drafted for o in outs for r in o.rounds) == 2 and proposer.forwards > 0
    assert_follows_law(Counter(tuple(o.tokens) for o in outs), law)


def test_the_confidence_policy_cuts_the_block_where_the_product_falls():
    policy = BlockConfidence(threshold=0.5, k=8)
    decisions = [policy.keep_going(DraftStep(i, confidence=c)) for i, c in enumerate([0.9, 0.8, 0.6, 0.95])]
    assert decisions == [True, True, False, False]  # Π c: 0.9, 0.72, then 0.432 < 0.5
    assert policy.keep_going(DraftStep(0, confidence=0.4)) is False  # nothing is worth drafting
    with pytest.raises(DraftsmithError, match="confidence head"):
        policy.keep_going(DraftStep(0))


def test_a_slot_tree_keeps_each_levels_best_children():
    """Depth 1 from `first`; depth 2 from `later` under the best depth-1 nodes (asked with their target ids),
    then the best nodes kept: a tie goes to the shallower node."""
    to_target, asked = torch.tensor([10, 11, 12]), []
    first = torch.tensor([0.5, 0.3, 0.2]).log()

    def same(j, parents):  # P-EAGLE, DFlash: one law for every parent
        asked.append(parents.tolist())
        return torch.tensor([0.6, 0.4, 1e-9]).log().expand(len(parents), -1)

    tree = slot_tree(first, same, TreeShape(2, 2, 3), to_target)
    assert asked == [[10, 11]]
    assert (tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()) == ([10, 11, 10], [-1, -1, 0], [1, 1, 2])

    def markov(j, parents):  # DSpark: the law depends on the parent
        rows = {10: [0.6, 0.4, 1e-9], 11: [0.05, 0.05, 0.9]}
        return torch.tensor([rows[p] for p in parents.tolist()]).log()

    tree = slot_tree(first, markov, TreeShape(2, 2, 4), to_target)
    assert (tree.tokens.tolist(), tree.parents.tolist()) == ([10, 11, 10, 12], [-1, -1, 0, 1])
    torch.testing.assert_close(tree.scores.exp(), torch.tensor([0.5, 0.3, 0.3, 0.27]))


def tree_proposer(target, kind: str, vocab: int, aux: int, spread: float = 1.0):
    """A block (dflash, dspark) or P-EAGLE proposer for trees; P-EAGLE's parallel laws made to differ."""
    if kind != "peagle":
        return BlockProposer(block_drafter(target, kind, vocab, aux, spread=spread, block_size=5), vocab, list(range(aux)))
    torch.manual_seed(5)
    drafter = PEagleDrafter(target.config, target.model.embed_tokens.weight, target.lm_head.weight, None,
                            torch.arange(vocab), aux, target.config.hidden_size, mask_token_id=vocab - 1).eval()
    with torch.no_grad():
        drafter.mask_hidden.mul_(20)
    return FeatureProposer(drafter, vocab, list(range(aux)))


@pytest.mark.parametrize("kind", ["dflash", "dspark", "peagle"])
@pytest.mark.parametrize("shape", [TreeShape(3, 2, 6), TreeShape(4, 3, 12)])
def test_block_and_parallel_trees_give_the_targets_greedy_text(target, kind, shape):
    """Trees drawn from one drafter forward a round (two for P-EAGLE's observe and mask forward)."""
    proposer = tree_proposer(target, kind, V, 3)
    runner = TargetRunner(target, proposer.aux_layer_ids)
    for prompt, expected in greedy_cases(target):
        out = generate(runner, proposer, prompt, 24, Static(0), tree=shape)
        assert out.tokens == expected
        assert all(r.drafter_forwards <= (2 if kind == "peagle" else 1) for r in out.rounds)
        assert any(r.drafted > r.depth for r in out.rounds)  # a tree, not a chain
        assert all(r.drafted <= shape.total_tokens and r.depth <= shape.depth for r in out.rounds)


@pytest.mark.parametrize("kind", ["dflash", "dspark", "peagle"])
def test_a_trees_best_path_is_the_greedy_chain_with_its_law(target, kind):
    """Along the best child of the best child …, a tree holds the greedy chain the same drafter drafts, each
    node scored by the log-probability of its path under the chain's laws (DSpark's under the Markov bias
    of each parent)."""
    prompt = [1, 2, 3, 4]
    drafted = {}
    for what in ("tree", "chain"):
        proposer = tree_proposer(target, kind, V, 3)
        runner = TargetRunner(target, proposer.aux_layer_ids)
        logits, final, aux = runner.forward(prompt, last_logits=True)
        first = int(logits[-1].argmax())
        proposer.observe(prompt[1:] + [first], final, aux)
        drafted[what] = proposer.propose_tree(TreeShape(3, 3, 30)) if what == "tree" else \
            proposer.propose(prompt + [first], Static(3), 3, SamplingConfig(), None)
    tree, (tokens, _, raw) = drafted["tree"], drafted["chain"]
    node, score = -1, 0.0
    for depth, token in enumerate(tokens):
        kids = [i for i in range(len(tree)) if int(tree.parents[i]) == node]
        node = max(kids, key=lambda i: float(tree.scores[i]))
        score += float(raw[depth, token].log())
        assert int(tree.tokens[node]) == token and int(tree.depth[node]) == depth + 1
        assert float(tree.scores[node]) == pytest.approx(score, abs=1e-4)


@pytest.mark.proof
@pytest.mark.parametrize("kind", ["dspark", "peagle"])
def test_block_and_parallel_tree_sampling_is_lossless(kind):
    """χ² of 2000 sampled 3-token continuations at T = 1 with trees of two levels (DSpark's second level
    under each parent's Markov bias)."""
    tv, length, n = 4, 3, 2000
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    cfg = SamplingConfig(temperature=1.0)
    law = exact_law(target, [1, 2], length, cfg)
    proposer, g = tree_proposer(target, kind, tv, 2, spread=2.0), torch.Generator().manual_seed(0)
    runner = TargetRunner(target, [0, 1])
    outs = [generate(runner, proposer, [1, 2], length, Static(0), cfg, generator=g, tree=TreeShape(2, 2, 4))
            for _ in range(n)]
    assert any(r.drafted > r.depth for o in outs for r in o.rounds)
    assert_follows_law(Counter(tuple(o.tokens) for o in outs), law)


def test_the_block_layout_is_the_formats():
    """Anchors 0 and 2 of 5 positions, blocks of 3: the slots sit at anchor..anchor+2 and see the context
    before their anchor only (the first block none of it)."""
    positions, visible = block_layout(torch.tensor([[0, 2]]), 3, 5)
    assert positions.tolist() == [[0, 1, 2, 2, 3, 4]]
    assert visible.int().tolist() == [[[0, 0, 0, 0, 0], [1, 1, 0, 0, 0]]]
    anchors, real = draw_anchors(torch.tensor([[False, True, True, False, True], [False, False, False, True, False]]), 2,
                                 torch.Generator().manual_seed(0))
    assert real.tolist() == [[True, True], [True, False]] and anchors[1].tolist() == [3, 0]
    assert set(anchors[0].tolist()) <= {1, 2, 4} and anchors[0, 0] < anchors[0, 1]


def test_block_attention_is_dense_attention_under_the_anchor_block_mask():
    """The attention over [context | all blocks] keys with the mask the `speculators` format defines (a
    block sees the context before its anchor and its whole own block, no other block), computed densely,
    equals `block_attention`, explicit (scores against the context and the own block only) and fused."""
    g = torch.Generator().manual_seed(0)
    t, a, b, h, kv, hd = 6, 3, 4, 4, 2, 8
    anchors = torch.tensor([[1, 3, 5]])
    q = torch.randn(1, h, a * b, hd, generator=g)
    k_blk, v_blk = torch.randn(1, kv, a * b, hd, generator=g), torch.randn(1, kv, a * b, hd, generator=g)
    k_ctx, v_ctx = torch.randn(1, kv, t, hd, generator=g), torch.randn(1, kv, t, hd, generator=g)
    _, visible = block_layout(anchors, b, t)
    got = block_attention(q, k_blk, v_blk, k_ctx, v_ctx, visible, hd ** -0.5)
    allowed = torch.zeros(a * b, t + a * b, dtype=torch.bool)
    for i in range(a):
        rows = slice(i * b, (i + 1) * b)
        allowed[rows, : int(anchors[0, i])] = True
        allowed[rows, t + i * b: t + (i + 1) * b] = True
    keys = torch.cat([k_ctx, k_blk], 2).repeat_interleave(h // kv, 1)
    values = torch.cat([v_ctx, v_blk], 2).repeat_interleave(h // kv, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    # the fused form (a GPU's default) is the same attention
    inputs = [x.clone().requires_grad_() for x in (q, k_blk, v_blk, k_ctx, v_ctx)]
    fused = block_attention(*inputs, visible, hd ** -0.5, fused=True)
    torch.testing.assert_close(fused, dense, atol=1e-5, rtol=1e-5)
    explicit = [x.clone().requires_grad_() for x in (q, k_blk, v_blk, k_ctx, v_ctx)]
    weights = torch.randn(dense.shape, generator=g)
    (fused * weights).sum().backward()
    (block_attention(*explicit, visible, hd ** -0.5) * weights).sum().backward()
    for x, y in zip(inputs, explicit):
        torch.testing.assert_close(x.grad, y.grad, atol=1e-5, rtol=1e-5)
