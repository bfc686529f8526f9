"""Who answers `draftsmith regenerate`'s prompts: transformers' batched generate, vLLM's offline engine
in this process, or any OpenAI-compatible chat-completions server.

Each answerer takes the chats to answer (their messages, and their token ids in the target's chat
template) and returns one `Answer` per chat: the text, how many tokens it took and whether it ended
on its own (EOS) rather than at max_new_tokens. The first two generate from the token ids draftsmith
rendered; a server renders the messages itself, so `EndpointAnswerer` first checks that it renders a probe
chat to the very ids the target's template gives (`/tokenize`, else the prompt's token count).
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

from draftsmith import DraftsmithError

REASONING = ("keep", "drop")
THINK = re.compile(r"^\s*(?:<think>)?.*?</think>\s*", re.DOTALL)  # a reasoning block, its opening tag optional
PROBE = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


class Answer(NamedTuple):
    text: str
    tokens: int
    ended: bool  # on EOS, not cut at max_new_tokens


def require_vllm() -> None:
    """Refuse `--engine vllm` where vLLM cannot be imported, saying where to get it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise DraftsmithError("--engine vllm needs vLLM in this environment: `make engines` installs its CPU build "
                              "with draftsmith in .venv-engines (run .venv-engines/bin/draftsmith), "
                              "`pip install vllm` a GPU build")


def vllm_engine_args(own: dict[str, Any], extra: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's `LLM(...)` arguments: draftsmith's `own` with the user's `--engine_args` added (placement and
    speed, e.g. tensor_parallel_size, gpu_memory_utilization, enforce_eager); an argument draftsmith sets
    itself is refused by name."""
    clash = sorted(set(extra or {}) & set(own))
    if clash:
        raise DraftsmithError(f"--engine_args {clash}: draftsmith sets {'it' if len(clash) == 1 else 'them'} itself "
                              "(the target, dtype, seed and lengths come from their own options)")
    return {**own, **(extra or {})}


def bound_cpu_kv_cache() -> None:
    """On a CPU vLLM reserves nearly all of the machine's memory for its KV cache unless
    VLLM_CPU_KVCACHE_SPACE (GiB) says otherwise, and whatever runs beside it then runs out of memory.
    Where the user has not set it: a quarter of the memory, 1 to 4 GiB, which holds dozens of
    full-length sequences of a small target. vLLM's GPU platform does not read it."""
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        total_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, min(4, int(total_gib // 4))))


def with_reasoning(content: str, reasoning: str | None, mode: str) -> str:
    """The answer text to keep: `keep` puts a reasoning trace the server returned apart back in front of
    the answer, as the model wrote it (<think>…</think>); `drop` keeps the answer alone, removing a
    reasoning block inside the text too."""
    if mode == "drop":
        return THINK.sub("", content, count=1) if "</think>" in content else content
    return f"<think>\n{reasoning.strip()}\n</think>\n\n{content}" if reasoning else content


class GenerateAnswerer:
    """transformers' generate on the loaded target, `batch_size` prompts at a time (left padding)."""

    def __init__(self, target: Any, cfg: Any):
        self.model, self.tok, self.cfg = target.model, target.tokenizer, cfg
        self.eos = list(target.eos_token_ids)
        if not self.eos:
            raise DraftsmithError(f"target {cfg.target!r} has no EOS token: answers would never end")
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos[0]
        self.batch_size = cfg.batch_size

    def answer(self, chats: list[tuple[list[dict], list[int]]]) -> list[Answer]:
        import torch

        prompts = [ids for _, ids in chats]
        width = max(len(p) for p in prompts)
        device = self.model.device
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = ({"do_sample": True, "temperature": self.cfg.temperature, "top_p": self.cfg.top_p or 1.0,
                     "top_k": self.cfg.top_k or 0}
                    if self.cfg.temperature > 0 else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None})
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.cfg.max_new_tokens,
                                      eos_token_id=self.eos, pad_token_id=self.pad, **sampling)[:, width:].tolist()
        return [self._decoded(row) for row in out]

    def _decoded(self, row: list[int]) -> Answer:
        cut = next((i for i, t in enumerate(row) if t in self.eos), None)
        tokens = row if cut is None else row[:cut]
        text = self.tok.decode(tokens, skip_special_tokens=True)
        return Answer(with_reasoning(text, None, self.cfg.reasoning), len(tokens), cut is not None)


class VllmAnswerer:
    """vLLM's offline `LLM` in this process, fed the token ids draftsmith rendered (every prompt of a turn
    at once: the engine batches them itself)."""

    def __init__(self, source: str, tokenizer: Any, cfg: Any, dtype: str):
        require_vllm()
        from transformers import AutoConfig
        from vllm import LLM, SamplingParams

        from draftsmith.models.target import eos_ids

        self.tok, self.cfg, self.batch_size = tokenizer, cfg, None
        self.eos = list(eos_ids(tokenizer, AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)))
        bound_cpu_kv_cache()
        self.llm = LLM(**vllm_engine_args(dict(model=source, dtype=dtype, seed=cfg.seed, max_model_len=cfg.max_length,
                                               trust_remote_code=cfg.trust_remote_code), cfg.engine_args))
        self.params = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p or 1.0, top_k=cfg.top_k or 0,
                                     max_tokens=cfg.max_new_tokens, stop_token_ids=self.eos, seed=cfg.seed)

    def answer(self, chats: list[tuple[list[dict], list[int]]]) -> list[Answer]:
        from vllm.inputs import TokensPrompt

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for _, ids in chats], self.params, use_tqdm=False)
        answers = []
        for out in outs:
            tokens = [t for t in out.outputs[0].token_ids if t not in self.eos]
            text = self.tok.decode(tokens, skip_special_tokens=True)
            answers.append(Answer(with_reasoning(text, None, self.cfg.reasoning), len(tokens),
                                  out.outputs[0].finish_reason == "stop"))
        return answers


class EndpointAnswerer:
    """An OpenAI-compatible chat-completions server: `concurrency` requests in flight, each retried with
    exponential backoff on a 5xx, a timeout or a refused connection; a 4xx stops the run with the
    server's own message."""

    def __init__(self, url: str, tokenizer: Any, cfg: Any, api_key: str | None = None,
                 log: Callable[[str], None] = print):
        base = url.rstrip("/")
        self.base = base if base.endswith("/v1") else base + "/v1"
        self.tok, self.cfg, self.api_key, self.log = tokenizer, cfg, api_key, log
        self.batch_size = None
        self._stopped = threading.Event()
        self.model = cfg.served_model or self._only_model()
        self._check_rendering()

    # --- one request, with retries ----------------------------------------------------------------
    def _request(self, path: str, body: dict | None = None, optional: bool = False) -> dict | None:
        """The server's JSON reply; None for an `optional` path the server lacks (404, 405)."""
        url = (self.base.removesuffix("/v1") if path.startswith("/tokenize") else self.base) + path
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}
        data = None if body is None else json.dumps(body).encode()
        tries = 1 + self.cfg.retries
        for attempt in range(1, tries + 1):
            try:
                with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),
                                            timeout=self.cfg.request_timeout) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as e:
                detail = _server_message(e)
                if optional and e.code in (404, 405):
                    return None
                if e.code < 500:
                    raise DraftsmithError(f"{url}: the server refused the request ({e.code} {e.reason}): {detail}") from None
                problem = f"{e.code} {e.reason}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                problem = str(getattr(e, "reason", e))
            if attempt == tries or self._stopped.is_set():
                raise DraftsmithError(f"{url}: no answer after {tries} tries (last: {problem}); the chats finished "
                                      "so far are kept: rerun the same command to resume") from None
            wait = min(self.cfg.retry_wait * 2 ** (attempt - 1), 60.0)
            self.log(f"endpoint: {problem}; retrying in {wait:g} s (try {attempt + 1} of {tries})")
            self._stopped.wait(wait)
        raise AssertionError("unreachable")

    def _only_model(self) -> str:
        models = [m["id"] for m in self._request("/models").get("data", [])]
        if len(models) != 1:
            raise DraftsmithError(f"{self.base} serves {models or 'no models'}: name one with --served_model")
        return models[0]

    def _check_rendering(self) -> None:
        """The server must render chats to the target's token ids: the same tokenizer and chat template."""
        from draftsmith.models.target import encode_chat

        mine = encode_chat(self.tok, PROBE)
        tokenized = self._request("/tokenize", {"model": self.model, "messages": PROBE, "add_generation_prompt": True},
                                  optional=True)
        if tokenized is None:  # no /tokenize (a hosted API): the prompt's token count must agree
            reply = self._request("/chat/completions", {"model": self.model, "messages": PROBE, "max_tokens": 1,
                                                        "temperature": 0.0})
            count = reply.get("usage", {}).get("prompt_tokens")
            if count is not None and count != len(mine):
                raise DraftsmithError(f"{self.base} ({self.model}) counts {count} prompt tokens in a probe chat where "
                                      f"--target's chat template gives {len(mine)}: the server runs another "
                                      "tokenizer or chat template; pass the served model's own --target")
            return
        theirs = tokenized["tokens"]
        if theirs != mine:
            at = next((i for i, (a, b) in enumerate(zip(theirs, mine)) if a != b), min(len(theirs), len(mine)))
            raise DraftsmithError(f"{self.base} ({self.model}) renders a probe chat to other token ids than --target's "
                                  f"chat template (first difference at token {at} of {len(mine)}): the server runs "
                                  "another tokenizer or chat template; pass the served model's own --target")

    # --- answers ------------------------------------------------------------------------------------
    def _one(self, messages: list[dict]) -> Answer:
        body = {"model": self.model, "messages": messages, "max_tokens": self.cfg.max_new_tokens,
                "temperature": self.cfg.temperature, "seed": self.cfg.seed}
        if self.cfg.top_p is not None:
            body["top_p"] = self.cfg.top_p
        if self.cfg.top_k is not None:
            body["top_k"] = self.cfg.top_k  # vLLM and SGLang take it beside the OpenAI fields
        reply = self._request("/chat/completions", body)
        choice = reply["choices"][0]
        message = choice.get("message") or {}
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        text = with_reasoning(message.get("content") or "", reasoning, self.cfg.reasoning)
        return Answer(text, int(reply.get("usage", {}).get("completion_tokens", 0)), choice.get("finish_reason") == "stop")

    def answer(self, chats: list[tuple[list[dict], list[int]]]) -> list[Answer]:
        pool = ThreadPoolExecutor(max_workers=self.cfg.concurrency)
        futures = [pool.submit(self._one, messages) for messages, _ in chats]
        try:
            answers = [f.result() for f in futures]
        except BaseException:  # the first failure ends the run: requests in flight stop retrying
            self._stopped.set()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return answers


def _server_message(error: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(error.read() or b"{}")
    except (json.JSONDecodeError, OSError):
        return error.reason or ""
    detail = body.get("error", body.get("detail", body))
    return detail.get("message", str(detail)) if isinstance(detail, dict) else str(detail)
