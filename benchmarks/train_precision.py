"""Seconds a training step in bf16-mixed and in float32, beside what `precision: auto` measures to choose.

`precision: auto` (`models/precision.py`) times one 512-row product in both types and takes bf16-mixed unless
float32 runs it clearly faster. A training step is more than its products (autocast's casts, attention, the
element-wise work), so its ratio can be far from the product's: this script measures both on this machine.
Each arm is its own `fit` process of the recipe's steps without validation (benchmarks/step_shapes.py),
alternating over `--passes`. Ends with

    RESULT product_ratio=<bf16's speed ÷ float32's, auto's measure> auto=<its choice>
           s_per_step_bf16=... s_per_step_fp32=... step_ratio=<fp32 ÷ bf16 seconds> steps=...

    python benchmarks/train_precision.py --steps 150 --recipe recipes/smollm2-135m/eagle3-cpu.yaml \\
        [-- --data.init_args.features_dir DIR --data.init_args.limit N]
"""

from __future__ import annotations

from harness import print_result
from step_shapes import fit_arguments, step_seconds

from draftsmith.models.precision import bf16_speed, prefers_bf16

ARMS = {"bf16": "bf16-mixed", "fp32": "32-true"}


def main() -> None:
    args = fit_arguments(__doc__, 150, overrides=True).parse_args()
    product = bf16_speed("bulk")
    step = step_seconds({arm: ("", [*args.overrides, "--trainer.precision", precision])
                         for arm, precision in ARMS.items()}, args.recipe, args.steps, args.passes)
    print_result({"product_ratio": f"{product:.2f}", "auto": ARMS["bf16" if prefers_bf16(product, "bulk") else "fp32"],
                  "s_per_step_bf16": f"{step['bf16']:.3f}", "s_per_step_fp32": f"{step['fp32']:.3f}",
                  "step_ratio": f"{step['fp32'] / step['bf16']:.3f}", "steps": args.steps})


if __name__ == "__main__":
    main()
