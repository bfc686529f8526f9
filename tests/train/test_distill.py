"""The standalone distillation step: its loss is the forward KL of the student's logits, without forming them."""

import pytest
import torch

from draftsmith.train.distill import DistillModule
from draftsmith.train.losses import forward_kl


@pytest.mark.parametrize("kl_top_k", [None, 5])
def test_step_loss_is_forward_kl_of_the_student_logits(tiny_target_dir, kl_top_k, monkeypatch):
    """... and the rows it runs on are padded to a multiple of 64 (`bucketed_rows`), which changes nothing."""
    from draftsmith.train import distill

    rows = []
    for name in ("forward_kl", "head_forward_kl"):
        real = getattr(distill, name)
        monkeypatch.setattr(distill, name, lambda x, *a, real=real: rows.append(len(x)) or real(x, *a))
    module = DistillModule(str(tiny_target_dir), num_layers=1, kl_top_k=kl_top_k)
    module.configure_model()
    g = torch.Generator().manual_seed(0)
    vocab, hidden = module.target_head.weight.shape
    ids = torch.randint(4, vocab, (2, 9), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    loss_mask = torch.zeros(2, 9, dtype=torch.long)
    loss_mask[:, 3:] = 1
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask,
             "final": torch.randn(2, 9, hidden, generator=g)}
    loss = module._step(batch, with_metrics=True)
    loss.backward()
    got = {n: p.grad.clone() for n, p in module.student.named_parameters() if p.grad is not None}
    module.student.zero_grad()

    valid = mask.bool()
    sel = valid[:, :-1] & loss_mask.bool()[:, 1:] & valid[:, 1:]
    hidden_states = module.student.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
    logits = module.student.get_output_embeddings()(hidden_states[:, :-1][sel])
    target = module.target_head(batch["final"][:, :-1][sel])
    expected = forward_kl(logits, target, sel.new_ones(len(logits)), kl_top_k)
    expected.backward()
    torch.testing.assert_close(loss.float(), expected)
    assert rows and all(n % 64 == 0 for n in rows) and len(logits) % 64
    assert got.keys() == {n for n, p in module.student.named_parameters() if p.grad is not None} and got
    for name, p in module.student.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, msg=name)
    metric = module.val_metric.compute()  # the validation metric saw the same logits
    agree = (logits.argmax(-1) == target.argmax(-1)).double().mean()
    torch.testing.assert_close(metric["acc_0"].double(), agree, atol=1e-6, rtol=0)
