"""Where oneDNN's packed weights pay: `F.linear` against `mkldnn._linear_pointwise` on a packed copy, per
weight shape, for the few rows a decoding step multiplies, side by side in one process.

    python benchmarks/packed_linear.py [--rows 3] [--dtype float32] [--passes 5]

The shapes run from a test model's 16 x 16 to the embedded default's MLP (1536 x 576). A packed call
has a higher fixed cost than `F.linear`; the runtime packs a linear only from
`runtime.kernels.MIN_PACKED_SIZE` weights on, which this measures.

Ends with `RESULT min_size=... ratio_<O>x<I>=...` where each ratio is F.linear's time over the packed
product's (above 1: packing pays) and `min_size` the smallest weight count from which every measured
shape's ratio is above 1.
"""

from __future__ import annotations

import torch

from harness import alternate, median_ms, medians, parser, print_result

SHAPES = [(16, 16), (64, 64), (128, 128), (256, 256), (192, 576), (384, 384), (576, 576), (1536, 576)]


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=3, help="rows per product (a chain's verification: k + 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--passes", type=int, default=5)
    args = ap.parse_args()

    from draftsmith.models.packing import pack, packable, packed_linear
    from draftsmith.runtime.kernels import MIN_PACKED_SIZE

    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    ratios: dict[tuple[int, int], float] = {}
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, dtype=dtype)
        if not packable(weight):
            raise SystemExit(f"oneDNN cannot pack {args.dtype} weights on this CPU")
        packed, x = pack(weight), torch.randn(1, args.rows, in_features, dtype=dtype)
        arms = {"plain": lambda: median_ms(lambda: torch.nn.functional.linear(x, weight), 500),
                "packed": lambda: median_ms(lambda: packed_linear(x, packed, None), 500)}
        us = {k: v * 1e3 for k, v in medians(alternate(arms, args.passes)).items()}
        ratios[out_features, in_features] = us["plain"] / us["packed"]
        print(f"{out_features:5d} x {in_features:<5d} ({out_features * in_features:>7d} weights): "
              f"F.linear {us['plain']:6.1f} us, packed {us['packed']:6.1f} us, ratio {ratios[out_features, in_features]:.2f}")
    paying = [o * i for (o, i), r in ratios.items() if all(r2 > 1 for (o2, i2), r2 in ratios.items() if o2 * i2 >= o * i)]
    print(f"{args.rows} rows, {args.dtype}; the runtime packs from {MIN_PACKED_SIZE} weights on")
    print_result({"min_size": min(paying) if paying else "none",
                  **{f"ratio_{o}x{i}": f"{r:.2f}" for (o, i), r in ratios.items()}})


if __name__ == "__main__":
    main()
