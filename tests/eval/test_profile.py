"""Cost profiles (`eval/profile.py`): a round priced from the rows it verified and the drafter forwards it ran."""

import json

import pytest

from draftsmith import DraftsmithError
from draftsmith.eval.profile import (CostProfile, load_profile, measure_profile, modelled_speedup, profile_names,
                                     shipped_profiles)
from draftsmith.runtime.generate import GenerationResult, RoundStats
from tests.conftest import run_cli
from tests.eval.test_eval import export_and_eval

PROFILE = CostProfile(name="p", machine="m", source="by hand", verify=((1, 1.0), (5, 1.2), (9, 2.0)),
                      draft={"eagle3": 0.1}, step_ms=10.0)


def test_verification_is_interpolated_between_its_rows_and_along_the_last_slope_beyond():
    assert PROFILE.verify_steps(1) == 1.0 and PROFILE.verify_steps(3) == pytest.approx(1.1)
    assert PROFILE.verify_steps(7) == pytest.approx(1.6) and PROFILE.verify_steps(13) == pytest.approx(2.8)
    assert PROFILE.round_steps(4, 3, "eagle3") == pytest.approx(1.15 + 0.3)
    with pytest.raises(DraftsmithError, match="no drafting cost for a dflash drafter .it has eagle3."):
        PROFILE.round_steps(4, 1, "dflash")
    assert PROFILE.round_steps(1, 0, "dflash") == 1.0  # a round that ran no drafter is priced anyway
    for verify in (((2, 1.0),), ((1, 1.0), (4, 1.1), (4, 1.2)), ((1, 1.0), (3, -1.0))):
        with pytest.raises(DraftsmithError, match="cost profile p"):
            CostProfile(name="p", machine="m", source="s", verify=verify)


def test_a_modelled_speedup_by_hand():
    """Two rounds of a chain of 3 (4 rows, 3 forwards): 2.75 committed a round; the prompt's prefill (5 rows,
    1.2 steps) on both sides."""
    rounds = [RoundStats(3, 3, 4, 3, 1, 3, 0.1), RoundStats(3, 1, 2, 3, 1, 3, 0.1)]
    g = GenerationResult(tokens=[0] * 7, prompt_length=5, rounds=rounds)  # the prefill's token, then 4 + 2
    m = modelled_speedup(PROFILE, [g], "eagle3")
    drafted = 1.2 + 2 * (1.15 + 0.3)
    assert m["speedup"] == pytest.approx((1.2 + 6) / drafted)
    assert m["tokens_per_second"] == pytest.approx(7 / (drafted * 0.010))


def test_a_measured_profile_prices_rows_by_the_timed_forwards_and_drafting_by_the_rounds():
    times = {0: 0.010, 1: 0.011, 3: 0.012, 7: 0.016, 9: 0.018}
    rounds = [RoundStats(3, 3, 4, 3, 1, 3, 0.1, draft_seconds=0.006), RoundStats(3, 1, 2, 3, 1, 1, 0.1, draft_seconds=0.002)]
    p = measure_profile(lambda n: times[n], rounds, "eagle3", 10, "cpu", repeats=1)
    assert [r for r, _ in p.verify] == [1, 2, 4, 8, 10] and p.verify_steps(8) == pytest.approx(1.6)
    assert p.draft == {"eagle3": pytest.approx(0.2)} and p.step_ms == pytest.approx(10.0)  # 8 ms over 4 forwards
    steady = measure_profile(lambda n: times[n], rounds, "eagle3", 10, "cpu", repeats=1, step_seconds=0.020)
    assert steady.verify == p.verify and steady.draft == {"eagle3": pytest.approx(0.1)} and steady.step_ms == 20.0


def test_profiles_are_named_shipped_or_read_from_a_file(tmp_path):
    assert "h100-llama8b" in shipped_profiles()
    h100 = load_profile("h100-llama8b")
    assert "H100" in h100.machine and h100.verify_steps(61) == pytest.approx(1.234) and h100.draft["eagle3"] < 0.1
    (tmp_path / "mine.json").write_text(json.dumps({"machine": "mine", "source": "vLLM's figures",
                                                    "verify": [[1, 1.0], [8, 1.1]], "draft": {"dflash": 0.2}}))
    assert profile_names(f"measured, h100-llama8b,{tmp_path / 'mine.json'}")[2] == str(tmp_path / "mine.json")
    assert load_profile(str(tmp_path / "mine.json")).name == "mine"
    with pytest.raises(DraftsmithError, match="--cost_profile a100: not measured, a profile draftsmith ships"):
        profile_names("measured,a100")
    (tmp_path / "bad.json").write_text(json.dumps({"machine": "x"}))
    with pytest.raises(DraftsmithError, match="not a profile file .KeyError"):
        load_profile(str(tmp_path / "bad.json"))


def test_eval_reports_the_modelled_speedup_of_each_profile_beside_the_timed_one(eagle3_ckpt, tiny_features, tmp_path):
    mine = tmp_path / "dflash-only.json"
    mine.write_text(json.dumps({"machine": "mine", "source": "by hand", "verify": [[1, 1.0]], "draft": {"dflash": 0.2}}))
    assert run_cli("export", str(eagle3_ckpt), "--format", "native", "--out", str(tmp_path / "d")).returncode == 0
    made = run_cli("profile", "--target", str(tiny_features / "target"), "--drafter", str(tmp_path / "d"), "--limit", "1",
                   "--max_new_tokens", "8", "--dtype", "float32", "--out", str(tmp_path / "here.json"))
    assert made.returncode == 0, made.stderr[-3000:]
    here = load_profile(str(tmp_path / "here.json"))
    assert [r for r, _ in here.verify] == [1, 2, 4, 8, 16, 32, 64] and here.draft["eagle3"] > 0 and here.step_ms > 0
    result, results = export_and_eval(eagle3_ckpt, tiny_features, tmp_path, "--limit", "2", "--repeats", "1",
                                      "--cost_profile", f"measured,h100-llama8b,{mine},{tmp_path / 'here.json'}")
    modelled = results["modelled"]
    assert modelled["measured"]["speedup"] > 0 and modelled["measured"]["profile"]["draft"]["eagle3"] > 0
    assert modelled["h100-llama8b"]["speedup"] > 0 and modelled["h100-llama8b"]["tokens_per_second"] > 0
    assert modelled[str(mine)]["speedup"] is None and "no drafting cost for a eagle3" in modelled[str(mine)]["why"]
    assert modelled[str(tmp_path / "here.json")]["speedup"] > 0
    said = " ".join(result.stdout.split())
    assert "modelled: h100-llama8b" in said and "priced by the cost profile" in said, said
    assert (tmp_path / "eval" / "speedup_modelled.png").is_file()
    refused = run_cli("eval", "--target", str(tiny_features / "target"), "--cost_profile", "nope", "--out",
                      str(tmp_path / "x"))
    assert refused.returncode == 2 and "--cost_profile nope" in refused.stderr
