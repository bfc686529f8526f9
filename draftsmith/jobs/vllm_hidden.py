"""`draftsmith extract --engine vllm`: the target's hidden states from vLLM's own forward.

vLLM's `extract_hidden_states` speculative method caches the residual stream at the requested layers
(id i = the input of layer i = transformers' `output_hidden_states[i]`; id N = the last layer's output,
before the final norm) in a cache-only layer, and a KV connector writes each finished request's rows to
a safetensors file. vLLM's own connector (`ExampleHiddenStatesConnector`) copies through CUDA streams
and pinned memory, which its CPU build refuses ("pin_memory=True requires a CUDA or other accelerator
backend"); `CpuHiddenStatesConnector` below is the same connector with a plain copy, and is the one used
when vLLM runs on a CPU. Every chat is one prompt generating one token; its rows are checked against
the chat's token ids before they are kept.

Imports vLLM: only `extract --engine vllm` loads this module.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    cleanup_hidden_states,
    extract_from_kv_cache,
    load_hidden_states,
)

from draftsmith import DraftsmithError
from draftsmith.jobs.answerers import bound_cpu_kv_cache, vllm_engine_args


class _Written:
    """What the connector's poll reads for a request whose rows are on disk."""

    @staticmethod
    def query() -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector with a synchronous copy and write (no CUDA stream, no pinned memory)."""

    def _submit_async_write(self, pending: Any) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size)[None] + blocks[:, None] * self._block_size).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), pending.token_ids.shape[0])
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            save_file({"hidden_states": rows.to("cpu").contiguous(), "token_ids": pending.token_ids.clone()},
                      pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the lock a reader waits on
        self._req_copy_events[pending.req_id] = _Written()


class VllmFeatures:
    """The target's features through vLLM: `part(chats)` returns, per chat, the post-norm last hidden state
    (the target's own final norm applied to vLLM's last-layer output) and the requested layers."""

    def __init__(self, source: str, target: Any, layer_ids: list[int], dtype: str, max_length: int,
                 trust_remote_code: bool = False, engine_args: dict[str, Any] | None = None):
        from vllm import LLM, SamplingParams

        self.target, self.layer_ids = target, list(layer_ids)
        self.capture = self.layer_ids + [target.num_layers]  # the last entry: the input of the final norm
        self.store = tempfile.mkdtemp(prefix="draftsmith-vllm-hidden-")
        on_cpu = not torch.cuda.is_available()
        connector = ({"kv_connector": "CpuHiddenStatesConnector", "kv_connector_module_path": __name__} if on_cpu
                     else {"kv_connector": "ExampleHiddenStatesConnector"})
        bound_cpu_kv_cache()
        own = dict(model=source, dtype=dtype, max_model_len=max_length + 1, seed=0, enable_prefix_caching=False,
                   trust_remote_code=trust_remote_code,
                   speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                       "draft_model_config": {"hf_config": {
                                           "eagle_aux_hidden_state_layer_ids": self.capture}}},
                   kv_transfer_config={**connector, "kv_role": "kv_producer",
                                       "kv_connector_extra_config": {"shared_storage_path": self.store}})
        self.llm = LLM(**vllm_engine_args(own, engine_args))
        self.params = SamplingParams(max_tokens=1, temperature=0.0)

    def part(self, chats: list[Any]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]]]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(c.input_ids)) for c in chats], self.params,
                                 use_tqdm=False)
        features = []
        for chat, out in zip(chats, outs):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise DraftsmithError(f"vLLM returned no hidden states for chat {chat.id!r}")
            data = load_hidden_states(path)
            cleanup_hidden_states(path)
            rows, ids = data["hidden_states"], data["token_ids"].tolist()
            if ids != list(chat.input_ids) or rows.shape[:2] != (len(ids), len(self.capture)):
                raise DraftsmithError(f"vLLM's hidden states for chat {chat.id!r} are not its tokens' "
                                      f"({rows.shape[0]} rows for {len(chat.input_ids)} tokens)")
            norm = self.target.decoder.norm
            with torch.inference_mode():
                final = norm(rows[:, -1].to(norm.weight.device, norm.weight.dtype)).float()
            features.append((final, {i: rows[:, j].float() for j, i in enumerate(self.layer_ids)}))
        return features
