"""`draftsmith export`: checkpoints → draftsmith's native format and the engines' formats.

Formats (../shared/ENGINES.md has the consumers' facts):
- native: config.json (kind, sizes, target identity, layer ids + convention, provenance) +
  model.safetensors with the trained weights; the runtime loads it (`load_native`).
- eagle: EAGLE-1/2/HASS drafters, one directory per consumer: vllm/, sglang/ (safetensors)
  and eagle-reference/ (pytorch_model.bin, strict keys).
- eagle3: flat Llama config read by vLLM (vllm/) and SGLang (sglang/, layer ids - 1).
- speculators: vLLM's native speculator config (Eagle3Speculator), EAGLE-3 drafters only.

Every export is checked against its consumer's contract (every expected tensor present
with its shape, nothing unexpected, config fields complete), then reloaded into a drafter
whose logits are compared with the trained module's.

Notation: H drafter hidden, Ht target hidden, I intermediate, V vocab, Vd draft vocab, k fused layers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from draftsmith import DraftsmithError

FORMATS = ("native", "eagle", "eagle3", "speculators")
NATIVE_FORMAT = "draftsmith-drafter/1"
TOKEN_COUNTS = "token_counts.safetensors"  # a standalone export's assistant-token counts (V,) int64


# --- loading a trained module ------------------------------------------------------------------------
def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a Lightning checkpoint without unpickling arbitrary objects (weights_only)."""
    path = Path(path)
    if path.is_dir():
        candidates = sorted(path.glob("**/best-*.ckpt")) or sorted(path.glob("**/last.ckpt"))
        if not candidates:
            raise DraftsmithError(f"no checkpoint (best-*.ckpt or last.ckpt) under {path}")
        path = candidates[-1]
    if not path.is_file():
        raise DraftsmithError(f"checkpoint {path} not found")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unexpected object in the pickle: refuse rather than execute it
        raise DraftsmithError(f"{path}: not a checkpoint draftsmith can read safely ({type(e).__name__}: {e})") from None
    if "draftsmith" not in ckpt or "hyper_parameters" not in ckpt:
        raise DraftsmithError(f"{path} is not a draftsmith training checkpoint (no draftsmith metadata)")
    ckpt["path"] = str(path)
    return ckpt


def module_from_checkpoint(ckpt: dict[str, Any]) -> Any:
    """Rebuild the trained LightningModule (target parts come back from the target itself)."""
    hp = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}  # LightningCLI adds _class_path
    kind = ckpt["draftsmith"]["kind"]
    if kind == "standalone":
        from draftsmith.train.distill import DistillModule

        module = DistillModule(**hp)
    else:
        from draftsmith.train.drafter import DrafterModule

        module = DrafterModule(**hp)
        if kind == "eagle3":
            d2t = ckpt["state_dict"]["drafter.d2t"]
            module.forced_draft_ids = torch.arange(len(d2t)) + d2t
    module.on_load_checkpoint(ckpt)
    module.load_state_dict(ckpt["state_dict"])
    return module.eval()


# --- tensor names per format ---------------------------------------------------------------------------
def _layer_tensors(layer_state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    keep = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight",
            "input_layernorm.weight", "hidden_norm.weight")
    return {prefix + k: v for k, v in layer_state.items() if k in keep}


def eagle_tensors(drafter: Any, with_embeddings: bool = True) -> dict[str, torch.Tensor]:
    """EAGLE-1/2/HASS engine tensors: fc (+ zero bias), layers.0.* without input norm, embeddings."""
    state = {k: v.detach().float().contiguous() for k, v in drafter.state_dict().items()}
    layer = {k[len("layer."):]: v for k, v in state.items() if k.startswith("layer.")}
    out = {"fc.weight": state["fc.weight"], "fc.bias": torch.zeros(state["fc.weight"].shape[0])}
    out.update(_layer_tensors(layer, "layers.0."))
    if with_embeddings:
        out["embed_tokens.weight"] = state["embed_tokens.weight"]
    return out


def eagle3_tensors(drafter: Any, with_embeddings: bool = False) -> dict[str, torch.Tensor]:
    state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
    layer = {k[len("layer."):]: v.float() for k, v in state.items() if k.startswith("layer.")}
    out = {"fc.weight": state["fc.weight"].float(), "norm.weight": state["norm.weight"].float(),
           "lm_head.weight": state["lm_head.weight"].float(), "d2t": state["d2t"].long(), "t2d": state["t2d"].bool()}
    out.update(_layer_tensors(layer, "layers.0."))
    if with_embeddings:
        out["embed_tokens.weight"] = state["embed_tokens.weight"].float()
    return out


def expected_shapes(fmt: str, c: dict[str, int]) -> tuple[dict[str, tuple], set[str]]:
    """(required name → shape, optional names) of a format, from ENGINES.md."""
    h, ht, i, v = c["H"], c["Ht"], c["I"], c["V"]
    q, kv = c["nh"] * c["hd"], c["nkv"] * c["hd"]
    attn_in = h if fmt == "eagle" else 2 * h
    shapes = {
        "layers.0.self_attn.q_proj.weight": (q, attn_in), "layers.0.self_attn.k_proj.weight": (kv, attn_in),
        "layers.0.self_attn.v_proj.weight": (kv, attn_in), "layers.0.self_attn.o_proj.weight": (h, q),
        "layers.0.mlp.gate_proj.weight": (i, h), "layers.0.mlp.up_proj.weight": (i, h),
        "layers.0.mlp.down_proj.weight": (h, i), "layers.0.post_attention_layernorm.weight": (h,),
    }
    if fmt == "eagle":
        shapes.update({"fc.weight": (h, 2 * h), "fc.bias": (h,)})
        return shapes, {"embed_tokens.weight"}
    vd = c["Vd"]
    shapes.update({"fc.weight": (h, c["k"] * ht), "layers.0.input_layernorm.weight": (h,),
                   "layers.0.hidden_norm.weight": (h,), "norm.weight": (h,), "lm_head.weight": (vd, h),
                   "d2t": (vd,), "t2d": (v,)})
    return shapes, {"embed_tokens.weight"}


def check_tensors(fmt: str, tensors: dict[str, torch.Tensor], sizes: dict[str, int], where: str) -> None:
    """Every expected tensor present with its shape, nothing unexpected; raise naming each problem."""
    shapes, optional = expected_shapes(fmt, sizes)
    problems = [f"missing {name} {shape}" for name, shape in shapes.items() if name not in tensors]
    problems += [f"{name}: shape {tuple(t.shape)}, expected {shapes[name]}" for name, t in tensors.items()
                 if name in shapes and tuple(t.shape) != shapes[name]]
    problems += [f"unexpected tensor {name}" for name in tensors if name not in shapes and name not in optional]
    if fmt != "eagle":
        if "d2t" in tensors and tensors["d2t"].dtype != torch.int64:
            problems.append(f"d2t dtype {tensors['d2t'].dtype}, expected int64")
        if "t2d" in tensors and (tensors["t2d"].dtype != torch.bool or int(tensors["t2d"].sum()) != sizes["Vd"]):
            problems.append("t2d must be bool with exactly Vd true entries")
    if problems:
        raise DraftsmithError(f"{where} breaks the {fmt} contract: " + "; ".join(problems))


def check_config(config: dict[str, Any], required: dict[str, Any], where: str) -> None:
    """Each required field present, and equal where a value is given (None: any value)."""
    problems = []
    for key, value in required.items():
        node = config
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError:
            problems.append(f"missing {key}")
        elif value is not None and node != value:
            problems.append(f"{key} = {node!r}, expected {value!r}")
    if problems:
        raise DraftsmithError(f"{where}/config.json breaks its consumer's contract: " + "; ".join(problems))


# --- configs -----------------------------------------------------------------------------------------
def _sizes(module: Any) -> dict[str, int]:
    cfg, d = module.drafter.config, module.drafter
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"H": cfg.hidden_size, "Ht": module.identity["hidden_size"], "I": cfg.intermediate_size,
            "V": module.identity["vocab_size"], "Vd": d.vocab_size, "k": len(module.aux_layer_ids) or 1,
            "nh": cfg.num_attention_heads, "nkv": cfg.num_key_value_heads, "hd": hd}


def _rope(cfg: Any) -> tuple[float, Any]:
    """Legacy rope_theta / rope_scaling from a transformers-5 config (which uses rope_parameters)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = params.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    scaling = None if params.get("rope_type", "default") == "default" else params
    return float(theta), scaling


def llama_layer_config(module: Any, architectures: list[str]) -> dict[str, Any]:
    cfg = module.drafter.config
    theta, scaling = _rope(cfg)
    s = _sizes(module)
    return {
        "architectures": architectures, "model_type": "llama", "hidden_size": s["H"],
        "intermediate_size": s["I"], "num_attention_heads": s["nh"], "num_key_value_heads": s["nkv"],
        "head_dim": s["hd"], "num_hidden_layers": 1, "vocab_size": s["V"], "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": theta, "rope_scaling": scaling, "attention_bias": bool(getattr(cfg, "attention_bias", False)),
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)), "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "torch_dtype": "float32",
    }


def native_config(module: Any, ckpt: dict[str, Any]) -> dict[str, Any]:
    kind = ckpt["draftsmith"]["kind"]
    callbacks = ckpt.get("callbacks", {})
    best = {k: float(v["best_model_score"]) for k, v in callbacks.items()
            if isinstance(v, dict) and v.get("best_model_score") is not None}
    config = {
        "format": NATIVE_FORMAT, "kind": kind, "target": module.identity,
        "layer_convention": "hf_output_hidden_states",  # id i = output_hidden_states[i]
        "final_feature": "post-norm last hidden state",
        "aux_layer_ids": getattr(module, "aux_layer_ids", []),
        "provenance": {"checkpoint": ckpt["path"], "global_step": ckpt.get("global_step"),
                       "epoch": ckpt.get("epoch"), "hyper_parameters": dict(ckpt["hyper_parameters"]),
                       "best_scores": best},
    }
    if kind == "standalone":
        config["model_config"] = module.student.config.to_dict() if hasattr(module.student, "config") else None
    else:
        config["sizes"] = _sizes(module)
        config["draft_vocab_size"] = module.drafter.vocab_size
        config["layer_config"] = module.drafter.config.to_dict()
    return config


# --- writers -----------------------------------------------------------------------------------------
def _save(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], bin_file: bool = False) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if bin_file:  # the EAGLE reference code reads only pytorch_model.bin (writing a pickle, never reading one)
        torch.save(tensors, out / "pytorch_model.bin")
    else:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def export(ckpt_path: str, fmt: str, out: str, speculative_tokens: int = 3) -> dict[str, Any]:
    """Write `fmt` for the checkpoint into `out`, check it, reload it and compare logits."""
    if fmt not in FORMATS:
        raise DraftsmithError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    ckpt = load_checkpoint(ckpt_path)
    kind = ckpt["draftsmith"]["kind"]
    module = module_from_checkpoint(ckpt)
    out_dir = Path(out)
    if kind == "standalone" and fmt != "native":
        raise DraftsmithError("a standalone draft LM exports as `native` (an ordinary transformers model directory)")
    if fmt in ("eagle3", "speculators") and kind != "eagle3":
        raise DraftsmithError(f"--format {fmt} is for EAGLE-3 drafters; this is an EAGLE-1/2/HASS drafter: "
                              "use --format eagle")
    if fmt == "eagle" and kind != "eagle":
        raise DraftsmithError("--format eagle is for EAGLE-1/2/HASS drafters; this is an EAGLE-3 drafter: "
                              "use --format eagle3 (vLLM, SGLang) or speculators")
    written = WRITERS[fmt](module, ckpt, out_dir, speculative_tokens)
    error = verify_roundtrip(module, fmt, out_dir)
    return {"format": fmt, "kind": kind, "out": str(out_dir), "directories": written, "max_logit_error": error}


def write_native(module: Any, ckpt: dict[str, Any], out: Path, _k: int) -> list[str]:
    config = native_config(module, ckpt)
    if config["kind"] == "standalone":
        student = module.student.merge_and_unload() if hasattr(module.student, "merge_and_unload") else module.student
        student.save_pretrained(out)
        module.student = student
        if getattr(module, "token_counts", None) is not None:  # for the runtime's frequency-ranked head
            from safetensors.torch import save_file

            save_file({"token_counts": module.token_counts.long().contiguous()}, str(out / TOKEN_COUNTS))
            config["token_counts"] = TOKEN_COUNTS
        (out / "draftsmith.json").write_text(json.dumps(config, indent=2) + "\n")
        return [str(out)]
    frozen = ("embed_tokens.weight",) + (("lm_head.weight",) if config["kind"] == "eagle" else ())
    tensors = {k: v.detach().contiguous() for k, v in module.drafter.state_dict().items() if k not in frozen}
    _save(out, tensors, config)
    return [str(out)]


def write_eagle(module: Any, ckpt: dict[str, Any], out: Path, _k: int) -> list[str]:
    sizes = _sizes(module)
    tensors = eagle_tensors(module.drafter)
    check_tensors("eagle", tensors, sizes, str(out))
    targets = {"vllm": ["LlamaForCausalLM"], "sglang": ["LlamaForCausalLMEagle"], "eagle-reference": ["LlamaForCausalLM"]}
    for engine, arch in targets.items():
        config = llama_layer_config(module, arch)
        config["draftsmith"] = {"kind": "eagle", "target": module.identity["name"],
                                "feature": "post-norm last hidden state", "input": "concat(embed, feature)"}
        check_config(config, {"architectures": arch, "num_hidden_layers": 1, "hidden_size": sizes["H"],
                              "vocab_size": sizes["V"], "rope_theta": None, "rope_scaling": None}, str(out / engine))
        _save(out / engine, tensors, config, bin_file=engine == "eagle-reference")
    return [str(out / e) for e in targets]


def eagle3_config(module: Any, layer_ids: list[int], k: int) -> dict[str, Any]:
    s = _sizes(module)
    config = llama_layer_config(module, ["LlamaForCausalLMEagle3"])
    config.update({"draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"], "norm_before_residual": False,
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}})
    if k != 3:
        config["num_aux_hidden_states"] = k
    return config


def write_eagle3(module: Any, ckpt: dict[str, Any], out: Path, _k: int) -> list[str]:
    s, ids = _sizes(module), list(module.aux_layer_ids)
    tensors = eagle3_tensors(module.drafter)
    check_tensors("eagle3", tensors, s, str(out))
    # vLLM reads HF output_hidden_states ids; SGLang adds 1 to what it reads
    for engine, layer_ids in (("vllm", ids), ("sglang", [i - 1 for i in ids])):
        config = eagle3_config(module, layer_ids, len(ids))
        check_config(config, {"architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                              "vocab_size": s["V"], "draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"],
                              "tie_word_embeddings": False, "norm_before_residual": False,
                              "eagle_config.eagle_aux_hidden_state_layer_ids": layer_ids, "rope_theta": None,
                              "rope_scaling": None}, str(out / engine))
        config["draftsmith"] = {"layer_convention": "sglang (hf id - 1)" if engine == "sglang" else "hf_output_hidden_states",
                                "target": module.identity["name"]}
        _save(out / engine, tensors, config)
    return [str(out / "vllm"), str(out / "sglang")]


def write_speculators(module: Any, ckpt: dict[str, Any], out: Path, k: int) -> list[str]:
    s, ids = _sizes(module), list(module.aux_layer_ids)
    tensors = eagle3_tensors(module.drafter)
    check_tensors("eagle3", tensors, s, str(out))
    layer = llama_layer_config(module, ["LlamaForCausalLM"])
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": layer, "draft_vocab_size": s["Vd"], "target_hidden_size": s["Ht"],
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": ids,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {"name_or_path": module.identity["name"], "architectures": [module.identity["architecture"]]},
        },
        "torch_dtype": "float32",
    }
    check_config(config, {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                          "transformer_layer_config": None, "draft_vocab_size": s["Vd"],
                          "target_hidden_size": s["Ht"], "norm_before_residual": False,
                          "eagle_aux_hidden_state_layer_ids": ids, "speculators_config.algorithm": "eagle3",
                          "speculators_config.default_proposal_method": "greedy",
                          "speculators_config.verifier.name_or_path": None}, str(out))
    methods = [m["proposal_type"] for m in config["speculators_config"]["proposal_methods"]]
    if config["speculators_config"]["default_proposal_method"] not in methods:
        raise DraftsmithError(f"{out}: default_proposal_method is not among proposal_methods {methods}")
    _save(out, tensors, config)
    return [str(out)]


WRITERS = {"native": write_native, "eagle": write_eagle, "eagle3": write_eagle3, "speculators": write_speculators}


# --- reading exports back ------------------------------------------------------------------------------
def _read(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = json.loads((directory / "config.json").read_text())
    return config, load_file(str(directory / "model.safetensors"))


def load_native(directory: str | Path, target: Any) -> Any:
    """A drafter from a native export, its frozen parts taken from `target` (a models.target.Target)."""
    directory = Path(directory)
    config, tensors = _read(directory)
    if config.get("format") != NATIVE_FORMAT:
        raise DraftsmithError(f"{directory} is not a native draftsmith export (format {config.get('format')!r})")
    diffs = target.identity.differences(config["target"])
    if diffs:
        raise DraftsmithError(f"drafter in {directory} was trained for another target: {'; '.join(diffs)}; "
                              "re-export the drafter for this target")
    return drafter_from_tensors(config["kind"], tensors, target, config.get("aux_layer_ids", []))


def drafter_from_tensors(kind: str, tensors: dict[str, torch.Tensor], target: Any, aux_layer_ids: list[int]) -> Any:
    """Build a drafter around `target` and load drafter-named tensors (native names)."""
    embed, head = target.embed_tokens.weight.detach().float(), target.lm_head.weight.detach().float()
    if kind == "eagle":
        from draftsmith.models.eagle import EagleDrafter

        drafter = EagleDrafter(target.config, embed, head)
    else:
        from draftsmith.models.eagle3 import Eagle3Drafter

        d2t = tensors["d2t"]
        drafter = Eagle3Drafter(target.config, embed, head, None, torch.arange(len(d2t)) + d2t, len(aux_layer_ids),
                                target.hidden_size)
    missing, unexpected = drafter.load_state_dict(tensors, strict=False)
    frozen = {"embed_tokens.weight", "lm_head.weight"} if kind == "eagle" else {"embed_tokens.weight"}
    if set(missing) - frozen or unexpected:
        raise DraftsmithError(f"drafter weights do not fit: missing {sorted(set(missing) - frozen)}, unexpected {unexpected}")
    return drafter.eval()


def engine_to_native(fmt: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
    if ckpt_kind(module) == "standalone":
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
        ids = torch.randint(0, reloaded.config.vocab_size, (1, 16))
        with torch.no_grad():
            a, b = module.student(input_ids=ids).logits, reloaded(input_ids=ids).logits
        return _compare(a, b, atol, out)
    from draftsmith.models.target import load_target

    target = load_target(module.hparams.target, dtype="float32")
    if fmt == "native":
        drafter = load_native(out, target)
    else:
        directory = out / "vllm" if fmt in ("eagle", "eagle3") else out
        _, tensors = _read(directory)
        drafter = drafter_from_tensors(module.hparams.kind, engine_to_native(fmt, tensors), target, module.aux_layer_ids)
    reference = module.drafter.float().eval()
    g = torch.Generator().manual_seed(0)
    b, t = 2, 8
    ids = torch.randint(0, target.vocab_size, (b, t), generator=g)
    width = reference.fc.in_features - (reference.config.hidden_size if module.hparams.kind == "eagle" else 0)
    feats = torch.randn(b, t, width, generator=g)
    positions = torch.arange(t)[None].expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        a = reference.logits(reference(ids, reference.project(feats, feats), positions, causal))
        c = drafter.logits(drafter(ids, drafter.project(feats, feats), positions, causal))
    return _compare(a, c, atol, out)


def ckpt_kind(module: Any) -> str:
    return "standalone" if hasattr(module, "student") else module.hparams.kind


def _compare(a: torch.Tensor, b: torch.Tensor, atol: float, where: Path) -> float:
    error = float((a.float() - b.float()).abs().max())
    if error > atol:
        raise DraftsmithError(f"{where}: reloaded drafter's logits differ from the trained module's by {error:.2e}")
    return error
