"""Stop heads end to end on the tiny target: `draftsmith labels` (resumable) → `fit` a SpecDec++ head and a
DISCO classifier → `export` them into the drafter's native export → `tune` → `eval --policy specdec|disco`."""

import csv
import json
import subprocess
import sys

import pytest
import torch
import yaml

from draftsmith import DraftsmithError
from draftsmith.eval.tune import roc_threshold
from draftsmith.export import export
from draftsmith.data.labels import read_labels
from draftsmith.jobs.labels import LabelsConfig, labels
from tests.conftest import killed_after_writes, run_cli, sample_chats


@pytest.fixture(scope="module")
def drafter_export(eagle_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter") / "native"
    export(str(eagle_ckpt), "native", str(out))
    return out


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.json"
    path.write_text(json.dumps(sample_chats(30, seed=3)))
    return path


def label_args(tiny_features, drafter_export, chats, out):
    return ["labels", "--target", str(tiny_features / "target"), "--drafter", str(drafter_export), "--data", str(chats),
            "--k", "4", "--top_k", "6", "--shard_size", "8", "--max_positions", "40", "--dtype", "float32",
            "--hidden_dtype", "float32", "--out", str(out)]


@pytest.fixture(scope="module")
def labelled(tiny_features, drafter_export, chats, tmp_path_factory):
    out = tmp_path_factory.mktemp("labels") / "l"
    result = run_cli(*label_args(tiny_features, drafter_export, chats, out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "labelled 30 chats" in result.stdout and "accepted by depth" in result.stdout
    return out


KILL_AFTER_SECOND_SHARD = killed_after_writes(2)  # the 2nd shard is written, not yet renamed


def test_sigkilled_labelling_resumes_to_the_same_shards(tiny_features, drafter_export, chats, labelled, tmp_path):
    args = label_args(tiny_features, drafter_export, chats, tmp_path / "a")
    killed = subprocess.run([sys.executable, "-c", KILL_AFTER_SECOND_SHARD, *args], capture_output=True, text=True,
                            timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [p.name for p in sorted((tmp_path / "a").glob("labels-*"))] == ["labels-000000.safetensors"]
    with pytest.raises(DraftsmithError, match="labelling has not finished"):
        read_labels(tmp_path / "a")
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not list((tmp_path / "a").glob(".*tmp*"))
    run_a, rows_a, ids_a, _ = read_labels(tmp_path / "a")
    run_b, rows_b, ids_b, _ = read_labels(labelled)
    assert ids_a == ids_b and len(ids_a) == 30 and run_a["drafter"] == run_b["drafter"]
    for name in rows_a:
        torch.testing.assert_close(rows_a[name], rows_b[name], rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def other_export(eagle3_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("other") / "native"
    export(str(eagle3_ckpt), "native", str(out))
    return out


def test_labels_of_another_drafter_are_not_mixed_in(tiny_features, other_export, chats, labelled):
    with pytest.raises(DraftsmithError, match="drafter.*refusing to mix"):
        labels(LabelsConfig(target=str(tiny_features / "target"), drafter=str(other_export), data=str(chats),
                            out=str(labelled), k=4, top_k=6, shard_size=8, max_positions=40, dtype="float32",
                            hidden_dtype="float32"))


def head_recipe(tiny_features, labelled, tmp_path, kind):
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_steps": 8, "val_check_interval": 4,
                    "check_val_every_n_epoch": None, "enable_progress_bar": False, "log_every_n_steps": 1,
                    "default_root_dir": str(tmp_path / kind),
                    "logger": {"class_path": "pytorch_lightning.loggers.CSVLogger",
                               "init_args": {"save_dir": str(tmp_path / kind), "name": "logs", "version": 0}},
                    "callbacks": [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                                   "init_args": {"dirpath": str(tmp_path / kind / "ckpt"), "monitor": "val/loss",
                                                 "mode": "min", "save_last": True, "filename": "best-{step}"}}]},
        "model": {"class_path": "draftsmith.train.heads.StopHeadModule",
                  "init_args": {"target": str(tiny_features / "target"), "kind": kind,
                                "label": "soft" if kind == "specdec" else "hard", "top_k": 6, "lr": 0.01,
                                "warmup_steps": 1, "draft_features": 4 if kind == "specdec" else 0}},
        "data": {"class_path": "draftsmith.train.heads.LabelDataModule",
                 "init_args": {"labels": str(labelled), "val_fraction": 0.3, "batch_size": 128}},
    }
    path = tmp_path / f"{kind}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def heads(tiny_features, labelled, tmp_path_factory):
    """Both heads trained briefly on the labels (run directories)."""
    root = tmp_path_factory.mktemp("heads")
    for kind in ("specdec", "disco"):
        result = run_cli("fit", "--config", str(head_recipe(tiny_features, labelled, root, kind)), here=True)
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_fitting_heads_logs_validation_metrics_and_keeps_the_best(heads):
    for kind in ("specdec", "disco"):
        rows = list(csv.DictReader(open(heads / kind / "logs" / "version_0" / "metrics.csv")))
        val = [r for r in rows if r.get("val/auroc")]
        assert len(val) == 2
        for key in ("val/loss", "val/bce", "val/kl", "val/auroc", "val/ece", "val/f1", "val/predicted", "val/label"):
            assert all(r[key] != "" for r in val), key
        assert all(0 <= float(r["val/auroc"]) <= 1 and float(r["val/kl"]) >= -1e-6 for r in val)
        assert list((heads / kind / "ckpt").glob("best-step=*.ckpt")) and (heads / kind / "logs" / "version_0" / "config.yaml").exists()


def test_each_head_is_built_from_its_own_options_and_refuses_more_probabilities_than_labels_keep(tiny_features):
    from draftsmith.models.heads import AcceptanceHead, StopClassifier
    from draftsmith.train.heads import StopHeadModule

    run = {"hidden_size": 24, "top_k": 6}
    specdec = StopHeadModule(str(tiny_features / "target"), kind="specdec", num_layers=2, draft_features=4)
    specdec.build(run)
    assert isinstance(specdec.head, AcceptanceHead)
    assert (specdec.head.config.hidden_size, specdec.head.config.num_layers, specdec.head.config.draft_features) == (24, 2, 4)
    disco = StopHeadModule(str(tiny_features / "target"), kind="disco", top_k=5, width=16)
    disco.build(run)
    assert isinstance(disco.head, StopClassifier) and (disco.head.config.top_k, disco.head.config.width) == (5, 16)
    for kind, option in (("specdec", "draft_features"), ("disco", "top_k")):
        module = StopHeadModule(str(tiny_features / "target"), kind=kind, **{option: 8})
        with pytest.raises(DraftsmithError, match=f"--model.{option} 8: the labels keep 6 probabilities per token"):
            module.build(run)


def test_heads_travel_in_the_export_and_decode_losslessly(tiny_features, drafter_export, other_export, heads, tmp_path):
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(drafter_export, drafter)
    for kind in ("specdec", "disco"):
        result = run_cli("export", str(heads / kind), "--format", "native", "--out", str(drafter))
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"exported {kind} stop head" in result.stdout
    config = json.loads((drafter / "config.json").read_text())
    assert set(config["stop_heads"]) == {"specdec", "disco"} and (drafter / "stop_heads.safetensors").exists()
    assert config["stop_heads"]["specdec"]["provenance"]["checkpoint"].endswith(".ckpt")
    assert config["stop_heads"]["specdec"]["head"]["draft_features"] == 4  # it reads the distribution too
    # a head is refused by the drafter it was not trained for
    with pytest.raises(DraftsmithError, match="trained for another drafter or target"):
        export(str(heads / "specdec"), "native", str(other_export))
    # eval: greedy fp32 with either head policy gives the target's own text
    for kind in ("specdec", "disco"):
        out = tmp_path / f"eval-{kind}"
        result = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(drafter), "--policy", kind,
                         "--k", "4", "--stop_threshold", "0.5", "--max_new_tokens", "12", "--limit", "2", "--repeats", "1",
                         "--dtype", "float32", "--out", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        results = json.loads((out / "results.json").read_text())
        assert results["identical_outputs"] is True and f"{kind} stop head (threshold 0.5, at most 4)" in results["config"]["drafter"]
    # tune: the fastest setting of a small grid on held-out prompts is written into the export and used by eval
    result = run_cli("tune", "--target", str(tiny_features / "target"), "--drafter", str(drafter), "--policy", "disco",
                     "--thresholds", "[0.3,0.7]", "--ks", "[2,3]", "--data", str(tiny_features / "chats.json"),
                     "--val_fraction", "0.3", "--limit", "2", "--max_new_tokens", "8", "--repeats", "1",
                     "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    tuned = json.loads((drafter / "config.json").read_text())["stop_heads"]["disco"]["tuned"]["greedy"]
    # the grid: each threshold at each k, and the never-stopping threshold 0 at k 1..3 (static lengths, the fallback)
    points = {(0.3, 2), (0.7, 2), (0.3, 3), (0.7, 3), (0.0, 1), (0.0, 2), (0.0, 3)}
    assert {(p["threshold"], p["k"]) for p in tuned["grid"]} == points and (tuned["threshold"], tuned["k"]) in points
    assert tuned["tokens_per_second"] == max(p["tokens_per_second"] for p in tuned["grid"])
    assert tuned["static"] == (tuned["threshold"] == 0.0)
    out = tmp_path / "eval-tuned"
    result = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(drafter), "--policy", "disco",
                     "--max_new_tokens", "8", "--limit", "1", "--repeats", "1", "--dtype", "float32", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    described = json.loads((out / "results.json").read_text())["config"]["drafter"]
    assert f"threshold {tuned['threshold']:g}, at most {tuned['k']}" in described
    # tune --tree: a threshold for tree rounds, kept apart from the chains', and used by eval --tree
    result = run_cli("tune", "--target", str(tiny_features / "target"), "--drafter", str(drafter), "--policy", "disco",
                     "--tree", "3,2,4", "--thresholds", "[0.2,0.8]", "--data", str(tiny_features / "chats.json"),
                     "--val_fraction", "0.3", "--limit", "2", "--max_new_tokens", "8", "--repeats", "1",
                     "--dtype", "float32")
    assert result.returncode == 0, result.stderr[-3000:]
    every = json.loads((drafter / "config.json").read_text())["stop_heads"]["disco"]["tuned"]
    assert every["greedy"] == tuned and every["tree_greedy"]["tree"] == "3,2,4" and every["tree_greedy"]["k"] <= 3
    out = tmp_path / "eval-tree"
    result = run_cli("eval", "--target", str(tiny_features / "target"), "--drafter", str(drafter), "--policy", "disco",
                     "--tree", "3,2,4", "--max_new_tokens", "8", "--limit", "1", "--repeats", "1", "--dtype", "float32",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert f"threshold {every['tree_greedy']['threshold']:g}, at most {every['tree_greedy']['k']}" in results["config"]["drafter"]
    assert results["identical_outputs"] is True


def test_the_confidence_threshold_by_transformers_roc_rule(tiny_features, labelled, drafter_export, tmp_path):
    threshold, at = roc_threshold(torch.tensor([0.1, 0.2, 0.35, 0.8, 0.9]), torch.tensor([0, 0, 1, 1, 1]))
    assert threshold == pytest.approx(0.35) and at["fpr"] == 0 and at["fnr"] == 0
    # missing an acceptance costs 3 false alarms: with one positive below two negatives, the cut goes below it
    threshold, at = roc_threshold(torch.tensor([0.1, 0.3, 0.4, 0.2, 0.9]), torch.tensor([0, 0, 0, 1, 1]))
    assert threshold == pytest.approx(0.2) and at["fpr"] == pytest.approx(2 / 3)
    # `tune --policy confidence` files the rule's threshold where `eval --policy confidence` reads it
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(drafter_export, drafter)
    target = str(tiny_features / "target")
    result = run_cli("tune", "--target", target, "--drafter", str(drafter), "--policy", "confidence", "--labels", str(labelled))
    assert result.returncode == 0, result.stderr[-3000:]
    tuned = json.loads((drafter / "config.json").read_text())["stop_heads"]["confidence"]["tuned"]["greedy"]["threshold"]
    result = run_cli("eval", "--target", target, "--drafter", str(drafter), "--policy", "confidence", "--k", "3",
                     "--max_new_tokens", "8", "--limit", "1", "--repeats", "1", "--dtype", "float32",
                     "--out", str(tmp_path / "eval"))
    assert result.returncode == 0, result.stderr[-3000:]
    described = json.loads((tmp_path / "eval" / "results.json").read_text())["config"]["drafter"]
    assert f"confidence policy (threshold {tuned:g}, at most 3)" in described


def test_labels_take_the_type_decoding_takes(tiny_features, drafter_export, chats, tmp_path, fresh):
    set_speed, calls = fresh
    set_speed({"bulk": 0.5, "decode": 2.0})  # float32 would train faster, bf16 decodes faster: labels are decoding's
    labels(LabelsConfig(target=str(tiny_features / "target"), drafter=str(drafter_export), data=str(chats),
                        out=str(tmp_path / "l"), limit=8, k=2, top_k=6, shard_size=8, max_positions=8,
                        hidden_dtype="float32"))
    assert json.loads((tmp_path / "l" / "run.json").read_text())["dtype"] == "bfloat16" and calls == ["decode"]
