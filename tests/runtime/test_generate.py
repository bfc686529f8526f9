"""docs/metrics.md proofs 1, 3, 5, 6 and 8 for the decoding loop, on tiny random models in fp32."""

import itertools
import warnings
from collections import Counter

import pytest
import torch

from draftsmith.models.common import cache_kwargs
from draftsmith.models.eagle import EagleDrafter
from draftsmith.models.eagle3 import Eagle3Drafter, PEagleDrafter
from draftsmith.runtime.generate import generate
from draftsmith.runtime.runner import TargetRunner
from draftsmith.runtime.policies import Confidence, Heuristic, Oracle, Static
from draftsmith.runtime.cost import CostAware
from draftsmith.eval.oracle import oracle_drafts
from draftsmith.runtime.proposers import FeatureProposer, NoProposer
from draftsmith.runtime.standalone import ModelProposer
from draftsmith.runtime.sampling import SamplingConfig, distributions
from tests.conftest import make_llama
from tests.runtime.conftest import V, greedy_cases



def proposers(target):
    torch.manual_seed(1)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    return {
        "none": NoProposer(V),
        "eagle": FeatureProposer(EagleDrafter(target.config, embed, head), V),
        "eagle3": FeatureProposer(Eagle3Drafter(target.config, embed, head, None, torch.arange(0, V, 3), 3, 32), V, [0, 1, 2]),
        "peagle": FeatureProposer(PEagleDrafter(target.config, embed, head, None, torch.arange(0, V, 3), 3, 32,
                                                mask_token_id=1), V, [0, 1, 2]),
        "standalone": ModelProposer(make_llama(V, seed=2, hidden=16, layers=1), V),
        "self": ModelProposer(target, V),
        "self-ranked": ModelProposer(target, V, head_ids=torch.arange(0, V, 2)),  # drafts even ids only
    }


@pytest.mark.parametrize("kind", ["none", "eagle", "eagle3", "peagle", "standalone", "self", "self-ranked"])
@pytest.mark.parametrize("policy", [lambda: Static(3), lambda: Heuristic(2), lambda: Confidence(0.05, 5),
                                    lambda: CostAware(5, cost=0.01)])
def test_greedy_output_is_the_targets_own(target, kind, policy):
    proposer = proposers(target)[kind]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    for prompt, expected in greedy_cases(target):
        out = generate(runner, proposer, prompt, 24, policy())
        assert out.tokens == expected, kind
        assert sum(r.committed for r in out.rounds) + 1 == 24


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "standalone", "self-ranked"])
def test_the_kv_cache_goes_by_the_name_the_installed_transformers_takes(target, kind):
    """transformers 5.24 renamed `past_key_values` to `cache`; the old name warns until 5.40 removes it."""
    proposer = proposers(target)[kind]
    runner = TargetRunner(target, proposer.aux_layer_ids)
    prompt, expected = next(iter(greedy_cases(target, seeds=1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert generate(runner, proposer, prompt, 24, Static(3)).tokens == expected


def test_cache_kwargs_follows_the_forward_signature():
    class New(torch.nn.Module):
        def forward(self, x, cache=None):
            return x

    class Old(torch.nn.Module):
        def forward(self, x, past_key_values=None):
            return x

    assert cache_kwargs(New(), 1) == {"cache": 1} and cache_kwargs(Old(), 1) == {"past_key_values": 1}


def test_always_right_and_always_wrong_drafters(target):
    prompt = [5, 9, 2, 7]
    right = generate(TargetRunner(target), ModelProposer(target, V), prompt, 1 + 5 * 4, Static(4))
    assert [r.accepted + 1 for r in right.rounds] == [5] * 4  # τ = K + 1

    class Wrong(NoProposer):
        def propose(self, sequence, policy, k, sampling, generator):
            logits = target(torch.tensor([sequence])).logits[0, -1]
            bad = (int(logits.argmax()) + 1) % V
            q = torch.nn.functional.one_hot(torch.tensor([bad] * k, dtype=torch.long), V).float()
            return [bad] * k, q, q

    wrong = generate(TargetRunner(target), Wrong(V), prompt, 12, Static(3))
    assert all(r.accepted == 0 and r.committed == 1 for r in wrong.rounds)  # τ = 1


def test_eos_inside_a_draft_and_the_length_boundary(target):
    prompt = [3, 1, 4, 1, 5]
    plain = generate(TargetRunner(target), NoProposer(V), prompt, 30, Static(0)).tokens
    eos = plain[10]
    stop_at = plain.index(eos)
    out = generate(TargetRunner(target), ModelProposer(target, V), prompt, 30, Static(4), eos_token_ids=(eos,))
    assert out.tokens == plain[: stop_at + 1] and out.stop == "eos"
    for n in (1, 2, 5, 6):
        out = generate(TargetRunner(target), ModelProposer(target, V), prompt, n, Static(4))
        assert out.tokens == plain[:n]


def test_target_cache_rollback_equals_recomputation(target):
    runner = TargetRunner(target)
    prompt, draft = [4, 8, 15, 16], [23, 42, 7, 9]
    for keep in range(len(draft) + 1):  # rejection at every position, then a full acceptance
        runner.reset()
        runner.forward(prompt[:-1])
        runner.forward([prompt[-1]] + draft)
        runner.rollback(len(draft) - keep)
        logits, _, _ = runner.forward([11])
        full = target(torch.tensor([prompt + draft[:keep] + [11]])).logits[0, -1]
        torch.testing.assert_close(logits[-1], full, atol=1e-5, rtol=1e-5)


def test_drafter_cache_is_complete_after_a_round(target):
    """After rounds of drafting and rollback, the drafter's state equals a fresh full recomputation."""
    proposer = proposers(target)["eagle"]
    runner = TargetRunner(target)
    prompt = [2, 4, 6, 8, 10]
    out = generate(runner, proposer, prompt, 15, Static(3))
    seq = prompt + out.tokens
    fresh = FeatureProposer(proposer.drafter, V)
    _, final, _ = _fresh_runner(target).forward(seq[:-1])
    fresh.observe(seq[1:], final, None)
    assert fresh.anchors == proposer.anchors
    torch.testing.assert_close(fresh.hidden, proposer.hidden, atol=1e-5, rtol=1e-4)


def _fresh_runner(target):
    runner = TargetRunner(target)
    runner.reset()
    return runner


def exact_law(model, prompt, length, cfg):
    """P(sequence) for every sequence of `length` tokens under the model's scaled distribution."""
    law = {}
    for seq in itertools.product(range(model.config.vocab_size), repeat=length):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(seq)])).logits[0, len(prompt) - 1:]
        _, probs = distributions(logits, cfg)
        law[seq] = float(torch.prod(torch.stack([probs[i, x] for i, x in enumerate(seq)])))
    return law


def assert_follows_law(counts: Counter, law: dict) -> None:
    """The sequences counted (`counts`, of n draws) follow `law`: none of probability zero, and a χ²
    statistic below ~ the 0.1 % tail of χ²(df), df = sequences of nonzero probability − 1."""
    n = sum(counts.values())
    cells = [s for s in law if law[s] > 0]
    assert all(law[s] > 0 for s in counts), "a sequence of probability zero was produced"
    chi2 = sum((counts.get(s, 0) - n * law[s]) ** 2 / (n * law[s]) for s in cells)
    df = len(cells) - 1
    assert chi2 < df + 4.5 * (2 * df) ** 0.5, (chi2, df)


@pytest.mark.proof
@pytest.mark.parametrize("cfg, k, head_ids", [
                                    (SamplingConfig(temperature=0.7, top_k=3), 3, None),
                                    (SamplingConfig(temperature=1.3, top_p=0.8), 1, None),
                                    (SamplingConfig(temperature=1.0), 2, [0, 2, 3])])  # a frequency-ranked head
def test_multi_step_sampling_is_lossless(cfg, k, head_ids):
    tv, length, n = 4, 3, 2000
    target = make_llama(tv, seed=3, hidden=16, layers=1)
    draft = make_llama(tv, seed=4, hidden=16, layers=1)
    prompt = [1, 2]
    law = exact_law(target, prompt, length, cfg)
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(target)
    proposer = ModelProposer(draft, tv, None if head_ids is None else torch.tensor(head_ids))
    counts = Counter(tuple(generate(runner, proposer, prompt, length, Static(k), cfg, generator=g).tokens)
                     for _ in range(n))
    assert_follows_law(counts, law)
    tv_dist = 0.5 * sum(abs(counts.get(s, 0) / n - law[s]) for s in law)
    assert tv_dist < 5 * 0.5 * sum((law[s] * (1 - law[s]) / n) ** 0.5 for s in law)


def test_a_ranked_head_drafts_only_its_tokens_with_the_full_models_logits(target):
    ids = torch.tensor([3, 8, 11, 20, 21, 40])
    ranked, full = ModelProposer(target, V, head_ids=ids), ModelProposer(target, V)
    prompt = [5, 9, 2, 7]
    for cfg in (SamplingConfig(), SamplingConfig(temperature=1.0)):
        ranked.reset()
        tokens, scaled, raw = ranked.propose(prompt, Static(3), 3, cfg, torch.Generator().manual_seed(0))
        assert set(tokens) <= set(ids.tolist())
        assert float(raw[:, ids].sum(-1).min()) == pytest.approx(1.0) and float(raw.sum(-1).max()) == pytest.approx(1.0)
    ranked.reset()
    _, _, raw = ranked.propose(prompt, Static(1), 1, SamplingConfig(), None)
    _, _, raw_full = full.propose(prompt, Static(1), 1, SamplingConfig(), None)
    assert torch.allclose(raw[0, ids], torch.softmax(torch.log(raw_full[0, ids]), -1), atol=1e-5)  # the same logits, renormalised


def test_a_ranked_head_refuses_a_model_whose_logits_are_not_a_plain_head(target):
    from draftsmith import DraftsmithError

    scaled = make_llama(V, seed=5, hidden=16, layers=1)
    plain_forward = scaled.forward
    scaled.forward = lambda *a, **kw: type(out := plain_forward(*a, **kw))(logits=out.logits / 4)  # as Granite's scaling
    with pytest.raises(DraftsmithError, match="not a plain linear head"):
        ModelProposer(scaled, V, head_ids=torch.arange(10))


@pytest.mark.parametrize("kind", ["standalone", "eagle", "eagle3", "self-ranked"])
def test_the_oracle_drafts_exactly_what_the_target_accepts(target, kind):
    """Knowing the target's greedy text and the drafter's greedy chain after each of its prefixes, the oracle
    keeps every token Static(K) keeps, round by round, and drafts nothing the target rejects: it is charged
    only for what it keeps."""
    prompt = [1, 2, 3]
    plain = generate(TargetRunner(target), NoProposer(V), prompt, 20, Static(0))
    drafter = proposers(target)[kind]
    runner = TargetRunner(target, drafter.aux_layer_ids)
    reference = prompt + plain.tokens
    static = generate(runner, drafter, prompt, 20, Static(4))
    oracle = generate(runner, drafter, prompt, 20, Oracle(reference, oracle_drafts(runner, drafter, reference, 3, 4), 4))
    assert oracle.tokens == static.tokens == plain.tokens
    assert [r.accepted for r in oracle.rounds] == [r.accepted for r in static.rounds]
    assert all(r.drafted == r.accepted for r in oracle.rounds)
    rejected = sum(r.drafted - r.accepted for r in static.rounds)
    if kind == "standalone":  # always right on this tiny target: the oracle drafts what static drafts
        assert rejected == 0 and [r.drafted for r in oracle.rounds] == [r.drafted for r in static.rounds]
    else:  # static pays for rejected tokens; the oracle never does
        assert rejected > 0


