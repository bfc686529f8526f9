"""`draftsmith eval`: a drafter against its target on a prompt set, through the shared runtime."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError


@dataclass
class EvalConfig:
    target: str
    drafter: str | None = None  # a native export directory; None: autoregressive only
    prompts: str = "mtbench"
    limit: int | None = None
    turns: str = "first"
    data: str = "sharegpt"
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    policy: str = "cost"
    k: int = 4
    threshold: float = 0.4
    tree: str | None = None  # DEPTH,TOPK,TOKENS: EAGLE-2 tree drafting instead of chains
    lookup: int = 0  # with a tree: a prompt-lookup branch of up to this many tokens grafted on it
    head_vocab: int = 8192  # a standalone drafter's head over its most frequent training tokens; 0 = full
    dtype: str = "bfloat16"
    device: str = "cpu"
    repeats: int = 3
    seed: int = 0
    out: str = "runs/eval"

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise DraftsmithError(f"--repeats must be >= 1, got {self.repeats}")
        if self.head_vocab < 0:
            raise DraftsmithError(f"--head_vocab must be >= 0 (0: the full head), got {self.head_vocab}")
        if self.turns not in ("first", "both"):
            raise DraftsmithError(f"--turns must be first or both, got {self.turns!r}")
        if self.tree in ("", "none", "chain"):
            self.tree = None
        if self.lookup and self.tree is None:
            raise DraftsmithError("--lookup grafts a branch on EAGLE-2 trees: give --tree DEPTH,TOPK,TOKENS too")
        self.tree_shape()

    def tree_shape(self) -> Any:
        """The TreeShape --tree asks for, or None for chain drafts."""
        from draftsmith.runtime.tree import TreeShape

        if self.tree is None:
            return None
        try:
            depth, topk, total = (int(x) for x in str(self.tree).strip("[]() ").split(","))
        except ValueError:
            raise DraftsmithError(f"--tree takes DEPTH,TOPK,TOKENS (e.g. 5,8,32), got {self.tree!r}") from None
        return TreeShape(depth, topk, total, self.lookup)


def load_proposer(drafter: str | None, target: Any, head_vocab: int = 0) -> tuple[Any, str]:
    """(proposer, description) for a native export directory, or plain decoding for None.

    head_vocab > 0: a standalone drafter exported with its training data's token counts drafts
    among its `head_vocab` most frequent tokens (its head runs over those rows only).
    """
    from draftsmith.runtime.proposers import FeatureProposer, ModelProposer, NoProposer

    if drafter in (None, "none"):
        return NoProposer(target.vocab_size), "autoregressive"
    path = Path(drafter)
    if (path / "draftsmith.json").is_file():  # a standalone draft LM
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=target.dtype).to(target.device)
        head_ids = standalone_head_ids(path, target, head_vocab)
        what = f"standalone ({path.name}" + (f", {len(head_ids)}-token head)" if head_ids is not None else ")")
        return ModelProposer(model, target.vocab_size, head_ids), what
    if not (path / "config.json").is_file():
        raise DraftsmithError(f"{path}: not a drafter export; run `draftsmith export CKPT --format native --out DIR`")
    from draftsmith.export import load_native

    config = json.loads((path / "config.json").read_text())
    drafter_module = load_native(path, target).to(device=target.device, dtype=target.dtype)  # int buffers stay int
    return FeatureProposer(drafter_module, target.vocab_size, config.get("aux_layer_ids", [])), f"{config['kind']} ({path.name})"


def standalone_head_ids(path: Path, target: Any, head_vocab: int) -> Any:
    """The `head_vocab` most frequent assistant tokens of a standalone export's training data (EOS
    and PAD always in), or None for the full head: head_vocab 0 or ≥ V, or an export without counts."""
    from draftsmith.export import TOKEN_COUNTS
    from draftsmith.models.eagle3 import draft_vocab

    if not head_vocab or head_vocab >= target.vocab_size or not (path / TOKEN_COUNTS).is_file():
        return None
    from safetensors.torch import load_file

    counts = load_file(str(path / TOKEN_COUNTS))["token_counts"]
    if len(counts) != target.vocab_size:
        raise DraftsmithError(f"{path / TOKEN_COUNTS}: {len(counts)} token counts for a target vocabulary of "
                              f"{target.vocab_size}; re-export the drafter trained for this target")
    tok = target.tokenizer
    specials = [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]
    return draft_vocab(counts, head_vocab, always=specials)


def policy_factory(cfg: EvalConfig) -> Callable[[], Any]:
    """A fresh draft-length policy per generation, as --policy, --k and --threshold ask; the
    cost-aware policies of one run share a meter, so later prompts start from what earlier ones measured."""
    from draftsmith.runtime.policies import CostMeter, make_policy

    args = {"static": {"k": cfg.k}, "heuristic": {"k": cfg.k}, "confidence": {"threshold": cfg.threshold, "max_k": cfg.k},
            "oracle": {"max_k": cfg.k}, "cost": {"max_k": cfg.k, "meter": CostMeter()}}.get(cfg.policy, {})
    make_policy(cfg.policy, **args)  # an unknown name stops here, with the choices
    return lambda: make_policy(cfg.policy, **args)


def evaluate(cfg: EvalConfig, console: Any = None) -> dict[str, Any]:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from draftsmith.eval.acceptance import measure
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import TargetRunner, generate
    from draftsmith.runtime.proposers import NoProposer
    from draftsmith.runtime.sampling import SamplingConfig

    console = console or Console(stderr=True)
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device)
    proposer, description = load_proposer(cfg.drafter, target, cfg.head_vocab)
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    tok = target.tokenizer
    eos = target.eos_token_ids
    new_policy = policy_factory(cfg)
    prompts = load_prompts(cfg.prompts, cfg.limit, cfg.turns, cfg.data)
    encode = target.encode_chat

    conversations = [[{"role": "user", "content": p["turns"][0]}] for p in prompts]
    if cfg.turns == "both":  # the second turn follows the target's own (greedy) first answer
        for conv, p in zip(conversations, prompts):
            if len(p["turns"]) > 1:
                first = generate(runner, NoProposer(target.vocab_size), encode(conv), cfg.max_new_tokens,
                                 new_policy(), SamplingConfig(), eos_token_ids=eos)
                conv += [{"role": "assistant", "content": tok.decode(first.tokens, skip_special_tokens=True)},
                         {"role": "user", "content": p["turns"][1]}]
    ids = [encode(c) for c in conversations]
    categories = [p["category"] for p in prompts]
    load_before = _load_average()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("eval", total=len(ids) * cfg.repeats * 2)

        def tick_factory(label: str):
            progress.update(task, description=label)
            return lambda: progress.advance(task)

        results = measure(runner, proposer, ids, categories, cfg.max_new_tokens, new_policy, sampling, eos,
                          cfg.repeats, cfg.seed, tick_factory, tree=cfg.tree_shape())
    for sample in results["samples"]:
        sample["text"] = tok.decode(sample.pop("tokens"), skip_special_tokens=True)[:400]
    results["config"] = {**asdict(cfg), "drafter": description, "eos_token_ids": list(eos),
                         "num_prompts": len(ids), "target_identity": target.identity.as_dict()}
    results["machine"] = machine = {"cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                                    "load_average": [load_before, _load_average()]}
    busy = max((x for x in machine["load_average"] if x is not None), default=0.0)
    if busy > machine["threads"] + 1:
        console.print(f"[yellow]warning:[/] the 1-minute load average reached {busy:.1f} with {machine['threads']} "
                      "threads of ours: other work shared the CPU, so tokens/s and speedup are not this machine's")
    return results


def _load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): other processes on the CPU skew timings."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
