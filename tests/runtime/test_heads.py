"""Stop heads as draft-length policies (SpecDec++, DISCO) and the labels they learn from: the labels are
what step-by-step decoding sees, the policies decide as their formulas say, decoding stays lossless."""

import math
from collections import Counter

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.jobs.labels import label_chat
from draftsmith.models.heads import AcceptanceHead, AcceptanceHeadConfig, StopClassifier, StopClassifierConfig
from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.policies import AcceptanceStop, ClassifierStop, Confidence, Static
from draftsmith.runtime.steps import DraftStep
from draftsmith.runtime.standalone import ModelProposer
from draftsmith.runtime.sampling import SamplingConfig
from draftsmith.runtime.tree import TreeShape
from tests.conftest import make_llama
from tests.runtime.conftest import V, greedy_cases
from tests.runtime.test_generate import assert_follows_law, exact_law, proposers


class Recorder(Static):
    """Static(K) that keeps the DraftStep of every decision."""

    def __init__(self, k):
        super().__init__(k)
        self.steps = []

    def keep_going(self, step):
        self.steps.append(step)
        return super().keep_going(step)


def hidden_size(proposer):
    return proposer.drafter.fc.weight.shape[0] if hasattr(proposer, "drafter") else proposer.model.config.hidden_size


def step_by_step(target, proposer, ids, t, k):
    """Decode one round after ids[:t+1] as the runtime does; returns the draft, q_raw (k, V), the policy's
    hidden states for positions 1..k−1 and the target's distributions of the draft's tokens (k, V)."""
    runner = TargetRunner(target, proposer.aux_layer_ids)
    runner.reset()
    proposer.reset()
    sequence = ids[: t + 1]
    if proposer.needs_features:  # as after a prefill of ids[:t] whose next token was ids[t]
        _, final, aux = runner.forward(ids[:t])
        proposer.observe(ids[1: t + 1], final, aux)
    policy = Recorder(k)
    draft, _, q_raw = proposer.propose(sequence, policy, k, SamplingConfig(), None)
    with torch.no_grad():
        logits = target(torch.tensor([sequence + draft])).logits[0, t:]
    hidden = {s.position: s.hidden for s in policy.steps if s.position >= 1}
    return draft, q_raw, hidden, torch.softmax(logits[:k].float(), -1)


@pytest.mark.parametrize("kind", ["standalone", "self-ranked", "eagle", "eagle3", "self"])
def test_labels_equal_a_step_by_step_decoding_simulation(target, kind):
    proposer = proposers(target)[kind]
    ids = torch.randint(4, V, (18,), generator=torch.Generator().manual_seed(5)).tolist()
    positions, k = [3, 7, 8, 12, 16], 4
    runner = TargetRunner(target, proposer.aux_layer_ids)
    rows = label_chat(runner, proposer, ids, positions, k, 5, "greedy", torch.Generator().manual_seed(0))
    assert len(rows["depth"]) == len(positions) * k
    for i, t in enumerate(positions):
        draft, q, hidden, p = step_by_step(target, proposer, ids, t, k)
        at = slice(i * k, (i + 1) * k)
        assert rows["anchor"][at].tolist() == [t] * k and rows["depth"][at].tolist() == [1, 2, 3, 4]
        assert rows["token_greedy"][at].tolist() == draft  # the greedy chain is the runtime's draft
        torch.testing.assert_close(rows["top_probs"][at], q.topk(5, -1).values, atol=1e-5, rtol=1e-4)
        entropy = -(q * q.clamp_min(1e-30).log()).sum(-1)
        torch.testing.assert_close(rows["entropy"][at], entropy, atol=1e-5, rtol=1e-4)
        for j in range(1, k):  # what the policy saw when deciding after token j
            torch.testing.assert_close(rows["hidden"][i * k + j - 1], hidden[j].float(), atol=1e-5, rtol=1e-4)
        d = torch.tensor(draft)
        s = rows["token_sampled"][at].long()
        rng = torch.arange(k)
        torch.testing.assert_close(rows["p_greedy"][at], p[rng, d], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(rows["q_sampled"][at], q[rng, s], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(rows["soft"][at], torch.clamp(p[rng, s] / q[rng, s], max=1), atol=1e-5, rtol=1e-4)
        assert rows["target_argmax"][at].tolist() == p.argmax(-1).tolist()
        assert rows["hard"][at].tolist() == (d == p.argmax(-1)).long().tolist()
        right = (d == p.argmax(-1)).long()
        assert rows["reached"][at].tolist() == [1] + torch.cumprod(right, 0)[:-1].tolist()
    if kind == "self":  # the target drafting for itself: every token is accepted
        assert rows["hard"].all() and torch.allclose(rows["soft"], torch.ones(len(rows["soft"])))


def constant_acceptance_head(size, a):
    head = AcceptanceHead(AcceptanceHeadConfig(size, num_layers=2))
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.out.bias.fill_(math.log(a / (1 - a)))
    return head


def top1_classifier(top_k, cut, sharpness=200.0):
    """A stop classifier whose confidence is sigmoid(sharpness·(top-1 probability − cut))."""
    head = StopClassifier(StopClassifierConfig(top_k=top_k, width=4))
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.net[0].weight[0, 0] = 1.0  # ReLU(top-1) ...
        head.net[2].weight[0, 0] = sharpness  # ... scaled, minus the cut
        head.net[2].bias.fill_(-sharpness * cut)
    return head


def test_a_hand_set_acceptance_head_stops_where_its_formula_says(target):
    """a = 0.8 everywhere, h = 0.5: 1 − 0.8^j first exceeds 0.5 at j = 4, so every round drafts 4 tokens."""
    proposer = proposers(target)["standalone"]
    runner = TargetRunner(target)
    policy = AcceptanceStop(constant_acceptance_head(16, 0.8), threshold=0.5, k=8)
    out = generate(runner, proposer, [1, 2, 3], 40, policy)
    assert {r.drafted for r in out.rounds[:-2]} == {4}
    assert [policy.keep_going(DraftStep(j, 5, torch.ones(V) / V, torch.zeros(16))) for j in range(6)] == \
        [True, True, True, True, False, False]
    assert out.rounds[-1].drafted <= 4  # cut by the room left
    longer = AcceptanceStop(constant_acceptance_head(16, 0.8), threshold=0.7, k=8)  # 1 − 0.8^6 = 0.74 > 0.7
    assert {r.drafted for r in generate(runner, proposer, [1, 2, 3], 40, longer).rounds[:-2]} == {6}


def test_a_hand_set_stop_classifier_stops_where_its_formula_says(target):
    """A classifier that reads only the top-1 probability (C ≥ 0.5 iff top-1 ≥ cut) makes the confidence
    policy's decisions at that cut, round by round."""
    proposer = proposers(target)["standalone"]
    runner = TargetRunner(target)
    for cut in (0.05, 0.08, 0.12):
        disco = generate(runner, proposer, [1, 2, 3], 40, ClassifierStop(top1_classifier(4, cut), 0.5, k=6))
        confidence = generate(runner, proposer, [1, 2, 3], 40, Confidence(cut, k=6))
        assert [r.drafted for r in disco.rounds] == [r.drafted for r in confidence.rounds]
    drafted = {r.drafted for r in disco.rounds}
    assert len(drafted) > 1  # the decisions vary, so the comparison tests something


def test_an_acceptance_head_with_draft_features_reads_the_drafters_distribution(target):
    """An acceptance head given DISCO's features whose weights read only the top-1 probability
    (a ≈ 1 iff top-1 ≥ cut; its hidden-state part zeroed): at h = 0.5 SpecDec++'s rule stops after the
    first token below the cut, so it drafts as the confidence policy does at that cut, round by round."""
    proposer = proposers(target)["standalone"]
    runner = TargetRunner(target)
    size = hidden_size(proposer)
    for cut in (0.05, 0.08, 0.12):
        head = AcceptanceHead(AcceptanceHeadConfig(size, num_layers=2, draft_features=4))
        with torch.no_grad():
            for p in head.parameters():
                p.zero_()  # the residual blocks pass their input through unchanged
            head.out.weight[0, size] = 200.0  # the first feature after the hidden state: top-1
            head.out.bias.fill_(-200.0 * cut)
        specdec = generate(runner, proposer, [1, 2, 3], 40, AcceptanceStop(head, 0.5, k=6))
        confidence = generate(runner, proposer, [1, 2, 3], 40, Confidence(cut, k=6))
        assert [r.drafted for r in specdec.rounds] == [r.drafted for r in confidence.rounds]
    assert len({r.drafted for r in specdec.rounds}) > 1  # the decisions vary, so the comparison tests something
    with pytest.raises(DraftsmithError, match="reads the drafter's distribution"):
        head(torch.zeros(size))


@pytest.mark.parametrize("kind", ["standalone", "eagle", "eagle3"])
def test_greedy_output_is_the_targets_own_with_head_policies(target, kind):
    proposer = proposers(target)[kind]
    torch.manual_seed(7)
    size = hidden_size(proposer)
    specdec = AcceptanceHead(AcceptanceHeadConfig(size))
    disco = StopClassifier(StopClassifierConfig(top_k=5))
    runner = TargetRunner(target, proposer.aux_layer_ids)
    for prompt, expected in greedy_cases(target):
        for policy in (AcceptanceStop(specdec, 0.6, 5), ClassifierStop(disco, 0.45, 5)):
            out = generate(runner, proposer, prompt, 24, policy)
            assert out.tokens == expected, (kind, policy.name)


@pytest.mark.proof
@pytest.mark.parametrize("policy_name", ["specdec", "disco"])
def test_sampling_with_a_head_policy_is_lossless(policy_name):
    """χ² of 2000 sampled 3-token continuations against the target's exact law, the draft length decided by
    a stop head whose decisions vary from token to token."""
    tv, length, n = 4, 3, 2000
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    draft = make_llama(tv, seed=4, hidden=16, layers=1)
    cfg = SamplingConfig(temperature=1.0)
    prompt = [1, 2]
    law = exact_law(target, prompt, length, cfg)
    torch.manual_seed(11)
    if policy_name == "specdec":
        head = AcceptanceHead(AcceptanceHeadConfig(16, 1))
        with torch.no_grad():
            head.out.weight.mul_(20)  # a spread of predicted acceptances
        make = lambda: AcceptanceStop(head, 0.5, 3)  # noqa: E731
    else:
        make = lambda: ClassifierStop(top1_classifier(3, 0.45, sharpness=50), 0.5, 3)  # noqa: E731
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(target)
    proposer = ModelProposer(draft, tv)
    outs = [generate(runner, proposer, prompt, length, make(), cfg, generator=g) for _ in range(n)]
    assert len({r.drafted for o in outs for r in o.rounds}) > 1, "the head never changed the draft length"
    counts = Counter(tuple(o.tokens) for o in outs)
    assert_follows_law(counts, law)


def top1_acceptance_head(size, cut, k=4):
    """An acceptance head reading DISCO's features whose a ≈ 1 iff the drafter's top-1 probability ≥ cut."""
    head = AcceptanceHead(AcceptanceHeadConfig(size, num_layers=2, draft_features=k))
    with torch.no_grad():
        for p in head.parameters():
            p.zero_()
        head.out.weight[0, size] = 200.0
        head.out.bias.fill_(-200.0 * cut)
    return head


def cuts_between(values, fractions, gap=1e-6):
    """Cuts at about these quantiles of sorted `values`, each in the middle of a gap wider than `gap` between two
    neighbours: a chain and a tree compute the same probability with different products, which on some CPUs
    round apart by a few 1e-9, so a cut between two near-equal values would split what is one value."""
    wide = [i for i in range(len(values) - 1) if values[i + 1] - values[i] > gap]
    picked = sorted({min(wide, key=lambda i: abs(i - f * len(values))) for f in fractions})
    return [(values[i] + values[i + 1]) / 2 for i in picked]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("policy_name", ["specdec", "disco"])
def test_a_stop_head_grows_a_top1_tree_as_deep_as_the_chain_it_drafts(target, kind, policy_name):
    """A tree of top-k 1 is the greedy chain: with a stop head deciding its depth, every round is as deep
    as the chain that head drafts, and the output is the target's own."""
    proposer = proposers(target)[kind]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    recorder = Recorder(6)  # cuts at quantiles of this drafter's top-1 probabilities
    for prompt, _ in greedy_cases(target, seeds=2):
        generate(runner, proposer, prompt, 24, recorder)
    top1 = sorted({float(s.q_raw.max()) for s in recorder.steps if s.q_raw is not None})
    depths = set()
    for cut in cuts_between(top1, (0.2, 0.5, 0.8)):
        def make():
            if policy_name == "specdec":
                return AcceptanceStop(top1_acceptance_head(hidden_size(proposer), cut), 0.5, k=6)
            return ClassifierStop(top1_classifier(4, cut), 0.5, k=6)
        for prompt, expected in greedy_cases(target, seeds=2):
            chain = generate(runner, proposer, prompt, 24, make())
            tree = generate(runner, proposer, prompt, 24, make(), tree=TreeShape(6, 1, 6))
            assert tree.tokens == chain.tokens == expected
            assert [r.depth for r in tree.rounds] == [r.drafted for r in chain.rounds]
            depths |= {r.depth for r in tree.rounds}
    assert len(depths) > 2  # the head's decisions vary, so the comparison tests something


def test_a_constant_acceptance_head_stops_a_wide_tree_where_its_formula_says(target):
    """a = 0.8 at every node: 1 − 0.8^j first exceeds h = 0.5 at j = 4 and h = 0.6 at j = 5, so every tree
    drafts 4 (5) levels of the 6 its shape allows: one drafter forward each after the first, plus the
    round's observe. Each node's a_i is computed once."""
    proposer = proposers(target)["eagle"]
    runner = TargetRunner(target)
    head = constant_acceptance_head(hidden_size(proposer), 0.8)
    calls = []
    counted = head.acceptance
    head.acceptance = lambda *a: calls.append(a) or counted(*a)
    for h, levels in ((0.5, 4), (0.6, 5)):
        calls.clear()
        out = generate(runner, proposer, [1, 2, 3], 40, AcceptanceStop(head, h, k=8), tree=TreeShape(6, 3, 10))
        full = out.rounds[:-6]  # the last rounds are cut by the room left
        assert {r.drafter_forwards for r in full} == {levels}
        assert len(calls) <= sum(r.drafter_forwards for r in out.rounds) * 3  # not once per node per level
