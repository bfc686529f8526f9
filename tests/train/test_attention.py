import pytest
import torch
import torch.nn.functional as F

from draftsmith.train.alignment import alignment_hiddens
from draftsmith.train.attention import StepMask, merged_attention
from tests.train.test_drafter import H, V, tiny_drafter


@pytest.mark.parametrize("step", [0, 1, 2])
def test_merged_attention_is_the_dense_masks_attention_at_real_anchors(step):
    """Output and gradients of q, k, v equal those of SDPA under `alignment_mask` (grouped heads, a padded
    row), for every query before a row's padding."""
    torch.manual_seed(step)
    b, h, kv, t, d = 2, 6, 2, 37, 16
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[1, 30:] = False
    q = torch.randn(b, h, t, d, requires_grad=True)
    k = torch.randn(b, kv, (step + 1) * t, d, requires_grad=True)
    v = torch.randn(b, kv, (step + 1) * t, d, requires_grad=True)
    weight = torch.randn(b, h, t, d) * valid[:, None, :, None]  # a loss at the real anchors only

    def grads(out):
        (out * weight).sum().backward()
        found = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        return found

    out = merged_attention(q, k, v, step, d ** -0.5)
    got = grads(out)
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(h // kv, 1), v.repeat_interleave(h // kv, 1),
                                         attn_mask=StepMask(valid, step).dense())
    want = grads(ref)
    real = valid[:, None, :, None]
    torch.testing.assert_close(out * real, ref * real, atol=1e-5, rtol=1e-5)
    for name, a, e in zip("qkv", got, want):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5, msg=f"d{name}")


def test_alignment_runs_without_the_dense_mask_and_trains_as_it_would():
    """A right-padded batch never builds the T × (j+1)·T mask, and the drafter's gradients from a loss at
    the real anchors are those of the dense mask's attention; a batch padded on the left takes the dense
    mask."""
    drafter = tiny_drafter("eagle3").train()
    t, steps = 12, 3
    ids = torch.randint(0, V, (2, t + 1))
    aux = torch.randn(2, t, 3 * H)
    anchors = torch.ones(2, t, dtype=torch.bool)
    anchors[1, 8:] = False

    def gradients():
        drafter.zero_grad()
        hiddens = alignment_hiddens(drafter, ids, drafter.project(None, aux), anchors, steps)
        sum(((hid * anchors[..., None]) ** 2).sum() for hid in hiddens).backward()
        return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    dense = StepMask.dense
    built = []

    def counted(self):
        built.append(self.step)
        return dense(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StepMask, "dense", counted)
        fast = gradients()
        assert built == []
        mp.setattr(StepMask, "right_padded", lambda self: False)
        slow = gradients()
        assert built == list(range(steps))
    assert fast.keys() == slow.keys() and fast
    for name in fast:
        torch.testing.assert_close(fast[name], slow[name], atol=1e-5, rtol=1e-4, msg=name)
    assert drafter.layer.self_attn.config._attn_implementation == "sdpa"  # switched back after the pass


def test_step_mask_knows_right_padding():
    assert StepMask(torch.tensor([[True, True, False], [True, False, False]]), 1).right_padded()
    assert not StepMask(torch.tensor([[False, True, True]]), 1).right_padded()
