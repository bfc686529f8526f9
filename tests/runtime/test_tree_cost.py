"""The cost policy for trees (runtime/policies.py TreeCost): hand cases where a node, a level and a
lookup token must and must not be drafted, the meter's model, and greedy identity."""

import math

import pytest
import torch

from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.cost import TreeCost, TreeCostMeter
from draftsmith.runtime.steps import TreeLevel
from draftsmith.runtime.tree import TreeShape, prune
from tests.runtime.test_tree import build_tree
from tests.runtime.conftest import greedy_cases
from tests.runtime.test_tree import feature_proposers


def meter_with(verify, level=None, beta=None):
    meter = TreeCostMeter()
    meter.calibrate(lambda n: verify(n), range(0, 65, 8), repeats=1)
    if level is not None:
        meter.levels.append(level)
    if beta is not None:
        meter.predictions.append((1.0, beta))  # accepted / predicted = beta
    return meter


def test_meter_interpolates_and_extrapolates_verify_cost():
    meter = TreeCostMeter()
    meter.calibrate(lambda n: 1.0 + 0.1 * n if n <= 16 else 2.6 + 0.2 * (n - 16), [0, 8, 16, 24], repeats=1)
    assert meter.verify_seconds(4) == pytest.approx(1.4)
    assert meter.verify_seconds(20) == pytest.approx(3.4)
    assert meter.verify_seconds(40) == pytest.approx(2.6 + 0.2 * 24)  # past the grid: the last slope
    assert meter.beta() == 1.0  # nothing verified yet
    meter.predictions.extend([(2.0, 1), (2.0, 2)])
    assert meter.beta() == pytest.approx(0.75)
    assert meter.lookup_chance(0) == 0.5  # unseen: one in two
    meter.add_lookup(offered=3, reached=1)
    assert [meter.lookup_chance(j) for j in range(3)] == [2 / 3, 1 / 3, 1 / 3]


def test_nodes_are_kept_while_they_pay_for_their_rows():
    """Verify costs 1 + 0.05·n: with drafter probabilities 0.9, 0.5, 0.3, 0.02, ... the rate
    (1 + Σ values) / (draft + verify) peaks after the nodes worth more than 0.05 × the rate."""
    policy = TreeCost(meter=meter_with(lambda n: 1.0 + 0.05 * n))
    probs = [0.9, 0.5, 0.3, 0.02, 0.01, 0.01]
    n = policy.size(torch.tensor([math.log(p) for p in probs]), draft_seconds=0.2)
    rates = [(1 + sum(probs[:k])) / (0.2 + 1.0 + 0.05 * k) for k in range(1, len(probs) + 1)]
    assert n == 1 + rates.index(max(rates)) == 3
    assert policy.predicted == pytest.approx(0.9 + 0.5 + 0.3)
    # rows that cost nothing: every node pays
    free = TreeCost(meter=meter_with(lambda n: 1.0))
    assert free.size(torch.tensor([math.log(p) for p in probs]), 0.2) == len(probs)
    # rows at 0.1 and an over-confident drafter (β = 0.1): the second node, worth 0.05 tokens for
    # 0.1 of a step, no longer pays (it would at β = 1)
    assert TreeCost(meter=meter_with(lambda n: 1.0 + 0.1 * n)).size(torch.tensor([math.log(p) for p in probs]), 0.2) > 1
    doubted = TreeCost(meter=meter_with(lambda n: 1.0 + 0.1 * n, beta=0.1))
    assert doubted.size(torch.tensor([math.log(p) for p in probs]), 0.2) == 1


def test_a_level_is_drafted_only_if_it_can_pay_for_itself():
    meter = meter_with(lambda n: 1.0 + 0.01 * n, level=0.05)
    policy = TreeCost(meter=meter)
    sure = [math.log(0.9), math.log(0.8)]
    assert policy.expand(TreeLevel(1, sure, sure))  # the level can add up to 1.7 tokens for ~6% of a step
    unlikely = [math.log(0.01), math.log(0.01)]
    assert not policy.expand(TreeLevel(1, sure + unlikely, unlikely))  # at most 0.02 tokens
    slow = TreeCost(meter=meter_with(lambda n: 1.0 + 0.01 * n, level=5.0))
    assert not slow.expand(TreeLevel(1, sure, sure))  # a level that costs five target steps
    untimed = TreeCost(meter=meter_with(lambda n: 1.0))
    assert untimed.expand(TreeLevel(1, unlikely, unlikely))  # until a level is timed, the full shape


def test_lookup_tokens_are_kept_while_their_chance_pays():
    meter = meter_with(lambda n: 1.0 + 0.2 * n)
    meter.add_lookup(offered=4, reached=2)
    meter.add_lookup(offered=4, reached=2)  # chances 3/4, 3/4, 1/4, 1/4
    policy = TreeCost(meter=meter, predicted=0.5)  # β = 1: 0.5 tokens expected from the drafter's nodes
    assert policy.lookup_length(nodes=2, offered=4, draft_seconds=0.1) == 2
    cheap = meter_with(lambda n: 1.0)
    assert TreeCost(meter=cheap, predicted=0.5).lookup_length(2, 4, 0.1) == 4


def test_prune_keeps_the_best_ancestor_closed_nodes():
    cands = [(5, -1, -0.1, 1), (6, -1, -2.0, 1), (7, 0, -0.3, 2), (8, 0, -3.0, 2), (9, 2, -0.5, 3), (3, 1, -2.5, 2)]
    tree = build_tree(cands, 6, torch.device("cpu"))
    assert prune(tree, 6) is tree
    small = prune(tree, 3)
    assert small.tokens.tolist() == [5, 7, 9] and small.parents.tolist() == [-1, 0, 1]
    assert torch.equal(prune(tree, 4).tokens, build_tree(cands, 4, torch.device("cpu")).tokens)


@pytest.mark.parametrize("shape", [TreeShape(4, 3, 10), TreeShape(3, 2, 5, 4)])
def test_greedy_output_with_cost_sized_trees_is_the_targets_own(target, shape):
    proposer = feature_proposers(target)["eagle3"]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    policy = TreeCost()
    for prompt, expected in greedy_cases(target):
        out = generate(runner, proposer, prompt, 24, policy, tree=shape)
        assert out.tokens == expected
        assert all(1 <= r.drafted <= shape.total_tokens + shape.lookup for r in out.rounds[:-1])
    meter = policy.meter
    assert set(meter.verify) >= {0, 1, 8} and meter.levels and meter.predictions  # calibrated and measured
