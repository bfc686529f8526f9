import json

import numpy as np
import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.data.features import FeatureReader, build_manifest, write_shard
from draftsmith.data.shards import claim_directory
from draftsmith.data.modules import PAD_MULTIPLE, FeatureDataModule, LengthBatchSampler, pad_collate

H = 8


def fake_run(**over):
    run = {"target": {"name": "t", "architecture": "A", "hidden_size": H, "vocab_size": 50, "num_layers": 2,
                      "tokenizer_hash": "abc", "weights_fingerprint": "f00", "adapter": None},
           "tokenizer_hash": "abc", "layer_ids": [1], "dtype": "float32", "max_length": 64, "shard_size": 4,
           "data": {"source": "x", "limit": None, "num_conversations": 0}}
    run.update(over)
    return run


def write_fake(out, num_shards, per_shard=4, seed=0):
    """Shards of random records whose features encode (shard, record) for checking."""
    g = torch.Generator().manual_seed(seed)
    run = fake_run()
    claim_directory(out, run, "features")
    for s in range(num_shards):
        records = []
        for r in range(per_shard):
            n = int(torch.randint(3, 20, (1,), generator=g))
            records.append({"id": f"c{s}-{r}", "input_ids": torch.randint(0, 50, (n,), generator=g).tolist(),
                            "loss_mask": [0] * (n // 2) + [1] * (n - n // 2),
                            "final": torch.full((n, H), float(s * 100 + r)), "layers": {1: torch.full((n, H), -1.0)}})
        write_shard(out, s, records, {"run": run, "skipped": {}, "truncated": {}}, [1], H, torch.float32)
    return build_manifest(out, num_shards, None)


def test_round_trip_and_random_access(tmp_path):
    manifest = write_fake(tmp_path, 3)
    reader = FeatureReader(tmp_path, layer_ids=[1])
    assert len(reader) == 12 == manifest["num_records"]
    for index in (0, 5, 11):
        item = reader[index]
        s, r = divmod(index, 4)
        assert item["id"] == f"c{s}-{r}"
        assert torch.all(item["final"] == s * 100 + r) and item["final"].shape == (len(item["input_ids"]), H)
        assert torch.all(item["aux"] == -1.0)


def test_reader_keeps_a_bounded_number_of_files_open(tmp_path):
    write_fake(tmp_path, 30, per_shard=2)
    reader = FeatureReader(tmp_path, max_open=4)
    for index in np.random.default_rng(0).permutation(len(reader)):
        reader[int(index)]
        assert len(reader._open) <= 4


def test_manifest_refuses_missing_or_foreign_shards(tmp_path):
    write_fake(tmp_path, 2)
    with pytest.raises(DraftsmithError, match="1 of 3 shards missing"):
        build_manifest(tmp_path, 3, None)
    with pytest.raises(DraftsmithError, match="tokenizer_hash: 'abc' there, 'zzz' here"):
        claim_directory(tmp_path, fake_run(tokenizer_hash="zzz"), "features")
    # a shard copied in from another run is caught when the manifest is built
    other = tmp_path / "other"
    other_run = fake_run(max_length=32)
    claim_directory(other, other_run, "features")
    write_shard(other, 2, [], {"run": other_run, "skipped": {}, "truncated": {}}, [1], H, torch.float32)
    (other / "shard-000002.safetensors").rename(tmp_path / "shard-000002.safetensors")
    with pytest.raises(DraftsmithError, match="made differently.*max_length"):
        build_manifest(tmp_path, 3, None)


def test_length_batches_respect_the_budget_and_split_ranks():
    lengths = np.random.default_rng(0).integers(5, 200, size=300)
    indices = np.arange(300)
    sampler = LengthBatchSampler(lengths, indices, max_tokens=800, max_batch_size=16, shuffle=True, seed=1)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(300))
    for b in batches:
        assert len(b) <= 16 and (len(b) == 1 or len(b) * max(lengths[b]) <= 800)
    sampler.set_epoch(1)
    assert list(sampler) != batches  # reshuffled per epoch, deterministically
    sampler.set_epoch(0)
    assert list(sampler) == batches
    padded = list(LengthBatchSampler(lengths, indices, 800, 16, True, 1, multiple=64))
    for b in padded:  # the budget counts the width the batch is padded to
        assert len(b) == 1 or len(b) * -(-max(lengths[b]) // 64) * 64 <= 800
    assert len(padded) > len(batches)
    ranks = [list(LengthBatchSampler(lengths, indices, 800, 16, True, 1, rank=r, world_size=2)) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1])
    assert not {i for b in ranks[0] for i in b} & {i for b in ranks[1] for i in b}


def test_datamodule_splits_by_conversation_id_and_pads(tmp_path):
    write_fake(tmp_path, 10)
    dm = FeatureDataModule(str(tmp_path), layer_ids=[1], val_fraction=0.3, max_tokens=64)
    dm.setup("fit")
    train_ids = {i for batch in dm.train_dataloader() for i in batch["ids"]}
    val_ids = {i for batch in dm.val_dataloader() for i in batch["ids"]}
    assert train_ids and val_ids and not train_ids & val_ids and len(train_ids | val_ids) == 40
    batch = next(iter(dm.train_dataloader()))
    b, t = batch["input_ids"].shape
    assert batch["final"].shape == (b, t, H) and batch["aux"].shape == (b, t, H)
    lengths = batch["attention_mask"].sum(1)
    assert not batch["loss_mask"][~batch["attention_mask"]].any()
    assert torch.all(batch["final"][~batch["attention_mask"]] == 0)
    assert t % PAD_MULTIPLE == 0 and t - PAD_MULTIPLE < lengths.max() <= t  # the longest, rounded up


def test_collate_right_pads():
    items = [{"id": "a", "input_ids": torch.tensor([1, 2, 3]), "loss_mask": torch.tensor([0, 1, 1]).bool(),
              "final": torch.ones(3, 2)},
             {"id": "b", "input_ids": torch.tensor([4]), "loss_mask": torch.tensor([1]).bool(), "final": torch.ones(1, 2)}]
    out = pad_collate(items)
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert out["attention_mask"].tolist() == [[True] * 3, [True, False, False]]
    assert out["final"][1, 1:].abs().sum() == 0
    out = pad_collate(items, multiple=4)
    assert out["input_ids"].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]] and out["final"].shape == (2, 4, 2)
    assert out["attention_mask"][0].tolist() == [True, True, True, False]


def test_missing_manifest_says_what_to_run(tmp_path):
    with pytest.raises(DraftsmithError, match="run `draftsmith extract"):
        FeatureReader(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(fake_run()))
    with pytest.raises(DraftsmithError, match="rerun the same `draftsmith extract` command"):
        FeatureReader(tmp_path)


def test_mix_draws_each_directory_by_its_weight_and_from_its_epoch(tmp_path):
    short, long = tmp_path / "short", tmp_path / "long"
    write_fake(short, 10)
    write_fake(long, 10, seed=1)
    dm = FeatureDataModule(str(short), layer_ids=[1], val_fraction=0.3, max_tokens=64,
                           mix=[{"features_dir": str(long), "weight": 0.5, "from_epoch": 1}])
    dm.setup("fit")
    assert len(dm.dataset) == 80
    loader = dm.train_dataloader()
    sampler = loader.batch_sampler
    (own, _, _), (other, weight, joins) = dm.train_indices.groups
    assert set(own.tolist()) < set(range(40)) and set(other.tolist()) < set(range(40, 80))
    assert (weight, joins) == (0.5, 1)
    first = [i for b in sampler for i in b]
    assert sorted(first) == sorted(own.tolist())  # epoch 0: the curriculum's first directory alone
    sampler.set_epoch(1)
    second = [i for b in sampler for i in b]
    drawn = [i for i in second if i >= 40]
    assert len(drawn) == round(0.5 * len(other)) and len(set(drawn)) == len(drawn)
    assert sorted(i for i in second if i < 40) == sorted(own.tolist())
    sampler.set_epoch(2)
    assert sorted(i for b in sampler for i in b if i >= 40) != sorted(drawn)  # another half every epoch
    batch = next(iter(loader))
    assert batch["aux"].shape[-1] == H
    # validation reads both directories' held-out records once; nothing held out is trained on
    val = [i for b in dm.val_dataloader().batch_sampler for i in b]
    assert any(i >= 40 for i in val) and not set(val) & (set(own.tolist()) | set(other.tolist()))
    counts = dm.token_counts(50)
    assert counts.sum() == sum(int(dm.dataset[i]["loss_mask"].sum()) for i in list(own) + list(other))


def test_mix_refuses_a_weight_that_draws_nothing_and_another_target(tmp_path):
    write_fake(tmp_path / "a", 2)
    with pytest.raises(DraftsmithError, match="weight must be > 0"):
        FeatureDataModule(str(tmp_path / "a"), mix=[{"features_dir": str(tmp_path / "a"), "weight": 0}])
    other = tmp_path / "b"
    run = fake_run(target={**fake_run()["target"], "tokenizer_hash": "zzz"})
    claim_directory(other, run, "features")
    write_shard(other, 0, [], {"run": run, "skipped": {}, "truncated": {}}, [1], H, torch.float32)
    build_manifest(other, 1, None)
    dm = FeatureDataModule(str(tmp_path / "a"), mix=[{"features_dir": str(other)}])
    dm.setup("fit")
    with pytest.raises(DraftsmithError, match="another target"):  # every directory is checked against the drafter's
        dm.check_compatible(fake_run()["target"], [1])
