import json

import pytest

from draftsmith.eval.acceptance import acceptance_stats
from draftsmith.eval.prompts import load_prompts
from draftsmith.runtime.generate import GenerationResult, RoundStats
from tests.conftest import run_cli


def test_prompt_sets():
    mt = load_prompts("mtbench")
    assert len(mt) == 80 and len({p["category"] for p in mt}) == 8
    assert len(load_prompts("mtbench", turns="both")[0]["turns"]) == 2
    few = load_prompts("mtbench", limit=16)
    assert len(few) == 16 and len({p["category"] for p in few}) == 8  # spread over categories
    assert len(load_prompts("humaneval")) == 164


def test_acceptance_statistics_by_hand():
    rounds = [RoundStats(3, 3, 4, 3, 1, 3, 0.1), RoundStats(3, 1, 2, 3, 1, 3, 0.1), RoundStats(3, 0, 1, 3, 1, 3, 0.1)]
    stats = acceptance_stats([GenerationResult(tokens=[0] * 8, prompt_length=2, rounds=rounds)])
    assert stats["tau"] == pytest.approx((4 + 2 + 1) / 3) and stats["mean_accepted"] == pytest.approx(4 / 3)
    # position 0 reached 3 times, accepted twice; position 1 reached twice, accepted once; position 2 reached once
    assert stats["alpha"] == [pytest.approx(2 / 3), 0.5, 1.0]
    assert stats["histogram"] == {"0": 1, "1": 1, "3": 1} and stats["drafted_rejected"] == 5
    assert stats["target_forwards_per_token"] == pytest.approx(4 / 8)


def test_rounds_are_placed_at_the_context_position_they_drafted_at():
    from draftsmith.eval.breakdown import by_position, position_bucket, round_positions

    # a 510-token prompt, the prefill's token, then rounds committing 4, 2 and 1: drafted at 511, 515 and 517
    rounds = [RoundStats(3, 3, 4, 3, 1, 3, 0.1), RoundStats(3, 1, 2, 3, 1, 3, 0.1), RoundStats(3, 0, 1, 3, 1, 3, 0.1)]
    result = GenerationResult(tokens=[0] * 8, prompt_length=510, rounds=rounds)
    assert round_positions(result) == [511, 515, 517]
    assert [position_bucket(n) for n in (0, 511, 512, 1024, 3000, 8191, 8192, 200_000)] == \
        ["<512", "<512", "512–1k", "1k–2k", "2k–4k", "4k–8k", "8k–16k", "≥128k"]
    buckets = by_position([result, GenerationResult(tokens=[0] * 7, prompt_length=10, rounds=rounds[:2])])
    assert list(buckets) == ["<512", "512–1k"] and buckets["<512"]["rounds"] == 3 and buckets["512–1k"]["rounds"] == 2
    assert buckets["512–1k"]["tau"] == pytest.approx(1.5) and buckets["<512"]["accepted"] == 7
    # beside the target alone (one token a round, 0.05 s each, in both buckets), each bucket's decoding speedup
    alone = [GenerationResult(tokens=[0] * 9, prompt_length=510, rounds=[RoundStats(0, 0, 1, 0, 1, 0, 0.05)] * 8)]
    buckets = by_position([result], alone)
    assert buckets["<512"]["speedup"] == pytest.approx((4 / 0.1) / (1 / 0.05))  # 511: 4 tokens in 0.1 s
    assert buckets["512–1k"]["speedup"] == pytest.approx((3 / 0.2) / (1 / 0.05))


def test_long_prompts_reach_their_length_in_the_template(tiny_features):
    from draftsmith.eval.prompts import conversations, load_prompts
    from draftsmith.models.target import encode_chat
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()
    encode = lambda messages: encode_chat(tok, messages)  # noqa: E731
    prompts = load_prompts("long", data=str(tiny_features / "chats.json"), val_fraction=0.3, encode=encode, window=1024)
    assert {p["category"] for p in prompts} == {"1k"} and len({p["history"][0]["content"] for p in prompts}) > 1
    entries, chats = conversations(prompts, "both", answer=lambda conv: "unused")
    lengths = [len(encode(c)) for c in chats]
    assert all(512 < n <= 1024 - 256 for n in lengths), lengths  # deep into the window, room left for an answer
    assert {e["turn"] for e in entries} == {"3+"} and all(c[-1]["role"] == "user" for c in chats)
    with pytest.raises(Exception, match="needs the target"):
        load_prompts("long")


def test_breakdowns_partition_the_rounds(eagle3_ckpt, tiny_features, tmp_path):
    """Several prompt sets at once, both MT-bench turns and the long set: each breakdown (set, category, turn,
    context position) sums to the run's own rounds and accepted tokens, and the table and plot show them."""
    result, results = export_and_eval(eagle3_ckpt, tiny_features, tmp_path, "--limit", "2", "--repeats", "1",
                                      "--policy", "static", "--k", "2", "--prompts", "mtbench,humaneval,long",
                                      "--turns", "both", "--data", str(tiny_features / "chats.json"),
                                      "--val_fraction", "0.3")
    acc = results["acceptance"]
    assert list(results["per_set"]) == ["mtbench", "humaneval", "long"]
    assert set(results["per_turn"]) == {"1", "2", "3+"} and results["per_set"]["mtbench"]["prompts"] == 4
    assert all(g["speedup"] > 0 for g in results["per_position"].values())  # both arms decode every bucket
    for key in ("per_set", "per_category", "per_turn", "per_position"):
        groups = results[key].values()
        assert sum(g["rounds"] for g in groups) == acc["rounds"], key
        assert sum(g["accepted"] for g in groups) == acc["accepted"], key
    assert len(results["per_position"]) >= 2 and "humaneval_pass_at_1" in results["quality"]
    text = " ".join(result.stdout.split())
    assert "where τ is lost" in text and "context position" in text
    assert (tmp_path / "eval" / "by_context_position.png").is_file()
    bad = run_cli("eval", "--target", str(tiny_features / "target"), "--prompts", "mtbench,nope", "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and "give one or more of mtbench, humaneval, heldout, long" in bad.stderr


def export_and_eval(ckpt, features, out, *args):
    """Export `ckpt` natively, run `draftsmith eval` greedy in fp32; (process result, results.json)."""
    assert run_cli("export", str(ckpt), "--format", "native", "--out", str(out / "d")).returncode == 0
    result = run_cli("eval", "--target", str(features / "target"), "--drafter", str(out / "d"),
                     "--max_new_tokens", "12", "--dtype", "float32", "--out", str(out / "eval"), *args)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "eval" / "results.json").read_text())
    assert results["identical_outputs"] is True  # greedy, fp32: the drafter never changes the output
    return result, results


def test_outputs_that_leave_the_targets_text_are_flagged(eagle3_ckpt, tiny_features, tmp_path):
    """Greedy exact decoding repeats the target's text; where rounding (bf16) makes it leave it, the table says
    so with the measured agreement instead of printing a τ as if nothing happened."""
    from rich.console import Console

    from draftsmith.eval.report import table

    _, results = export_and_eval(eagle3_ckpt, tiny_features, tmp_path, "--limit", "2", "--repeats", "1",
                                 "--policy", "static", "--k", "2", "--dtype", "float32")
    assert results["quality"]["agreement"] == 1.0 and results["identical_outputs"]
    too_short = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"),
                        "--max_prompt_length", "3", "--out", str(tmp_path / "none"))
    assert too_short.returncode == 2, too_short.stderr[-2000:]
    assert "none of the 80 mtbench prompts is at most --max_prompt_length 3 tokens long" in too_short.stderr
    for agreement, flagged in ((1.0, False), (0.82, True)):
        results["quality"]["agreement"] = agreement
        console = Console(record=True, width=400)
        console.print(table(results))
        text = " ".join(console.export_text().split())
        assert ("OUTPUTS DIFFER from the target's greedy text (agreement 82%)" in text) == flagged


def test_eval_end_to_end(eagle3_ckpt, tiny_features, tmp_path):
    result, results = export_and_eval(eagle3_ckpt, tiny_features, tmp_path, "--limit", "4", "--repeats", "2",
                                      "--policy", "static", "--k", "3")
    acc = results["acceptance"]
    assert 1.0 <= acc["tau"] <= 4.0 and len(acc["alpha"]) == 3 and acc["tokens"] > 0
    assert results["speed"]["repeats"] == 2 and results["speed"]["speedup"] > 0
    assert set(results["per_category"]) and (tmp_path / "eval" / "alpha_by_position.png").is_file()
    assert (tmp_path / "eval" / "by_category.png").is_file() and "speedup" in result.stdout
    assert 0.0 < acc["draft_vocab_coverage"] <= 1.0 and "inside the draft vocabulary" in " ".join(result.stdout.split())


def test_eval_with_tree_drafts(eagle3_ckpt, tiny_features, tmp_path):
    result, results = export_and_eval(eagle3_ckpt, tiny_features, tmp_path, "--limit", "2", "--repeats", "1",
                                      "--tree", "3,2,5", "--lookup", "4")
    assert results["config"]["tree"] == "3,2,5" and results["config"]["lookup"] == 4
    acc = results["acceptance"]
    # sized by measured cost, a round on a busy machine may draft nothing: no lower bound on the size
    assert 1.0 <= acc["tau"] <= 5.0 and len(acc["alpha"]) <= 4 and 0 <= acc["mean_tree_size"] <= 5 + 4
    assert "tree sized by cost within 3,2,5 + prompt lookup 4" in " ".join(result.stdout.split())  # --policy cost: the default
    bad = run_cli("eval", "--target", str(tiny_features / "target"), "--tree", "5x8", "--out", str(tmp_path / "e2"))
    assert bad.returncode == 2 and "DEPTH,TOPK,TOKENS" in bad.stderr
    bad = run_cli("eval", "--target", str(tiny_features / "target"), "--lookup", "4", "--out", str(tmp_path / "e3"))
    assert bad.returncode == 2 and "--tree" in bad.stderr


def test_a_busy_core_is_counted_as_other_work_while_the_arms_are_timed():
    """A process spinning a core for the whole of a short run: the load average, a minute behind, stays under
    the core count; the kernel's counters see it at once."""
    import subprocess
    import sys
    import time

    from draftsmith.eval.machine import OTHERS_LIMIT, CpuShare, cpu_times

    if cpu_times() is None:
        pytest.skip("no /proc: the load average is all there is")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with CpuShare() as share:
            time.sleep(1.5)
    finally:  # reaped after the window: a waited-for child's time would count as ours
        spinner.kill()
        spinner.wait()
    assert share.others is not None and share.others > OTHERS_LIMIT, share.others


def test_eval_marks_a_speed_timed_beside_other_work_not_valid(tiny_features, tmp_path, monkeypatch):
    import io
    import os

    from rich.console import Console

    from draftsmith.eval import machine
    from draftsmith.eval.evaluate import EvalConfig, evaluate
    from draftsmith.eval.report import plots, table

    cfg = EvalConfig(target=str(tiny_features / "target"), drafter=None, limit=1, max_new_tokens=4, repeats=1,
                     dtype="float32", out=str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 0.0, 0.0))  # the load average would call both quiet
    for others, warned in ((0.0, False), (1e6, True)):
        readings = iter([(0.0, 0.0, 2), (others + 5.0, 5.0, 2)])  # (machine busy s, ours s, CPUs) at start, end
        monkeypatch.setattr(machine, "cpu_times", lambda: next(readings))
        printed = io.StringIO()
        results = evaluate(cfg, Console(file=printed, width=300))
        assert results["machine"]["others_cpu_share"] == (1.0 if warned else 0.0)
        assert results["machine"]["cpus"] == os.cpu_count()
        assert ("other work shared the CPU" in printed.getvalue()) == warned
        assert results["speed"]["valid"] is not warned
        shown = Console(record=True, width=400)
        shown.print(table(results))
        text = " ".join(shown.export_text().split())
        assert ("SPEEDUP NOT VALID: other processes took 100%" in text and ") not valid" in text) == warned
        if warned:  # no speedup bars for a run whose speed is not this machine's
            pytest.importorskip("matplotlib")
            import matplotlib.axes

            drawn = []
            monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda ax, *a, **k: drawn.append(ax.get_title()))
            plots(results, tmp_path / "plots")
            assert len(drawn) == 2  # α by position and τ by category; not the speedups


def test_draft_vocab_coverage_counts_generated_tokens_the_drafter_can_propose():
    import torch

    from draftsmith.eval.acceptance import draft_vocab_coverage

    results = [GenerationResult(tokens=[1, 2, 3, 9], prompt_length=2), GenerationResult(tokens=[2, 2, 7, 50], prompt_length=2)]
    assert draft_vocab_coverage(results, torch.tensor([2, 3, 7])) == 5 / 8
    assert draft_vocab_coverage(results, None) is None


def test_decoding_draws_its_random_numbers_on_the_targets_device(monkeypatch):
    """torch refuses a CPU generator for a GPU tensor's draws (sampling, the acceptance test), so eval's
    seeded generator is made on the device the runner decodes on. A stand-in runner "on a GPU" and a
    recording generator show which device it is asked for, on a CPU-only build."""
    from types import SimpleNamespace

    import torch

    from draftsmith.eval import acceptance
    from draftsmith.runtime import sampling

    asked, passed = [], []

    class Recording:
        def __init__(self, device="cpu"):
            asked.append(torch.device(device))

        def manual_seed(self, seed):
            return self

    monkeypatch.setattr(sampling.torch, "Generator", Recording)
    monkeypatch.setattr(acceptance, "generate", lambda *a, generator=None, **k: passed.append(generator))
    runner = SimpleNamespace(device=torch.device("cuda", 1))
    acceptance.decode_all(runner, None, [[1, 2], [3]], 4, lambda ids: None, sampling.SamplingConfig(1.0), (), seed=7)
    assert asked == [torch.device("cuda", 1)]
    assert len(passed) == 2 and all(isinstance(g, Recording) for g in passed)  # one generator for the whole run
