"""`draftsmith labels`: what a stop head learns from, by running a trained drafter and its target.

For every assistant position t of a chat (the sequence ids[:t+1], the next token an assistant
token) the drafter drafts a chain of `k` tokens, exactly as the runtime drafts a round after
that sequence (`Proposer.chains`: all positions of a chat at once, one drafter forward per depth;
a feature drafter's later tokens read its own hidden states), and the target scores every chain in
one forward per depth under a mask that lets each chain see only its prefix and itself. A row per
(position, depth j) records what a policy would see before deciding on token j + 1 and what
verification made of token j:

    hidden (N, H)       the drafter state that produced token j's distribution (DraftStep.hidden)
    top_probs (N, top_k) that distribution's largest probabilities; entropy (N,) in nats
    token_greedy, token_sampled (N,)   its argmax and a token sampled from it at T = 1
    q_greedy, q_sampled, p_greedy, p_sampled (N,)   drafter and target probabilities of them
    target_argmax (N,)  the target's greedy token after the same prefix
    soft (N,)           min(1, p/q) of the sampled token: its chance of acceptance at T = 1
    hard (N,)           the greedy token equals the target's argmax (accepted when greedy)
    reached (N,)        every earlier token of this chain was the target's argmax
    anchor, depth (N,)  t and j; offsets (R+1,) the rows of each chat

Each chain continues with the greedy token (`--chain greedy`, what greedy decoding drafts) or the
sampled one (`--chain sample`). Shards are written atomically under fixed parts of the chats, with
run.json naming the drafter and the target; a rerun resumes after the finished shards.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith import DraftsmithError
from draftsmith.options import ChatOptions, DraftOptions, TargetOptions

if TYPE_CHECKING:
    import torch

CHAINS = ("greedy", "sample")


@dataclass(kw_only=True)
class LabelsConfig(TargetOptions, ChatOptions, DraftOptions):
    """Options of `draftsmith labels` (the target's, the chats', and these).

    Args:
        drafter: the drafter's native export directory.
        data: chats to label, best the target's own answers (`draftsmith regenerate` output).
        out: the label directory.
        k: tokens drafted after every position: the longest draft a head will judge.
        top_k: drafter probabilities kept per drafted token (a DISCO classifier reads up to this many).
        chain: greedy (each chain continues with the drafter's argmax, as greedy decoding drafts) or sample
            (with the token sampled at T = 1).
        max_positions: label at most this many positions per chat (spread evenly); all when omitted.
        max_length: tokens per chat; longer chats are truncated (every position drafts a chain: shorter
            than extraction's default).
        shard_size: conversations per shard (the unit of resumption).
        hidden_dtype: dtype of the stored hidden states.
        seed: seed of the sampled tokens (each chat's own stream, so shards do not depend on the order).
    """

    drafter: str
    out: str
    k: int = 8
    top_k: int = 16
    chain: str = "greedy"
    max_positions: int | None = None
    max_length: int = 1024
    shard_size: int = 16
    hidden_dtype: str = "bfloat16"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("k", "top_k", "max_length", "shard_size"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.chain not in CHAINS:
            raise DraftsmithError(f"--chain must be one of {CHAINS}, got {self.chain!r}")
        if self.max_positions is not None and self.max_positions < 1:
            raise DraftsmithError(f"--max_positions must be at least 1, got {self.max_positions}")
        if self.hidden_dtype not in ("bfloat16", "float16", "float32"):
            raise DraftsmithError(f"--hidden_dtype must be bfloat16, float16 or float32, got {self.hidden_dtype!r}")


def label_positions(loss_mask: list[int], first: int, max_positions: int | None) -> list[int]:
    """Positions t whose next token is an assistant token (t ≥ first), at most `max_positions`, evenly spread."""
    positions = [t for t in range(max(first, 0), len(loss_mask) - 1) if loss_mask[t + 1]]
    if max_positions is not None and len(positions) > max_positions:
        step = len(positions) / max_positions
        positions = [positions[int(i * step)] for i in range(max_positions)]
    return positions


def label_chat(runner: Any, proposer: Any, ids: list[int], positions: list[int], k: int, top_k: int,
               chain: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The rows of one chat (n positions × k depths, position-major): see the module docstring."""
    import torch

    from draftsmith.models.heads import distribution_summary
    from draftsmith.runtime.chains import feed_chains
    from draftsmith.runtime.sampling import sample

    n = len(positions)
    runner.reset()
    logits, final, aux = runner.forward(ids)  # (P, V): the target's prefix, its cache kept for the chains
    at = torch.tensor(positions, device=logits.device)
    per_depth: list[dict[str, torch.Tensor]] = []

    def pick(d: int, q: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        top, entropy = distribution_summary(q, top_k)
        greedy = q.argmax(-1)
        sampled = sample(q.float().cpu(), generator).to(q.device)  # the runtime's draw, on the CPU generator
        per_depth.append({"hidden": hidden.detach().float().cpu(), "top_probs": top.cpu(), "entropy": entropy.cpu(),
                          "token_greedy": greedy.cpu(), "token_sampled": sampled.cpu(),
                          "q_greedy": q.gather(-1, greedy[:, None])[:, 0].cpu(),
                          "q_sampled": q.gather(-1, sampled[:, None])[:, 0].cpu()})
        return greedy if chain == "greedy" else sampled

    proposer.chains(ids, positions, k, pick, final, aux)
    reached = torch.ones(n, dtype=torch.bool)  # every earlier token of the chain was the target's argmax
    for d in range(1, k + 1):
        if d == 1:
            p = torch.softmax(logits[at].float(), -1)
        else:  # the chains' token d−1 after each prefix, fed to the target
            chained = per_depth[d - 2]["token_greedy" if chain == "greedy" else "token_sampled"]
            hidden = feed_chains(runner.decoder, runner.cache, chained.to(at.device), at, len(ids), d - 1, runner.gqa)
            p = torch.softmax(runner.logits(hidden).float(), -1)
        row = per_depth[d - 1]
        g, s = row["token_greedy"].to(p.device), row["token_sampled"].to(p.device)
        row["p_greedy"] = p.gather(-1, g[:, None])[:, 0].cpu()
        row["p_sampled"] = p.gather(-1, s[:, None])[:, 0].cpu()
        row["target_argmax"] = p.argmax(-1).cpu()
        row["soft"] = torch.clamp(row["p_sampled"] / row["q_sampled"].clamp_min(1e-30), max=1.0)
        row["hard"] = (row["token_greedy"] == row["target_argmax"]).to(torch.uint8)
        row["reached"] = reached.to(torch.uint8)
        reached = reached & (row["token_greedy" if chain == "greedy" else "token_sampled"] == row["target_argmax"])
    stacked = {name: torch.stack([row[name] for row in per_depth], 1) for name in per_depth[0]}  # (n, K, ...)
    out = {name: v.reshape(n * k, *v.shape[2:]) for name, v in stacked.items()}
    out["anchor"] = torch.tensor(positions, dtype=torch.int32).repeat_interleave(k)
    out["depth"] = torch.arange(1, k + 1, dtype=torch.uint8).repeat(n)
    return out


def labels(cfg: LabelsConfig, console: Any = None) -> dict[str, Any]:
    """Label every chat of cfg.data into cfg.out, resuming after finished shards; returns the manifest."""
    import torch

    from collections import Counter

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from draftsmith.data.chat import MaskAudit, tokenize_many
    from draftsmith.data.conversations import load_conversations
    from draftsmith.data.labels import LABELS_FORMAT, PREFIX, label_manifest, shard_name, write_label_shard
    from draftsmith.data.shards import claim_directory, recorded, remove_stale
    from draftsmith.files import write_json_atomic
    from draftsmith.runtime.loading import drafter_identity, load_proposer
    from draftsmith.models.target import load_target
    from draftsmith.models.precision import resolve_dtype
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.progress import Bars

    console = console or Console(stderr=True)
    out = Path(cfg.out)
    convs, _ = load_conversations(cfg.data, limit=cfg.limit)
    # labels stand for decoding's decisions, so they take the type decoding takes here; a resumed run keeps its own
    dtype = resolve_dtype(cfg.dtype, cfg.device, "decode", recorded(out, "dtype"))
    target = load_target(cfg.target, dtype=dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    proposer, description = load_proposer(cfg.drafter, target, cfg.head_vocab)
    if not proposer.drafts:
        raise DraftsmithError("--drafter: labels need a drafter export")
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    feature_drafter = getattr(proposer, "drafter", None)
    hidden_size = feature_drafter.fc.weight.shape[0] if feature_drafter is not None else proposer.model.config.hidden_size
    run = {"format": LABELS_FORMAT, "target": target.identity.as_dict(),
           "drafter": drafter_identity(proposer, cfg.head_vocab), "drafter_path": cfg.drafter,
           "drafter_description": description,
           "hidden_size": hidden_size, "k": cfg.k, "top_k": cfg.top_k, "chain": cfg.chain,
           "max_positions": cfg.max_positions, "data": {"source": cfg.data, "limit": cfg.limit},
           "max_length": cfg.max_length, "shard_size": cfg.shard_size, "dtype": dtype,
           "hidden_dtype": cfg.hidden_dtype, "seed": cfg.seed}
    claim_directory(out, run, "labels")
    num_parts = math.ceil(len(convs) / cfg.shard_size)
    remove_stale(out, PREFIX)
    todo = [p for p in range(num_parts) if not (out / shard_name(p)).exists()]
    first = 1 if proposer.needs_features else 0  # a feature drafter's chain needs one anchor before it
    started, rows_done = time.perf_counter(), 0
    with Bars(TextColumn("[bold]labels[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("conversations"),
                  TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task("labels", total=sum(min(cfg.shard_size, len(convs) - p * cfg.shard_size) for p in todo),
                                 rate="- rows/s")
        for p in todo:
            part = convs[p * cfg.shard_size: (p + 1) * cfg.shard_size]
            skipped, truncated, audit = Counter(), Counter(), MaskAudit()
            chats = tokenize_many(target.tokenizer, part, cfg.max_length, skipped, truncated, audit)
            progress.update(task, advance=len(part) - len(chats))
            done = []
            for chat in chats:
                positions = label_positions(chat.loss_mask, first, cfg.max_positions)
                if positions:
                    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + zlib.crc32(chat.id.encode()))
                    done.append((chat.id, label_chat(runner, proposer, chat.input_ids, positions, cfg.k, cfg.top_k,
                                                     cfg.chain, g)))
                    rows_done += len(positions) * cfg.k
                rate = rows_done / max(time.perf_counter() - started, 1e-9)
                progress.update(task, advance=1, rate=f"{rate:,.0f} rows/s")
            write_label_shard(out, p, done, {"skipped": dict(skipped), "truncated": dict(truncated)},
                              getattr(torch, cfg.hidden_dtype))
    manifest = label_manifest(out, num_parts, run)
    manifest["this_run"] = {"seconds": round(time.perf_counter() - started, 1), "shards_written": len(todo)}
    write_json_atomic(out / "manifest.json", manifest)
    return manifest
