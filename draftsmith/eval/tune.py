"""`draftsmith tune`: choose a draft-length policy's settings on held-out prompts and write them into the export.

- specdec, disco: every (threshold, maximum length) of a grid decodes the held-out prompts (the
  validation split of the drafter's training chats, never a benchmark's), and the fastest by measured
  tokens/s is written into the stop head's section of the drafter's export (`tuned.greedy` or
  `tuned.sampling`), where `draftsmith eval --policy specdec|disco` finds it. With --tree the prompts
  are decoded in EAGLE-2 trees of that shape, the head deciding each round's depth (at most the
  tree's), and the threshold goes to `tuned.tree_greedy` or `tuned.tree_sampling`, where
  `eval --tree ... --policy specdec|disco` finds it.
- confidence: transformers' rule for its assisted generation's confidence threshold: on the drafted
  tokens of the labels' validation chats (score: the drafter's top probability; positive: the target
  accepts the greedy token), the threshold minimizing FPR + 3·FNR on the ROC curve, written where
  `eval --policy confidence` reads it when no --threshold is given. No decoding.
- dspark: DSpark's bound on Π c_i, decoded as specdec's and disco's thresholds are.
- The grid holds, beside the thresholds, the policy's never-stopping threshold at every length up to its
  most (`PolicyKind.static_at`): static draft lengths, so what is chosen never loses to the best static
  length on the tuning prompts; where the costs leave nothing to adapt, that length is what is filed.
- With --cost_profile NAME[,NAME...] the grid is decoded as above, and the setting chosen is the fastest by
  the speedup modelled under each profile (`eval/profile.py`: the rounds counted, priced by the profile)
  rather than by tokens/s timed here: the threshold for the machine the drafter will serve on. Each
  profile's choice is filed under `greedy@NAME` (and so on), with the profile; the first profile's is also
  the plain `greedy` that eval decodes with.

Which policy is tuned which way is its registry entry's `tune` (`runtime.policies.POLICY_KINDS`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from draftsmith import DraftsmithError
from draftsmith.options import DraftOptions, SamplingOptions, TargetOptions
from draftsmith.data.conversations import VAL_FRACTION

if TYPE_CHECKING:
    from draftsmith.eval.evaluate import DecodeOptions

ROC_FNR_COST = 3.0  # transformers' assisted generation weighs a missed acceptance 3x a false one


@dataclass(kw_only=True)
class TuneConfig(TargetOptions, SamplingOptions, DraftOptions):
    """Options of `draftsmith tune` (the target's, the sampling options' and these).

    Args:
        drafter: the drafter's native export; specdec and disco read (and get) their stop head there.
        policy: specdec, disco, dspark (a DSpark drafter's confidence head), or confidence (transformers'
            ROC rule on --labels, no decoding).
        thresholds: the thresholds tried (specdec's h, disco's τ, dspark's bound on Π c_i); default 0.2 to
            0.99 for specdec, 0.2 to 0.9 by 0.1 for disco, 0.05 to 0.8 for dspark.
        ks: the maximum draft lengths tried (disco's SL_max); default [8] for specdec and dspark (a block
            drafts at most its own length), [4, 6, 8] for disco; with --tree, the tree's depth.
        tree: tune for EAGLE-2 tree rounds of this shape, DEPTH,TOPK,TOKENS (feature drafters), as
            `eval --tree` drafts them; omit for chains.
        labels: the label directory (confidence: its validation chats give the ROC curve).
        label_val_fraction: the labels' validation share (as the head recipe's data.val_fraction).
        data: the chats whose validation split gives the held-out prompts (the drafter's training data).
        val_fraction: that data's validation share (as the drafter recipe's data.val_fraction, and as
            `eval --val_fraction`).
        data_limit: the number of conversations the drafter's training split was drawn from.
        limit: held-out prompts decoded per setting.
        temperature: 0 tunes greedy decoding (written as `greedy`); > 0 sampling (written as `sampling`),
            with top_k / top_p.
        repeats: timed passes per setting (median); the settings alternate within a pass.
        cost_profile: choose by the speedup modelled under these cost profiles (comma-separated: a shipped
            one such as h100-llama8b, a profile file, or measured: this machine's, timed) in place of tokens/s
            timed here, one choice per profile; the first's is the one eval decodes with.
    """

    drafter: str
    policy: str = "specdec"
    thresholds: list[float] | None = None
    ks: list[int] | None = None
    tree: str | None = None
    labels: str | None = None
    label_val_fraction: float = 0.1
    data: str = "sharegpt"
    val_fraction: float = VAL_FRACTION
    data_limit: int | None = None
    limit: int = 8
    repeats: int = 2
    cost_profile: str | None = None

    def __post_init__(self) -> None:
        from draftsmith.runtime.policies import POLICY_KINDS

        tunable = [k.name for k in POLICY_KINDS.values() if k.tune is not None]
        if self.policy not in tunable:
            raise DraftsmithError(f"--policy must be one of {', '.join(tunable)} (the policies tune chooses settings "
                                  f"for), got {self.policy!r}")
        by_labels = self.kind().tune == "labels"
        if by_labels and self.labels is None:
            raise DraftsmithError(f"--policy {self.policy} tunes on labelled drafts: give --labels (`draftsmith labels`)")
        if any(not 0 <= t <= 1 for t in self.thresholds or []) or any(k < 1 for k in self.ks or []):
            raise DraftsmithError("--thresholds must lie in [0, 1] and --ks be >= 1")
        if self.repeats < 1 or self.limit < 1:
            raise DraftsmithError("--repeats and --limit must be >= 1")
        if self.tree is not None and by_labels:
            raise DraftsmithError(f"--policy {self.policy} is tuned on labels, not by decoding: drop --tree")
        if self.cost_profile is not None:
            from draftsmith.eval.profile import profile_names

            if by_labels or not profile_names(self.cost_profile):
                raise DraftsmithError("--cost_profile: profiles for a policy tuned by decoding")
        if self.tree is not None:
            from draftsmith.runtime.policies import check_tree_policy

            check_tree_policy(self.kind())
        self.tree_shape()  # a malformed --tree stops here

    def kind(self) -> Any:
        """The policy's registry entry (`runtime.policies.PolicyKind`)."""
        from draftsmith.runtime.policies import policy_kind

        return policy_kind(self.policy)

    def tree_shape(self) -> Any:
        from draftsmith.runtime.tree import TreeShape

        return TreeShape.parse(self.tree)

    def grid(self) -> list[tuple[float, int]]:
        """(threshold, maximum length) pairs tried."""
        kind = self.kind()
        thresholds = self.thresholds or list(kind.grid)
        if self.tree is not None:  # a tree round drafts at most its depth
            ks = [self.tree_shape().depth]
            points = [(t, ks[0]) for t in thresholds]
        else:
            ks = self.ks or list(kind.ks)
            points = [(t, k) for k in ks for t in thresholds]
        static = [(kind.static_at, k) for k in range(1, max(ks) + 1)] if kind.static_at is not None else []
        return points + [p for p in static if p not in points]


def roc_threshold(scores: Any, accepted: Any, fnr_cost: float = ROC_FNR_COST) -> tuple[float, dict[str, float]]:
    """transformers' confidence threshold: the ROC point minimizing FPR + fnr_cost·FNR (positives: accepted)."""
    import torch
    from torchmetrics.functional.classification import binary_roc

    fpr, tpr, thresholds = binary_roc(scores.float(), accepted.long())
    cost = fpr + fnr_cost * (1 - tpr)
    i = int(cost.argmin())
    return float(thresholds[i].clamp(0, 1)), {"fpr": float(fpr[i]), "fnr": float(1 - tpr[i]), "cost": float(cost[i]),
                                              "rows": len(scores), "accepted": float(torch.as_tensor(accepted).float().mean())}


def tune(cfg: TuneConfig, console: Any = None) -> dict[str, Any]:
    """Tune cfg.policy for cfg.drafter and write the result into its export; returns what was written."""
    from draftsmith.models.loading import update_stop_heads

    if cfg.kind().tune == "labels":
        import torch

        from draftsmith.data.conversations import split_of
        from draftsmith.data.labels import read_labels

        _, rows, ids, chat_of = read_labels(cfg.labels)
        val = torch.tensor([split_of(i, cfg.label_val_fraction) == "val" for i in ids], dtype=torch.bool)[chat_of]
        threshold, at = roc_threshold(rows["top_probs"][val, 0], rows["hard"][val])
        chosen = {"threshold": threshold, "rule": f"ROC: minimum FPR + {ROC_FNR_COST:g}·FNR", **at, "labels": cfg.labels}
        update_stop_heads(cfg.drafter, cfg.policy, {"tuned": {"greedy": chosen}})
        return chosen
    return _tune_by_speed(cfg, console)


def _tune_by_speed(cfg: TuneConfig, console: Any) -> dict[str, Any]:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from draftsmith.eval.acceptance import acceptance_stats, decode_all
    from draftsmith.eval.profile import profile_names
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.models.loading import tuned_key, update_stop_heads
    from draftsmith.runtime.loading import export_kind, load_proposer, load_stop_head
    from draftsmith.models.target import load_target
    from draftsmith.runtime.runner import TargetRunner
    from draftsmith.runtime.policies import PolicySettings, check_tree_policy
    from draftsmith.runtime.proposers import levels_asked
    from draftsmith.runtime.sampling import SamplingConfig
    from draftsmith.progress import Bars

    console = console or Console(stderr=True)
    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    proposer, _ = load_proposer(cfg.drafter, target, cfg.head_vocab)
    if cfg.tree is not None:
        check_tree_policy(cfg.kind(), levels_asked(proposer))
    head, section = load_stop_head(cfg.drafter, cfg.kind(), target, proposer)
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    prompts = load_prompts("heldout", cfg.limit, "first", cfg.data, cfg.val_fraction, cfg.data_limit)
    ids = [target.encode_chat([{"role": "user", "content": p["turns"][0]}]) for p in prompts]
    sampling = SamplingConfig(cfg.temperature, cfg.top_k, cfg.top_p)
    eos = target.eos_token_ids
    tree = cfg.tree_shape()

    grid = cfg.grid()

    def policy_for(point: tuple[float, int]):
        return cfg.kind().build(PolicySettings(k=point[1], threshold=point[0], tree=tree is not None, head=head))

    decode_all(runner, proposer, ids[:1], 16, policy_for(grid[0]), sampling, eos, cfg.seed, tree=tree)  # warm-up
    rates: dict[tuple[float, int], list[float]] = {p: [] for p in grid}
    taus: dict[tuple[float, int], float] = {}
    decoded: dict[tuple[float, int], list[Any]] = {p: [] for p in grid}  # every pass's generations
    with Bars(TextColumn("[bold]tune {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task(cfg.policy, total=len(grid) * cfg.repeats)
        for r in range(cfg.repeats):
            for point in grid:
                results = decode_all(runner, proposer, ids, cfg.max_new_tokens, policy_for(point), sampling, eos,
                                     cfg.seed + r, tree=tree)
                rates[point].append(sum(len(x.tokens) for x in results) / sum(x.seconds for x in results))
                taus[point] = acceptance_stats(results)["tau"]
                decoded[point] += results
                progress.advance(task)
    speed = {p: statistics.median(v) for p, v in rates.items()}
    mode = tuned_key(cfg.temperature == 0, tree is not None)
    common = {"prompts": {"set": "heldout", "data": cfg.data, "count": len(ids), "ids": [p["id"] for p in prompts],
                          "max_new_tokens": cfg.max_new_tokens}, "temperature": cfg.temperature,
              "dtype": target.dtype_name, "threads": torch.get_num_threads(), **({"tree": cfg.tree} if tree is not None else {})}

    def chosen(modelled: dict[tuple[float, int], dict[str, Any]]) -> dict[str, Any]:
        best = max(grid, key=lambda p: (modelled[p]["speedup"] if modelled else speed[p], -p[1]))  # ties: shorter
        return {"threshold": best[0], "k": best[1], "tokens_per_second": round(speed[best], 2),
                "static": best[0] == cfg.kind().static_at,
                **({"cost_profile": modelled[best]["profile"], "modelled_speedup": round(modelled[best]["speedup"], 3)}
                   if modelled else {}),
                "grid": [{"threshold": t, "k": k, "tokens_per_second": round(speed[t, k], 2), "tau": round(taus[t, k], 3),
                          **({"modelled_speedup": round(modelled[t, k]["speedup"], 3)} if modelled else {})}
                         for t, k in grid], **common}

    tuned = section.setdefault("tuned", {})
    if cfg.cost_profile:
        names = profile_names(cfg.cost_profile)
        by_profile = modelled_by_point(names, runner, decoded, export_kind(cfg.drafter))
        for name in names:
            tuned[f"{mode}@{name}"] = chosen(by_profile[name])
        tuned[mode] = tuned[f"{mode}@{names[0]}"]
    else:
        tuned[mode] = chosen({})
    update_stop_heads(cfg.drafter, cfg.policy, section)
    return tuned[mode]


def modelled_by_point(names: list[str], runner: Any, decoded: dict[tuple[float, int], list[Any]],
                      kind: str | None) -> dict[str, dict[tuple[float, int], dict[str, Any]]]:
    """Profile → each grid point's speedup modelled under it (`eval/profile.modelled_speedup`); a measured
    profile is timed once, on every point's rounds together."""
    from draftsmith.eval.machine import cpu_name
    from draftsmith.eval.profile import modelled_speedup, profile_for

    out = {}
    for name in names:
        profile = profile_for(name, runner, [g for gens in decoded.values() for g in gens], kind, cpu_name())
        try:
            out[name] = {p: {**modelled_speedup(profile, gens, kind), "profile": profile.as_dict()}
                         for p, gens in decoded.items()}
        except DraftsmithError as e:
            raise DraftsmithError(f"--cost_profile {name}: {e}") from None
    return out


def decoded_choice(cfg: DecodeOptions, section: dict[str, Any]) -> dict[str, Any] | None:
    """The choice `draftsmith tune` filed in `section` that the policy decodes with (`tuned_choice`), or None
    where the command gives the threshold or the policy is not one tune chooses for."""
    from draftsmith.models.loading import tuned_choice
    from draftsmith.runtime.policies import policy_kind

    kind = policy_kind(cfg.policy)
    given = cfg.stop_threshold if kind.head else cfg.threshold
    return tuned_choice(section, cfg.temperature == 0, tree=cfg.tree is not None) if kind.tuned and given is None else None


def tuned_length_note(cfg: DecodeOptions, section: dict[str, Any]) -> str | None:
    """What to say when the policy decodes with a setting `tune` chose on answers of another length (half or
    twice --max_new_tokens or further): the best draft length grows with the answer's (dynamic_length.py)."""
    tuned_at = (decoded_choice(cfg, section) or {}).get("prompts", {}).get("max_new_tokens")
    if not tuned_at or tuned_at / 2 < cfg.max_new_tokens < tuned_at * 2:
        return None
    return (f"--policy {cfg.policy} decodes with what tune chose on {tuned_at}-token answers, this run {cfg.max_new_tokens}: "
            f"the best draft length changes with the answer's; `draftsmith tune --max_new_tokens {cfg.max_new_tokens}` "
            "chooses for this length")
