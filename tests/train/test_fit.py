"""Training through the real CLI on tiny features: logging, frozen target, resume, DDP, bad input."""

import csv
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from draftsmith import DraftsmithError
from tests.conftest import recipe, run_cli, save_tiny_target

ROOT = Path(__file__).resolve().parents[2]


def trained_state(ckpt):
    state = torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("drafter.")}


def test_fit_logs_tau_per_validation_and_keeps_the_target_frozen(tiny_features, tmp_path):
    from draftsmith.train.cli import lightning_cli

    cli = lightning_cli(["--config", str(recipe(tiny_features, tmp_path, kind="eagle3", draft_vocab_size=40,
                                                aux_layer_ids=[0, 1, 2]))], run=False)
    from draftsmith.train.trainer import ReleaseFreedMemory

    assert any(isinstance(c, ReleaseFreedMemory) for c in cli.trainer.callbacks)  # fit's memory stays bounded
    cli.trainer.fit(cli.model, cli.datamodule)
    model = cli.model
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "drafter.embed_tokens.weight" in frozen and "target_head.weight" in frozen
    optimized = {id(p) for g in cli.trainer.optimizers[0].param_groups for p in g["params"]}
    assert not any(id(p) in optimized for n, p in model.named_parameters() if n in frozen)
    from draftsmith.models.target import load_target
    target = load_target(str(tiny_features / "target"))
    assert torch.equal(model.target_head.weight, target.lm_head.weight)
    assert torch.equal(model.drafter.embed_tokens.weight, target.embed_tokens.weight)
    assert model.drafter.vocab_size == 40
    rows = list(csv.DictReader(open(tmp_path / "run" / "logs" / "version_0" / "metrics.csv")))
    taus = [float(r["val/tau"]) for r in rows if r.get("val/tau")]
    assert len(taus) == 2 and all(1.0 <= t <= 3.0 for t in taus)
    ckpt = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert not any(k.startswith(("drafter.embed_tokens", "target_head")) for k in ckpt["state_dict"])


KILL_AT_STEP_4 = textwrap.dedent("""
    import os, signal, sys
    import pytorch_lightning as pl
    from draftsmith.train.cli import lightning_cli
    class Die(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 4:
                os.kill(os.getpid(), signal.SIGKILL)
    cli = lightning_cli(sys.argv[1:], run=False)
    cli.trainer.callbacks.insert(len(cli.trainer.callbacks), Die())  # after the checkpoint callback
    cli.trainer.fit(cli.model, cli.datamodule)
""")


SIGTERM_AT_STEP_3 = textwrap.dedent("""
    import os, signal, sys
    import draftsmith.train.cli as train_cli
    from draftsmith.cli import main
    real = train_cli.save_last_at_stop
    def with_a_sigterm():  # the callback fit adds, which also sends the process SIGTERM after step 3
        class Term(type(real())):
            def on_train_batch_end(self, trainer, *args):
                if trainer.global_step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)
        return Term()
    train_cli.save_last_at_stop = with_a_sigterm
    main(sys.argv[1:])
""")


def test_sigterm_saves_the_last_checkpoint_and_says_so(tiny_features, tmp_path):
    """A preempted run (SIGTERM) stops after its step with last.ckpt written and a non-zero status; Lightning
    alone exits 0 and keeps only the last periodic checkpoint (here: none before step 50)."""
    callbacks = [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                  "init_args": {"dirpath": str(tmp_path / "run" / "ckpt"), "save_last": True, "save_top_k": 0,
                                "every_n_train_steps": 50}}]
    path = recipe(tiny_features, tmp_path, callbacks=callbacks)
    stopped = subprocess.run([sys.executable, "-c", SIGTERM_AT_STEP_3, "fit", "--config", str(path),
                              "--trainer.max_steps", "8"], capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    assert "stopped by SIGTERM" in stopped.stderr and "--ckpt_path last" in stopped.stderr
    ckpt = torch.load(tmp_path / "run" / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3 and ckpt["FeatureDataModule"]["batches_done"] == 3


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_killed_mid_epoch_and_resumed_matches_uninterrupted(tiny_features, tmp_path, optimizer):
    """Muon's momentum and AdamW's moments both travel in the checkpoint."""
    chosen = ("--model.init_args.optimizer", optimizer)
    whole = recipe(tiny_features, tmp_path / "a")
    result = run_cli("fit", "--config", str(whole), "--trainer.max_steps", "8", *chosen, here=True)
    assert result.returncode == 0, result.stderr[-3000:]
    broken = recipe(tiny_features, tmp_path / "b")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP_4, "--config", str(broken), "--trainer.max_steps", "8",
                             *chosen], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpt = torch.load(tmp_path / "b" / "run" / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 4 and ckpt["FeatureDataModule"]["batches_done"] == 4  # mid-epoch
    resumed = run_cli("fit", "--config", str(broken), "--trainer.max_steps", "8", "--ckpt_path", "last", *chosen,
                      here=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a = trained_state(tmp_path / "a" / "run" / "ckpt" / "last.ckpt")
    b = trained_state(tmp_path / "b" / "run" / "ckpt" / "last.ckpt")
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_a_shipped_recipe_killed_between_validations_resumes_from_its_last_steps(tiny_features, tmp_path):
    """A recipe's last.ckpt follows the steps, not the best validation: killed at step 4, with validations
    at steps 3 and 6 and last.ckpt every 2 steps, the run resumes at step 4 and keeps its best record."""
    from draftsmith.train.checkpoints import best_checkpoint

    shipped = yaml.safe_load((ROOT / "recipes/smollm2-135m/hass-cpu.yaml").read_text())["trainer"]["callbacks"]
    callbacks = [cb for cb in shipped if cb["class_path"].endswith("ModelCheckpoint")]
    assert len(callbacks) == 2
    for cb in callbacks:
        cb["init_args"]["dirpath"] = str(tmp_path / "run" / "ckpt")
        if "every_n_train_steps" in cb["init_args"]:
            cb["init_args"]["every_n_train_steps"] = 2
    path = recipe(tiny_features, tmp_path, callbacks=callbacks)
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP_4, "--config", str(path), "--trainer.max_steps", "8"],
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    ckpt_dir = tmp_path / "run" / "ckpt"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["best-step=3.ckpt", "last.ckpt"]
    assert torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 4
    resumed = run_cli("fit", "--config", str(path), "--trainer.max_steps", "8", "--ckpt_path", "last", here=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 8
    assert not list(ckpt_dir.glob("last-v*.ckpt"))
    assert best_checkpoint(tmp_path / "run").name in {"best-step=3.ckpt", "best-step=6.ckpt"}


def shipped_layout(tiny_features, tmp_path, run: str) -> Path:
    """A tiny recipe laid out as the shipped ones are: the hass-cpu-full recipe's ModelCheckpoints (no dirpath:
    their files go under the logger's version, logs/version_N/checkpoints), its CSVLogger (no version), and
    the run directory `run` relative to the working directory, as `runs/...` is in the recipes."""
    shipped = yaml.safe_load((ROOT / "recipes/smollm2-135m/hass-cpu-full.yaml").read_text())["trainer"]
    callbacks = [cb for cb in shipped["callbacks"] if cb["class_path"].endswith("ModelCheckpoint")]
    assert callbacks and not any("dirpath" in cb["init_args"] for cb in callbacks)
    for cb in callbacks:
        if "every_n_train_steps" in cb["init_args"]:
            cb["init_args"]["every_n_train_steps"] = 2
    path = recipe(tiny_features, tmp_path, callbacks=callbacks)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"]["default_root_dir"] = run
    cfg["trainer"]["logger"]["init_args"] = {"save_dir": run, "name": "logs"}
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_recipe_as_shipped_resumes_with_ckpt_path_last(tiny_features, tmp_path):
    """The resumed run logs to version_1, where Lightning alone would find no last.ckpt and start over; fit
    resumes from version_0's and goes on writing there: the same last.ckpt, the best one still on record."""
    path = shipped_layout(tiny_features, tmp_path, "run")
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP_4, "--config", str(path), "--trainer.max_steps", "8"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert killed.returncode == -9, killed.stderr[-3000:]
    first = tmp_path / "run" / "logs" / "version_0"
    assert torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 4
    resumed = run_cli("fit", "--config", str(path), "--trainer.max_steps", "8", "--ckpt_path", "last", cwd=str(tmp_path))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr + resumed.stdout
    assert "dirpath has changed" not in resumed.stderr
    assert sorted(p.name for p in (first / "checkpoints").iterdir()) == ["best-step=3.ckpt", "last.ckpt"] or \
        sorted(p.name for p in (first / "checkpoints").iterdir()) == ["best-step=6.ckpt", "last.ckpt"]
    assert torch.load(first / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"] == 8
    assert not (tmp_path / "run" / "logs" / "version_1" / "checkpoints").exists()
    steps = [int(r["step"]) for r in csv.DictReader(open(tmp_path / "run" / "logs" / "version_1" / "metrics.csv"))]
    assert steps and min(steps) >= 4  # the new version logs the steps after the resume, version_0 keeps its own
    assert (first / "metrics.csv").is_file()


def test_draftsmith_run_resuming_keeps_the_checkpoints_beside_its_last(tiny_features, tmp_path, monkeypatch):
    """`draftsmith run` finds last.ckpt itself and hands it to lightning_cli(resume=...): the resumed run's
    ModelCheckpoints write beside it, under the dirpath it recorded (relative, as Lightning records it)."""
    from draftsmith.train.cli import lightning_cli

    monkeypatch.chdir(tmp_path)
    path = shipped_layout(tiny_features, tmp_path, "run")
    last = Path("run/logs/version_0/checkpoints/last.ckpt")
    last.parent.mkdir(parents=True)
    torch.save({"callbacks": {"ModelCheckpoint{'monitor': 'val/tau'}": {"dirpath": "run/logs/version_0/checkpoints"}}}, last)
    fresh = lightning_cli(["--config", str(path)], run=False)
    assert {cb.dirpath for cb in fresh.trainer.checkpoint_callbacks} == {None}  # Lightning's: the logger's version
    resumed = lightning_cli(["--config", str(path)], run=False, resume=last)
    assert {cb.dirpath for cb in resumed.trainer.checkpoint_callbacks} == {"run/logs/version_0/checkpoints"}


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_the_same_global_batch(tiny_features, tmp_path):
    two = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path / "ddp")), "--trainer.max_steps", "3",
                  "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.val_check_interval", "null",
                  "--trainer.limit_val_batches", "0", timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path / "one")), "--trainer.max_steps", "3",
                  "--trainer.accumulate_grad_batches", "2", "--trainer.val_check_interval", "null",
                  "--trainer.limit_val_batches", "0")
    assert one.returncode == 0, one.stderr[-3000:]
    a = trained_state(tmp_path / "ddp" / "run" / "ckpt" / "last.ckpt")
    b = trained_state(tmp_path / "one" / "run" / "ckpt" / "last.ckpt")
    start = trained_state(sorted((tmp_path / "one" / "run" / "ckpt").glob("epoch=0-step=1*.ckpt"))[0])
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)
    assert any(not torch.allclose(start[k], b[k]) for k in b)  # it trained


RANK_WEIGHTS_AT_END = textwrap.dedent("""
    import sys, torch
    import pytorch_lightning as pl
    from draftsmith.train.cli import lightning_cli
    class Dump(pl.Callback):
        def on_train_end(self, trainer, module):
            lr = trainer.optimizers[0].param_groups[0]["lr"]
            torch.save({"lr": lr, "step": trainer.global_step, "weights": module.drafter.state_dict()},
                       f"{sys.argv[1]}.rank{trainer.global_rank}")
    cli = lightning_cli(sys.argv[2:], run=False)
    cli.trainer.callbacks.append(Dump())
    cli.trainer.fit(cli.model, cli.datamodule)
""")


@pytest.mark.slow
def test_ddp_ranks_under_a_time_budget_apply_the_same_learning_rate(tiny_features, tmp_path):
    """Each rank reads its own clock: without rank 0's reading broadcast, their learning rates, and so their
    weights, part although their averaged gradients agree (by about 1 % in 5 s here)."""
    path = recipe(tiny_features, tmp_path)
    out, script = tmp_path / "dump", tmp_path / "dump_ranks.py"  # a file: Lightning's DDP launcher reruns sys.argv
    script.write_text(RANK_WEIGHTS_AT_END)
    ran = subprocess.run([sys.executable, str(script), str(out), "--config", str(path),
                          "--trainer.max_steps", "-1", "--trainer.max_time", "00:00:00:05", "--trainer.strategy", "ddp",
                          "--trainer.devices", "2", "--trainer.val_check_interval", "null",
                          "--trainer.limit_val_batches", "0", "--model.init_args.min_lr_ratio", "0.1"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]
    assert ranks[0]["step"] == ranks[1]["step"] > 3
    assert ranks[0]["lr"] == ranks[1]["lr"] < 0.003 * 0.2  # near the floor at the end of the time
    for k, v in ranks[0]["weights"].items():
        assert torch.equal(v, ranks[1]["weights"][k]), k


@pytest.mark.slow
def test_ddp_ranks_take_the_auto_precision_rank_0_chose(tiny_features, tmp_path):
    """`precision: auto` is measured once, in the launching process; the rank it starts inherits the choice."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DRAFTSMITH_DTYPE_")}
    result = subprocess.run([sys.executable, "-m", "draftsmith.cli", "fit", "--config", str(recipe(tiny_features, tmp_path)),
                             "--trainer.max_steps", "1", "--trainer.strategy", "ddp", "--trainer.devices", "2",
                             "--trainer.precision", "auto", "--trainer.val_check_interval", "null",
                             "--trainer.limit_val_batches", "0"], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("dtype auto:") == 1, result.stderr[-3000:]


def test_mismatched_features_and_missing_features_are_refused(tiny_features, tmp_path):
    other = save_tiny_target(tmp_path / "other", seed=3)
    result = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path)), "--model.init_args.target", str(other),
                     here=True)
    assert result.returncode == 2 and "come from another target" in result.stderr
    assert "weights_fingerprint" in result.stderr and "draftsmith extract --target" in result.stderr
    result = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path)), "--data.init_args.features_dir", str(tmp_path / "none"),
                     here=True)
    assert result.returncode == 2 and "make the features with:\n  draftsmith extract --target" in result.stderr
    result = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path, kind="eagle3", aux_layer_ids=[0, 1, 3])), here=True)
    assert result.returncode == 2 and "model.init_args.aux_layer_ids: layer ids [3] are out of range" in result.stderr


def test_the_extract_command_fit_prints_for_missing_features_makes_features_fit_takes(tiny_features, tmp_path):
    """An EAGLE-3 recipe that names its fused layers for the model only (as the shipped ones do, or not at all)
    and has no features yet: `fit` prints an extract command; run as printed, it makes features the same `fit`
    trains on."""
    import shlex

    path = recipe(tiny_features, tmp_path, kind="eagle3", draft_vocab_size=40, aux_layer_ids=[1, 2])
    config = yaml.safe_load(path.read_text())
    config["data"]["init_args"].update(features_dir=str(tmp_path / "features"), data=str(tiny_features / "chats.json"),
                                       max_length=256)
    path.write_text(yaml.safe_dump(config))
    result = run_cli("fit", "--config", str(path), "--trainer.max_steps", "1", here=True)
    assert result.returncode == 2 and "make the features with:" in result.stderr, result.stderr[-3000:]
    printed = result.stderr.split("make the features with:\n  ", 1)[1].splitlines()[0]
    assert "--layer_ids [" in printed, printed
    command = shlex.split(printed)
    assert command[:2] == ["draftsmith", "extract"]
    made = run_cli(*command[1:])
    assert made.returncode == 0, made.stderr[-3000:]
    result = run_cli("fit", "--config", str(path), "--trainer.max_steps", "1", "--trainer.val_check_interval", "1",
                     here=True)
    assert result.returncode == 0, result.stderr[-3000:]


def test_non_finite_loss_stops_with_a_message(tiny_features, tmp_path):
    from draftsmith.train.cli import lightning_cli

    cli = lightning_cli(["--config", str(recipe(tiny_features, tmp_path)), "--trainer.max_steps", "1"], run=False)
    cli.model.configure_model()
    with torch.no_grad():
        cli.model.drafter.fc.weight.fill_(float("nan"))
    with pytest.raises(DraftsmithError, match="non-finite loss at step 0"):
        cli.trainer.fit(cli.model, cli.datamodule)


def test_online_mode_runs_the_frozen_target_inside_the_step(tiny_features, tmp_path):
    from draftsmith.train.cli import lightning_cli

    cli = lightning_cli(["--config", str(recipe(tiny_features, tmp_path, kind="eagle3", aux_layer_ids=[1, 2])),
                         "--trainer.max_steps", "2", "--data", "draftsmith.data.modules.ChatDataModule",
                         "--data.init_args.data", str(tiny_features / "chats.json"),
                         "--data.init_args.max_length", "256", "--data.init_args.max_tokens", "300"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    model = cli.model
    assert model.drafting.target is not None and cli.datamodule.online
    target_params = {id(p) for p in model.drafting.target.model.parameters()}
    assert not target_params & {id(p) for p in model.parameters()}  # outside the module tree: never saved
    optimized = {id(p) for g in cli.trainer.optimizers[0].param_groups for p in g["params"]}
    assert not target_params & optimized
    # the features it computes online are the ones extraction stored
    from draftsmith.data.features import FeatureReader
    item = FeatureReader(tiny_features / "features", layer_ids=[1, 2])[0]
    batch = {"input_ids": item["input_ids"][None], "attention_mask": torch.ones(1, len(item["input_ids"]), dtype=torch.bool)}
    final, aux = model.drafting.features(batch)
    torch.testing.assert_close(final[0], item["final"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux[0], item["aux"], atol=1e-5, rtol=1e-5)


def test_the_online_target_moves_to_the_device_its_batches_are_on(tiny_target_dir, monkeypatch):
    """The frozen target lives outside the module tree, so Lightning never moves it to the accelerator."""
    from draftsmith.models.target import Target, load_target
    from draftsmith.train.frozen import online_features

    target = load_target(str(tiny_target_dir))
    seen = []
    monkeypatch.setattr(Target, "features", lambda self, ids, mask, layers=(): seen.append(self.device) or (ids, {}))
    batch = {"input_ids": torch.ones(1, 3, dtype=torch.long, device="meta"),
             "attention_mask": torch.ones(1, 3, dtype=torch.bool, device="meta")}
    online_features(target, batch)
    assert seen == [torch.device("meta")] and target.model.lm_head.weight.device.type == "meta"


def test_under_fsdp_the_frozen_target_parts_join_the_drafters_dtype(tiny_target_dir):
    """FSDP flattens a unit's parameters into one tensor of one dtype: a bf16 target's embedding and head
    cannot sit beside the drafter's float32 weights there (FSDP refuses at setup)."""
    from types import SimpleNamespace

    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy

    from draftsmith.train.drafter import DrafterModule

    def dtypes(strategy):
        module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2], target_dtype="bfloat16")
        module._trainer = SimpleNamespace(strategy=strategy)
        module.configure_model()
        return {p.dtype for p in module.parameters()}

    assert dtypes(FSDPStrategy()) == {torch.float32}
    assert dtypes(DDPStrategy()) == {torch.float32, torch.bfloat16}  # elsewhere they stay the target's


def test_under_fsdp_gradients_are_clipped_by_norm_through_the_sharded_root(tiny_target_dir):
    """Lightning's FSDP precision refuses `gradient_clip_algorithm="norm"` (the 8B DFlash recipe's clipping)
    at the first step; the modules clip through the FSDP root's own `clip_grad_norm_` there, and through
    Lightning's clipping elsewhere."""
    from types import SimpleNamespace

    import pytorch_lightning as pl
    from lightning_fabric.utilities.exceptions import MisconfigurationException
    from pytorch_lightning.plugins.precision import FSDPPrecision, Precision
    from pytorch_lightning.strategies import DDPStrategy, FSDPStrategy
    from pytorch_lightning.utilities import GradClipAlgorithmType

    from draftsmith.train.drafter import DrafterModule

    module = DrafterModule(str(tiny_target_dir), kind="eagle3", aux_layer_ids=[0, 1, 2])
    module.configure_model()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.1)
    clipped, clipping = [], {"gradient_clip_val": 1.0, "gradient_clip_algorithm": GradClipAlgorithmType.NORM}
    module._trainer = SimpleNamespace(strategy=FSDPStrategy(), precision_plugin=FSDPPrecision("bf16-mixed"),
                                      model=SimpleNamespace(clip_grad_norm_=clipped.append), **clipping)
    with pytest.raises(MisconfigurationException, match="not supported for `FSDPPrecision`"):
        pl.LightningModule.configure_gradient_clipping(module, opt, 1.0, "norm")  # Lightning's own hook
    module.configure_gradient_clipping(opt, 1.0, "norm")
    assert clipped == [1.0]

    for p in params:
        p.grad = torch.full_like(p, 10.0)
    module._trainer = SimpleNamespace(strategy=DDPStrategy(), precision_plugin=Precision(), model=module, **clipping)
    module.configure_gradient_clipping(opt, 1.0, "norm")
    assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) == pytest.approx(1.0, rel=1e-4)
    assert clipped == [1.0]


def test_fit_is_free_of_lightning_noise_a_user_cannot_act_on(tiny_features, tmp_path, monkeypatch):
    """No "args parameter is intended to run from within Python" warning, no litlogger advert."""
    import logging
    import warnings

    from lightning_fabric.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only

    from draftsmith.train.cli import lightning_cli

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    rank_zero = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    # this process speaks as rank 0 at INFO, whatever an earlier test in it left behind
    for only in (rank_zero_only, utilities_rank_zero_only):
        monkeypatch.setattr(only, "rank", 0, raising=False)
    monkeypatch.setattr(rank_zero, "level", logging.INFO)
    monkeypatch.setattr(rank_zero, "disabled", False)
    rank_zero.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cli = lightning_cli(["--config", str(recipe(tiny_features, tmp_path))], run=False)
    finally:
        rank_zero.removeHandler(handler)
    assert cli.trainer.max_steps == 6
    assert cli.trainer.logger.save_dir == str(tmp_path / "run")  # the recipe's own, not moved
    messages = [r.getMessage() for r in records]
    assert any("GPU available" in m for m in messages)  # Lightning's own lines still come through
    assert not any("litlogger" in m for m in messages)
    assert not any("run from within Python" in str(w.message) for w in caught)


def test_a_recipe_extends_the_base_recipe_and_logs_under_its_root(tiny_features, tmp_path):
    """A recipe that names no seed, logger or callbacks gets the base recipe's (seed 0, the best-τ̂ and
    last checkpoints) and CSV logs under its default_root_dir, wherever the command line moves that."""
    from draftsmith.train.cli import lightning_cli

    path = recipe(tiny_features, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    del cfg["seed_everything"], cfg["trainer"]["logger"], cfg["trainer"]["callbacks"]
    path.write_text(yaml.safe_dump(cfg))
    cli = lightning_cli(["--config", str(path)], run=False)
    assert cli.config["seed_everything"] == 0
    assert cli.trainer.logger.save_dir == str(tmp_path / "run") and cli.trainer.logger.name == "logs"
    kept = {(cb.monitor, cb.save_last) for cb in cli.trainer.checkpoint_callbacks}
    assert kept == {("val/tau", None), (None, True)}
    moved = lightning_cli(["--config", str(path), "--trainer.default_root_dir", str(tmp_path / "moved")], run=False)
    assert moved.trainer.logger.save_dir == str(tmp_path / "moved")
    named = lightning_cli(["--config", str(recipe(tiny_features, tmp_path / "named"))], run=False)
    assert named.trainer.logger.version == 0  # a recipe's own logger is kept as it is


def test_fit_without_a_logger_writes_nothing_into_the_working_directory(tiny_features, tmp_path):
    """LightningCLI saves config.yaml into trainer.log_dir, the cwd when a recipe has no logger; draftsmith
    saves it beside the checkpoints instead, and nowhere when the run keeps no files."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    path = recipe(tiny_features, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["trainer"].update(logger=False, max_steps=2, val_check_interval=2)
    path.write_text(yaml.safe_dump(cfg))
    kept = run_cli("fit", "--config", str(path), cwd=str(cwd), here=True)
    assert kept.returncode == 0, kept.stderr[-3000:]
    assert list(cwd.iterdir()) == []
    saved = yaml.safe_load((tmp_path / "run" / "ckpt" / "config.yaml").read_text())  # beside the checkpoints
    assert saved["trainer"]["max_steps"] == 2
    cfg["trainer"].update(callbacks=None, enable_checkpointing=False)
    path.write_text(yaml.safe_dump(cfg))
    bare = run_cli("fit", "--config", str(path), cwd=str(cwd), here=True)
    assert bare.returncode == 0, bare.stderr[-3000:]
    assert list(cwd.iterdir()) == []


def test_a_redirected_fit_shows_its_progress_in_lines_and_in_its_log(tiny_features, tmp_path):
    """Lightning's progress bar prints nothing when stderr is a file: `fit` then writes plain lines, to stderr
    and to train.log beside the run's logs (every 30 s of training, after each validation, at the end)."""
    result = run_cli("fit", "--config", str(recipe(tiny_features, tmp_path)), "--trainer.max_steps", "2",
                     "--trainer.val_check_interval", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    log = (tmp_path / "run" / "logs" / "version_0" / "train.log").read_text()
    for line in ("training DrafterModule for 2 steps", "step 2 validation at 0:", "val/loss", "val/tau", "done: 2 steps"):
        assert line in log and line in result.stderr, line


def test_progress_lines_give_step_mean_loss_and_time_left():
    """A line's loss is the mean of the steps' logged losses since the line before, not the last step's."""
    from types import SimpleNamespace

    import draftsmith.train.progress as progress
    from draftsmith.train.progress import ProgressLog

    log = ProgressLog(every_seconds=30.0, to_stderr=False)
    lines = []
    log._write = lines.append
    log.path, log.start, log.last = "x", 0.0, 0.0
    trainer = SimpleNamespace(global_step=0, max_steps=100, accumulate_grad_batches=2,
                              optimizers=[SimpleNamespace(param_groups=[{"lr": 1e-3}])], callbacks=[])
    real = progress.time.perf_counter
    try:
        for step, (now, loss) in enumerate([(10.0, 2.0), (20.0, 2.5), (50.0, 3.5), (70.0, 4.0), (90.0, 5.0)], 1):
            trainer.global_step = step * 5
            progress.time.perf_counter = lambda: now
            # Lightning hands the hook the step's loss divided by the batches it accumulates
            log.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss / 2)}, None, 0)
    finally:
        progress.time.perf_counter = real
    assert lines == ["step 15/100  loss 2.6667  lr 1.00e-03  0:50 elapsed, ~4:43 left",
                     "step 25/100  loss 4.5000  lr 1.00e-03  1:30 elapsed, ~4:30 left"]


def test_a_time_budget_ends_the_schedule_and_the_run_reads_as_finished(tiny_features, tmp_path):
    """max_time alone bounds the run: the cosine reaches its floor as the time runs out, the base recipe's
    checkpoints keep the stop (last.ckpt, with the Timer's state), and `run` would skip the training."""
    from draftsmith.train.checkpoints import checkpoint_state, training_finished
    from draftsmith.train.cli import lightning_cli

    path = recipe(tiny_features, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    del cfg["trainer"]["callbacks"]  # base.yaml's: the best by val/tau, last.ckpt every 50 steps
    cfg["trainer"].update(max_steps=-1, max_time="00:00:00:06", val_check_interval="00:00:00:02")
    cfg["model"]["init_args"].update(min_lr_ratio=0.1)
    path.write_text(yaml.safe_dump(cfg))
    cli = lightning_cli(["--config", str(path)], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    steps = cli.trainer.global_step
    assert steps > 6  # not a step count: the time ended it
    last = next((tmp_path / "run").glob("**/last.ckpt"))
    state = checkpoint_state(last)
    assert state["global_step"] == steps  # saved at the stop, not at the last multiple of 50
    assert state["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(0.003 * 0.1, rel=0.1)  # the floor
    assert training_finished(state, -1, "00:00:00:06")
    assert not training_finished(state, -1, "00:00:01:00") and training_finished(state, steps, None)
    log = next((tmp_path / "run").glob("**/train.log")).read_text()
    assert "for 0:06 (" in log  # the progress log names the budget


def test_a_run_bounded_by_time_shows_its_epoch_without_a_negative_total(tiny_features, tmp_path):
    """Lightning 2.6's rich bar reads max_epochs -1 (a run bounded by time alone) as "Epoch 1/-2"; draftsmith's
    CLI swaps in its own bar, which shows "Epoch 1", and keeps a bounded count's total."""
    from pytorch_lightning.callbacks import RichProgressBar

    from draftsmith.train.cli import lightning_cli
    from draftsmith.train.progress import RichBar

    path = recipe(tiny_features, tmp_path)
    cfg = yaml.safe_load(path.read_text())
    del cfg["trainer"]["callbacks"]
    cfg["trainer"].update(max_steps=-1, max_time="00:00:00:02", enable_progress_bar=True)
    path.write_text(yaml.safe_dump(cfg))
    cli = lightning_cli(["--config", str(path)], run=False)
    bars = [c for c in cli.trainer.callbacks if isinstance(c, RichProgressBar)]
    assert [type(b) for b in bars] == [RichBar]
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.max_epochs == -1
    assert bars[0]._get_train_description(1).strip() == "Epoch 1"
    cli.trainer.fit_loop.max_epochs = 3
    assert bars[0]._get_train_description(1).strip() == "Epoch 1/2"
