"""Cost profiles: what a decoding round costs on a machine, in one-token target steps, and the speedup the
rounds a decode counted would have there (`--cost_profile`).

A profile gives verification as a function of the rows one target forward verifies (the pending token
and a chain's drafted tokens, or a tree's nodes), 1 row being one step, and drafting as the steps one
drafter forward costs, by drafter kind. A decode counts, per round, the rows it verified and the drafter
forwards it ran (`RoundStats`); under a profile its rounds cost Σ verify(rows) + forwards · draft(kind)
steps against one step a token for the target alone, a prompt's prefill the same on both sides
(verify(P) steps: prompts are short against the window, so the table's last slope carries it).

`measured` is this machine's own profile, timed by the run that asks for it (`measure_profile`): the
target's forwards over a grid of rows, and the drafting seconds the run's rounds spent per drafter forward.
draftsmith ships the profiles of `profiles/*.json` (each says what it measured and on which machine);
a user's own is a JSON file of the same fields.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from draftsmith import DraftsmithError
from draftsmith.options import DraftOptions, TargetOptions

SHIPPED = Path(__file__).parent / "profiles"
MEASURED = "measured"
VERIFY_GRID = (1, 2, 4, 8, 16, 32, 64)  # rows the measured profile times


@dataclass(frozen=True)
class CostProfile:
    """What a round costs on one machine, in one-token target steps.

    name: what `--cost_profile` calls it; machine: where it was measured; source: how (the command, or the
    figures it was written from); verify: (rows, steps) pairs, rows ascending from (1, 1.0), linear between
    them and along the last two's slope beyond; draft: drafter kind → steps one drafter forward costs;
    step_ms: one target step, where known (modelled tokens per second)."""

    name: str
    machine: str
    source: str
    verify: tuple[tuple[int, float], ...]
    draft: dict[str, float] = field(default_factory=dict)
    step_ms: float | None = None

    def __post_init__(self) -> None:
        rows = [r for r, _ in self.verify]
        if not self.verify or tuple(self.verify[0]) != (1, 1.0) or rows != sorted(set(rows)):
            raise DraftsmithError(f"cost profile {self.name}: verify must start at [1, 1.0] (one row is one target "
                                  f"step) and list each row count once, ascending; got {list(self.verify)}")
        if any(s <= 0 for _, s in self.verify) or any(c < 0 for c in self.draft.values()):
            raise DraftsmithError(f"cost profile {self.name}: costs must be positive")

    def verify_steps(self, rows: int) -> float:
        """Steps of one target forward over `rows` rows."""
        table = self.verify
        if len(table) == 1:
            return table[0][1] * rows
        for (r0, s0), (r1, s1) in zip(table, table[1:]):
            if rows <= r1 or (r1, s1) == table[-1]:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        raise AssertionError("unreachable")

    def round_steps(self, rows: int, forwards: int, kind: str) -> float:
        if forwards and kind not in self.draft:
            raise DraftsmithError(f"cost profile {self.name} has no drafting cost for a {kind} drafter "
                                  f"(it has {', '.join(self.draft) or 'none'})")
        return self.verify_steps(rows) + forwards * self.draft.get(kind, 0.0)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verify": [list(p) for p in self.verify]}


def read_profile(path: Path, name: str | None = None) -> CostProfile:
    try:
        raw = json.loads(Path(path).read_text())
        return CostProfile(name=name or raw.get("name") or Path(path).stem, machine=raw["machine"], source=raw["source"],
                           verify=tuple((int(r), float(s)) for r, s in raw["verify"]),
                           draft={k: float(v) for k, v in raw.get("draft", {}).items()}, step_ms=raw.get("step_ms"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DraftsmithError(f"cost profile {path}: not a profile file ({type(e).__name__}: {e}); it holds machine, "
                              "source, verify [[rows, steps], ...] from [1, 1.0], and draft {kind: steps}") from None


def write_profile(profile: CostProfile, path: Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profile.as_dict(), indent=1) + "\n")


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def profile_names(spec: str | None) -> list[str]:
    """The profiles `--cost_profile` names (comma-separated): measured, a shipped name or a file."""
    names = [n.strip() for n in (spec or "").split(",") if n.strip()]
    for n in names:
        if n != MEASURED and n not in shipped_profiles() and not Path(n).is_file():
            raise DraftsmithError(f"--cost_profile {n}: not {MEASURED}, a profile draftsmith ships "
                                  f"({', '.join(shipped_profiles())}) or a profile file")
    return names


def load_profile(name: str) -> CostProfile:
    """A shipped profile by name, or a profile file."""
    if name in shipped_profiles():
        return read_profile(SHIPPED / f"{name}.json", name)
    return read_profile(Path(name))


def measure_profile(verify_seconds: Any, rounds: Iterable[Any], kind: str | None, most_rows: int,
                    machine: str, repeats: int = 9, step_seconds: float | None = None) -> CostProfile:
    """This machine's profile: `verify_seconds(n)` (seconds of one target forward over the root and n more rows)
    timed at each grid row count up to `most_rows` (and at it), the counts taken in turn `repeats` times so a
    drifting clock moves them alike, as medians over one row's; drafting from `rounds` (`RoundStats`:
    draft_seconds over drafter_forwards), for `kind`, over one step: `step_seconds` where the caller timed
    the target alone's steps in its own run (a steadier figure than a few forwards), else one row's median."""
    grid = sorted({r for r in VERIFY_GRID if r <= most_rows} | {1, max(1, most_rows)})
    times: dict[int, list[float]] = {r: [] for r in grid}
    for _ in range(repeats):
        for r in grid:
            times[r].append(verify_seconds(r - 1))
    seconds = {r: statistics.median(v) for r, v in times.items()}
    step = step_seconds or seconds[1]
    rounds = list(rounds)
    forwards = sum(r.drafter_forwards for r in rounds)
    draft = {kind: sum(r.draft_seconds for r in rounds) / forwards / step} if kind and forwards else {}
    return CostProfile(name=MEASURED, machine=machine, source="timed by this run: target forwards over a grid of "
                       "rows (over one row's), the target alone's steps, and its rounds' drafting seconds a drafter "
                       "forward", verify=tuple((r, 1.0 if r == 1 else seconds[r] / seconds[1]) for r in grid),
                       draft=draft, step_ms=step * 1000)


def modelled_speedup(profile: CostProfile, generations: Iterable[Any], kind: str | None) -> dict[str, Any]:
    """The speedup `generations` (GenerationResults) would have under `profile`: the target alone's steps
    (its prefill, then one a token) over the rounds' (the same prefill, then each round's verify(rows) and
    drafter forwards). With the profile's step_ms, modelled tokens per second too."""
    alone = drafted = 0.0
    tokens = 0
    for g in generations:
        prefill = profile.verify_steps(g.prompt_length)
        tokens += len(g.tokens)
        alone += prefill + len(g.tokens) - 1
        drafted += prefill + sum(profile.round_steps(r.drafted + 1, r.drafter_forwards, kind or "") for r in g.rounds)
    out: dict[str, Any] = {"speedup": alone / drafted if drafted else None, "machine": profile.machine,
                           "steps_per_token": drafted / tokens if tokens else None}
    if profile.step_ms:
        out["tokens_per_second"] = tokens / (drafted * profile.step_ms / 1000) if drafted else None
    return out


def profile_for(name: str, runner: Any, generations: list[Any], kind: str | None, machine: str,
                alone: list[Any] = ()) -> CostProfile:
    """The profile `name` (`profile_names`) for a run: `measured` is timed here on `runner`, at the context the
    run's last generation ended with, its drafting from `generations`' rounds and its step the mean round of
    `alone` (the target alone's generations of the same run) where given; any other is loaded."""
    if name != MEASURED:
        return load_profile(name)
    from draftsmith.runtime.generate import verify_seconds

    rounds = [r for g in generations for r in g.rounds]
    steps = [r for g in alone for r in g.rounds]
    most = max((r.drafted + 1 for r in rounds), default=1)
    root = generations[-1].tokens[-1]
    return measure_profile(lambda n: verify_seconds(runner, root, n), rounds, kind, most, machine,
                           step_seconds=sum(r.seconds for r in steps) / len(steps) if steps else None)


def modelled_speedups(names: list[str], runner: Any, generations: list[Any], kind: str | None,
                      machine: str, alone: list[Any] = ()) -> dict[str, dict[str, Any]]:
    """`modelled_speedup` of a run's drafting arm under each profile named (`profile_for`). A profile without
    the drafter's kind gives no speedup, and says why."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        profile = profile_for(name, runner, generations, kind, machine, alone)
        try:
            out[name] = {**modelled_speedup(profile, generations, kind), "profile": profile.as_dict()}
        except DraftsmithError as e:
            out[name] = {"speedup": None, "why": str(e), "profile": profile.as_dict()}
    return out


@dataclass(kw_only=True)
class ProfileConfig(TargetOptions, DraftOptions):
    """Options of `draftsmith profile` (the target's and these).

    Args:
        drafter: the native export whose forwards are timed (omit: verification only).
        prompts: the prompt set decoded to time the drafter's forwards (mtbench, humaneval).
        limit: prompts decoded.
        max_new_tokens: tokens generated per prompt.
        k: the static chain each round drafts.
        out: the profile file written (JSON: `--cost_profile FILE` reads it).
    """

    drafter: str | None = None
    prompts: str = "mtbench"
    limit: int = 4
    max_new_tokens: int = 64
    k: int = 4
    out: str = "runs/profile.json"

    def __post_init__(self) -> None:
        if self.limit < 1 or self.max_new_tokens < 2 or self.k < 1:
            raise DraftsmithError("--limit and --k must be >= 1 and --max_new_tokens >= 2")


def run_profile(cfg: ProfileConfig) -> CostProfile:
    """Measure this machine's profile: the target verifying 1 to 64 rows, after a decode of the prompts with
    static chains of k whose rounds give the drafter's seconds a forward; written to cfg.out."""
    from draftsmith.eval.machine import cpu_name
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.models.target import load_target
    from draftsmith.runtime.generate import generate, verify_seconds
    from draftsmith.runtime.loading import export_kind, load_proposer
    from draftsmith.runtime.policies import Static
    from draftsmith.runtime.runner import TargetRunner

    target = load_target(cfg.target, dtype=cfg.dtype, device=cfg.device, trust_remote_code=cfg.trust_remote_code,
                         chat_template=cfg.chat_template, template_kwargs=cfg.template_kwargs)
    proposer, description = load_proposer(cfg.drafter, target, cfg.head_vocab)
    runner = TargetRunner(target.model, proposer.aux_layer_ids)
    prompts = [target.encode_chat([{"role": "user", "content": p["turns"][0]}])
               for p in load_prompts(cfg.prompts, cfg.limit)]
    generate(runner, proposer, prompts[0], 8, Static(cfg.k))  # warm-up
    generations = [generate(runner, proposer, x, cfg.max_new_tokens, Static(cfg.k), eos_token_ids=target.eos_token_ids)
                   for x in prompts]
    rounds = [r for g in generations for r in g.rounds]
    root = generations[-1].tokens[-1]
    profile = measure_profile(lambda n: verify_seconds(runner, root, n), rounds, export_kind(cfg.drafter),
                              max(VERIFY_GRID), f"{cpu_name()}, {target.dtype_name}")
    profile = replace(profile, name=Path(cfg.out).stem,
                      source=f"draftsmith profile: {target.identity.name} verifying 1 to {max(VERIFY_GRID)} rows after "
                             f"{len(prompts)} {cfg.prompts} prompts; {description}'s forwards over chains of {cfg.k}")
    write_profile(profile, Path(cfg.out))
    return profile
