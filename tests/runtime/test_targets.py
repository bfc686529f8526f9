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


@pytest.mark.proof
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


@pytest.mark.proof
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
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
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
        EvalConfig(target="", mode="bogus")
    assert EvalConfig(target="", mode="exact").target_rule() is None


def sequential_law(target, draft, prompt, length, k, cfg, rule):
    """P(sequence) of `length` tokens decoded by the runtime with a static draft of k and `rule`, by walking
    every path of the procedure: the prefill's token ~ p; a round drafts min(k, room) tokens (BiLD's
    fallback stops it at the first drafted position whose max q_raw is below the threshold); at drafted
    position i the committed x is accepted with mass min(q, π)(x) (the round goes on) or is the
    correction with mass max(0, π − q)(x) (the round ends) — for BiLD's rollback, q(x)·keep(x) and
    Σ q·(1 − keep)·p(x); after the last drafted token the target draws from p."""
    from collections import defaultdict

    from draftsmith.runtime.sampling import distributions

    cache = {}

    def law_after(model, seq):
        if (id(model), seq) not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([list(seq)])).logits[0, -1]
            cache[id(model), seq] = distributions(logits, cfg)
        return cache[id(model), seq]

    law: dict[tuple, float] = defaultdict(float)
    bild = isinstance(rule, targets.Rollback)

    def walk(seq: tuple, prob: float, i: int | None, k_round: int) -> None:
        done = len(seq) - len(prompt)
        if done == length:
            law[seq[len(prompt):]] += prob
            return
        if i is None:  # a round starts
            i, k_round = 0, min(k, length - done - 1)
        p_raw, p = law_after(target, seq)
        if i < k_round:
            q_raw, q = law_after(draft, seq)
            if not (bild and rule.fallback is not None and float(q_raw.max()) < rule.fallback):
                if bild:
                    keep = rule.keep(p_raw)
                    accept, correct = q * keep, (q * (1 - keep)).sum() * p
                else:
                    pi = rule(q_raw[None], q[None], p_raw[None], p[None])[0]
                    accept, correct = torch.minimum(q, pi), (pi - q).clamp(min=0)
                for x in range(len(p)):
                    if accept[x] > 0:
                        walk(seq + (x,), prob * float(accept[x]), i + 1, k_round)
                    if correct[x] > 0:
                        walk(seq + (x,), prob * float(correct[x]), None, 0)
                return
        for x in range(len(p)):  # the bonus, or a round that drafted nothing
            if p[x] > 0:
                walk(seq + (x,), prob * float(p[x]), None, 0)

    _, p0 = law_after(target, tuple(prompt))
    for x in range(len(p0)):
        walk(tuple(prompt) + (x,), float(p0[x]), None, 0)
    return dict(law)


@pytest.mark.proof
@pytest.mark.parametrize("mode, rule, alpha", [("lossy", "tuned", 0.2), ("cascade", "opt", 0.2), ("token", "v3", 0.6),
                                              ("bild", "star", 0.1), ("bild", "rollback", 0.6)])
def test_decoded_sequences_follow_the_sequential_law_of_pi(mode, rule, alpha):
    """χ² of 4-token sequences decoded through the runtime (tiny target and drafter, 3-token vocabulary, static
    drafts of 2, temperature 1, logits sharpened so the two disagree) against the law enumerated from π at
    every prefix, one rule of each family. The law must differ from the target's own and from the drafter's
    by more than the test's noise (n·Σ Δ²/law, the χ² statistic a runtime producing either would score on
    average above the degrees of freedom), or the test would prove nothing about the rule."""
    from collections import Counter

    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.standalone import ModelProposer
    from draftsmith.runtime.sampling import SamplingConfig
    from tests.conftest import make_llama

    vocab, length, k, n, prompt = 3, 4, 2, 3000, [1, 2]
    cfg = SamplingConfig(temperature=1.0)
    target, draft = make_llama(vocab, seed=3, hidden=16, layers=1), make_llama(vocab, seed=4, hidden=16, layers=1)
    target.config.eos_token_id = draft.config.eos_token_id = None
    with torch.no_grad():  # tied embeddings: the final norm undoes the scale on the way in, the head keeps it
        target.lm_head.weight.mul_(3)
        draft.lm_head.weight.mul_(3)
    rule_fn = targets.target_rule(mode, rule, alpha, greedy=False, fallback=0.45)
    law = sequential_law(target, draft, prompt, length, k, cfg, rule_fn)
    assert sum(law.values()) == pytest.approx(1.0, abs=1e-5)
    for end in (lambda q_raw, q, p_raw, p: p, lambda q_raw, q, p_raw, p: q):
        other = sequential_law(target, draft, prompt, length, k, cfg, end)
        assert n * sum((law[s] - other.get(s, 0)) ** 2 / law[s] for s in law if law[s] > 0) > 30, "a trivial law"
    g = torch.Generator().manual_seed(0)
    runner, proposer = TargetRunner(target), ModelProposer(draft, vocab)
    counts = Counter(tuple(generate(runner, proposer, prompt, length, Static(k), cfg, rule=rule_fn, generator=g).tokens)
                     for _ in range(n))
    cells = sorted(law)
    assert all(s in law for s in counts), "a sequence of probability zero was produced"
    observed = torch.tensor([float(counts.get(s, 0)) for s in cells])
    assert chi2_p_value(observed, torch.tensor([law[s] for s in cells])) > ALPHA


def test_bild_rules_by_hand():
    """BiLD*: defer where TV(p, q) > α. Rollback: accept while p(x) ≥ 1 − α, the target picks the token at the
    first that falls short; its law is token-specific with keep(v) = 1[p(v) ≥ 1 − α]; the fallback keeps the
    drafted tokens before the first whose max q is below its threshold."""
    assert targets.bild_star(Q, P, 0.49).item() == 1.0 and targets.bild_star(Q, P, 0.5).item() == 0.0  # TV = 0.5
    rule = targets.target_rule("bild", None, 0.65, greedy=False, fallback=0.5)
    assert isinstance(rule, targets.Rollback) and rule.floor == pytest.approx(0.35)
    p_raw = torch.tensor([[0.2, 0.4, 0.4], [0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    p = torch.cat([p_raw, torch.tensor([[0.0, 0.0, 1.0]])])
    g = torch.Generator().manual_seed(0)
    assert rule.verify(torch.tensor([1, 1, 0]), p_raw, p, g) == (3, 2)  # 0.4, 0.6, 0.5 ≥ 0.35: all kept, bonus ~ p[3]
    n, token = rule.verify(torch.tensor([2, 2, 0]), p_raw, torch.eye(3)[[0, 1, 1, 2]], g)
    assert (n, token) == (1, 1)  # p(2) = 0.3 < 0.35 at position 1: rolled back, the target's token there
    assert torch.allclose(rule(Q, Q, P, P), targets.token_specific(Q, P, torch.tensor([0.0, 1.0, 1.0])))
    assert float(rule.deferral(Q, Q, P, P)) == pytest.approx(0.7)  # q's mass on the token p gives 0.2 < 0.35
    q_raw = torch.tensor([[0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0.4, 0.3, 0.3], [0.9, 0.05, 0.05]])
    assert rule.confident(q_raw) == 2 and targets.Rollback(0.5).confident(q_raw) == 4
    star = targets.target_rule("bild", "star", 0.3, greedy=False)
    assert torch.allclose(star(Q, Q, P, P), P) and float(star.deferral(Q, Q, P, P)) == 1.0


def test_bild_fallback_through_the_runtime(target):
    """A fallback threshold no drafted token reaches leaves every token to the target (its own greedy text,
    nothing drafted); with threshold 0 every round drafts what the policy allows; the rollback floor at α = 0
    takes nothing the target does not give probability 1, so the text stays the target's."""
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static
    from tests.runtime.test_generate import proposers

    prompt, drafter = [1, 2, 3], proposers(target)["self"]  # the target drafting for itself
    runner = TargetRunner(target)
    exact = generate(runner, drafter, prompt, 12, Static(3))
    unsure = generate(runner, drafter, prompt, 12, Static(3), rule=targets.Rollback(0.9, fallback=1.01))
    assert unsure.tokens == exact.tokens and all(r.drafted == 0 for r in unsure.rounds)
    sure = generate(runner, drafter, prompt, 12, Static(3), rule=targets.Rollback(0.999, fallback=0.0))
    assert sure.tokens == exact.tokens and sum(r.accepted for r in sure.rounds) == sum(r.drafted for r in sure.rounds) > 0
    strict = generate(runner, drafter, prompt, 12, Static(3), rule=targets.Rollback(0.0, fallback=0.0))
    assert strict.tokens == exact.tokens and sum(r.accepted for r in strict.rounds) == 0
