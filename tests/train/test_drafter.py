import math

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import KVBuffer, alignment_mask
from draftsmith.models.eagle import EagleDrafter
from draftsmith.models.eagle3 import Eagle3Drafter, PEagleDrafter
from draftsmith.train.alignment import alignment_hiddens, cod_positions
from draftsmith.train.drafter import DrafterModule
from tests.conftest import assert_same_step, make_llama, step_and_validate

V, H = 50, 32


def tiny_drafter(kind):
    torch.manual_seed(0)
    target = make_llama(V, hidden=H)
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    if kind == "eagle":
        return EagleDrafter(target.config, embed, head).eval()
    return Eagle3Drafter(target.config, embed, head, target.model.norm.weight, torch.arange(0, V, 2), 3, H).eval()


def test_alignment_mask_pattern():
    valid = torch.tensor([[True, True, True, False]])
    m = alignment_mask(valid, 2)[0, 0].int()
    # keys: step-0 block (causal over real positions) | step-1 diagonal | step-2 diagonal
    assert m.tolist() == [
        [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1],
    ]
    # COD sampling: step 1 ran at anchors 2, 0, 3 and step 2 at 2, 0 (a prefix); step 2's queries are
    # anchors 2 and 0, each seeing its own chain's key of step 1 (rows 0 and 1 of step 1's keys)
    kept = [None, torch.tensor([[2, 0, 3]]), torch.tensor([[2, 0]])]
    assert alignment_mask(valid, 2, kept)[0, 0].int().tolist() == [
        [1, 1, 1, 0, 1, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 1],
    ]


def decode_chain(drafter, ids, feature, t, steps):
    """What decoding does from a real prefix ending at anchor t: step 0 over target features
    (causal), then one token at a time, each fed the previous step's output."""
    cache = KVBuffer()
    n = t + 1
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    h = drafter(ids[:, 1 : n + 1], feature[:, :n], torch.arange(n)[None], causal, cache)
    outs, prev = [h[:, t]], h[:, t : t + 1]
    for j in range(1, steps):
        keys = cache.get_seq_length() + 1
        prev = drafter(ids[:, t + 1 + j : t + 2 + j], prev, torch.tensor([[t + j]]), torch.ones(1, 1, 1, keys, dtype=torch.bool), cache)
        outs.append(prev[:, 0])
    return outs


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_alignment_step_j_equals_decoding_with_its_own_features(kind):
    """Step j at anchor t sees target-feature keys up to t and its own chain's keys of steps
    1..j, with positions t+j: the same hidden state decoding produces."""
    drafter = tiny_drafter(kind)
    steps, t_len = 3, 12
    ids = torch.randint(0, V, (2, t_len + 1))
    final = torch.randn(2, t_len + 1, H)
    aux = torch.randn(2, t_len + 1, 3 * H)
    valid = torch.ones(2, t_len + 1, dtype=torch.bool)
    valid[1, 9:] = False  # the second record is padded after 9 tokens
    with torch.no_grad():
        feature = drafter.project(final[:, :-1], aux[:, :-1])
        hiddens = alignment_hiddens(drafter, ids, feature, valid[:, :-1], steps)
        for row, length in ((0, t_len + 1), (1, 9)):
            for t in range(length - steps):
                chain = decode_chain(drafter, ids[row : row + 1], feature[row : row + 1], t, steps)
                for j in range(steps):
                    torch.testing.assert_close(hiddens[j][row, t], chain[j][0], atol=2e-5, rtol=1e-4,
                                               msg=f"row {row} anchor {t} step {j}")
    # step 1 is not step 0 applied again: it really reads the drafter's own features
    assert not torch.allclose(hiddens[1], hiddens[0], atol=1e-3)


@pytest.mark.parametrize("kind", ["peagle", "eagle", "eagle3"])
def test_cod_sampling_runs_the_kept_anchors_exactly_as_the_full_pass(kind):
    """COD sampling: step j runs at a nested sample of the anchors (⌈n·max(0.7^j, 0.2)⌉, real anchors
    first), and a kept anchor's hidden state is the one the pass over every anchor computes there: its
    step-0 keys and its own chain's earlier steps (P-EAGLE's mask inputs, a chain's own outputs), nothing
    of the dropped anchors."""
    torch.manual_seed(0)
    target = make_llama(V, hidden=H)
    drafter = tiny_drafter(kind) if kind != "peagle" else PEagleDrafter(
        target.config, target.model.embed_tokens.weight, target.lm_head.weight, target.model.norm.weight,
        torch.arange(V), 3, H, mask_token_id=0).eval()
    steps, t_len = 4, 12
    ids, final, aux = torch.randint(0, V, (2, t_len + 1)), torch.randn(2, t_len + 1, H), torch.randn(2, t_len + 1, 3 * H)
    valid = torch.ones(2, t_len + 1, dtype=torch.bool)
    valid[1, 9:] = False
    anchors = valid[:, :-1]
    kept = cod_positions(anchors, steps, 0.7, 0.2, torch.Generator().manual_seed(0))
    index = kept.index
    assert index[0] is None and [k.shape[1] for k in index[1:]] == [math.ceil(12 * r) for r in (0.7, 0.49, 0.343)]
    for longer, shorter in zip(index[1:], index[2:]):
        assert torch.equal(shorter, longer[:, :shorter.shape[1]])  # each step keeps a prefix of the one before
    assert sorted(index[1][1].tolist()) == list(range(9))  # row 1's nine real anchors come first
    for i, m in zip(index[1:], kept.mask[1:]):
        assert m.sum().item() == i.numel() and bool(m.gather(1, i).all())
    with torch.no_grad():
        feature = drafter.project(final[:, :-1], aux[:, :-1])
        full = alignment_hiddens(drafter, ids, feature, anchors, steps)
        cod = alignment_hiddens(drafter, ids, feature, anchors, steps, kept=kept)
    torch.testing.assert_close(cod[0], full[0])
    for j in range(1, steps):
        for row in range(2):
            index = kept.index[j][row]
            torch.testing.assert_close(cod[j][row, index], full[j][row, index], atol=2e-5, rtol=1e-4)
            dropped = torch.ones(t_len, dtype=torch.bool).index_fill(0, index, False)
            assert cod[j][row, dropped].abs().sum() == 0
    assert not torch.allclose(full[2][0], full[1][0], atol=1e-3)  # the steps differ: their positions do


def test_detached_steps_read_their_inputs_as_constants():
    """detach_steps: a later step's loss trains the drafter at that step only (the same values)."""
    drafter = tiny_drafter("eagle")
    ids, final = torch.randint(0, V, (1, 9)), torch.randn(1, 9, H)
    valid = torch.ones(1, 8, dtype=torch.bool)
    grads = {}
    for detach in (False, True):
        feature = drafter.project(final[:, :-1], None)
        hiddens = alignment_hiddens(drafter, ids, feature, valid, 2, detach=detach)
        hiddens[0].retain_grad()
        hiddens[1].sum().backward()
        grads[detach] = hiddens[0].grad
        drafter.zero_grad()
    assert grads[False] is not None and grads[False].abs().sum() > 0
    assert grads[True] is None  # nothing flowed back into step 0's output
    with torch.no_grad():
        plain = alignment_hiddens(drafter, ids, drafter.project(final[:, :-1], None), valid, 2)
        detached = alignment_hiddens(drafter, ids, drafter.project(final[:, :-1], None), valid, 2, detach=True)
    torch.testing.assert_close(plain[1], detached[1])


def test_eagle3_vocab_mapping():
    drafter = tiny_drafter("eagle3")
    assert drafter.vocab_size == 25 and drafter.t2d.sum() == 25
    assert torch.equal(drafter.draft_to_target, torch.arange(0, V, 2))
    torch.testing.assert_close(drafter.lm_head.weight, make_llama(V, hidden=H).lm_head.weight[::2])


def test_init_layer_starts_the_draft_layer_as_that_target_layer(tiny_target_dir):
    """With its token half silenced, a draft layer started from target layer -1 computes exactly that layer
    on the features it reads (attention, MLP and norm scales copied); fc passes the last fused layer through."""
    from draftsmith.models.target import load_target
    from draftsmith.train.drafter import DrafterModule

    torch.manual_seed(0)
    module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], init_layer=-1)
    module.configure_model()
    drafter, target = module.drafter, load_target(str(tiny_target_dir))
    source, h = target.decoder.layers[-1], target.hidden_size
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(drafter.layer.self_attn, name).weight[:, :h] = 0
        g = torch.randn(1, 5, h)
        pos = torch.arange(5)[None]
        pe = drafter.rotary(g, pos)
        mine = drafter.layer(torch.randn(1, 5, h), g, None, pos, pe)
        theirs = source(hidden_states=g, attention_mask=None, position_ids=pos, position_embeddings=pe)
    theirs = theirs[0] if isinstance(theirs, tuple) else theirs
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    fc = drafter.fc.weight
    assert torch.allclose(torch.diagonal(fc[:, -h:]), torch.ones(h), atol=0.1)  # the identity, a tenth of noise
    assert fc[:, :-h].abs().max() < 0.02

    random = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2])
    random.configure_model()
    assert not torch.equal(random.drafter.layer.mlp.gate_proj.weight, source.mlp.gate_proj.weight)


def test_init_layer_starts_a_block_drafters_layer_as_that_target_layer(tiny_target_dir):
    """A DFlash layer started from target layer -1 holds its projections, MLP and norm scales, and its
    context values are that layer's values of the last fused layer, which fc passes through."""
    from draftsmith.models.target import load_target
    from draftsmith.train.block import BlockDrafterModule

    torch.manual_seed(0)
    module = BlockDrafterModule(target=str(tiny_target_dir), kind="dflash", aux_layer_ids=[0, 1, 2], block_size=4,
                                init_layer=-1)
    module.configure_model()
    drafter, target = module.drafter, load_target(str(tiny_target_dir))
    source, h = target.decoder.layers[-1], target.hidden_size
    mine = drafter.layers[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert torch.equal(getattr(mine.self_attn, name).weight, getattr(source.self_attn, name).weight)
    assert torch.equal(mine.mlp.down_proj.weight, source.mlp.down_proj.weight)
    assert torch.equal(drafter.hidden_norm.weight, target.norm_scale(source.input_layernorm))
    fc = drafter.fc.weight
    assert torch.allclose(torch.diagonal(fc[:, -h:]), torch.ones(h), atol=0.1)  # the identity, a tenth of noise
    assert fc[:, :-h].abs().max() < 0.02
    with torch.no_grad():
        fc.zero_()
        fc[:, -h:] = torch.eye(h)  # the noise silenced: the context is the last fused layer itself
        g = torch.randn(1, 5, h)
        _, values = drafter.context(drafter.project(None, torch.cat([torch.randn(1, 5, 2 * h), g], -1)),
                                    torch.arange(5)[None])[0]
        theirs = source.self_attn.v_proj(source.input_layernorm(g))
    torch.testing.assert_close(values.transpose(1, 2).flatten(2), theirs, rtol=1e-5, atol=1e-5)

    random = BlockDrafterModule(target=str(tiny_target_dir), kind="dflash", aux_layer_ids=[0, 1, 2], block_size=4)
    random.configure_model()
    assert not torch.equal(random.drafter.layers[0].mlp.down_proj.weight, source.mlp.down_proj.weight)


def test_init_layer_starts_a_deeper_block_drafter_from_consecutive_target_layers(tiny_target_dir):
    """Two draft layers start from the two target layers that end at init_layer, in order, and fc's
    identity is set once (not once a layer); more draft layers than the target has up to init_layer is an error."""
    from draftsmith import DraftsmithError
    from draftsmith.models.target import load_target
    from draftsmith.train.block import BlockDrafterModule

    torch.manual_seed(0)
    module = BlockDrafterModule(target=str(tiny_target_dir), kind="dflash", aux_layer_ids=[0, 1, 2], block_size=4,
                                draft_layers=2, init_layer=-1)
    module.configure_model()
    drafter, target = module.drafter, load_target(str(tiny_target_dir))
    sources, h = target.decoder.layers, target.hidden_size
    for mine, source in zip(drafter.layers, sources[-2:]):
        assert torch.equal(mine.self_attn.q_proj.weight, source.self_attn.q_proj.weight)
        assert torch.equal(mine.mlp.gate_proj.weight, source.mlp.gate_proj.weight)
    assert not torch.equal(sources[0].self_attn.q_proj.weight, sources[1].self_attn.q_proj.weight)
    assert torch.equal(drafter.hidden_norm.weight, target.norm_scale(sources[0].input_layernorm))
    fc = drafter.fc.weight
    assert torch.allclose(torch.diagonal(fc[:, -h:]), torch.ones(h), atol=0.05)  # set once: not 1.1
    assert fc[:, :-h].abs().max() < 0.02

    with pytest.raises(DraftsmithError, match="has only 1 up to it"):
        BlockDrafterModule(target=str(tiny_target_dir), kind="dflash", aux_layer_ids=[0, 1, 2], block_size=4,
                           draft_layers=2, init_layer=0).configure_model()


def test_init_layer_refuses_a_layer_the_target_lacks_and_a_kind_without_it(tiny_target_dir):
    from draftsmith import DraftsmithError
    from draftsmith.train.drafter import DrafterModule

    with pytest.raises(DraftsmithError, match="has no decoder layer 9"):
        DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], init_layer=9).configure_model()
    with pytest.raises(DraftsmithError, match="option of the eagle3 kinds"):
        DrafterModule(str(tiny_target_dir), kind="eagle", init_layer=-1).configure_model()


def feature_batch(module, t: int) -> dict:
    """One sequence of t random tokens, every one carrying loss, with random final and 3-layer fused features."""
    h, v = module.drafter.config.hidden_size, module.drafter.vocab_size
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, v, (1, t), generator=g), "attention_mask": torch.ones(1, t),
            "loss_mask": torch.ones(1, t), "final": torch.randn(1, t, h, generator=g),
            "aux": torch.randn(1, t, 3 * h, generator=g)}


def test_target_temperature_distills_the_sharpened_law_and_scores_the_law_itself(tiny_target_dir):
    """The soft cross-entropy of a module with target_temperature 0.5 is the one against the target's law
    squared and renormalised; its validation metric (T = 1 overlap) is the same as at temperature 1."""
    from draftsmith.train.drafter import DrafterModule
    from draftsmith.train.losses import sharpen, soft_cross_entropy

    losses, metrics = {}, {}
    for temperature in (1.0, 0.5):
        torch.manual_seed(0)
        module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], ce_weight=1.0,
                               target_temperature=temperature)
        module.configure_model()
        t = 7
        batch = feature_batch(module, t)
        with torch.no_grad():
            losses[temperature] = module.alignment_forward(batch, with_metrics=True)["distill_0"]
            metrics[temperature] = module.val_metric.compute()["tau_t1"]
            feature = module.drafter.project(batch["final"][:, :-1], batch["aux"][:, :-1])
            anchors = torch.ones(1, t - 1, dtype=torch.bool)
            hidden = alignment_hiddens(module.drafter, batch["input_ids"], feature, anchors, 1)[0]
            logits = module.drafter.logits(hidden)[0]  # anchor i predicts the target's law at position i + 1
            p = torch.softmax(batch["final"][0, 1:] @ module.target_head.weight.T, -1)
        expected = soft_cross_entropy(logits, sharpen(p, temperature), torch.ones(len(p), dtype=torch.bool))
        torch.testing.assert_close(losses[temperature], expected, rtol=1e-4, atol=1e-4)
    assert not torch.isclose(losses[0.5], losses[1.0])
    torch.testing.assert_close(metrics[0.5], metrics[1.0])


def test_t1_metric_of_a_pruned_vocabulary_is_the_overlap_with_the_targets_own_law(tiny_target_dir):
    """With a pruned draft vocabulary the distillation target is the target's law renormalised over it, but the
    T = 1 acceptance is Σ_v∈Vd min(p(v), q(v)) with p the law itself: the mass outside is never drafted."""
    from draftsmith.train.drafter import DrafterModule

    torch.manual_seed(0)
    module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], ce_weight=1.0,
                           draft_vocab_size=8, count_tokens=lambda v: torch.arange(v))  # the 8 highest ids
    module.configure_model()
    t, ids = 7, module.drafter.draft_to_target
    assert len(ids) < module.target_head.weight.shape[0]
    batch = feature_batch(module, t)
    with torch.no_grad():
        module.alignment_forward(batch, with_metrics=True)
        got = module.val_metric.compute()["tau_t1"]
        feature = module.drafter.project(batch["final"][:, :-1], batch["aux"][:, :-1])
        hidden = alignment_hiddens(module.drafter, batch["input_ids"], feature, torch.ones(1, t - 1, dtype=torch.bool),
                                   1)[0]
        q = torch.softmax(module.drafter.logits(hidden)[0], -1)  # (t-1, Vd)
        p = torch.softmax(batch["final"][0, 1:] @ module.target_head.weight.T, -1)[:, ids]  # the law on Vd
    own = 1 + torch.minimum(p, q).sum(-1).mean()
    renormalised = 1 + torch.minimum(p / p.sum(-1, keepdim=True), q).sum(-1).mean()
    assert renormalised - own > 0.01  # the case tells the two apart
    torch.testing.assert_close(got, own.float(), rtol=1e-4, atol=1e-4)


def test_val_steps_scores_steps_beyond_the_trained_ones_without_training_them(tiny_target_dir):
    """A module trained over 2 steps and validated over 3 has the loss of the 2-step module and the metrics
    of the 3-step one, step for step, from the same weights."""
    from draftsmith import DraftsmithError
    from draftsmith.train.drafter import DrafterModule

    out, metrics, state = {}, {}, None
    for name, steps, scored in (("two", 2, None), ("three", 3, None), ("two_scored_three", 2, 3)):
        torch.manual_seed(0)
        module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], ce_weight=1.0,
                               alignment_steps=steps, val_steps=scored, step_weight_decay=0.5)
        module.configure_model()
        if state is None:
            state = module.state_dict()
        module.load_state_dict(state)
        batch = feature_batch(module, 9)
        with torch.no_grad():
            out[name] = module.alignment_forward(batch, with_metrics=True)
            metrics[name] = module.val_metric.compute()
    assert set(out["two_scored_three"]) == set(out["two"]) == {"loss", "distill_0", "distill_1"}
    torch.testing.assert_close(out["two_scored_three"]["loss"], out["two"]["loss"])
    assert set(metrics["two_scored_three"]) == set(metrics["three"]) != set(metrics["two"])
    for key, value in metrics["three"].items():
        torch.testing.assert_close(metrics["two_scored_three"][key], value)
    assert metrics["three"]["tau_t1"] > metrics["two"]["tau_t1"]  # the third step adds to the chain
    with pytest.raises(DraftsmithError, match="val_steps must be >= 1"):
        DrafterModule(str(tiny_target_dir), kind="eagle3", val_steps=0)


def test_bucketed_rows_pads_a_masks_entries_to_the_multiple():
    from draftsmith.train.alignment import bucketed_rows, gather_rows

    mask = torch.tensor([[False, True, True], [True, False, False]])
    rows = bucketed_rows(mask, 4)
    assert rows.index.tolist() == [1, 2, 3, 1] and rows.real.tolist() == [True, True, True, False] and rows.n == 3
    x = torch.arange(12.0).view(2, 3, 2)
    assert gather_rows(x, rows).tolist() == [[2, 3], [4, 5], [6, 7], [2, 3]]
    assert bucketed_rows(mask, 3).index.tolist() == [1, 2, 3]  # already a multiple: no padding
    empty = bucketed_rows(torch.zeros(2, 3, dtype=torch.bool), 4)
    assert empty.n == 0 and len(empty.index) == 0


@pytest.mark.parametrize("kind, top_k", [("eagle3", 0), ("peagle", 0), ("eagle3", 5)])
def test_padding_the_loss_rows_changes_neither_loss_nor_gradients_nor_metrics(tiny_target_dir, monkeypatch, kind,
                                                                              top_k):
    """The rows a step's losses gather (the target's table, each step's anchors, the anchors
    `alignment_top_k` checks) are padded to a multiple of 64 so that its products take few shapes; the loss,
    its gradients and the validation metrics are those of the unpadded rows, with 2 trained steps and 3
    scored."""
    from draftsmith.train import alignment, drafter

    rows_seen, spy = [], drafter.head_distillation
    monkeypatch.setattr(drafter, "head_distillation", lambda x, *a: rows_seen.append(len(x)) or spy(x, *a))
    got, state = {}, None
    for multiple in (1, 64):
        monkeypatch.setattr(alignment, "ROW_MULTIPLE", multiple)
        torch.manual_seed(0)
        module = DrafterModule(str(tiny_target_dir), kind=kind, aux_layer_ids=[0, 1, 2], ce_weight=1.0,
                               acceptance_weight=0.5, acceptance_loss="log", alignment_steps=2, val_steps=3,
                               alignment_top_k=top_k)
        module.configure_model()
        state = state or module.state_dict()
        module.load_state_dict(state)
        batch = feature_batch(module, 11)
        batch["loss_mask"][0, :3] = 0  # a prompt: not every position carries loss
        out, grads = step_and_validate(module, batch)
        got[multiple] = out, grads, module.val_metric.compute()
    assert rows_seen[0] % 64 != 0 and all(n % 64 == 0 for n in rows_seen[len(rows_seen) // 2:])
    assert "distill_1" in got[64][0]  # with alignment_top_k too, step 1 keeps rows to compare
    assert_same_step(got[1], got[64])


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_train_on_all_puts_loss_on_every_token_in_training_and_validates_on_the_answer(tiny_target_dir, kind):
    """With train_on: all a training step's loss is the one of a batch whose every token is an answer token;
    validation (eval mode) reads the loss mask as the default module does."""
    from draftsmith import DraftsmithError
    from draftsmith.train.block import BlockDrafterModule
    from draftsmith.train.drafter import DrafterModule

    cls, extra = (DrafterModule, {}) if kind == "eagle3" else (BlockDrafterModule, {"block_size": 4})
    modules = {}
    for train_on in ("assistant", "all"):
        torch.manual_seed(0)
        modules[train_on] = cls(target=str(tiny_target_dir), kind=kind, aux_layer_ids=[0, 1, 2], ce_weight=1.0,
                                train_on=train_on, **extra)
        modules[train_on].configure_model()
    modules["all"].load_state_dict(modules["assistant"].state_dict())
    batch = feature_batch(modules["assistant"], 12)
    answer = dict(batch, loss_mask=torch.tensor([[0.0] * 6 + [1.0] * 6]))  # a user turn, then the answer
    with torch.no_grad():
        torch.manual_seed(1)
        everything = modules["assistant"].train().alignment_forward(batch, with_metrics=False)["loss"]
        torch.manual_seed(1)
        trained = modules["all"].train().alignment_forward(answer, with_metrics=False)["loss"]
        torch.manual_seed(1)
        answered = modules["assistant"].train().alignment_forward(answer, with_metrics=False)["loss"]
        validated = modules["all"].eval().alignment_forward(answer, with_metrics=True)["loss"]
        reference = modules["assistant"].eval().alignment_forward(answer, with_metrics=True)["loss"]
    torch.testing.assert_close(trained, everything)
    assert not torch.isclose(trained, answered)
    torch.testing.assert_close(validated, reference)
    with pytest.raises(DraftsmithError, match="train_on must be one of"):
        cls(target=str(tiny_target_dir), kind=kind, train_on="user", **extra)


@pytest.mark.parametrize("kind, k", [("eagle3", 1), ("eagle3", 3), ("peagle", 1)])
def test_alignment_top_k_trains_a_step_only_where_the_step_before_drafted_the_token_it_reads(tiny_target_dir, kind,
                                                                                            k):
    """GRIFFIN's token-alignable training (`alignment_top_k`): step 1's loss is the soft cross-entropy over
    exactly the anchors t where x_{t+2}, the token step 1 reads, is among step 0's top-k draft tokens; step 0's
    loss and the validation loss are the unmasked module's."""
    from draftsmith.train.losses import soft_cross_entropy

    modules = {}
    for top_k in (0, k):
        torch.manual_seed(0)
        modules[top_k] = DrafterModule(str(tiny_target_dir), kind=kind, aux_layer_ids=[0, 1, 2], ce_weight=1.0,
                                       draft_vocab_size=40, count_tokens=lambda v: torch.arange(v),
                                       alignment_steps=2, alignment_top_k=top_k)
        modules[top_k].configure_model()
    module, ids = modules[k], modules[k].drafter.draft_to_target
    if kind == "peagle":  # a mask input of its own, so that the parallel step's laws differ from anchor to anchor
        torch.nn.init.normal_(modules[0].drafter.mask_hidden, std=3.0)
    module.load_state_dict(modules[0].state_dict())
    t = 12
    batch = feature_batch(module, t)
    anchors = torch.ones(1, t - 1, dtype=torch.bool)

    def hiddens(steps):
        feature = module.drafter.project(batch["final"][:, :-1], batch["aux"][:, :-1])
        return alignment_hiddens(module.drafter, batch["input_ids"], feature, anchors, steps)

    with torch.no_grad():  # step 0 drafts, within its top k, the token that follows at every other anchor
        for a in range(0, t - 2, 2):  # anchor a's draft reads tokens up to x_{a+1}: setting x_{a+2} keeps it
            ranked = module.drafter.logits(hiddens(1)[0])[0, a].argsort(descending=True)
            batch["input_ids"][0, a + 2] = ids[ranked[a // 2 % k]]
        top = ids[module.drafter.logits(hiddens(1)[0])[0].topk(k, -1).indices]  # (t-1, k)
        aligned = (top[: t - 2] == batch["input_ids"][0, 2:, None]).any(-1)  # anchors 0..t-3: x_{t+2} exists
        assert 0 < aligned.sum() < len(aligned)  # the case has both kinds of anchor
        out = {m: modules[m].train().alignment_forward(batch, with_metrics=False) for m in modules}
        step1 = module.drafter.logits(hiddens(2)[1])[0, : t - 2]  # anchor a predicts the law at a + 2
        p = torch.softmax(batch["final"][0, 2:] @ module.target_head.weight[ids].T, -1)
        val = {m: modules[m].eval().alignment_forward(batch, with_metrics=True)["loss"] for m in modules}
    torch.testing.assert_close(out[k]["distill_1"], soft_cross_entropy(step1, p, aligned), rtol=1e-4, atol=1e-4)
    assert not torch.isclose(out[k]["distill_1"], out[0]["distill_1"])
    torch.testing.assert_close(out[k]["distill_0"], out[0]["distill_0"])
    torch.testing.assert_close(val[k], val[0])
    for bad, match in (({"alignment_steps": 1}, "alignment_top_k masks"), ({"alignment_top_k": -1}, ">= 0")):
        with pytest.raises(DraftsmithError, match=match):
            DrafterModule(str(tiny_target_dir), kind="eagle3", **{"alignment_steps": 2, "alignment_top_k": 1, **bad})
