"""`draftsmith eval`: a drafter against its target on a prompt set, through the shared runtime."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Callable, Literal

from draftsmith import DraftsmithError
from draftsmith.data.conversations import VAL_FRACTION
from draftsmith.options import DeviceOptions, DraftOptions, SamplingOptions, TargetOptions


@dataclass(kw_only=True)
class DecodeOptions(SamplingOptions, DraftOptions, DeviceOptions):
    """How a drafter is evaluated (the sampling, draft and device options' and these): shared by
    `draftsmith eval` and `draftsmith run`.

    Args:
        prompts: the prompt sets, comma-separated: mtbench, humaneval, heldout (the validation split of the
            training chats), long (those chats concatenated to 2k, 4k and the target's window, then a question).
        limit: number of prompts of each set (spread over its categories).
        turns: first, or both (MT-bench's second turns too, each after the target's own first answer).
        policy: draft length: cost (draft a token only while it is expected to pay for its measured
            cost), static, heuristic, confidence, specdec or disco (the stop heads the drafter's export
            carries), or oracle (a greedy bound: drafts exactly the tokens the target will accept).
        k: draft length (static), starting length (heuristic) or maximum (cost, confidence, oracle, and
            specdec/disco when --stop_threshold is given).
        threshold: the confidence rule's threshold (default: the one `draftsmith tune --policy confidence` wrote
            into the drafter's export, else 0.4), and BiLD's fallback threshold (--mode bild; default 0.4).
        stop_threshold: specdec's h (stop once the predicted chance of a rejection exceeds it), disco's τ
            (draft while the classifier's confidence is at least it) or dspark's bound on Π c_i; omitted: the
            threshold and maximum length tuned into the export (`draftsmith tune`), else 0.5.
        tree: EAGLE-2 dynamic tree drafting as DEPTH,TOPK,TOKENS (e.g. 5,8,32; feature drafters);
            omit for chain drafts with --policy. With --policy cost (the default) the tree is the most
            a round may draft: each round's depth, node count and lookup tokens are chosen by their
            measured cost; with specdec or disco the stop head decides each round's depth (the chain's
            rule on the best node the next level would expand); any other policy drafts EAGLE-2's fixed
            tree of that shape.
        lookup: with --tree, graft a prompt-lookup branch of up to this many tokens on every tree (the
            tokens that followed the latest earlier occurrence of the text's ending); 0 = off.
        compile: compile the target's decoder with inductor (torch.compile): the whole decoder, or with
            --graphs its norms and MLPs, whose fused kernels the graphs record. Each kind of forward compiles
            at its first call (minutes on a small CPU); the warm-up absorbs it and the report gives its time.
        compile_mode: how the weights enter the compiled decoder (without --graphs): cached (inputs of the
            graph, so inductor's cache keeps it for a later process: a shorter warm-up) or frozen (folded into
            the graph, compiled anew in every process); both measured in docs/runtime.md.
        graphs: on a GPU, replay each target forward and each feature drafter's forward from a CUDA graph
            (KV caches of fixed capacity, one graph per row count, recorded at its first use;
            runtime/graphs.py); a static chain (greedy or sampled) or a tree without a stop policy is drafted
            whole by one graph. Both arms use it.
        repeats: timed repeats after a warm-up (median reported).
        mode: exact (lossless), lossy (lossy speculative decoding), cascade (speculative cascades: the
            draft's law mixed with the target's where a rule defers), token (token-specific cascades) or
            bild (Big Little Decoder); every mode but exact trades quality for speed and runs on chain drafts.
        rule: lossy: beta1 or tuned (the residual scale); cascade: chow, diff or opt; token: v1, v2 or v3;
            bild: rollback (the original: draft while the top probability >= --threshold, roll back at the
            first token the target gives less than 1 - alpha) or star (defer where TV(p, q) > alpha).
        alpha: the mode's leniency: larger alpha accepts more of the drafter's tokens.
        sweep: run the mode over a grid of leniencies in one process, e.g. alpha=0,0.1,0.3 (overrides
            --alpha); results.json gets a row per point.
        max_prompt_length: leave out prompts whose first turn, templated, is longer (`run`: default the
            recipe's data.max_length, the longest chat it trained on).
    """

    prompts: str = "mtbench"
    limit: int | None = None
    turns: str = "first"
    policy: str = "cost"
    k: int = 4
    threshold: float | None = None
    stop_threshold: float | None = None
    tree: str | None = None
    lookup: int = 0
    compile: bool = False
    compile_mode: Literal["cached", "frozen"] = "cached"
    graphs: bool = False
    repeats: int = 3
    mode: str = "exact"
    rule: str | None = None
    alpha: float = 0.0
    sweep: str | None = None
    max_prompt_length: int | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise DraftsmithError(f"--repeats must be >= 1, got {self.repeats}")
        if self.head_vocab < 0:
            raise DraftsmithError(f"--head_vocab must be >= 0 (0: the full head), got {self.head_vocab}")
        if self.turns not in ("first", "both"):
            raise DraftsmithError(f"--turns must be first or both, got {self.turns!r}")
        from draftsmith.eval.prompts import prompt_sets

        prompt_sets(self.prompts)
        if self.tree in ("", "none", "chain"):
            self.tree = None
        from draftsmith.runtime.policies import check_tree_policy, policy_kind

        if policy_kind(self.policy).references and self.temperature > 0:
            raise DraftsmithError(f"--policy {self.policy} is a greedy bound (it drafts until the first token that "
                                  "differs from the target's greedy text): use --temperature 0")
        if self.tree is not None:
            check_tree_policy(policy_kind(self.policy))
        if self.lookup and self.tree is None:
            raise DraftsmithError("--lookup grafts a branch on EAGLE-2 trees: give --tree DEPTH,TOPK,TOKENS too")
        if self.mode != "exact" and self.tree is not None:
            raise DraftsmithError(f"--mode {self.mode} verifies chain drafts; drop --tree (trees verify exactly)")
        if self.graphs and not str(self.device).startswith("cuda"):
            raise DraftsmithError(f"--graphs records CUDA graphs: it needs --device cuda, not {self.device!r}")
        if self.graphs and self.compile and self.compile_mode != "cached":
            raise DraftsmithError(f"--compile_mode {self.compile_mode} compiles the whole decoder, without graphs: "
                                  "with --graphs the norms and MLPs recorded into them are compiled; drop --compile_mode")
        if self.stop_threshold is not None and not 0 <= self.stop_threshold <= 1:
            raise DraftsmithError(f"--stop_threshold must be in [0, 1], got {self.stop_threshold}")
        if not 0 <= self.alpha < 1:
            raise DraftsmithError(f"--alpha must be in [0, 1), got {self.alpha}")
        if self.rule is None and self.mode != "exact":  # the mode's default, named so that results.json says it
            from draftsmith.runtime.targets import MODES

            self.rule = MODES[self.mode][0] if self.mode in MODES else None
        for alpha in self.alphas():
            self.target_rule(alpha)
        self.tree_shape()

    def alphas(self) -> list[float]:
        """The leniencies to run: --sweep alpha=A,B,... or just --alpha."""
        if self.sweep is None:
            return [self.alpha]
        name, _, values = str(self.sweep).partition("=")
        try:
            grid = [float(x) for x in values.split(",") if x.strip()]
        except ValueError:
            grid = []
        if name.strip() != "alpha" or not grid:
            raise DraftsmithError(f"--sweep takes alpha=A,B,... (e.g. alpha=0,0.1,0.3), got {self.sweep!r}")
        if self.mode == "exact":
            raise DraftsmithError("--sweep varies a lossy mode's alpha: give --mode lossy, cascade, token or bild")
        bad = [a for a in grid if not 0 <= a < 1]
        if bad:
            raise DraftsmithError(f"--sweep alpha values must be in [0, 1), got {bad}")
        return grid

    def target_rule(self, alpha: float | None = None) -> Any:
        """The runtime's target rule for --mode/--rule and `alpha` (default --alpha); None: exact decoding."""
        from draftsmith.runtime.targets import target_rule

        try:
            return target_rule(self.mode, self.rule, self.alpha if alpha is None else alpha,
                               greedy=self.temperature == 0,
                               fallback=DEFAULT_THRESHOLD if self.threshold is None else self.threshold)
        except ValueError as e:
            raise DraftsmithError(str(e)) from None

    def tree_shape(self) -> Any:
        """The TreeShape --tree asks for, or None for chain drafts."""
        from draftsmith.runtime.tree import TreeShape

        return TreeShape.parse(self.tree, self.lookup)


@dataclass(kw_only=True)
class EvalConfig(TargetOptions, DecodeOptions):
    """Options of `draftsmith eval` (the target's, DecodeOptions' and these).

    Args:
        drafter: a native export directory (`draftsmith export --format native`); omit for autoregressive only.
        data: the chats whose validation split `--prompts heldout` evaluates on.
        val_fraction: the share of conversations held out for validation (as the training recipe's data.val_fraction).
        data_limit: the number of conversations the training split was drawn from (as the recipe's data.limit).
        cost_profile: the cost profiles to model the speedup under, beside the one timed (comma-separated):
            measured (this machine's, timed by the run), a profile draftsmith ships (h100-llama8b) or a
            profile file (`eval/profile.py`); reported as modelled in the table, results.json and a plot.
        out: the results directory.
    """

    drafter: str | None = None
    data: str = "sharegpt"
    val_fraction: float = VAL_FRACTION
    data_limit: int | None = None
    cost_profile: str | None = None
    out: str = "runs/eval"


def policy_factory(cfg: DecodeOptions, references: dict[tuple[int, ...], tuple[list[int], dict]] | None = None,
                   stop_head: tuple[Any, dict[str, Any]] | None = None) -> Callable[[list[int]], Any]:
    """A fresh draft-length policy per generation (given its prompt), as --policy, --k and the thresholds ask,
    built by the policy's registry entry (`runtime.policies.POLICY_KINDS`). The oracle reads `references`: each
    prompt's ids → (prompt + the target's greedy continuation, the drafter's greedy chain after each of its
    prefixes). A policy with a head or tuned settings reads `stop_head`: the head (or None) and its export
    section (`runtime.loading.load_stop_head`)."""
    from draftsmith.runtime.policies import PolicySettings, policy_kind

    kind = policy_kind(cfg.policy)
    if kind.head is not None and stop_head is None:
        raise DraftsmithError(f"--policy {cfg.policy} needs the stop head of the drafter's export (evaluate loads it)")
    head, section = stop_head or (None, {})
    threshold, k = stop_settings(cfg, section)
    return kind.build(PolicySettings(k=k, threshold=threshold, tree=cfg.tree is not None, head=head,
                                     references=references))


def stop_settings(cfg: DecodeOptions, section: dict[str, Any]) -> tuple[float | None, int]:
    """(threshold, k) of the policy: the command's threshold (--threshold for the confidence rule,
    --stop_threshold for a head's) with --k, else what `draftsmith tune` wrote into the export's `section`
    for this kind of decoding (greedy or sampling; with --tree, tuned on trees where it was, else on chains),
    else the policy's default. With --tree a head's most is the tree's depth (the shape bounds a tree round,
    as it does for cost), or the shallower depth tune filed (a fixed tree of that depth was fastest)."""
    from draftsmith.eval.tune import decoded_choice
    from draftsmith.models.loading import choice_settings
    from draftsmith.runtime.policies import policy_kind

    kind = policy_kind(cfg.policy)
    given, default = (cfg.stop_threshold, DEFAULT_STOP_THRESHOLD) if kind.head else (cfg.threshold, DEFAULT_THRESHOLD)
    tuned = choice_settings(decoded_choice(cfg, section))
    threshold, k = (given, cfg.k) if given is not None else (tuned[0], tuned[1] or cfg.k) if tuned else (default, cfg.k)
    if cfg.tree is not None and kind.head:
        depth = cfg.tree_shape().depth
        k = min(tuned[1], depth) if given is None and tuned and tuned[1] else depth
    return threshold, k


DEFAULT_STOP_THRESHOLD = 0.5  # h or τ of an untuned stop head
DEFAULT_THRESHOLD = 0.4  # the confidence rule's and BiLD's fallback threshold where none is given or tuned


def evaluate(cfg: EvalConfig, console: Any = None) -> dict[str, Any]:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from draftsmith.eval.acceptance import measure
    from draftsmith.eval.machine import OTHERS_LIMIT, CpuShare, cpu_name, load_average
    from draftsmith.eval.profile import modelled_speedups, profile_names
    from draftsmith.eval.oracle import oracle_references
    from draftsmith.eval.prompts import conversations, load_prompts, prompt_sets
    from draftsmith.eval.quality import reference_chats, reference_quality, reference_rows
    from draftsmith.eval.tune import tuned_length_note
    from draftsmith.runtime.loading import export_kind, load_proposer, load_stop_head
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import generate
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import Static, check_tree_policy, policy_kind
    from draftsmith.runtime.proposers import NoProposer, levels_asked
    from draftsmith.runtime.sampling import SamplingConfig
    from draftsmith.progress import Bars

    console = console or Console(stderr=True)
    profiles = profile_names(cfg.cost_profile)
    if cfg.mode != "exact" and cfg.drafter is None:
        raise DraftsmithError(f"--mode {cfg.mode} verifies a drafter's tokens: give --drafter")
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    proposer, description = load_proposer(cfg.drafter, target, cfg.head_vocab)
    kind = export_kind(cfg.drafter)
    model = (lambda generations, alone: modelled_speedups(profiles, runner, generations, kind, cpu_name(), alone)) \
        if profiles else None
    if cfg.graphs:  # --compile then compiles the blocks recorded into the graphs
        runner = TargetRunner(target.model, proposer.aux_layer_ids, graphs=True, compile_blocks=cfg.compile)
        proposer.enable_graphs()  # where the proposer has graphs to replay
    else:
        runner = TargetRunner(target.model, proposer.aux_layer_ids, compile=cfg.compile and cfg.compile_mode)
    tok = target.tokenizer
    eos = target.eos_token_ids
    encode = target.encode_chat
    fits = (lambda p: len(encode([{"role": "user", "content": p["turns"][0]}])) <= cfg.max_prompt_length)
    window = getattr(target.model.config, "max_position_embeddings", None) or 4096
    prompts = []
    for name in prompt_sets(cfg.prompts):
        found = load_prompts(name, cfg.limit, cfg.turns, cfg.data, cfg.val_fraction, cfg.data_limit,
                             fits if cfg.max_prompt_length else None, encode, window)
        if not found:
            held = len(load_prompts(name, cfg.limit, cfg.turns, cfg.data, cfg.val_fraction, cfg.data_limit, None,
                                    encode, window))
            if not held:
                raise DraftsmithError(f"no {name} prompt: the validation split of {cfg.data} (--val_fraction "
                                      f"{cfg.val_fraction}, --data_limit {cfg.data_limit}) holds no chat; give more chats "
                                      "or a larger validation share")
            raise DraftsmithError(f"none of the {held} {name} prompts is at most --max_prompt_length "
                                  f"{cfg.max_prompt_length} tokens long: give a larger --max_prompt_length")
        prompts += found

    def answer(conversation: list[dict[str, str]]) -> str:  # the target's own (greedy) answer to a first turn
        first = generate(runner, NoProposer(target.vocab_size), encode(conversation), cfg.max_new_tokens, Static(0),
                         SamplingConfig(), eos_token_ids=eos)
        return tok.decode(first.tokens, skip_special_tokens=True)

    prompts, chats = conversations(prompts, cfg.turns, answer)
    ids = [encode(c) for c in chats]
    groups = {"set": [p["set"] for p in prompts], "category": [p["category"] for p in prompts],
              "turn": [p["turn"] for p in prompts]}
    policy = policy_kind(cfg.policy)
    if cfg.tree is not None:
        check_tree_policy(policy, levels_asked(proposer))
    references = oracle_references(runner, proposer, ids, cfg.max_new_tokens, cfg.k, eos) if policy.references else None
    stop_head = None
    if policy.head is not None and cfg.drafter is None:
        raise DraftsmithError(f"--policy {cfg.policy} reads the stop head of a drafter's export: give --drafter")
    if policy.tuned and cfg.drafter is not None:
        stop_head = load_stop_head(cfg.drafter, policy, target, proposer)
    if policy.tuned:  # every policy with a head is tuned too
        section = stop_head[1] if stop_head else {}
        threshold, k = stop_settings(cfg, section)
        description += f", {policy.name} {'stop head' if policy.head else 'policy'} (threshold {threshold:g}, at most {k})"
        if note := tuned_length_note(cfg, section):
            console.print(f"[yellow]note:[/] {note}")
    new_policy = policy_factory(cfg, references, stop_head)
    rules = [(alpha, cfg.target_rule(alpha)) for alpha in cfg.alphas()]
    chats = reference_chats(tok, [p for p in prompts if p["set"] == "heldout" and p["turn"] == "1"]) \
        if cfg.mode != "exact" else []
    load_before = load_average()
    with CpuShare() as share, Bars(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("eval", total=len(ids) * cfg.repeats * 2 * len(rules) + len(chats))

        def tick_factory(label: str):
            progress.update(task, description=label)
            return lambda: progress.advance(task)

        points = []
        for alpha, rule in rules:
            prefix = f"alpha {alpha:g} " if cfg.sweep else ""
            points.append(measure(runner, proposer, ids, groups, cfg.max_new_tokens, new_policy, sampling, eos,
                                  cfg.repeats, cfg.seed, lambda label: tick_factory(prefix + label),
                                  tree=cfg.tree_shape(), rule=rule, model=model))
        rows = reference_rows(runner, proposer, chats, tick_factory("reference answers")) if chats else None
    scores: dict = {}  # the target alone's text is the same at every point: scored once
    for (alpha, rule), point in zip(rules, points):
        point["alpha"] = alpha
        point["quality"] = text_quality(cfg, prompts, tok, point.pop("outputs"), scores)
        if rows is not None:
            point["quality"]["reference"] = reference_quality(rows, rule, sampling)
        for sample in point["samples"]:
            sample["text"] = tok.decode(sample.pop("tokens"), skip_special_tokens=True)[:400]
    results = points[0] if not cfg.sweep else {"points": points}
    if rows is not None:
        results["reference_ends"] = {arm: reference_quality(rows, arm, sampling) for arm in ("target", "drafter")}
    results["config"] = {**asdict(cfg), "dtype": target.dtype_name, "drafter": description, "eos_token_ids": list(eos),
                         "num_prompts": len(ids), "prompt_ids": [p["id"] for p in prompts], "target_identity": target.identity.as_dict()}
    results["machine"] = machine = {"cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                                    "load_average": [load_before, load_average()], "others_cpu_share": share.others}
    if share.others is not None:  # what other processes took while the arms were timed
        shared = share.others > OTHERS_LIMIT
        why = f"other processes took {share.others:.0%} of the machine's CPU time while the arms were timed"
    else:  # no kernel counters: the load average, a minute behind, is all there is
        busy = max((x for x in machine["load_average"] if x is not None), default=0.0)
        shared = busy > machine["threads"] + 1
        why = f"the 1-minute load average reached {busy:.1f} with {machine['threads']} threads of ours"
    for point in points:
        point["speed"]["valid"] = not shared
    if shared:
        machine["not_valid_because"] = why
        console.print(f"[yellow]warning:[/] {why}: other work shared the CPU, so tokens/s and speedup are not "
                      "this machine's")
    return results


def text_quality(cfg: EvalConfig, prompts: list[dict[str, Any]], tokenizer: Any,
                 outputs: dict[str, list[list[int]]], scores: dict | None = None) -> dict[str, Any]:
    """Quality of the generated text, the method's and the target alone's (the same process, first repeat):
    ROUGE-L against held-out reference answers, HumanEval pass@1, and at temperature 0 the agreement
    with the target's own greedy text. `scores` keeps each (measure, texts) scored, across calls."""
    from draftsmith.eval.quality import agreement, humaneval_pass_at_1, rouge_l

    scores = {} if scores is None else scores

    def scored(measure: str, score: Callable[[list[str]], float], texts: list[str]) -> float:
        if (measure, tuple(texts)) not in scores:
            scores[measure, tuple(texts)] = score(texts)
        return scores[measure, tuple(texts)]

    texts = {arm: [tokenizer.decode(t, skip_special_tokens=True) for t in toks] for arm, toks in outputs.items()}
    out: dict[str, Any] = {}
    with_reference = [i for i, p in enumerate(prompts) if p.get("reference") and p.get("turn", "1") == "1"]
    if with_reference:
        refs = [prompts[i]["reference"] for i in with_reference]
        out["rouge_l"] = {arm: scored("rouge_l", lambda x: rouge_l(x, refs), [t[i] for i in with_reference])
                          for arm, t in texts.items()}
    code = [i for i, p in enumerate(prompts) if p.get("set", cfg.prompts) == "humaneval"]
    if code:
        task_ids = [prompts[i]["id"] for i in code]
        out["humaneval_pass_at_1"] = {arm: scored("pass_at_1", lambda x: humaneval_pass_at_1(task_ids, x),
                                                  [t[i] for i in code]) for arm, t in texts.items()}
    if cfg.temperature == 0:
        out["agreement"] = agreement(outputs["method"], outputs["autoregressive"])
    return out
