"""Target distributions π = T(q, p) (docs/metrics.md proof 9): hand-computed cases for every rule
family, and single-step χ² tests that the procedures they stand for produce π."""

import pytest
import torch

from draftsmith.runtime import targets
from draftsmith.runtime.sampling import sample
from draftsmith.runtime.verify import verify_chain
from tests.runtime.test_verify import ALPHA, N, chi2_p_value, random_law

Q = torch.tensor([0.7, 0.2, 0.1])
P = torch.tensor([0.2, 0.4, 0.4])


def test_lossy_hand_case_with_beta_one_and_tuned():
    # α = 0.5: p/(1−α) = [0.4, 0.8, 0.8]; kept = min(q, ·) = [0.4, 0.2, 0.1]; rejected mass R = 0.3
    # β = 1: residual max(0, p − q) = [0, 0.2, 0.3] → π = kept + 0.3·[0, 0.4, 0.6]
    assert torch.allclose(targets.lossy(Q, P, 0.5), torch.tensor([0.4, 0.32, 0.28]))
    # tuned: (0.4/β − 0.2) + (0.4/β − 0.1) = 0.3 → β = 4/3; Lemma 2: max{min{q, p/(1−α)}, p/β} = [0.4, 0.3, 0.3]
    beta = targets.tuned_beta(Q, P, 0.5)
    assert float(beta) == pytest.approx(4 / 3, rel=1e-5)
    assert torch.allclose(targets.lossy(Q, P, 0.5, beta), torch.tensor([0.4, 0.3, 0.3]), atol=1e-5)
    lemma2 = torch.maximum(torch.minimum(Q, P / 0.5), P / beta)
    assert torch.allclose(targets.lossy(Q, P, 0.5, beta), lemma2, atol=1e-5)


def test_lossy_ends_and_its_acceptance_ratio():
    g = torch.Generator().manual_seed(3)
    p, q = (0.5 * random_law(g) + 0.5 / 6 for _ in range(2))  # no near-zero entries: p/q stays moderate
    assert torch.allclose(targets.lossy(q, p, 0.0), p, atol=1e-6)  # α = 0: lossless
    lenient = 1 - float((p / q).min())  # from here on p/(1−α) ≥ q everywhere: every draft is accepted
    assert torch.allclose(targets.lossy(q, p, min(0.999, lenient + 1e-3)), q, atol=1e-6)
    for alpha in (0.1, 0.3):
        pi = targets.lossy(q, p, alpha)
        assert float(pi.sum()) == pytest.approx(1.0)
        # verifying against π accepts x exactly as lossy decoding does: min(1, p(x)/((1−α)·q(x)))
        assert torch.allclose((pi / q).clamp(max=1), (p / ((1 - alpha) * q)).clamp(max=1), atol=1e-6)


@pytest.mark.parametrize("beta", [1.0, "tuned"])
def test_lossy_procedure_follows_pi(beta):
    """Run the lossy procedure itself (accept with min(1, p/((1−α)q)), else draw from norm(max(0, p/β − q)))
    and compare its samples with π."""
    g = torch.Generator().manual_seed(4)
    p, q, alpha = random_law(g), random_law(g), 0.3
    b = targets.tuned_beta(q, p, alpha) if beta == "tuned" else torch.tensor(beta)
    residual = (p / b - q).clamp(min=0)
    residual = residual / residual.sum()
    counts = torch.zeros(len(p))
    for _ in range(N):
        x = int(sample(q, g))
        keep = float(torch.rand(1, generator=g)) < min(1.0, float(p[x] / ((1 - alpha) * q[x])))
        counts[x if keep else int(sample(residual, g))] += 1
    assert chi2_p_value(counts, targets.lossy(q, p, alpha, b)) > ALPHA


def test_token_specific_rules_hand_cases():
    q = torch.tensor([0.50, 0.30, 0.20])
    p = torch.tensor([0.60, 0.35, 0.05])
    # α = 0.2, max p = 0.6: V1 q(v) < 0.4; V2 p(v) < 0.4; V3 p(v) < 0.48
    assert targets.token_defer("v1", q, p, 0.2).tolist() == [0.0, 1.0, 1.0]
    assert targets.token_defer("v2", q, p, 0.2).tolist() == [0.0, 1.0, 1.0]
    assert targets.token_defer("v3", q, p, 0.2).tolist() == [0.0, 1.0, 1.0]
    # where they part. V1 reads the drafter: q(1) = 0.45 ≥ 0.4 keeps token 1, which V2 (p(1) = 0.35 < 0.4) defers
    q2, p2 = torch.tensor([0.42, 0.45, 0.13]), torch.tensor([0.60, 0.35, 0.05])
    assert targets.token_defer("v1", q2, p2, 0.2).tolist() == [0.0, 0.0, 1.0]
    assert targets.token_defer("v2", q2, p2, 0.2).tolist() == [0.0, 1.0, 1.0]
    # V2 subtracts α, V3 scales by 1 − α. Unnormalized p = [0.9, 0.62, 0.5], α = 0.3: V2's bar is 0.9 − 0.3 = 0.6,
    # V3's is 0.7·0.9 = 0.63, so 0.62 clears V2 but not V3 (both bars scale with the normalization)
    p3 = torch.tensor([0.90, 0.62, 0.50]) / 2.02
    assert targets.token_defer("v2", q2, p3, 0.3 / 2.02).tolist() == [0.0, 0.0, 1.0]
    assert targets.token_defer("v3", q2, p3, 0.3).tolist() == [0.0, 1.0, 1.0]
    # π(v) = q(v)(1 − r(v)) + p(v)·Σ r q: here r = [0, 1, 1], deferred mass 0.5
    r = targets.token_defer("v2", q, p, 0.2)
    assert torch.allclose(targets.token_specific(q, p, 1 - r), torch.tensor([0.5 + 0.6 * 0.5, 0.35 * 0.5, 0.05 * 0.5]))
    with pytest.raises(ValueError, match="v1, v2 or v3"):
        targets.token_defer("v4", q, p, 0.2)


def test_v3_at_temperature_zero_is_greedy_lossy_decoding():
    """Lemma 7: with a greedy draft x (q one-hot) and the target's greedy law (p one-hot at its argmax),
    V3 on the raw distributions accepts x exactly when p_raw(x) ≥ (1−α)·max p_raw, else commits argmax p."""
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        p_raw, alpha = random_law(g), float(torch.rand(1, generator=g)) * 0.6
        top = int(p_raw.argmax())
        p_greedy = torch.nn.functional.one_hot(torch.tensor(top), len(p_raw)).float()
        for x in range(len(p_raw)):
            q = torch.nn.functional.one_hot(torch.tensor(x), len(p_raw)).float()
            r = targets.token_defer("v3", q, p_raw, alpha)
            pi = targets.token_specific(q, p_greedy, 1 - r)
            accepted, token = verify_chain(torch.tensor([x]), q[None], torch.stack([pi, p_greedy]), g)
            lenient = bool(p_raw[x] >= (1 - alpha) * p_raw.max())
            assert (accepted == 1) == lenient and (lenient or token == top)


@pytest.mark.parametrize("rule", ["v1", "v2", "v3"])
def test_token_specific_samples_follow_pi(rule):
    g = torch.Generator().manual_seed(6)
    p, q = random_law(g), random_law(g)
    pi = targets.token_specific(q, p, 1 - targets.token_defer(rule, q, p, 0.15))
    assert float(pi.sum()) == pytest.approx(1.0)
    counts = torch.zeros(len(p))
    for _ in range(N):
        x = sample(q, g).reshape(1)
        n, t = verify_chain(x, q[None], torch.stack([pi, pi]), g)
        counts[int(x) if n else t] += 1
    assert chi2_p_value(counts, pi) > ALPHA


def test_decoding_modes_through_the_runtime(target):
    """At α = 0 every mode is exact decoding (greedy: the target's own output); a cascade that never defers
    accepts every drafted token; a lenient token rule accepts more of a wrong drafter's tokens than exact."""
    from draftsmith.runtime.generate import TargetRunner, generate
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.targets import target_rule
    from tests.runtime.test_generate import proposers

    prompt = [1, 2, 3]
    drafter = proposers(target)["eagle"]  # wrong at every position on this tiny target
    runner = TargetRunner(target, drafter.aux_layer_ids)
    exact = generate(runner, drafter, prompt, 16, Static(3))
    for mode, rule in [("lossy", None), ("cascade", "opt"), ("token", "v2"), ("token", "v3")]:
        same = generate(runner, drafter, prompt, 16, Static(3), rule=target_rule(mode, rule, 0.0, greedy=True))
        assert same.tokens == exact.tokens, (mode, rule)
    never = target_rule("cascade", "chow", 0.999, greedy=True)  # defers only when max q < 0.001
    out = generate(runner, drafter, prompt, 16, Static(3), rule=never)
    assert all(r.accepted == r.drafted for r in out.rounds) and out.tokens != exact.tokens
    lenient = generate(runner, drafter, prompt, 16, Static(3), rule=target_rule("token", "v3", 0.99, greedy=True))
    assert sum(r.accepted for r in lenient.rounds) > sum(r.accepted for r in exact.rounds) == 0


def test_mode_settings_are_checked():
    from draftsmith import DraftsmithError
    from draftsmith.eval.evaluate import EvalConfig

    with pytest.raises(DraftsmithError, match="--mode token takes --rule v1 or v2 or v3"):
        EvalConfig(target="", mode="token", rule="chow")
    with pytest.raises(DraftsmithError, match="verifies chain drafts; drop --tree"):
        EvalConfig(target="", mode="cascade", tree="3,4,8")
    with pytest.raises(DraftsmithError, match="unknown decoding mode"):
        EvalConfig(target="", mode="bild")
    assert EvalConfig(target="", mode="exact").target_rule() is None
