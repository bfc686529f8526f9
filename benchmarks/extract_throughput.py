"""Extraction throughput against the plain target forward on the same batches, one run.

Arm "plain": the target's base-model forward over the very batches extraction builds
(same chats, same padding), nothing else: the ceiling. Arm "extract": `draftsmith
extract` end to end (tokenizing, forward, hidden-state copies, dtype casts, shard
writes, manifest) into a fresh directory. Arms alternate; the median of the repeats is
compared. Both count real (unpadded) tokens.

    python benchmarks/extract_throughput.py [--limit 48] [--max_length 512] [--repeats 3]

Ends with `RESULT ratio=<extract tok/s / plain tok/s> ...`; the target is >= 0.9.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter

import torch

from draftsmith.data.chat import MaskAudit, tokenize_many
from draftsmith.data.conversations import load_conversations
from draftsmith.jobs.extract import ExtractConfig, batches_by_length, extract, pad_batch
from draftsmith.models.target import load_target

from harness import alternate, medians, parser, print_result


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--target", default="embedded:smollm2-135m-instruct")
    ap.add_argument("--data", default="sharegpt")
    ap.add_argument("--limit", type=int, default=48)
    ap.add_argument("--max_length", type=int, default=512)
    ap.add_argument("--layer_ids", type=int, nargs="*", default=[2, 15, 27])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    cfg_kwargs = dict(target=args.target, data=args.data, limit=args.limit, max_length=args.max_length,
                      layer_ids=args.layer_ids, dtype=args.dtype, shard_size=16)
    target = load_target(args.target, dtype=args.dtype)
    convs, _ = load_conversations(args.data, limit=args.limit)
    cfg = ExtractConfig(out="unused", **cfg_kwargs)
    # the same parts and batches extraction builds
    batches = []
    for p in range(0, len(convs), cfg.shard_size):
        chats = tokenize_many(target.tokenizer, convs[p : p + cfg.shard_size], cfg.max_length,
                              Counter(), Counter(), MaskAudit())
        lengths = [len(c.input_ids) for c in chats]
        batches += [[chats[i] for i in b] for b in batches_by_length(lengths, cfg.batch_tokens)]
    tokens = sum(len(c.input_ids) for b in batches for c in b)

    def plain() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                ids, mask = pad_batch(b, target.device)
                target.decoder(input_ids=ids, attention_mask=mask, use_cache=False)
        return tokens / (time.perf_counter() - start)

    def extraction() -> float:
        with tempfile.TemporaryDirectory() as out:
            manifest = extract(ExtractConfig(out=out, **cfg_kwargs))
            assert manifest["num_tokens"] == tokens, (manifest["num_tokens"], tokens)
            return manifest["this_run"]["tokens_per_second"]

    plain()  # warm-up
    rates = alternate({"plain": plain, "extract": extraction}, args.repeats)
    med = medians(rates)
    ratio = med["extract"] / med["plain"]
    print(f"{tokens:,} tokens in {len(batches)} batches, layers final + {args.layer_ids}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")
    print(f"plain forward {med['plain']:,.0f} tok/s (spread {min(rates['plain']):,.0f}-{max(rates['plain']):,.0f}); "
          f"extract {med['extract']:,.0f} tok/s (spread {min(rates['extract']):,.0f}-{max(rates['extract']):,.0f})")
    print_result(f"ratio={ratio:.3f} extract_tok_s={med['extract']:.0f} plain_tok_s={med['plain']:.0f} tokens={tokens}")


if __name__ == "__main__":
    main()
