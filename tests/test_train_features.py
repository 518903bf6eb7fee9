"""train/features.py: the target's rows on disk, resumable, within a disk bound."""

import json

import numpy as np
import pytest
import torch

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.export.checkpoint import load_target
from trt_spec.export.model import empty_cache
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train.data import tokenize_all
from trt_spec.train.features import (ARRAYS, DiskBudgetExceeded, FeatureConfig, FeatureStore,
                                     extract, plan_shards, shard_bytes)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dir, tmp_path_factory):
    target, _ = load_target(tiny_hf_dir)
    path = write_sharegpt(tmp_path_factory.mktemp("data") / "d.json", sharegpt_records(12))
    convs, _ = read_conversations(path)
    return target, tokenize_all(load_tokenizer(tiny_hf_dir), convs, max_len=64)


CONFIG = FeatureConfig(top_k=8, shard_tokens=100)


def test_rows_are_the_targets(tiny, tmp_path):
    target, examples = tiny
    extract(target, examples[:3], tmp_path, CONFIG, "tiny")
    store = FeatureStore(tmp_path)
    assert len(store) == 3 and store.complete
    for ex, seq in zip(examples[:3], store):
        n = len(ex.input_ids)
        ids = torch.from_numpy(ex.input_ids.astype(np.int64))[None]
        pos = torch.arange(n)[None]
        with torch.no_grad():
            logits, hidden, feats = target(ids, pos, torch.tensor([n - 1], dtype=torch.int32),
                                           torch.tensor([n], dtype=torch.int32),
                                           torch.tensor(n, dtype=torch.int32), pos,
                                           *empty_cache(target.config, 1, n))[:3]
        np.testing.assert_array_equal(seq.input_ids, ex.input_ids)
        np.testing.assert_array_equal(seq.loss_mask, ex.loss_mask)
        np.testing.assert_allclose(seq.hidden, hidden[0].numpy(), rtol=2e-3, atol=2e-3)
        np.testing.assert_allclose(seq.eagle3, feats[0].numpy(), rtol=2e-3, atol=2e-3)
        probs = logits[0].softmax(-1)
        top = probs.topk(8)
        np.testing.assert_array_equal(seq.topk_ids[:, 0], logits[0].argmax(-1).numpy())
        np.testing.assert_allclose(seq.topk_probs, top.values.numpy(), atol=1e-3)
        assert seq.hidden.dtype == np.float16 and seq.topk_ids.shape == (n, 8)


def read_all(folder):
    store = FeatureStore(folder)
    return {k: np.concatenate([np.asarray(store.arrays(s)[k]) for s in store.shards])
            for k in ARRAYS if k != "offsets"}


def test_resume_after_an_interrupted_run(tiny, tmp_path):
    target, examples = tiny
    clean = extract(target, examples, tmp_path / "clean", CONFIG, "tiny")
    assert clean.shards >= 4 and clean.skipped_shards == 0

    def interrupt(progress):
        if progress.shard == 2:
            raise KeyboardInterrupt

    folder = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        extract(target, examples, folder, CONFIG, "tiny", progress=interrupt)
    # a shard killed half-way, and one renamed but never recorded
    (folder / "shard_00002.tmp").mkdir()
    (folder / "shard_00002.tmp" / "hidden.npy").write_bytes(b"partial")
    (folder / "shard_00003").mkdir()
    seen = []
    report = extract(target, examples, folder, CONFIG, "tiny", progress=seen.append)
    assert report.skipped_shards == 2 and report.shards == clean.shards
    assert [p.shard for p in seen] == list(range(3, clean.shards + 1))
    assert seen[-1].tokens_done == seen[-1].tokens_todo and seen[-1].eta_s == 0
    assert not list(folder.glob("*.tmp"))
    a, b = read_all(tmp_path / "clean"), read_all(folder)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    again = extract(target, examples, folder, CONFIG, "tiny")  # all done: nothing to do
    assert again.skipped_shards == clean.shards and again.tokens == 0
    with pytest.raises(ValueError, match="other settings"):
        extract(target, examples, folder, FeatureConfig(top_k=4, shard_tokens=100), "tiny")


def test_a_larger_budget_extends_the_folder(tiny, tmp_path):
    target, examples = tiny
    small = extract(target, examples[:7], tmp_path, CONFIG, "tiny")
    kept = plan_shards(examples[:7], 100)
    full = plan_shards(examples, 100)
    same = sum(1 for a, b in zip(kept, full) if a == b)  # the last small shard may differ
    assert same >= 2
    grown = extract(target, examples, tmp_path, CONFIG, "tiny")
    assert grown.skipped_shards == same and grown.shards == len(full)
    assert len(FeatureStore(tmp_path)) == len(examples)
    shrunk = extract(target, examples[:7], tmp_path, CONFIG, "tiny")  # back: shards dropped
    assert shrunk.shards == small.shards and len(FeatureStore(tmp_path)) == 7
    assert len([d for d in tmp_path.iterdir() if d.is_dir()]) == small.shards


def test_disk_bound_stops_before_the_shard_that_would_pass_it(tiny, tmp_path):
    target, examples = tiny
    h = target.config.hidden_size
    shard0 = plan_shards(examples, 100)[0]  # whole sequences
    first = sum(len(examples[i].input_ids) for i in shard0)
    bound = shard_bytes(first, h, 8, len(shard0)) + 20_000  # room for shard 0 and the manifest
    config = FeatureConfig(top_k=8, shard_tokens=100, max_disk_bytes=bound)
    with pytest.raises(DiskBudgetExceeded, match=r"stopping before shard_00001: .* kB bound; "
                                                 r"1 of \d+ shards are done"):
        extract(target, examples, tmp_path, config, "tiny")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert list(manifest["done"]) == ["shard_00000"]
    assert FeatureStore(tmp_path).complete is False
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) <= bound


def test_bad_settings_quote_the_value():
    with pytest.raises(ValueError, match="top_k 0: must be in 1..1024"):
        FeatureConfig(top_k=0)
