"""Seconds a training step with training-time test's attention merged (as `fit` runs it) or under its dense mask.

Alignment step j's queries see the step-0 keys causally and their own chain's keys of steps 1..j
(`models.common.alignment_mask`). Under that boolean mask SDPA scores every query against all (j+1)·T keys;
`train.attention` runs one causal flash attention over the step-0 keys and merges the j diagonal keys by
log-sum-exp. First the attention alone at the recipe's shape (two 512-token rows, the target's heads;
forward and backward of steps 0 and 1, medians), then whole steps: the arm `dense` builds the mask as before
(`StepMask.right_padded` answers no), `merged` runs as `fit` does; each arm its own `fit` process of the
recipe's steps (benchmarks/step_shapes.py), alternating over `--passes`. Ends with

    RESULT attn_ms_dense=... attn_ms_merged=... s_per_step_dense=... s_per_step_merged=...
           speedup=<dense ÷ merged> steps=...

    python benchmarks/alignment_attention.py --steps 200 --recipe recipes/smollm2-135m/eagle3-cpu.yaml \
        [-- --data.init_args.features_dir DIR --data.init_args.limit N]
"""

from __future__ import annotations

import statistics

import torch

from harness import alternate, median_ms, print_result
from step_shapes import fit_arguments, step_seconds

ARMS = {
    "dense": "from draftsmith.train.attention import StepMask\nStepMask.right_padded = lambda self: False",
    "merged": "",
}


def attention_ms(dense: bool, rows: int = 2, length: int = 511, heads: int = 9, kv_heads: int = 3,
                 dim: int = 64, repeats: int = 10) -> float:
    """Milliseconds of steps 0 and 1's attention, forward and backward, at the embedded default's shape."""
    from draftsmith.train.attention import StepMask, alignment_attention

    valid = torch.ones(rows, length, dtype=torch.bool)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    gen = torch.Generator().manual_seed(0)

    def run() -> None:
        for step in (0, 1):
            q = torch.randn(rows, heads, length, dim, generator=gen, requires_grad=True)
            k, v = (torch.randn(rows, kv_heads, (step + 1) * length, dim, generator=gen, requires_grad=True)
                    for _ in range(2))
            mask = StepMask(valid, step)
            out, _ = alignment_attention(module, q, k, v, mask.dense() if dense else mask, scaling=dim ** -0.5)
            out.sum().backward()

    return median_ms(run, repeats)


def main() -> None:
    args = fit_arguments(__doc__, 200, overrides=True).parse_args()
    attn = alternate({"dense": lambda: attention_ms(True), "merged": lambda: attention_ms(False)}, 3)
    step = step_seconds({arm: (setup, args.overrides) for arm, setup in ARMS.items()}, args.recipe, args.steps,
                        args.passes)
    ms = {arm: statistics.median(values) for arm, values in attn.items()}
    print_result({"attn_ms_dense": f"{ms['dense']:.1f}", "attn_ms_merged": f"{ms['merged']:.1f}",
                  "s_per_step_dense": f"{step['dense']:.3f}", "s_per_step_merged": f"{step['merged']:.3f}",
                  "speedup": f"{step['dense'] / step['merged']:.3f}", "steps": args.steps})


if __name__ == "__main__":
    main()
