"""`draftsmith export`: a training checkpoint → draftsmith's native format or an engine's format.

- native (`export/native.py`): what draftsmith's runtime loads (`models/loading.py`);
- eagle (`export/eagle.py`): EAGLE-1/2/HASS drafters for vLLM, SGLang and the EAGLE reference code;
- eagle3 (`export/eagle3.py`): EAGLE-3 drafters for vLLM and SGLang;
- speculators (`export/speculators.py`, `export/block.py`): the `speculators` package's models, which vLLM
  serves: EAGLE-3, DFlash and DSpark drafters.

Each writer checks its output against its consumer's contract (every expected tensor present
with its shape, nothing unexpected, config fields complete); the export is then reloaded and its
logits compared with the trained module's. docs/formats.md lists each layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith import DraftsmithError

if TYPE_CHECKING:
    import torch

from draftsmith.models.registry import EAGLE, EAGLE3, FORMATS, HEAD_KINDS, check_format, drafter_kind

# torch, the models and the writers load when an export runs, not when the command map imports ExportConfig


def writers() -> dict[str, Any]:
    """format → writer(module, ckpt, out, options: ExportConfig) → directories written."""
    from draftsmith.export.eagle import write_eagle
    from draftsmith.export.eagle3 import write_eagle3
    from draftsmith.export.native import write_native
    from draftsmith.export.speculators import write_speculators

    return {"native": write_native, EAGLE.name: write_eagle, EAGLE3.name: write_eagle3, "speculators": write_speculators}


@dataclass
class ExportConfig:
    """Options of `draftsmith export`.

    Args:
        checkpoint: a Lightning checkpoint, a DeepSpeed ZeRO checkpoint directory, or a run directory (its best checkpoint);
            a stop head's (specdec, disco) is added to its drafter's native export named by --out.
        format: native (draftsmith's runtime), eagle (EAGLE-1/2/HASS for vLLM, SGLang, EAGLE code), eagle3 (vLLM, SGLang) or speculators (vLLM).
        out: the output directory.
        speculative_tokens: tokens per proposal written into the speculators config (default: 3 for EAGLE-3,
            a block drafter's whole block).
        verifier: the target the speculators config names, which vLLM loads: a hub id or a local model directory
            (default: the local directory the drafter was trained against; an embedded or GGUF target's dequantized copy).
    """

    checkpoint: str
    format: str = "native"
    out: str = "export"
    speculative_tokens: int | None = None
    verifier: str | None = None

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise DraftsmithError(f"unknown format {self.format!r}; choose one of {FORMATS}")
        if self.speculative_tokens is not None and self.speculative_tokens < 1:
            raise DraftsmithError(f"--speculative_tokens must be >= 1, got {self.speculative_tokens}")


def export(ckpt_path: str, fmt: str, out: str, speculative_tokens: int | None = None, verifier: str | None = None) -> dict[str, Any]:
    """Write `fmt` for the checkpoint into `out`, check it, reload it and compare logits."""
    from draftsmith.export.checkpoint import load_checkpoint, module_from_checkpoint

    options = ExportConfig(ckpt_path, fmt, out, speculative_tokens, verifier)  # the settings' checks, stated once
    ckpt = load_checkpoint(ckpt_path)
    if ckpt["draftsmith"]["kind"] in HEAD_KINDS:  # a stop head goes into its drafter's native export
        from draftsmith.export.heads import export_stop_head

        return export_stop_head(ckpt, fmt, out)
    kind = drafter_kind(ckpt["draftsmith"]["kind"])
    check_format(kind, fmt)
    module = module_from_checkpoint(ckpt)
    out_dir = Path(out)
    written = writers()[fmt](module, ckpt, out_dir, options)
    error = verify_roundtrip(module, fmt, out_dir)
    return {"format": fmt, "kind": kind.name, "out": str(out_dir), "directories": written, "max_logit_error": error,
            "checkpoint": ckpt["path"]}


def engine_to_native(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Engine tensor names → draftsmith module names (the inverse of eagle_tensors / eagle3_tensors)."""
    out = {}
    for name, t in tensors.items():
        if name == "fc.bias":
            if t.abs().max() > 0:
                raise DraftsmithError("fc.bias is not zero; draftsmith drafters have no fc bias")
            continue
        out["layer." + name[len("layers.0."):] if name.startswith("layers.0.") else name] = t
    return out


def verify_roundtrip(module: Any, fmt: str, out: Path, atol: float = 1e-4) -> float:
    """Reload what was written and compare its logits with the trained module's; returns the max error."""
    import torch

    from draftsmith.models.loading import drafter_from_tensors, load_native, read_export

    kind = module.kind
    if not kind.reads_features:  # a standalone draft LM: an ordinary transformers directory
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.randint(0, reloaded.config.vocab_size, (1, 16))
        with torch.no_grad():
            a, b = module.student(input_ids=ids).logits, reloaded(input_ids=ids).logits
        return _compare(a, b, atol, out)
    from draftsmith.models.target import load_target

    target = load_target(module.hparams.target, dtype="float32", chat_template=module.hparams.get("chat_template"),
                         template_kwargs=module.hparams.get("template_kwargs"))
    if fmt == "native":
        drafter = load_native(out, target)
    else:
        _, tensors = read_export(out / "vllm" if (out / "vllm").is_dir() else out)  # one engine's copy
        named = tensors if kind.blocks else engine_to_native(tensors)  # block drafters keep the package's names
        drafter = drafter_from_tensors(kind.name, named, target, module.aux_layer_ids, module.drafter.options)
    reference = module.drafter.float().eval()
    if kind.blocks:
        from draftsmith.models.block import probe

        return _compare(probe(reference), probe(drafter), atol, out)
    g = torch.Generator().manual_seed(0)
    b, t = 2, 8
    ids = torch.randint(0, target.vocab_size, (b, t), generator=g)
    # what `project` reads: the fused layers (k*Ht), or the final feature beside the token embedding (2H − H)
    width = reference.fc.in_features - (0 if kind.fused_layers else reference.config.hidden_size)
    feats = torch.randn(b, t, width, generator=g)
    positions = torch.arange(t)[None].expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        a = reference.logits(reference(ids, reference.project(feats, feats), positions, causal))
        c = drafter.logits(drafter(ids, drafter.project(feats, feats), positions, causal))
        if kind.parallel:  # P-EAGLE: its parallel positions' input too
            a, c = torch.cat([a.flatten(), reference.mask_inputs(1, 1)[1].flatten()]), \
                torch.cat([c.flatten(), drafter.mask_inputs(1, 1)[1].flatten()])
    return _compare(a, c, atol, out)


def _compare(a: torch.Tensor, b: torch.Tensor, atol: float, where: Path) -> float:
    error = float((a.float() - b.float()).abs().max())
    if error > atol:
        raise DraftsmithError(f"{where}: reloaded drafter's logits differ from the trained module's by {error:.2e}")
    return error
