"""Every family's drafters served by vLLM's CPU build beside their target (`make test-engines`).

A tiny random target of each family (head dim 64: what vLLM's CPU attention takes) and a drafter trained
two steps on it: an EAGLE-3 drafter, loaded from its `eagle3` export as the target's drafter, and
DFlash and P-EAGLE drafters, loaded from their `speculators` export alone (`LLM(model=export)`: vLLM
reads the verifier and the method from its config). vLLM decodes greedily, which must give the target's
own tokens (speculative decoding is lossless) with drafts verified. vLLM 0.32 refuses Gemma 2 and 3
targets for every drafter that reads target features (their classes lack its `SupportsEagle3`
interface), and serves no DSpark drafter (its V1 runner lacks the method): those refusals are what
their tests expect, verbatim. Each engine runs in its own process. CI serves each drafter on a Llama target
(and the Gemma refusal once); the other families are the `matrix` cases (`make test-engines-matrix`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

from tests.test_families import ARMS, FAMILIES, engine_case, family_features, train_family_drafter  # noqa: E402

NO_EAGLE3 = "Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested"
REFUSED = {family: NO_EAGLE3 for family in ("gemma2", "gemma3_text")}  # vLLM 0.32's Gemma 2 and 3 lack SupportsEagle3
NO_DSPARK = "Model Runner V1 does not support: dspark speculative decoding"
SIZES = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256)

WORKER = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
job = json.load(open(sys.argv[1]))
llm = LLM(dtype="float32", max_model_len=256, enforce_eager=True, seed=0, skip_tokenizer_init=True,
          disable_log_stats=False, **job["llm"])
out = llm.generate([TokensPrompt(prompt_token_ids=job["prompt"])],
                   SamplingParams(temperature=0.0, max_tokens=job["new"], ignore_eos=True), use_tqdm=False)
drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
json.dump({"tokens": list(out[0].outputs[0].token_ids), "drafts": drafts}, open(job["out"], "w"))
"""


@pytest.mark.parametrize("family, options", [engine_case(family, {}, ci=("llama", "gemma3_text")) for family in FAMILIES]
                         + [("llama", {"fc_norm": True, "norm_output": True, "rope_theta": 1e6})])  # EAGLE-3.1, own RoPE
def test_vllm_serves_every_familys_eagle3_export_beside_its_target(family, options, tmp_path):
    from draftsmith.export import export

    target = family_features(family, tmp_path / "tiny", **SIZES)
    ckpt = train_family_drafter(tmp_path / "tiny", tmp_path / "fit", {**ARMS["eagle3"], **options})
    export(str(ckpt), "eagle3", str(tmp_path / "eagle3"))
    llm = dict(model=str(target), speculative_config={"method": "eagle3", "model": str(tmp_path / "eagle3" / "vllm"),
                                                      "num_speculative_tokens": 3})
    serves_the_targets_tokens(target, llm, REFUSED.get(family), tmp_path)


@pytest.mark.parametrize("family, arm", [engine_case(family, arm) for arm in ("dflash", "peagle") for family in FAMILIES]
                         + [("llama", "dspark")])
def test_vllm_serves_every_familys_block_and_parallel_drafters_from_their_speculators_export(family, arm, tmp_path):
    from draftsmith.export import export

    target = family_features(family, tmp_path / "tiny", **SIZES)
    ckpt = train_family_drafter(tmp_path / "tiny", tmp_path / "fit", ARMS[arm])
    export(str(ckpt), "speculators", str(tmp_path / "spec"))
    refused = NO_DSPARK if arm == "dspark" else REFUSED.get(family)
    serves_the_targets_tokens(target, dict(model=str(tmp_path / "spec")), refused, tmp_path)


def serves_the_targets_tokens(target, llm: dict, refused: str | None, tmp_path):
    """vLLM, built with `llm`, decodes the target's own greedy tokens with drafts verified; or, where vLLM
    refuses the pair, fails with the words `refused`."""
    from transformers import AutoModelForCausalLM

    prompt, new = list(range(10, 50)), 24
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                                  eos_token_id=None)[0, len(prompt):].tolist()
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"llm": llm, "prompt": prompt, "new": new, "out": str(tmp_path / "out.json")}))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run([sys.executable, "-c", WORKER, str(job)], capture_output=True, text=True, env=env,
                          timeout=600)
    if refused is not None:
        assert done.returncode != 0 and refused in done.stderr + done.stdout, (done.stdout + done.stderr)[-4000:]
        return
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(Path(tmp_path / "out.json").read_text())
    assert result["tokens"] == expected and result["drafts"] > 0
