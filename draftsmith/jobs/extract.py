"""`draftsmith extract`: run the frozen target over tokenized chats, write feature shards.

The conversations are cut into fixed parts of `shard_size`; part p becomes shard p, and
process r of N extracts the parts p ≡ r (mod N). The shards are therefore the same
whatever N is and however often the run was interrupted: a rerun skips finished shards, and a
rerun with a larger --limit extends the directory (the first N conversations of a source are a
prefix of its first M > N: only the parts the directory lacks are extracted), a smaller one cuts it.
Notation: B batch, T sequence, H hidden.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from draftsmith import DraftsmithError
from draftsmith.options import ChatOptions, EngineOptions, TargetOptions

FEATURE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(kw_only=True)
class ExtractConfig(TargetOptions, ChatOptions, EngineOptions):
    """Options of `draftsmith extract` (the target's, the chats', and these).

    Args:
        out: the feature directory.
        layer_ids: extra hidden states to keep (id i = output_hidden_states[i]), e.g. [2,15,27] for EAGLE-3.
        shard_size: conversations per shard (the unit of resumption).
        batch_tokens: padded tokens per forward batch.
        feature_dtype: dtype of the stored features.
        devices: processes to extract with (each takes every N-th shard); torchrun works too.
        device_map: accelerate placement for a target larger than one device (e.g. auto).
        adapter: a peft LoRA adapter directory merged into the target on load.
        pack: join consecutive chats into one of at most this many tokens (whole exchanges, within each
            train/validation split at the default share): long sequences that train positions deep into the
            window; at most --max_length. 0: each chat alone.
    """

    out: str
    layer_ids: list[int] = field(default_factory=list)
    shard_size: int = 64
    batch_tokens: int = 8192
    feature_dtype: str = "bfloat16"
    devices: int = 1
    device_map: str | None = None
    adapter: str | None = None
    pack: int = 0

    def __post_init__(self) -> None:
        for name in ("max_length", "shard_size", "batch_tokens", "devices"):
            if getattr(self, name) < 1:
                raise DraftsmithError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.limit is not None and self.limit < 0:
            raise DraftsmithError(f"--limit must be >= 0, got {self.limit}")
        if not 0 <= self.pack <= self.max_length:
            raise DraftsmithError(f"--pack {self.pack}: packed chats hold at most --max_length {self.max_length} "
                                  "tokens (0: no packing)")
        if self.batch_tokens < self.max_length:
            raise DraftsmithError(
                f"--batch_tokens {self.batch_tokens} is smaller than --max_length {self.max_length}: "
                "one full-length chat must fit in a batch; raise --batch_tokens"
            )
        if self.feature_dtype not in FEATURE_DTYPES:
            raise DraftsmithError(f"--feature_dtype must be one of {FEATURE_DTYPES}, got {self.feature_dtype!r}")
        if self.device_map is not None and self.devices > 1:
            raise DraftsmithError("--device_map places one target across devices; use it with --devices 1")
        self.check_engine()
        if self.engine == "vllm" and (self.devices > 1 or self.device_map or self.adapter):
            raise DraftsmithError("--engine vllm places the target itself: leave --devices, --device_map and --adapter out")


def batches_by_length(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that B * max(T) stays within `batch_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[current[0]] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_batch(chats: list[Any], device: Any) -> tuple[Any, Any]:
    """Right-padded input ids and attention mask, both (B, T)."""
    import torch

    width = max(len(c.input_ids) for c in chats)
    ids = torch.zeros((len(chats), width), dtype=torch.long)
    mask = torch.zeros((len(chats), width), dtype=torch.long)
    for row, chat in enumerate(chats):
        ids[row, : len(chat.input_ids)] = torch.tensor(chat.input_ids)
        mask[row, : len(chat.input_ids)] = 1
    return ids.to(device), mask.to(device)


def extract_part(target: Any, chats: list[Any], layer_ids: list[int], cfg: ExtractConfig, on_batch=None,
                 engine: Any = None) -> list[dict]:
    """Features for one part's chats, returned in the chats' order (`engine`: a `VllmFeatures`)."""
    import torch

    dtype = getattr(torch, cfg.feature_dtype)
    records: list[dict | None] = [None] * len(chats)
    if engine is not None:
        for k, (chat, (final, extra)) in enumerate(zip(chats, engine.part(chats))):
            records[k] = {"id": chat.id, "input_ids": chat.input_ids, "loss_mask": chat.loss_mask,
                          "final": final.to(dtype), "layers": {j: h.to(dtype) for j, h in extra.items()}}
        if on_batch:
            on_batch(len(chats), sum(len(c.input_ids) for c in chats))
        return records
    for batch in batches_by_length([len(c.input_ids) for c in chats], cfg.batch_tokens):
        ids, mask = pad_batch([chats[i] for i in batch], target.device)
        with torch.inference_mode():
            final, extra = target.features(ids, mask, layer_ids)  # (B, T, H), {i: (B, T, H)}
            final, extra = final.to("cpu", dtype), {i: h.to("cpu", dtype) for i, h in extra.items()}
        for row, i in enumerate(batch):
            n = len(chats[i].input_ids)
            records[i] = {
                "id": chats[i].id, "input_ids": chats[i].input_ids, "loss_mask": chats[i].loss_mask,
                "final": final[row, :n], "layers": {j: h[row, :n] for j, h in extra.items()},
            }
        if on_batch:
            on_batch(len(batch), int(mask.sum()))
    return records


def _distributed(cfg: ExtractConfig) -> Any:
    """A Fabric for N processes (launched here, or by torchrun), or None for one process."""
    world_env = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.devices == 1 and world_env == 1:
        return None
    from lightning_fabric import Fabric

    devices = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.devices))
    accelerator = "cpu" if cfg.device == "cpu" else "cuda"
    fabric = Fabric(accelerator=accelerator, devices=devices, strategy="ddp",
                    num_nodes=max(1, world_env // devices))
    fabric.launch()
    if accelerator == "cpu":
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // devices))
    return fabric


def extract(cfg: ExtractConfig, console: Any = None) -> dict[str, Any]:
    """Extract features into `cfg.out`, resuming from finished shards; returns the manifest."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from draftsmith.data.chat import MaskAudit, tokenize_many
    from draftsmith.data.conversations import load_conversations
    from draftsmith.data.features import build_manifest, shard_name, write_shard
    from draftsmith.data.shards import claim_directory, recorded, remove_stale
    from draftsmith.models.target import load_target
    from draftsmith.models.precision import resolve_dtype
    from draftsmith.progress import Bars

    out = Path(cfg.out)
    # one type for the whole directory: an interrupted run's, else the one chosen here, before the workers
    # start (they inherit it), and rank 0's where they were started apart (torchrun)
    dtype = resolve_dtype(cfg.dtype, "auto" if cfg.device_map else cfg.device, "bulk", recorded(out, "target_dtype"))
    fabric = _distributed(cfg)
    rank, world = (fabric.global_rank, fabric.world_size) if fabric else (0, 1)
    barrier = fabric.barrier if fabric else (lambda: None)
    console = console or Console(stderr=True)

    convs, source_report = load_conversations(cfg.data, limit=cfg.limit)
    if not convs:
        raise DraftsmithError(f"{cfg.data} holds no chat to extract: {describe_skips(source_report.read, source_report.skipped)}"
                              f"; `draftsmith data stats --data {cfg.data}` shows what it holds")
    device = str(fabric.device) if fabric else cfg.device
    if fabric:
        dtype = fabric.broadcast(dtype)
    target = load_target(cfg.target, dtype=dtype, device=device, device_map=cfg.device_map,
                         adapter=cfg.adapter, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    target.tokenizer.padding_side = "right"
    if cfg.pack:
        from draftsmith.data.conversations import pack
        from draftsmith.models.target import encode_chat

        convs = pack(convs, cfg.pack,
                     lambda messages: len(encode_chat(target.tokenizer, messages, add_generation_prompt=False)))
    layer_ids = target.check_layer_ids(cfg.layer_ids, "--layer_ids (in a recipe: data.init_args.layer_ids, "
                                       "and the drafter's model.init_args.aux_layer_ids)")
    run = {
        "target": target.identity.as_dict(),
        "tokenizer_hash": target.identity.tokenizer_hash,
        "layer_ids": layer_ids,
        "layer_convention": "hf_output_hidden_states",  # id i = output_hidden_states[i]
        "final_feature": "post-norm last hidden state",
        "dtype": cfg.feature_dtype,
        "target_dtype": dtype,
        "hidden_size": target.hidden_size,
        "data": {"source": cfg.data, "limit": cfg.limit, "num_conversations": len(convs),
                 **({"pack": cfg.pack} if cfg.pack else {})},
        "max_length": cfg.max_length,
        "shard_size": cfg.shard_size,
    }
    if rank == 0:
        claim_directory(out, run, "features", extendable=True)
    barrier()
    if rank != 0:
        claim_directory(out, run, "features", extendable=True)

    engine = None
    if cfg.engine == "vllm":
        from draftsmith.jobs.answerers import require_vllm

        require_vllm()
        from draftsmith.jobs.vllm_hidden import VllmFeatures
        from draftsmith.models.sources import resolve_source

        engine = VllmFeatures(resolve_source(cfg.target), target, layer_ids, dtype, cfg.max_length,
                              cfg.trust_remote_code, cfg.engine_args)
    num_parts = math.ceil(len(convs) / cfg.shard_size)
    sizes = [min(cfg.shard_size, len(convs) - p * cfg.shard_size) for p in range(num_parts)]
    done = [holds_part(out / shard_name(p), size) for p, size in enumerate(sizes)]
    existing = sum(done)
    todo = [p for p in range(rank, num_parts, world) if not done[p]]
    remove_stale(out, "shard", owns=lambda part: part % world == rank)  # each part is one rank's
    mine = sum(sizes[p] for p in todo)

    started, tokens = time.perf_counter(), 0
    progress = Bars(
        TextColumn("[bold]extract[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("conversations"),
        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
        console=console, disable=rank != 0, transient=False,
    )
    with progress:
        task = progress.add_task("extract", total=mine, rate="- tok/s")

        def on_batch(n_conv: int, n_tok: int) -> None:
            nonlocal tokens
            tokens += n_tok
            rate = tokens / max(time.perf_counter() - started, 1e-9)
            progress.update(task, advance=n_conv, rate=f"{rate:,.0f} tok/s")

        for p in todo:
            part = convs[p * cfg.shard_size : (p + 1) * cfg.shard_size]
            skipped, truncated, audit = Counter(), Counter(), MaskAudit()
            chats = tokenize_many(target.tokenizer, part, cfg.max_length, skipped, truncated, audit)
            audit.check(f"{cfg.data} (part {p})")
            progress.update(task, advance=len(part) - len(chats))
            records = extract_part(target, chats, layer_ids, cfg, on_batch, engine)
            meta = {"run": run, "skipped": dict(skipped), "truncated": dict(truncated), "audit": audit.summary()}
            write_shard(out, p, records, meta, layer_ids, target.hidden_size, getattr(torch, cfg.feature_dtype))
    barrier()
    elapsed = time.perf_counter() - started
    if fabric:
        tokens = int(fabric.all_reduce(torch.tensor(tokens), reduce_op="sum"))
    manifest = build_manifest(out, num_parts, source_report.as_dict()) if rank == 0 else {}
    barrier()
    if rank == 0 and not manifest["num_records"]:
        raise DraftsmithError(f"no chat of {cfg.data} could be extracted: "
                              f"{describe_skips(len(convs), Counter(manifest['skipped']))} (--max_length {cfg.max_length})")
    if rank == 0:
        manifest = dict(manifest, this_run={"processes": world, "shards_written": num_parts - existing,
                                            "seconds": round(elapsed, 2),
                                            "tokens_per_second": round(tokens / elapsed, 1) if elapsed else None})
    return manifest


def describe_skips(read: int, skipped: Counter) -> str:
    """'read N, skipped: reason n, ...' as a message says it."""
    reasons = ", ".join(f"{reason.replace('_', ' ')} {n}" for reason, n in skipped.most_common()) or "none"
    return f"{read} read, skipped: {reasons}"


def holds_part(path: Path, size: int) -> bool:
    """Whether the shard at `path` is finished for a part of `size` conversations: a shard written under a
    smaller --limit may hold fewer (that run's last part), and is then written again."""
    from draftsmith.data.shards import shard_meta

    if not path.exists():
        return False
    meta = shard_meta(path)
    return meta["num_records"] + sum(meta["skipped"].values()) == size


def summary_table(manifest: dict[str, Any], out: str) -> Any:
    """A rich table of what a feature directory holds."""
    from rich.table import Table

    table = Table(title=f"features in {out}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    t = manifest["target"]
    rows = [
        ("target", f"{t['name']} ({t['architecture']}, {t['num_layers']} layers, hidden {t['hidden_size']})"),
        ("tokenizer hash", manifest["tokenizer_hash"]),
        ("records", f"{manifest['num_records']:,} of {manifest['data']['num_conversations']:,} conversations"),
        ("tokens", f"{manifest['num_tokens']:,} ({manifest['num_loss_tokens']:,} assistant)"),
        ("shards", str(len(manifest["shards"]))),
        ("layers", f"final (post-norm) + {manifest['layer_ids'] or 'none'}, {manifest['dtype']}"),
        ("skipped", ", ".join(f"{k}={v}" for k, v in manifest["skipped"].items()) or "none"),
        ("truncated", ", ".join(f"{k}={v}" for k, v in manifest["truncated"].items()) or "none"),
    ]
    if "this_run" in manifest:
        r = manifest["this_run"]
        rows.append(("this run", f"{r['seconds']} s, {r['tokens_per_second']} tok/s, {r['processes']} process(es)"))
    for k, v in rows:
        table.add_row(k, v)
    return table

