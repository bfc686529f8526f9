"""docs/metrics.md proofs 2, 4, 5 and 9 for the verification routine, on a 6-token vocabulary."""

import pytest
import torch

from draftsmith.runtime import targets
from draftsmith.runtime.sampling import SamplingConfig, distributions, greedy_tokens, sample
from draftsmith.runtime.verify import verify_chain, verify_greedy

V, N = 6, 30000
ALPHA = 1e-3  # a test fails when its samples are this unlikely under the law they should follow


def chi2(counts: torch.Tensor, law: torch.Tensor) -> float:
    expected = law * counts.sum()
    seen = expected > 0
    assert counts[~seen].sum() == 0, "a token of zero probability was produced"
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


def chi2_p_value(counts: torch.Tensor, law: torch.Tensor) -> float:
    """P(χ² ≥ observed) under `law`, degrees of freedom = cells of nonzero probability − 1:
    the upper regularized incomplete gamma Q(df/2, χ²/2)."""
    df = int((law > 0).sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(chi2(counts, law) / 2, dtype=torch.float64)))


def test_chi2_p_value_matches_the_tables():
    """5 degrees of freedom: χ² = 20.52 is the 0.1 % point, 11.07 the 5 % point, 4.35 the median."""
    law = torch.full((6,), 1 / 6)
    for statistic, p in [(20.52, 0.001), (11.07, 0.05), (4.35, 0.5)]:
        # counts whose statistic is `statistic`: move mass between two cells of 6000 draws
        d = (statistic * 1000 / 2) ** 0.5
        counts = torch.full((6,), 1000.0)
        counts[0] += d
        counts[1] -= d
        assert abs(chi2_p_value(counts, law) - p) < 0.02 * p + 1e-4


def tv_bound(law: torch.Tensor, n: int) -> float:
    """Five standard deviations of the empirical total variation."""
    return 5 * 0.5 * float((law * (1 - law) / n).sqrt().sum())


def law_of(draw, n=N) -> torch.Tensor:
    counts = torch.zeros(V)
    for _ in range(n):
        counts[draw()] += 1
    return counts


def random_law(g, zero=None):
    law = torch.rand(V, generator=g) ** 2
    if zero is not None:
        law[zero] = 0
    return law / law.sum()


@pytest.mark.parametrize("seed", [0, 1])
def test_single_step_output_follows_p_including_the_bonus(seed):
    g = torch.Generator().manual_seed(seed)
    p1, p2, q = random_law(g, zero=2), random_law(g), random_law(g)
    firsts, bonus, accepted = torch.zeros(V), torch.zeros(V), 0
    for _ in range(N):
        x = sample(q, g).reshape(1)
        n, token = verify_chain(x, q[None], torch.stack([p1, p2]), g)
        first = int(x) if n == 1 else token
        firsts[first] += 1
        if n == 1:
            bonus[token] += 1
            accepted += 1
    assert chi2_p_value(firsts, p1) > ALPHA
    assert float((firsts / N - p1).abs().sum() / 2) < tv_bound(p1, N)
    assert chi2_p_value(bonus, p2) > ALPHA
    expected_rate = float(torch.minimum(p1, q).sum())  # acceptance probability Σ min(p, q)
    assert abs(accepted / N - expected_rate) < 5 * (expected_rate * (1 - expected_rate) / N) ** 0.5


def test_deterministic_draft_is_one_hot_q():
    g = torch.Generator().manual_seed(3)
    p = random_law(g)
    draft = torch.tensor([4])
    one_hot = torch.nn.functional.one_hot(draft, V).float()
    counts = law_of(lambda: (lambda n, t: 4 if n else t)(*verify_chain(draft, one_hot, torch.stack([p, p]), g)))
    assert chi2_p_value(counts, p) > ALPHA


def test_the_q_contract_matters():
    """Verifying with a q other than the one the token came from breaks losslessness."""
    g = torch.Generator().manual_seed(4)
    p, q_true, q_claimed = random_law(g), random_law(g), torch.full((V,), 1 / V)
    counts = torch.zeros(V)
    for _ in range(N):
        x = sample(q_true, g).reshape(1)
        n, t = verify_chain(x, q_claimed[None], torch.stack([p, p]), g)
        counts[int(x) if n else t] += 1
    assert chi2_p_value(counts, p) < 1e-12  # the wrong q is caught


def test_edge_cases():
    g = torch.Generator().manual_seed(5)
    p = random_law(g, zero=1)
    draft = sample(p.expand(4, V), g)
    n, _ = verify_chain(draft, p.expand(4, V), p.expand(5, V), g)
    assert n == 4  # p == q always accepts
    n, t = verify_chain(torch.tensor([1]), torch.full((1, V), 1 / V), torch.stack([p, p]), g)
    assert n == 0 and t != 1  # p(x) = 0 is never accepted, nor resampled
    n, t = verify_chain(torch.zeros(0, dtype=torch.long), torch.zeros(0, V), p[None], g)
    assert n == 0 and p[t] > 0  # K = 0 samples from π directly
    # zero residual mass (π == q up to rounding) yields a token, not NaN
    q = p.clone()
    pi = torch.stack([p * (1 + 1e-7), p])
    n, t = verify_chain(torch.tensor([0]), q[None], pi / pi.sum(-1, keepdim=True), g)
    assert 0 <= t < V
    # fresh randomness every call
    outs = {verify_chain(torch.tensor([0]), torch.full((1, V), 1 / V), torch.stack([p, p]), g)[1] for _ in range(50)}
    assert len(outs) > 1


def test_greedy_path():
    assert verify_greedy(torch.tensor([3, 1, 2]), torch.tensor([3, 1, 5, 0])) == (2, 5)
    assert verify_greedy(torch.tensor([3, 1]), torch.tensor([3, 1, 4])) == (2, 4)
    assert verify_greedy(torch.tensor([2]), torch.tensor([3, 1])) == (0, 3)
    assert verify_greedy(torch.zeros(0, dtype=torch.long), torch.tensor([3])) == (0, 3)


def test_sampling_transforms():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    raw, greedy = distributions(logits, SamplingConfig())
    assert torch.allclose(raw, torch.softmax(logits, -1)) and greedy.tolist() == [1, 0, 0, 0, 0, 0]
    _, hot = distributions(logits, SamplingConfig(temperature=0.5))
    assert torch.allclose(hot, torch.softmax(logits / 0.5, -1))
    _, topk = distributions(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert (topk[2:] == 0).all() and torch.allclose(topk[:2], torch.softmax(logits[:2], -1))
    _, nucleus = distributions(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    full = torch.softmax(logits, -1)  # 0.55, 0.20, ... : the smallest prefix reaching 0.7 is 2 tokens... or 3
    keep = (full.cumsum(0) - full) < 0.7
    assert torch.allclose(nucleus, full * keep / (full * keep).sum())


@pytest.mark.parametrize("rule", ["chow", "diff", "opt"])
def test_cascade_mixtures(rule):
    g = torch.Generator().manual_seed(7)
    p, q = random_law(g), random_law(g)
    defer = getattr(targets, rule)(q, p, 0.1)
    pi = targets.mixture(q, p, defer)
    assert torch.allclose(pi.sum(-1), torch.tensor(1.0))
    r = 0.3
    pi = targets.mixture(q, p, r)
    rejection = float((q - torch.minimum(pi, q)).sum())  # Σ max(0, q − π)
    assert abs(rejection - r * float(targets.total_variation(p, q))) < 1e-6
    assert torch.allclose(targets.mixture(q, p, 1.0), p)  # always defer: exact decoding
    x = sample(q, g).reshape(1)
    assert verify_chain(x, q[None], torch.stack([targets.mixture(q, p, 0.0), p]), g)[0] == 1  # never defer


def test_deferral_rules_defer_where_they_must_and_not_elsewhere():
    """Hand cases, α = 0.2. Rows: a confident drafter agreeing with a confident target; an unsure
    drafter; a drafter less confident than the target by more than α; the same by less than α."""
    q = torch.tensor([[0.90, 0.05, 0.05], [0.50, 0.30, 0.20], [0.60, 0.20, 0.20], [0.60, 0.20, 0.20]])
    p = torch.tensor([[0.90, 0.05, 0.05], [0.50, 0.30, 0.20], [0.95, 0.03, 0.02], [0.70, 0.20, 0.10]])
    # Chow: max q < 1 − α = 0.8
    assert targets.chow(q, p, 0.2).tolist() == [0.0, 1.0, 1.0, 1.0]
    # Diff: max q < max p − α: 0.9 < 0.7 no; 0.5 < 0.3 no; 0.6 < 0.75 yes; 0.6 < 0.5 no
    assert targets.diff(q, p, 0.2).tolist() == [0.0, 0.0, 1.0, 0.0]
    # OPT: max q < max p − α·TV(p, q); TV = 0, 0, 0.35, 0.1 → thresholds 0.9, 0.5, 0.88, 0.68
    assert targets.total_variation(p, q).tolist() == pytest.approx([0.0, 0.0, 0.35, 0.1])
    assert targets.opt(q, p, 0.2).tolist() == [0.0, 0.0, 1.0, 1.0]
    # a rule's δ mixes: deferred rows are p, kept rows are q
    pi = targets.mixture(q, p, targets.diff(q, p, 0.2))
    assert torch.equal(pi[2], p[2]) and torch.equal(pi[[0, 1, 3]], q[[0, 1, 3]])


def test_token_specific_target_matches_a_hand_computed_pi():
    """Token-level Diff, α = 0.1: keep x where q(x) ≥ max p − α = 0.4; π(x) = q(x)·keep(x) + p(x)·Σ deferred q."""
    q = torch.tensor([0.45, 0.35, 0.20])
    p = torch.tensor([0.50, 0.10, 0.40])
    keep = 1 - targets.token_defer("v1", q, p, 0.1)
    assert keep.tolist() == [1.0, 0.0, 0.0]
    deferred = 0.35 + 0.20
    expected = torch.tensor([0.45 + 0.50 * deferred, 0.10 * deferred, 0.40 * deferred])
    assert torch.allclose(targets.token_specific(q, p, keep), expected)
    assert torch.allclose(targets.token_specific(q, p, torch.ones(3)), q)  # keep all: the drafter's own law
    assert torch.allclose(targets.token_specific(q, p, torch.zeros(3)), p)  # defer all: the target's


def test_mixture_samples_follow_pi_and_token_specific_sums_to_one():
    g = torch.Generator().manual_seed(8)
    p, q = random_law(g), random_law(g)
    pi = targets.mixture(q, p, 0.4)
    counts = torch.zeros(V)
    for _ in range(N):
        x = sample(q, g).reshape(1)
        n, t = verify_chain(x, q[None], torch.stack([pi, pi]), g)
        counts[int(x) if n else t] += 1
    assert chi2_p_value(counts, pi) > ALPHA
    keep = 1 - targets.token_defer("v1", q, p, 0.1)
    assert torch.allclose(targets.token_specific(q, p, keep).sum(-1), torch.tensor(1.0))


def test_greedy_tokens_match_the_low_precision_argmax_including_ties():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=g).to(torch.bfloat16)
    logits[:, 7] = logits[:, 3] = logits.max() + 1  # an exact tie: the first index wins in both
    assert torch.equal(greedy_tokens(logits), logits.argmax(-1))
    assert (greedy_tokens(logits) == 3).all()


def test_sample_draws_each_row_by_its_law_and_refuses_a_broken_one():
    """`sample` (inverse CDF): rows of a batch each follow their own law, unnormalized or not, and a token of
    probability 0 (first, inside, last) is never drawn; nan, inf, negative entries and all-zero rows fail."""
    g = torch.Generator().manual_seed(0)
    first, inside = random_law(g, zero=0), random_law(g, zero=[2, 5])
    rows = torch.stack([first, inside * 7.0])  # the second unnormalized
    draws = torch.stack([sample(rows, g) for _ in range(N)])  # (N, 2)
    for r, law in enumerate((first, inside)):
        counts = torch.bincount(draws[:, r], minlength=V).double()
        assert chi2_p_value(counts, law / law.sum()) > ALPHA
    assert sample(torch.tensor([0.0, 0.0, 3.0]), g).shape == ()
    for broken in ([0.5, float("nan")], [0.0, 0.0], [-0.1, 1.1], [float("inf"), 1.0]):
        with pytest.raises(Exception, match="inf, nan or a negative"):
            sample(torch.tensor(broken), g)


def test_drawing_with_swaps_every_draw_of_the_runtime_and_restores_it():
    """benchmarks/sampling_cost.py measures another sampler in the decoding loop through this one hook."""
    from draftsmith.runtime.sampling import drawing_with, sample

    probs = torch.tensor([[0.0, 1.0, 0.0]])
    with drawing_with(lambda p, g: torch.full(p.shape[:-1], 2, dtype=torch.long)):
        assert sample(probs).tolist() == [2]
    assert sample(probs).tolist() == [1]
