"""The second embedded target, Google's Gemma-3-270M (15 of its 18 layers attend over a 512-token sliding
window), decoded by draftsmith's runtime past its window: chains and trees give exactly the text
transformers' own generate gives (fp32, greedy). Its first `run` used to die in transformers' sliding
cache (`crop` cannot roll a rejected draft back once the window is full)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def gemma():
    from draftsmith.models.target import load_target

    return load_target("embedded:gemma-3-270m", dtype="float32")


def test_the_embedded_gemma_decodes_its_own_text_past_its_sliding_window(gemma):
    from draftsmith.models.eagle3 import Eagle3Drafter
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.proposers import FeatureProposer
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.tree import TreeShape

    target = gemma
    window = target.config.sliding_window
    assert target.config.model_type == "gemma3_text" and window == 512 and target.tokenizer.chat_template
    prompt = target.encode_chat([{"role": "user", "content": "Repeat after me. " + "The quick brown fox jumps "
                                  "over the lazy dog near the river bank. " * 50}])
    assert len(prompt) > window + 16
    new = 24
    with torch.no_grad():
        expected = target.model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                         eos_token_id=None)[0, len(prompt):].tolist()
    torch.manual_seed(0)  # a drafter that never trained: most drafts are rejected and rolled back
    drafter = Eagle3Drafter.from_target(target.config, target.embed_tokens.weight, target.lm_head.weight,
                                        target.final_norm_scale(), torch.arange(4096), 3, target.hidden_size)
    runner = TargetRunner(target.model, [2, 9, 15])
    for tree in (None, TreeShape(3, 2, 6, lookup=6)):  # the prompt lookup branch gets accepted: paths kept
        proposer = FeatureProposer(drafter, target.vocab_size, [2, 9, 15])
        result = generate(runner, proposer, prompt, new, Static(3), tree=tree)
        assert result.tokens == expected, tree
        if tree is not None:
            assert max(r.accepted for r in result.rounds) > 0
