import pytest

from tests.conftest import make_llama

V = 50  # the vocabulary of the shared tiny target


@pytest.fixture(scope="module")
def target():
    return make_llama(V, seed=0, hidden=32, layers=2)


def greedy_cases(target, seeds=3, prompt_length=7, new_tokens=24):
    """(prompt, the target's own greedy continuation) pairs from HF generate, for identity tests."""
    import torch

    for seed in range(seeds):
        prompt = torch.randint(0, V, (prompt_length,), generator=torch.Generator().manual_seed(seed)).tolist()
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                   pad_token_id=1, eos_token_id=None)[0, prompt_length:].tolist()
        yield prompt, expected


def assert_cache_is_recomputation(target, layers, sequence):
    """Each cache layer's first len(sequence) keys and values are what a fresh forward over `sequence` caches."""
    import torch
    from transformers import DynamicCache

    from draftsmith.models.common import cache_kwargs

    fresh = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=torch.tensor([sequence]), use_cache=True, **cache_kwargs(target, fresh))
    for mine, theirs in zip(layers, fresh.layers):
        torch.testing.assert_close(mine.keys[:, :, : len(sequence)], theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values[:, :, : len(sequence)], theirs.values, atol=1e-5, rtol=1e-5)
