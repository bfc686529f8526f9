import math

import pytest
import torch

from draftsmith.train.losses import (acceptance_loss, feature_regression, forward_kl, head_distillation, head_forward_kl, head_logsumexp,
                                     sharpen, soft_cross_entropy, step_weights, target_mix, topk_distillation,
                                     uniform_noise)

# one position, vocabulary of 3: q = softmax(log([0.5, 0.25, 0.25])) = [0.5, 0.25, 0.25]
LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))
P = torch.tensor([[0.7, 0.2, 0.1]])
ONE = torch.tensor([True])


def test_soft_cross_entropy_by_hand():
    expected = -(0.7 * math.log(0.5) + 0.2 * math.log(0.25) + 0.1 * math.log(0.25))
    assert math.isclose(soft_cross_entropy(LOGITS, P, ONE).item(), expected, rel_tol=1e-6)


def test_sharpen_by_hand():
    # T = 0.5: p² renormalised = [0.49, 0.04, 0.01] / 0.54
    torch.testing.assert_close(sharpen(P, 0.5), torch.tensor([[0.49, 0.04, 0.01]]) / 0.54)
    torch.testing.assert_close(sharpen(torch.softmax(LOGITS * 3, -1), 0.5), torch.softmax(LOGITS * 6, -1))
    assert sharpen(P, 1.0) is P
    with pytest.raises(ValueError, match="> 0"):
        sharpen(P, 0.0)


def test_topk_distillation_by_hand():
    # top-2 of p are tokens 0 and 1: -(0.7 log 0.5 + 0.2 log 0.25)
    expected = -(0.7 * math.log(0.5) + 0.2 * math.log(0.25))
    assert math.isclose(topk_distillation(LOGITS, P, 2, ONE).item(), expected, rel_tol=1e-6)
    assert math.isclose(topk_distillation(LOGITS, P, 3, ONE).item(), soft_cross_entropy(LOGITS, P, ONE).item(), rel_tol=1e-6)


def test_forward_kl_by_hand():
    target_logits = torch.log(P)
    expected = sum(p * math.log(p / q) for p, q in zip([0.7, 0.2, 0.1], [0.5, 0.25, 0.25]))
    assert math.isclose(forward_kl(LOGITS, target_logits, ONE).item(), expected, rel_tol=1e-5)
    # top-2: p renormalized over {0, 1} = [7/9, 2/9]
    expected2 = 7 / 9 * math.log((7 / 9) / 0.5) + 2 / 9 * math.log((2 / 9) / 0.25)
    assert math.isclose(forward_kl(LOGITS, target_logits, ONE, top_k=2).item(), expected2, rel_tol=1e-5)
    assert forward_kl(target_logits, target_logits, ONE).abs().item() < 1e-6


def test_feature_regression_by_hand_and_mask():
    pred = torch.tensor([[0.0, 0.0], [5.0, 5.0]])
    goal = torch.tensor([[0.5, 2.0], [0.0, 0.0]])
    # smooth L1 (beta 1): 0.5*0.5^2 = 0.125 and |2|-0.5 = 1.5 → mean 0.8125; the masked row is ignored
    assert math.isclose(feature_regression(pred, goal, torch.tensor([True, False])).item(), 0.8125, rel_tol=1e-6)


def test_masked_positions_do_not_count():
    logits = torch.cat([LOGITS, torch.zeros(1, 3)])
    p = torch.cat([P, torch.tensor([[1.0, 0.0, 0.0]])])
    assert math.isclose(soft_cross_entropy(logits, p, torch.tensor([True, False])).item(),
                        soft_cross_entropy(LOGITS, P, ONE).item(), rel_tol=1e-6)


def test_noise_and_step_weights():
    x = torch.zeros(1000)
    noisy = uniform_noise(x, 0.2)
    assert noisy.abs().max() <= 0.1 and noisy.std() > 0.04
    assert torch.equal(uniform_noise(x, 0.0), x)
    assert step_weights(3, 0.5) == [1.0, 0.5, 0.25]


def test_factored_head_loss_equals_the_plain_definitions():
    x, weight = torch.randn(6, 8, dtype=torch.float64), torch.randn(30, 8, dtype=torch.float64)
    p = torch.softmax(torch.randn(6, 30, dtype=torch.float64), -1)
    mask = torch.tensor([True, True, False, True, True, True])
    logits = x @ weight.T
    for ce_w, topk_w in ((0.1, 1.0), (1.0, 0.0), (0.0, 1.0)):
        mass, mix = target_mix(p, weight, ce_w, topk_w, 5)
        expected = ce_w * soft_cross_entropy(logits, p, mask) + topk_w * topk_distillation(logits, p, 5, mask)
        # head_distillation sums x · mix in float32 (as training runs it): float32's tolerance, not float64's
        torch.testing.assert_close(head_distillation(x, weight, mass, mix, mask).double(), expected.double(),
                                   rtol=1e-5, atol=1e-6)
    reference = -(p * torch.log_softmax(logits, -1)).sum(-1)[mask].mean()
    torch.testing.assert_close(soft_cross_entropy(logits, p, mask).double(), reference)


@pytest.fixture(params=[None, 150, 50])  # default (one block a chunk); 3 rows of 50 (5 = 3 + 2); 1 row
def cache_floats(request, monkeypatch):
    from draftsmith.train import head_kernel

    if request.param is not None:
        monkeypatch.setattr(head_kernel, "CACHE_FLOATS", request.param)
    return request.param


def assert_same_values_and_gradients(got_fn, expected_fn, *leaves):
    got = got_fn()
    got.sum().backward()
    grads = [leaf.grad.clone() for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None
    expected = expected_fn()
    expected.sum().backward()
    torch.testing.assert_close(got, expected)
    for grad, leaf in zip(grads, leaves):
        torch.testing.assert_close(grad, leaf.grad)


def test_chunked_head_logsumexp_matches_autograd_of_the_plain_one(cache_floats):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(37, generator=g, dtype=torch.float64)
    assert_same_values_and_gradients(lambda: head_logsumexp(x, w, chunk=5) * upstream,
                                     lambda: torch.logsumexp(x @ w.T, -1) * upstream, x, w)
    frozen = w.detach()
    out = head_logsumexp(x, frozen, chunk=7)
    torch.testing.assert_close(out, torch.logsumexp(x @ frozen.T, -1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # computed in bf16 under autocast, returned as float32
        assert head_logsumexp(x.float(), frozen.float()).dtype == torch.float32


def test_a_head_is_cast_once_until_the_optimizer_changes_it():
    from draftsmith.train.head_kernel import cast_weight

    w = torch.nn.Parameter(torch.randn(50, 8))
    x = torch.randn(37, 8)
    first = cast_weight(w, torch.bfloat16)
    assert cast_weight(w, torch.bfloat16) is first  # the forward, the backward and every step share it
    with torch.no_grad():
        w.add_(1.0)  # what an optimizer step does to it
    again = cast_weight(w, torch.bfloat16)
    assert again is not first and torch.equal(again, w.detach().to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the loss after the update reads the new weights
        got = head_logsumexp(x, w)
    torch.testing.assert_close(got, torch.logsumexp(x.bfloat16().float() @ again.float().T, -1), atol=0.05, rtol=0)
    assert cast_weight(w, torch.float32) is w


def test_a_small_head_takes_its_rows_in_fewer_chunks(monkeypatch):
    from draftsmith.train import head_kernel
    from draftsmith.train.head_kernel import CHUNK_FLOATS, HEAD_CHUNK, chunk_rows

    assert chunk_rows(49152) == HEAD_CHUNK  # a full vocabulary: 256 rows of logits a product
    assert chunk_rows(4096) == CHUNK_FLOATS // 4096 == 1024  # a draft vocabulary: a 1024-token batch at once
    chunks = []
    apply = head_kernel._HeadLogSumExp.apply
    monkeypatch.setattr(head_kernel._HeadLogSumExp, "apply", lambda *a: chunks.append(a[-1]) or apply(*a))
    head_logsumexp(torch.randn(4, 8), torch.randn(4096, 8))
    head_logsumexp(torch.randn(4, 8), torch.randn(49152, 8))
    assert chunks == [1024, HEAD_CHUNK]  # what the loss runs with by default


def test_row_blocks_are_for_cpu_caches_only():
    from draftsmith.train.head_kernel import CACHE_FLOATS, cache_rows

    assert cache_rows(49152, torch.device("cpu")) == CACHE_FLOATS // 49152 == 16
    assert cache_rows(49152, torch.device("meta")) >= 10**9  # an accelerator: the whole chunk at once


def test_head_forward_kl_equals_forward_kl_of_the_logits_with_its_gradients(cache_floats):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    target = 2 * torch.randn(11, 50, generator=g, dtype=torch.float64)
    mask = torch.rand(11, generator=g) > 0.3

    def expected():  # forward_kl's definition, in float64
        log_p, log_q = torch.log_softmax(target, -1), torch.log_softmax(x @ w.T, -1)
        return ((log_p.exp() * (log_p - log_q)).sum(-1) * mask).sum() / mask.sum()

    assert_same_values_and_gradients(lambda: head_forward_kl(x, w, target, mask), expected, x, w)
    torch.testing.assert_close(forward_kl(x @ w.T, target, mask).double(), expected())


@pytest.mark.parametrize("weight", [1.0, 6.0])
def test_an_acceptance_head_trained_with_a_rejection_weight_predicts_the_acceptance_itself(weight):
    """SpecDec++'s loss with weight w drives the head's sigmoid to a / (a + w(1 − a)); `probability`
    undoes that, so a head fitted to tokens accepted with chance 0.2 (hidden state h0) or 0.7 (h1)
    predicts 0.2 and 0.7 whatever w was."""
    from draftsmith.models.heads import AcceptanceHead, AcceptanceHeadConfig
    from draftsmith.train.heads import mixed_bce

    torch.manual_seed(0)
    head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=4, num_layers=1, rejection_weight=weight))
    hidden = torch.eye(4)[torch.arange(400) % 2]  # alternately h0 and h1
    label = torch.where(torch.arange(400) % 2 == 0, 0.2, 0.7)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(300):
        optimizer.zero_grad()
        mixed_bce(head(hidden), label, weight, torch.ones(400)).backward()
        optimizer.step()
    with torch.no_grad():
        raw = torch.sigmoid(head(hidden[:2]))
        assert torch.allclose(head.probability(hidden[:2]), torch.tensor([0.2, 0.7]), atol=0.01)
    biased = torch.tensor([0.2, 0.7]) / (torch.tensor([0.2, 0.7]) + weight * torch.tensor([0.8, 0.3]))
    assert torch.allclose(raw, biased, atol=0.01)


def test_a_normalizing_acceptance_head_reads_only_the_direction_of_the_hidden_state():
    """With `normalize`, a hidden state and the same state scaled 300x (a feature drafter's residual stream
    varies that much in norm) get the same prediction; without it they do not."""
    from draftsmith.models.heads import AcceptanceHead, AcceptanceHeadConfig

    torch.manual_seed(0)
    hidden = torch.randn(5, 8)
    for normalize in (True, False):
        head = AcceptanceHead(AcceptanceHeadConfig(hidden_size=8, num_layers=2, normalize=normalize))
        with torch.no_grad():
            same = torch.allclose(head(hidden), head(300 * hidden), atol=1e-4)
        assert same == normalize


def test_acceptance_losses_by_hand():
    """p = (0.5, 0.3, 0.2), q = softmax(log(0.2, 0.3, 0.5)) = (0.2, 0.3, 0.5): α = 0.2 + 0.3 + 0.2 = 0.7."""
    p = torch.tensor([[0.5, 0.3, 0.2]])
    logits = torch.tensor([[0.2, 0.3, 0.5]]).log()
    every = torch.ones(1, dtype=torch.bool)
    assert acceptance_loss(logits, p, every, "tv") == pytest.approx(0.3)
    assert acceptance_loss(logits, p, every, "log") == pytest.approx(-math.log(0.7))
    kl = 0.5 * math.log(0.5 / 0.2) + 0.2 * math.log(0.2 / 0.5)  # the middle term is 0
    lam = math.exp(-3.0 * 0.7)
    assert acceptance_loss(logits, p, every, "hybrid", eta=3.0) == pytest.approx(lam * kl + (1 - lam) * 0.3)
    assert acceptance_loss(logits, p, every, "hybrid", eta=1e9) == pytest.approx(0.3)  # λ → 0: TV alone
    # a one-hot target: −log α is the cross-entropy; p = q: every form is 0 (the hybrid's KL too)
    assert acceptance_loss(logits, torch.tensor([[0.0, 0.0, 1.0]]), every, "log") == pytest.approx(-math.log(0.5))
    for form in ("tv", "log", "hybrid"):
        assert acceptance_loss(logits, logits.softmax(-1), every, form) == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(ValueError, match="one of"):
        acceptance_loss(logits, p, every, "kl")


def test_the_log_acceptance_gradient_is_tvs_scaled_by_one_over_alpha():
    p = torch.tensor([[0.5, 0.3, 0.2]])
    every = torch.ones(1, dtype=torch.bool)
    grads = {}
    for form in ("tv", "log"):
        logits = torch.tensor([[0.2, 0.3, 0.5]]).log().requires_grad_()
        acceptance_loss(logits, p, every, form).backward()
        grads[form] = logits.grad
    assert torch.allclose(grads["log"], grads["tv"] / 0.7, atol=1e-6)
