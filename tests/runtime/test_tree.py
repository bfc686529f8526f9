"""docs/metrics.md proof 7 (trees) and proofs 1, 3, 6 for tree drafts, on tiny random fp32 models."""

import os
from collections import Counter

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models.eagle import EagleDrafter
from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.policies import ClassifierStop, Static
from draftsmith.runtime.proposers import FeatureProposer
from draftsmith.runtime.standalone import ModelProposer
from draftsmith.runtime.sampling import SamplingConfig
from draftsmith.runtime.tree import (DraftTree, TreeShape, ancestor_matrix, graft, lookup_continuation, select_tree,
                                     tree_attention_mask, verify_tree)
from tests.conftest import make_llama
from tests.runtime.conftest import V, greedy_cases
from tests.runtime.test_generate import assert_follows_law, exact_law, proposers


#        root
#       /    \
#      0      1
#     / \      \
#    2   3      4
#    |
#    5
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2])



def build_tree(candidates: list[tuple[int, int, float, int]], total_tokens: int, device: torch.device) -> DraftTree:
    """A hand-made tree: rerank candidates (token, parent candidate index or -1, score, depth) and keep the
    `total_tokens` best, breadth-first, as the runtime's `select_tree` does."""
    tokens, parents, scores, depth = zip(*candidates) if candidates else ((), (), (), ())
    long = dict(dtype=torch.long, device=device)
    return select_tree(torch.tensor(tokens, **long), torch.tensor(parents, **long),
                       torch.tensor(scores, dtype=torch.float64, device=device), torch.tensor(depth, **long),
                       total_tokens)


def node_path(tree: DraftTree, node: int) -> list[int]:
    """Node indices from the root's child down to `node`."""
    out = []
    while node >= 0:
        out.append(node)
        node = int(tree.parents[node])
    return out[::-1]

def hand_tree(tokens):
    depth = torch.tensor([1, 1, 2, 2, 2, 3])
    return DraftTree(torch.tensor(tokens), PARENTS, depth, -depth.float())


def feature_proposers(target):
    every = proposers(target)
    return {"eagle": every["eagle"], "eagle3": every["eagle3"]}


def test_tree_mask_is_the_ancestor_matrix():
    anc = ancestor_matrix(PARENTS)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i, chain in enumerate([[0], [1], [0, 2], [0, 3], [1, 4], [0, 2, 5]]):
        expected[i, chain] = True
    assert torch.equal(anc, expected)
    mask = tree_attention_mask(hand_tree([1] * 6), cached=4, dtype=torch.float32)[0, 0]
    assert mask.shape == (7, 11)
    visible = mask == 0
    assert visible[:, :5].all()  # cache and root seen by every row
    assert not visible[0, 5:].any()  # the root sees no drafted node
    assert torch.equal(visible[1:, 5:], expected)
    with pytest.raises(DraftsmithError, match="parents must come before"):
        ancestor_matrix(torch.tensor([1, -1]))


def test_every_root_to_leaf_path_matches_the_chain_computation(target):
    runner = TargetRunner(target)
    prompt, tree = [4, 8, 15, 16, 23], hand_tree([42, 7, 9, 11, 30, 2])
    runner.reset()
    runner.forward(prompt[:-1])
    logits, _, _ = runner.forward([prompt[-1]] + tree.tokens.tolist(), tree)
    for leaf in (3, 4, 5):
        nodes = node_path(tree, leaf)
        chain = target(torch.tensor([prompt + tree.tokens[nodes].tolist()])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(logits[[0] + [1 + i for i in nodes]], chain, atol=1e-5, rtol=1e-5)


def test_tree_verification_attends_grouped_queries_without_repeating_the_cache(target, monkeypatch):
    """On a CPU the runner lets SDPA group the query heads itself (the tiny target has 4 heads over 2
    KV heads) instead of copying every cached key and value per head; the logits do not change."""
    import transformers.integrations.sdpa_attention as sdpa

    repeats, real_repeat = [], sdpa.repeat_kv
    monkeypatch.setattr(sdpa, "repeat_kv", lambda x, n: repeats.append(n) or real_repeat(x, n))
    prompt, tree = [4, 8, 15, 16, 23], hand_tree([42, 7, 9, 11, 30, 2])
    logits = {}
    for gqa in (False, True):
        runner = TargetRunner(target, gqa=gqa)
        runner.reset()
        runner.forward(prompt[:-1])
        repeats.clear()
        logits[gqa], _, _ = runner.forward([prompt[-1]] + tree.tokens.tolist(), tree)
        assert bool(repeats) != gqa  # the default path repeats K/V in every layer; the grouped one never
    assert TargetRunner(target).gqa and "TRANSFORMERS_SDPA_FORCE_GQA" not in os.environ
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keep", [[], [0], [0, 2], [0, 2, 5], [1, 4]])
def test_target_cache_keeps_exactly_the_accepted_path(target, keep):
    runner = TargetRunner(target)
    prompt, tree = [4, 8, 15, 16], hand_tree([42, 7, 9, 11, 30, 2])
    runner.reset()
    runner.forward(prompt[:-1])
    start = runner.cached()
    runner.forward([prompt[-1]] + tree.tokens.tolist(), tree)
    runner.keep_path(start, keep)
    logits, _, _ = runner.forward([13])
    full = target(torch.tensor([prompt + tree.tokens[keep].tolist() + [13]])).logits[0, -1]
    torch.testing.assert_close(logits[-1], full, atol=1e-5, rtol=1e-5)


def test_reranking_keeps_the_best_ancestor_closed_nodes():
    # (token, parent, score, depth)
    cands = [(5, -1, -0.1, 1), (6, -1, -2.0, 1), (7, 0, -0.3, 2), (8, 0, -3.0, 2), (9, 2, -0.5, 3), (3, 1, -2.5, 2)]
    tree = build_tree(cands, 4, torch.device("cpu"))
    assert tree.tokens.tolist() == [5, 6, 7, 9]  # breadth-first; the 4 best scores
    assert tree.parents.tolist() == [-1, -1, 0, 2] and tree.depth.tolist() == [1, 1, 2, 3]
    tied = [(5, -1, 0.0, 1), (6, 0, 0.0, 2), (7, 1, 0.0, 3)]  # probability-1 drafts tie their parents
    assert build_tree(tied, 2, torch.device("cpu")).tokens.tolist() == [5, 6]


def host_tree(proposer, shape, expand):
    """EAGLE-2's tree drafted the plain way, every choice on the host (Python lists, a mask per level),
    with the drafter's state as `propose_tree` finds it: the oracle for the tensor-built tree."""
    candidates, ancestors, hidden_of, logp_of = [], {}, {-1: proposer.hidden[0, 0]}, {}

    def add_children(hidden, parents, depth):
        logp = torch.log_softmax(proposer.drafter.logits(hidden)[0].float(), dim=-1)
        logp_of.update(zip(parents, logp))
        top = logp.topk(min(shape.topk, logp.shape[-1]), dim=-1)
        ids = top.indices if proposer.to_target is None else proposer.to_target[top.indices]
        new = []
        for parent, row_ids, row_logp in zip(parents, ids.tolist(), top.values.tolist()):
            for token, lp in zip(row_ids, row_logp):
                new.append(len(candidates))
                candidates.append((token, parent, (candidates[parent][2] if parent >= 0 else 0.0) + lp, depth))
                ancestors[new[-1]] = ancestors[parent] + (parent,) if parent >= 0 else ()
        return new

    frontier, expanded = add_children(proposer.hidden, [-1], 1), []
    for depth in range(2, shape.depth + 1):
        nodes = sorted(frontier, key=lambda c: -candidates[c][2])[: shape.topk]
        path = [(candidates[c][3], candidates[c][0], logp_of[candidates[c][1]].exp(), hidden_of[candidates[c][1]])
                for c in ancestors[nodes[0]] + (nodes[0],)]
        if not expand([c[2] for c in candidates], [candidates[c][2] for c in nodes], path):
            break
        a, m = proposer.anchors, len(nodes)
        mask = torch.zeros(1, 1, m, a + len(expanded) + m, dtype=torch.bool)
        mask[..., :a] = True
        for r, c in enumerate(nodes):
            for e, d in enumerate(expanded):
                mask[0, 0, r, a + e] = d in ancestors[c]
            mask[0, 0, r, a + len(expanded) + r] = True
        out = proposer.drafter(torch.tensor([[candidates[c][0] for c in nodes]]),
                               torch.stack([hidden_of[candidates[c][1]] for c in nodes])[None],
                               torch.full((1, m), a - 2 + depth), mask, proposer.cache)
        expanded += nodes
        hidden_of.update({c: out[0, r] for r, c in enumerate(nodes)})
        frontier = add_children(out, nodes, depth)
    return build_tree(candidates, shape.total_tokens, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", [TreeShape(1, 3, 3), TreeShape(4, 3, 20), TreeShape(5, 4, 200)])
def test_the_tree_built_with_tensors_is_the_host_built_tree(target, kind, shape):
    """propose_tree (candidates, scores and ancestors as tensors, no value read per level) drafts the tree the
    plain host algorithm drafts, and shows an `expand` policy the same levels: scores, the nodes it would
    expand, and the best node's path with the distributions and states that drew it. Levels stop early too."""
    proposer = feature_proposers(target)[kind]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    for prompt, _ in greedy_cases(target, seeds=2):
        for stop_at in (shape.depth, 2):
            runner.reset()
            _, final, aux = runner.forward(prompt, last_logits=True)
            proposer.reset()
            proposer.observe(prompt[1:] + [prompt[0]], final, aux)
            seen = {"tensor": [], "host": []}

            def expand(level):
                seen["tensor"].append((level.levels, level.scores, level.expanding,
                                       [(s.position, s.token, s.q_raw, s.hidden) for s in level.path]))
                return level.levels + 1 < stop_at

            def host_expand(scores, expanding, path):
                seen["host"].append((len(seen["host"]) + 1, scores, expanding, path))
                return len(seen["host"]) + 1 < stop_at

            tree = proposer.propose_tree(shape, expand)
            proposer.cache.crop(proposer.anchors)
            expected = host_tree(proposer, shape, host_expand)
            assert tree.tokens.tolist() == expected.tokens.tolist() and tree.parents.tolist() == expected.parents.tolist()
            assert tree.depth.tolist() == expected.depth.tolist() and tree.max_depth <= min(stop_at, shape.depth)
            torch.testing.assert_close(tree.scores, expected.scores, atol=1e-5, rtol=1e-5)
            assert len(seen["tensor"]) == len(seen["host"]) == min(stop_at, shape.depth) - 1
            for (levels, scores, expanding, path), (levels_h, scores_h, expanding_h, path_h) in zip(*seen.values()):
                assert levels == levels_h and len(path) == len(path_h) == levels
                torch.testing.assert_close(torch.tensor(scores), torch.tensor(scores_h, dtype=torch.float32))
                torch.testing.assert_close(torch.tensor(expanding), torch.tensor(expanding_h, dtype=torch.float32))
                for step, step_h in zip(path, path_h):
                    assert step[:2] == step_h[:2]
                    torch.testing.assert_close(step[2], step_h[2])
                    torch.testing.assert_close(step[3], step_h[3])


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("shape", [TreeShape(1, 3, 3), TreeShape(3, 2, 5), TreeShape(5, 4, 12), TreeShape(3, 2, 5, 4)])
def test_greedy_tree_output_is_the_targets_own(target, kind, shape):
    proposer = feature_proposers(target)[kind]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    for prompt, expected in greedy_cases(target):
        out = generate(runner, proposer, prompt, 24, Static(0), tree=shape)
        assert out.tokens == expected
        assert all(r.drafted <= shape.total_tokens + shape.lookup and r.depth <= max(shape.depth, shape.lookup)
                   for r in out.rounds)
        assert all(r.drafter_forwards <= shape.depth for r in out.rounds)  # one per level + the observe


def test_tree_drafts_from_a_perfect_drafter_accept_a_full_depth(target):
    """A tree holding the target's own greedy continuation (next to a wrong sibling at every
    level) is accepted to its full depth every round: τ = depth + 1."""
    prompt = [3, 5, 7]

    class Perfect(FeatureProposer):
        def reset(self):
            super().reset()
            self.seen = prompt[:1]  # observe() adds every later token

        def observe(self, next_tokens, final, aux):
            self.seen = self.seen + list(next_tokens)
            super().observe(next_tokens, final, aux)

        def propose_tree(self, shape, expand=None):
            seq, cands, parent = list(self.seen), [], -1
            for d in range(1, shape.depth + 1):
                token = int(target(torch.tensor([seq])).logits[0, -1].argmax())
                cands += [(token, parent, -float(d), d), ((token + 1) % V, parent, -d - 0.5, d)]
                parent, seq = len(cands) - 2, seq + [token]
            return build_tree(cands, shape.total_tokens, torch.device("cpu"))

    perfect = Perfect(feature_proposers(target)["eagle"].drafter, V)
    out = generate(TargetRunner(target), perfect, prompt, 1 + 5 * 5, Static(0), tree=TreeShape(4, 2, 8))
    assert [r.accepted for r in out.rounds] == [4] * 5 and all(r.drafted == 8 for r in out.rounds)


def test_sibling_wise_sampling_is_lossless_at_one_node():
    """The first committed token follows p, whichever children were drafted (one of them with p = 0)."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g) * 1.5, -1)
    p[4] = 0.0
    p = p / p.sum()
    tree = DraftTree(torch.tensor([2, 4, 0]), torch.tensor([-1, -1, -1]), torch.tensor([1, 1, 1]), torch.zeros(3))
    pi = torch.stack([p] + [torch.full((6,), 1 / 6)] * 3)
    n = 20000
    counts = Counter()
    for _ in range(n):
        path, token = verify_tree(tree, pi, g)
        counts[int(tree.tokens[path[0]]) if path else token] += 1
    assert counts[4] == 0
    cells = [v for v in range(6) if p[v] > 0]
    chi2 = sum((counts[v] - n * float(p[v])) ** 2 / (n * float(p[v])) for v in cells)
    assert chi2 < 20.5, (chi2, counts)  # chi-square(4): 0.1% tail at 18.5


def top1_stop():
    """DISCO's rule on a classifier that draws the next level iff the best node's top-1 probability is at least
    0.424: for `peaky_drafter` after the prompt [1, 2], true after two of the four first tokens."""
    from tests.runtime.test_heads import top1_classifier

    return ClassifierStop(top1_classifier(3, 0.424), 0.5, 3)


def peaky_drafter(target):
    """An EAGLE drafter whose distributions differ from token to token (random weights alone give near-uniform
    ones that hardly depend on the token)."""
    drafter = EagleDrafter(target.config, target.model.embed_tokens.weight * 50, target.lm_head.weight)
    drafter.head_input = lambda h: h * 100
    return drafter


@pytest.mark.proof
@pytest.mark.parametrize("cfg, shape, prompt, policy", [
    (SamplingConfig(temperature=1.0), TreeShape(2, 2, 4), [1, 2], None),
    (SamplingConfig(temperature=0.7, top_k=3), TreeShape(3, 2, 5), [1, 2], None),
    (SamplingConfig(temperature=1.3, top_p=0.8), TreeShape(2, 3, 6), [1, 2], None),
    (SamplingConfig(temperature=1.0), TreeShape(1, 2, 2, lookup=3), [1, 2, 3, 1, 2], None),  # a grafted branch 3 1 2
    (SamplingConfig(temperature=1.0), TreeShape(3, 2, 6), [1, 2], top1_stop)])  # a stop head sets the depth
def test_multi_step_tree_sampling_is_lossless(cfg, shape, prompt, policy):
    tv, length, n = (4, 3, 2000) if policy is None else (4, 4, 4000)  # 4 tokens: room for a second level
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    torch.manual_seed(5)
    if policy is None:
        drafter = EagleDrafter(target.config, target.model.embed_tokens.weight, target.lm_head.weight)
    else:
        drafter = peaky_drafter(target)
    law = exact_law(target, prompt, length, cfg)
    g = torch.Generator().manual_seed(0)
    runner, proposer = TargetRunner(target), FeatureProposer(drafter, tv)
    policy = policy() if policy is not None else Static(0)
    outs = [generate(runner, proposer, prompt, length, policy, cfg, generator=g, tree=shape) for _ in range(n)]
    if isinstance(policy, ClassifierStop):
        assert len({r.drafter_forwards for o in outs for r in o.rounds[:1]}) > 1, "the head never changed the depth"
    counts = Counter(tuple(o.tokens) for o in outs)
    assert_follows_law(counts, law)


def test_drafter_state_after_tree_rounds_equals_a_fresh_recomputation(target):
    proposer = feature_proposers(target)["eagle3"]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    prompt = [2, 4, 6, 8, 10]
    out = generate(runner, proposer, prompt, 15, Static(0), tree=TreeShape(3, 3, 8))
    seq = prompt + out.tokens
    fresh = FeatureProposer(proposer.drafter, V, proposer.aux_layer_ids)
    fresh.reset()
    fresh_runner = TargetRunner(target, proposer.aux_layer_ids)
    fresh_runner.reset()
    _, final, aux = fresh_runner.forward(seq[:-1])
    fresh.observe(seq[1:], final, aux)
    assert fresh.anchors == proposer.anchors
    torch.testing.assert_close(fresh.hidden, proposer.hidden, atol=1e-5, rtol=1e-4)


def test_trees_refuse_what_they_cannot_do(target):
    runner = TargetRunner(target)
    with pytest.raises(DraftsmithError, match="tree drafting needs a feature or block drafter"):
        generate(runner, ModelProposer(target, V), [1, 2], 5, Static(2), tree=TreeShape())
    with pytest.raises(DraftsmithError, match="chain drafts"):
        generate(runner, feature_proposers(target)["eagle"], [1, 2], 5, Static(2), rule=lambda *a: a[3], tree=TreeShape())
    with pytest.raises(DraftsmithError, match=">= 1"):
        TreeShape(depth=0)


def test_lookup_continuation_follows_the_latest_longest_earlier_match():
    seq = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup_continuation(seq, 3) == [9, 2, 3]  # "1 2 3" (3 tokens) beats the later "2 3"
    assert lookup_continuation([5, 2, 3, 7, 5, 2, 3, 6, 4, 2, 3], 2) == [6, 4]  # equal length: the latest
    assert lookup_continuation([4, 4, 4], 5) == [4]  # a loop predicts itself
    assert lookup_continuation([1, 2, 3, 4], 3) == [] and lookup_continuation([1, 2, 5, 2], 3) == []  # 1 < min_match
    assert lookup_continuation(seq, 0) == [] and lookup_continuation([], 3) == []


def test_graft_shares_matching_nodes_and_appends_the_rest():
    tree = hand_tree([42, 7, 9, 11, 30, 2])  # 42 -> 9 -> 2 is a path
    grafted = graft(tree, [42, 9, 5, 6])
    assert grafted.tokens.tolist() == [42, 7, 9, 11, 30, 2, 5, 6]
    assert grafted.parents.tolist() == PARENTS.tolist() + [2, 6] and grafted.depth.tolist()[6:] == [3, 4]
    assert node_path(grafted, 7) == [0, 2, 6, 7]
    ancestor_matrix(grafted.parents)  # parents before children
    assert graft(tree, [42, 9, 2]) is tree and graft(tree, []) is tree
    fresh = graft(tree, [8, 8])
    assert fresh.parents.tolist()[6:] == [-1, 6] and fresh.depth.tolist()[6:] == [1, 2]


def test_prompt_lookup_branch_is_accepted_as_far_as_it_agrees(target):
    """With a drafter that is always wrong, every accepted token comes from the grafted branch: each
    round accepts exactly the common prefix of the lookup continuation and the target's own output."""

    class Wrong(FeatureProposer):
        def reset(self):
            super().reset()
            self.seen = []

        def observe(self, next_tokens, final, aux):
            self.seen = self.seen + list(next_tokens)
            super().observe(next_tokens, final, aux)

        def propose_tree(self, shape, expand=None):  # seen = the sequence after its first token
            token = int(target(torch.tensor([prompt[:1] + self.seen])).logits[0, -1].argmax())
            return build_tree([((token + 1) % V, -1, -1.0, 1)], 1, torch.device("cpu"))

    wrong = Wrong(feature_proposers(target)["eagle"].drafter, V)
    agreed = 0
    for prompt, expected in greedy_cases(target, new_tokens=40):
        out = generate(TargetRunner(target), wrong, prompt, 40, Static(0), tree=TreeShape(1, 1, 1, lookup=4))
        assert out.tokens == expected
        done = 1  # the prefill commits the first token
        for r in out.rounds:
            branch, rest = lookup_continuation(prompt + out.tokens[:done], min(4, 40 - done - 1)), out.tokens[done:]
            common = 0
            while common < min(len(branch), len(rest)) and branch[common] == rest[common]:
                common += 1
            assert r.accepted == common
            agreed += common
            done += r.committed
    assert agreed > 0  # the test cases do repeat themselves
