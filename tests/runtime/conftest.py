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
