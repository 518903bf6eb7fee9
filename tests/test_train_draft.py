"""The vanilla draft trainer, the target's own answers (train/regen.py) and live features
(train/live.py) on the tiny target."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.export.checkpoint import load_target
from trt_spec.export.model import empty_cache
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train.data import tokenize_all
from trt_spec.train.draft import draft_loss, init_draft, train_draft
from trt_spec.train.features import FeatureConfig, FeatureStore, extract
from trt_spec.train.forward import causal_forward
from trt_spec.train.live import LiveFeatures
from trt_spec.train.loop import TrainConfig, collate
from trt_spec.runtime.scheduler import generate_ids

CONFIG = TrainConfig(epochs=3, batch_size=4, lr=3e-3, warmup_steps=2, checkpoint_every=5)


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(tiny_hf_dir)[0]


@pytest.fixture(scope="module")
def examples(tiny_hf_dir, tmp_path_factory):
    path = write_sharegpt(tmp_path_factory.mktemp("data") / "d.json", sharegpt_records(24))
    convs, _ = read_conversations(path)
    return tokenize_all(load_tokenizer(tiny_hf_dir), convs, max_len=64)


@pytest.fixture(scope="module")
def store(target, examples, tmp_path_factory):
    folder = tmp_path_factory.mktemp("features")
    extract(target, examples, folder, FeatureConfig(top_k=16, shard_tokens=300), "tiny")
    return FeatureStore(folder)


def test_causal_forward_is_the_cached_prefill(target):
    """Batched, right-padded: each row's real tokens get the exported forward's values."""
    ids = [torch.tensor([3, 8, 9, 10, 4, 3, 6, 40]), torch.tensor([5, 7, 11, 12, 30])]
    batch = torch.zeros(2, 8, dtype=torch.long)
    for i, x in enumerate(ids):
        batch[i, :len(x)] = x
    with torch.no_grad():
        hidden, eagle3 = causal_forward(target, batch, want_features=True)
        for i, x in enumerate(ids):
            n = len(x)
            pos = torch.arange(n)[None]
            out = target(x[None], pos, torch.tensor([n - 1], dtype=torch.int32),
                         torch.tensor([n], dtype=torch.int32), torch.tensor(n, dtype=torch.int32),
                         pos, *empty_cache(target.config, 1, n))
            torch.testing.assert_close(hidden[i, :n], out[1][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(eagle3[i, :n], out[2][0], rtol=1e-5, atol=1e-5)


def test_live_features_are_the_cached_ones(target, store, examples):
    """The same rows with --features live as read back from disk (both rounded via fp16)."""
    live = LiveFeatures(target, examples, 16, "cpu")
    assert len(live) == len(store) and live.tokens == store.tokens
    idx = [0, 3, 5]
    a, b = live.batch(idx), collate([store[i] for i in idx])
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    for name in ("hidden", "eagle3", "topk_probs"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=2e-3, atol=2e-3)
    agree = (a.topk_ids[..., 0] == b.topk_ids[..., 0]).float().mean()
    assert agree > 0.99


def test_init_draft_is_the_truncated_target(target):
    draft = init_draft(target, (0, 1))
    assert draft.config.num_layers == 2
    assert torch.equal(draft.layers[1].qkv_proj.weight, target.layers[1].qkv_proj.weight)
    assert not draft.embed_tokens.weight.requires_grad
    with pytest.raises(ValueError, match="each in 0..3"):
        init_draft(target, (0, 9))


@pytest.fixture(scope="module")
def trained(target, store, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    with torch.no_grad():
        before = draft_loss(init_draft(target, (0, 3)), collate([store[i] for i in range(8)]))[0]
    metrics = train_draft(store, target, out, CONFIG, (0, 3))
    return out, float(before), metrics


def test_draft_training_lowers_the_loss(trained, target, store):
    from trt_spec.export.drafter_checkpoint import load_draft

    out, before, metrics = trained
    assert metrics["done"]
    draft = load_draft(out / "draft", target)
    with torch.no_grad():
        after = draft_loss(draft, collate([store[i] for i in range(8)]))[0]
    assert float(after) < before
    saved = json.loads((out / "draft" / "drafter.json").read_text())
    assert saved["kind"] == "draft" and saved["source_layers"] == [0, 3]
    from safetensors import safe_open
    with safe_open(str(out / "draft" / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" not in f.keys()  # the target's: not shipped twice


def test_trained_draft_exports_and_drafts_losslessly(tiny_hf_dir, trained, target, tmp_path):
    from trt_spec.export.drafter_checkpoint import load_draft
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.backends.ort import OrtTarget
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.step_inputs import SlotTokens
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.settings import SpeculationConfig
    from trt_spec.runtime.sampling import SamplingParams

    out, _, _ = trained
    engine = export_model(ExportConfig(str(tiny_hf_dir), tmp_path / "engine", "fp32",
                                       drafters={"vanilla": out / "draft"}))
    manifest = json.loads((engine / "manifest.json").read_text())
    assert "trained draft" in manifest["drafters"]["vanilla"]["kind"]
    # the exported draft graph computes the torch draft's logits at every prompt position
    draft = load_draft(out / "draft", target)
    ids = [3, 8, 9, 10, 4, 3, 6]
    with torch.no_grad():
        want = draft.head(causal_forward(draft, torch.tensor([ids]))[0])[0].numpy()
    graph = OrtTarget(engine / "draft.onnx", draft.config.num_layers,
                      draft.config.max_position_embeddings)
    cache = KVCache(draft.config, slots=1, max_len=32)
    slot = cache.allocate()
    got = [graph.step(cache, [SlotTokens(slot, ids[:4], list(range(4)))]).logits[0],
           graph.step(cache, [SlotTokens(slot, ids[4:], list(range(3)))]).logits[0]]
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4)
    prompts = [[3, 8, 9, 10, 4, 3, 6, 40, 43], [3, 8, 20, 21, 22, 4, 3, 6]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = generate_ids(Generator(engine, max_batch=2), prompts, params)
    spec = Generator(engine, method="vanilla", max_batch=2,
                     speculation=SpeculationConfig(num_draft_tokens=3, min_acceptance=0))
    streams = generate_ids(spec, prompts, params)
    assert [s.output_ids for s in streams] == [s.output_ids for s in plain]
    assert sum(s.stats.proposed_per_position[0] for s in streams) > 0


def test_regenerated_answers_resume(tiny_hf_dir, target, tmp_path):
    from trt_spec.train.regen import RegenConfig, read_done, regenerate

    path = write_sharegpt(tmp_path / "d.json", sharegpt_records(6))
    convs, _ = read_conversations(path)
    tok = load_tokenizer(tiny_hf_dir)
    out = tmp_path / "answers.jsonl"
    config = RegenConfig(max_new_tokens=6, batch_size=4)
    stop = list(target.config.eos_token_ids)
    first = regenerate(tiny_hf_dir, tok, convs[:4], out, stop, config)
    assert [c.id for c in first] == [c.id for c in convs[:4]]
    for conv, orig in zip(first, convs):
        assert conv.messages[0] == orig.messages[0]  # the prompt is kept
        assert conv.messages[-1]["role"] == "assistant" and len(conv.messages) == 2
    # greedy: the answer is the target's own greedy continuation of the prompt
    import transformers
    model = transformers.LlamaForCausalLM.from_pretrained(str(tiny_hf_dir)).eval()
    prompt = tok.encode_chat(list(first[0].messages[:1]))
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                             eos_token_id=stop, pad_token_id=stop[0])[0, len(prompt):].tolist()
    ref = ref[:next((i for i, t in enumerate(ref) if t in stop), len(ref))]
    assert first[0].messages[-1]["content"] == tok.decode(ref)
    # a torn last line is dropped and redone; finished ones are not generated again
    text = out.read_text()
    out.write_text(text + '{"id": "torn')
    assert len(read_done(out)) == 4
    again = regenerate(tiny_hf_dir, tok, convs, out, stop, config)
    assert [c.id for c in again][:4] == [c.id for c in first]
    assert len(out.read_text().splitlines()) == 6


def test_train_all_methods_from_the_cli(tiny_hf_dir, tmp_path):
    from trt_spec.cli import main

    data = write_sharegpt(tmp_path / "d.json", sharegpt_records(80))
    args = ["train", "--method", "all", "--model", str(tiny_hf_dir), "--data", str(data),
            "--out", str(tmp_path / "run"), "--answers", "target", "--answer-tokens", "8",
            "--max-conversations", "40", "--max-tokens", "600", "--max-len", "48",
            "--draft-vocab", "48", "--batch-size", "4", "--top-k", "8", "--max-steps", "2",
            "--num-modules", "2", "--draft-layers", "0,1", "--head-intermediate", "32",
            "--features", "live"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"eagle3", "mtp", "eagle", "draft"}
    assert "answers: " in result.stderr
    for method in out:
        assert (tmp_path / "run" / method / "drafter.json").is_file()
    eagle3 = json.loads((tmp_path / "run" / "eagle3" / "drafter.json").read_text())
    assert eagle3["layer_config"]["intermediate_size"] == 32
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["draft"]["answers"] == "target" and metrics["draft"]["step"] == 2
    bad = CliRunner().invoke(main, args[:2] + ["eagle3,vanilla"] + args[3:])
    assert bad.exit_code != 0 and "'eagle3,vanilla'" in bad.output and "draft" in bad.output
