"""The cost-aware draft-length policy: its meter, its decisions, and what it does to real rounds."""

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.eval.evaluate import EvalConfig, policy_factory
from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.cost import CostAware, CostMeter
from draftsmith.runtime.steps import DraftStep
from draftsmith.runtime.proposers import NoProposer
from draftsmith.runtime.standalone import ModelProposer
from tests.runtime.conftest import V


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def conf(p: float) -> torch.Tensor:
    """A drafter distribution over V tokens whose top probability is p."""
    q = torch.full((V,), (1 - p) / (V - 1))
    q[0] = p
    return q


def play(policy: CostAware, clock: Clock, confidences: list[float], accepted: int, plain_s=0.010, per_token_s=0.003,
         resume_s=0.0):
    """One round as the runtime drives it: ask, 'draft' while told to, verify; returns K. A round that
    drafts after plain ones also takes `resume_s` (the drafter catching up on what it skipped)."""
    k = 0
    if policy.keep_going(DraftStep(0)):
        k = 1
        while policy.keep_going(DraftStep(k, q_raw=conf(confidences[k - 1]))):
            k += 1
    clock.now += plain_s + per_token_s * k + (resume_s if k and policy.plain_streak else 0.0)
    policy.end_round(k, min(accepted, k))
    return k


def test_meter_fits_cost_per_token_and_acceptance():
    meter = CostMeter(window=8)
    assert meter.cost() is None and meter.alpha() is None
    meter.add(0, 0, 0.010)
    meter.add(2, 1, 0.016)  # 3 ms per drafted token over a 10 ms plain round
    meter.add(4, 4, 0.022)
    meter.add(1, 0, 0.900)  # a drafter prefill: one outlier, the median ignores it
    assert meter.cost() == pytest.approx(0.3)
    meter.add(1, 1, 0.030, after_plain=True)  # a round that resumes drafting pays a catch-up once
    meter.add(1, 1, 0.030, after_plain=True)
    assert meter.cost() == pytest.approx(0.3)  # ... and is left out of b while steady rounds exist
    assert CostMeter().cost() is None
    assert meter.alpha() == pytest.approx((1 + 4 + 0 + 1 + 1) / (2 + 4 + 1 + 1 + 1))  # accepted over reached


def test_measures_first_then_drafts_while_a_token_pays():
    clock = Clock()
    meter = CostMeter()
    policy = CostAware(k=6, meter=meter, clock=clock)
    assert play(policy, clock, [], 0) == 0  # a generation's first round is not timed
    assert play(policy, clock, [], 0) == 0  # plain steps until one has timed R0
    assert play(policy, clock, [0.99] * 6, 1) == 1  # cost not known yet: one token
    assert meter.cost() == pytest.approx(0.3)
    for _ in range(3):
        play(policy, clock, [0.99] * 6, 6)  # a drafter that is always right: α̂ → high
    alpha = meter.alpha()
    assert alpha > 0.8
    # after the first token, continue while α̂ · Π q ≥ c = 0.3
    k = play(policy, clock, [0.9, 0.8, 0.5, 0.9, 0.9, 0.9], 6)
    chance, expected = 1.0, 1
    for q in [0.9, 0.8, 0.5, 0.9, 0.9]:
        chance *= q
        if alpha * chance < 0.3:
            break
        expected += 1
    assert k == expected < 6


def test_a_slow_catch_up_does_not_price_drafting_out():
    """The first draft of a generation also pays the drafter's prefill (here 50 plain rounds' worth):
    timed alone it would price a drafted token at 50 rounds, and every later probe, itself a resuming
    round, would confirm it. The round after a resuming one times steady drafting instead."""
    clock = Clock()
    meter = CostMeter()
    policy = CostAware(k=4, meter=meter, clock=clock)
    ks = [play(policy, clock, [0.99] * 4, 4, resume_s=0.5) for _ in range(12)]
    assert meter.resumed and meter.resumed[0][1] > 0.5  # the resuming round was timed, prefill included
    assert ks[:4] == [0, 0, 1, 1]  # R0, then one token to learn α̂, then one more to time a steady round
    assert meter.cost() == pytest.approx(0.3)
    assert all(k == 4 for k in ks[4:])  # a drafter that pays keeps drafting


def test_a_drafter_that_does_not_pay_gets_plain_rounds_and_probes():
    clock = Clock()
    policy = CostAware(k=4, cost=0.3, probe=5, clock=clock)
    ks = [play(policy, clock, [0.2] * 4, 0) for _ in range(40)]
    assert ks[0] == 1  # α̂ unknown: draft to learn it
    assert all(k == 0 for k in ks[1:6]) and ks[6] == 1  # then a probe after 5 plain rounds
    assert all(k == 0 for k in ks[7:17]) and ks[17] == 1  # probes that find no pay wait twice as long
    assert ks[38] == 1 and sum(ks) == 4  # then after 20


def test_fixed_cost_skips_timing_and_refresh_times_plain_rounds():
    clock = Clock()
    fixed = CostAware(cost=0.1, clock=clock)
    assert play(fixed, clock, [0.9] * 8, 8) >= 1  # a given cost needs no plain round first
    meter = CostMeter()
    measured = CostAware(meter=meter, refresh=3, clock=clock)
    ks = [play(measured, clock, [0.99] * 8, 8) for _ in range(12)]
    assert ks[:6] == [0, 0, 1, 8, 8, 0]  # R0 is timed first, then again every 3 drafted rounds
    assert len(meter.plain) == ks.count(0) - 1  # the first round is left untimed


def test_the_runtime_with_a_cost_aware_policy(target):
    """Output stays the target's own; a useless drafter leaves mostly plain rounds; a perfect one drafts."""
    from tests.runtime.conftest import greedy_cases

    prompt, expected = next(greedy_cases(target))
    meter = CostMeter()
    for _ in range(2):
        out = generate(TargetRunner(target), ModelProposer(target, V), prompt, 24, CostAware(k=4, meter=meter))
        assert out.tokens == expected
    assert meter.cost() is not None and meter.alpha() == 1.0

    class Wrong(NoProposer):
        def propose(self, sequence, policy, k, sampling, generator):
            if k <= 0 or not policy.keep_going(DraftStep(0)):
                return [], torch.zeros(0, V), torch.zeros(0, V)
            logits = target(torch.tensor([sequence])).logits[0, -1]
            bad = (int(logits.argmax()) + 1) % V
            q = torch.nn.functional.one_hot(torch.tensor([bad]), V).float()
            return [bad], q, q

    out = generate(TargetRunner(target), Wrong(V), prompt, 40, CostAware(k=4, cost=0.2, probe=4))
    assert out.tokens == generate(TargetRunner(target), NoProposer(V), prompt, 40, CostAware()).tokens
    drafted = [r.drafted for r in out.rounds]
    assert sum(drafted) <= 1 + len(drafted) // 4 and drafted.count(0) > len(drafted) * 0.7


def test_eval_default_is_cost_aware_with_one_meter_per_run():
    new_policy = policy_factory(EvalConfig(target=""))
    a, b = new_policy([]), new_policy([])
    assert isinstance(a, CostAware) and a.k == 4 and a.meter is b.meter
    assert policy_factory(EvalConfig(target=""))([]).meter is not a.meter


def test_a_stop_head_on_a_tree_may_draft_as_deep_as_the_tree():
    """--tree bounds a tree round for a stop head as it does for cost; --k still bounds a chain."""
    from draftsmith.eval.evaluate import stop_settings

    assert stop_settings(EvalConfig(target="", policy="specdec", stop_threshold=0.7, k=3), {}) == (0.7, 3)
    assert stop_settings(EvalConfig(target="", policy="specdec", stop_threshold=0.7, k=3, tree="5,4,12"), {}) == (0.7, 5)
    assert stop_settings(EvalConfig(target="", policy="disco", k=3, tree="6,4,12"), {})[1] == 6
    # a tuned shallower depth (tune found a fixed tree of that depth fastest) is kept; a chain's 8 is bounded
    tuned = {"tuned": {"tree_greedy": {"threshold": 0.0, "k": 2}, "greedy": {"threshold": 0.3, "k": 8}}}
    assert stop_settings(EvalConfig(target="", policy="disco", tree="6,4,12", temperature=0), tuned) == (0.0, 2)
    assert stop_settings(EvalConfig(target="", policy="disco", k=3, temperature=0), tuned) == (0.3, 8)
    del tuned["tuned"]["tree_greedy"]
    assert stop_settings(EvalConfig(target="", policy="disco", tree="6,4,12", temperature=0), tuned) == (0.3, 6)


def test_eval_says_when_it_decodes_at_another_length_than_tune_chose_on():
    """A choice filed on 96-token answers (static K 1) lost to K 2-3 at 256 (dynamic_length.py): eval names the
    lengths and the tune that chooses for its own, and says nothing at a like length or with a given threshold."""
    from draftsmith.eval.tune import tuned_length_note

    tuned = {"tuned": {"greedy": {"threshold": 1.0, "k": 1, "prompts": {"max_new_tokens": 96}}}}
    note = tuned_length_note(EvalConfig(target="", policy="specdec", temperature=0, max_new_tokens=256), tuned)
    assert "96-token answers, this run 256" in note and "tune --max_new_tokens 256" in note
    assert "this run 32" in tuned_length_note(EvalConfig(target="", policy="disco", temperature=0, max_new_tokens=32), tuned)
    assert tuned_length_note(EvalConfig(target="", policy="specdec", temperature=0, max_new_tokens=128), tuned) is None
    assert tuned_length_note(EvalConfig(target="", policy="specdec", temperature=0, max_new_tokens=256,
                                        stop_threshold=0.5), tuned) is None
    assert tuned_length_note(EvalConfig(target="", policy="static", max_new_tokens=256), tuned) is None
    assert tuned_length_note(EvalConfig(target="", policy="specdec", max_new_tokens=256), {}) is None


def test_each_tuned_policy_drafts_a_static_length_at_its_never_stopping_threshold():
    """`static_at` is what `tune` adds to its grid as the static fallback: at it, a policy drafts its k
    whatever its head says, and tune tries it at every k up to the grid's most."""
    from draftsmith.eval.tune import TuneConfig
    from draftsmith.runtime.policies import POLICY_KINDS, PolicySettings

    class Doubtful:  # a head sure that every token will be rejected
        def acceptance(self, *args):
            return 0.0

        def confidence(self, *args):
            return 0.0

    decoded = [k for k in POLICY_KINDS.values() if k.tune == "decode"]
    assert {k.name for k in decoded} == {"specdec", "disco", "dspark"} and all(k.static_at is not None for k in decoded)
    q = torch.full((V,), 1.0 / V)
    for kind in decoded:
        for k in (1, 3):
            policy = kind.build(PolicySettings(k=k, threshold=kind.static_at, head=Doubtful()))([])
            steps = [DraftStep(position=i, token=None if i == 0 else 1, q_raw=q, hidden=torch.zeros(4), confidence=0.0)
                     for i in range(k + 1)]
            assert [policy.keep_going(step) for step in steps] == [True] * k + [False], (kind.name, k)
        stopping = kind.build(PolicySettings(k=3, threshold=0.5, head=Doubtful()))([])
        assert not all(stopping.keep_going(step) for step in steps[:3]), kind.name  # the same head stops at 0.5
        grid = TuneConfig(target="", drafter="d", policy=kind.name, ks=[2, 4]).grid()
        assert [(t, k) for t, k in grid if t == kind.static_at] == [(kind.static_at, k) for k in range(1, 5)]
    tree = TuneConfig(target="", drafter="d", policy="specdec", thresholds=[0.5], tree="3,2,6").grid()
    assert tree == [(0.5, 3), (1.0, 1), (1.0, 2), (1.0, 3)]


def test_policies_read_the_hidden_state_that_drafted_each_token(target):
    """Each step's hidden state is the drafter's state whose distribution the step's token was drawn
    from: a stop head reading it judges the token it is asked about (feature and standalone drafters)."""
    from tests.runtime.test_generate import proposers

    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import FeatureProposer

    class Recorder(Static):
        def keep_going(self, step):
            steps.append(step)
            return super().keep_going(step)

    for name, proposer in proposers(target).items():
        if name == "none":
            continue
        steps = []
        generate(TargetRunner(target, proposer.aux_layer_ids), proposer, [1, 2, 3], 12, Recorder(3))
        drafted = [s for s in steps if s.position > 0]
        assert drafted and all(s.hidden is not None and s.hidden.dim() == 1 for s in drafted), name
        for s in drafted:
            if isinstance(proposer, FeatureProposer):
                logits = proposer.drafter.logits(s.hidden[None, None])[0, 0]
            else:
                logits = (proposer.head or proposer.model.get_output_embeddings())(s.hidden)
            probs = proposer._to_target(torch.softmax(logits.float(), -1))
            assert torch.allclose(probs, s.q_raw, atol=1e-5), name
            assert s.token == int(s.q_raw.argmax())


def test_a_policy_that_does_nothing_with_trees_is_refused_with_them(target):
    """Before, `--policy dspark --tree ...` decoded whole trees and said nothing (as did the heuristic, the
    confidence rule and the oracle): each policy's entry says what it does with a tree, and one that does
    nothing is refused, naming what works; a stop head is refused on trees drawn whole from one forward."""
    from draftsmith.eval.tune import TuneConfig
    from draftsmith.runtime.policies import POLICY_KINDS, check_tree_policy, policy_kind
    from draftsmith.runtime.proposers import levels_asked
    from tests.runtime.test_block import tree_proposer
    from tests.runtime.test_tree import feature_proposers

    chains_only = [k.name for k in POLICY_KINDS.values() if k.trees is None]
    assert {"dspark", "heuristic", "confidence", "oracle"} <= set(chains_only)
    for name in chains_only:
        with pytest.raises(DraftsmithError, match=f"--policy {name}: .* sizes chains only; with --tree use "
                                                  "--policy cost or static, or drop --tree"):
            EvalConfig(target="", policy=name, tree="3,2,6", temperature=0)
    with pytest.raises(DraftsmithError, match="sizes chains only"):
        TuneConfig(target="", drafter="d", policy="dspark", tree="3,2,6")
    for name in ("cost", "static", "specdec", "disco"):
        EvalConfig(target="", policy=name, tree="3,2,6")
    block, parallel = (tree_proposer(target, kind, V, 3) for kind in ("dflash", "peagle"))
    assert not levels_asked(block) and not levels_asked(parallel) and levels_asked(feature_proposers(target)["eagle3"])
    assert not levels_asked(ModelProposer(target, V))  # no trees at all
    with pytest.raises(DraftsmithError, match="draws every level of a tree from one forward"):
        check_tree_policy(policy_kind("specdec"), levels_asked(block))
    check_tree_policy(policy_kind("specdec"), levels_asked(feature_proposers(target)["eagle3"]))
    check_tree_policy(policy_kind("cost"), levels_asked(block))
