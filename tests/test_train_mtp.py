"""train/mtp.py on the tiny target: MTP's chained forward and Eagle's unroll are the exported
modules' cache forwards; training lowers the loss; the modules export and draft losslessly."""

import numpy as np
import pytest
import torch

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.export.checkpoint import load_target
from trt_spec.export.drafter_checkpoint import load_drafter
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train.data import tokenize_all
from trt_spec.train.features import FeatureConfig, FeatureStore, extract
from trt_spec.train.loop import RunControl, TrainConfig
from trt_spec.train.mtp import init_mtp, train_mtp
from trt_spec.train.unroll import unroll
from trt_spec.runtime.scheduler import generate_ids


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(tiny_hf_dir)[0]


@pytest.fixture(scope="module")
def store(target, tiny_hf_dir, tmp_path_factory):
    path = write_sharegpt(tmp_path_factory.mktemp("data") / "d.json", sharegpt_records(16, seed=5))
    convs, _ = read_conversations(path)
    examples = tokenize_all(load_tokenizer(tiny_hf_dir), convs, max_len=64)
    folder = tmp_path_factory.mktemp("features")
    extract(target, examples, folder, FeatureConfig(top_k=16, shard_tokens=400), "tiny")
    return FeatureStore(folder)


def module_forward(module, tokens: torch.Tensor, hidden: torch.Tensor, start: int = 0,
                   key=None, value=None, max_len: int = 128):
    """The exported module over rows start .. start + len(tokens) - 1 of its cache."""
    c = module.config
    if key is None:
        key = torch.zeros(1, c.num_kv_heads, max_len, c.head_dim)
        value = torch.zeros_like(key)
    n = len(tokens)
    pos = torch.arange(start, start + n)[None]
    return module(tokens[None], hidden[None], pos, torch.tensor([start + n - 1], dtype=torch.int32),
                  torch.tensor([n], dtype=torch.int32), torch.tensor(max_len, dtype=torch.int32),
                  torch.arange(n)[None], key, value)


def perturbed(drafter):
    with torch.no_grad():
        for m in drafter.modules:
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


def test_mtp_chain_is_the_cache_forward(target, store):
    drafter = perturbed(init_mtp(target, 3, seed=1))
    seq = store[0]
    ids = torch.from_numpy(seq.input_ids.astype(np.int64))
    n = len(ids)
    with torch.no_grad():
        hidden_train = torch.from_numpy(seq.hidden.astype(np.float32))[None]
        hidden_cache = hidden_train[0]
        for i, module in enumerate(drafter.modules):
            logits_t, hidden_train = unroll(module, ids[None], hidden_train, 1, token_offset=i)[0]
            rows = n - i - 1  # row p reads x_{p+i+1}
            logits_c, hidden_cache, _, _ = module_forward(module, ids[i + 1:], hidden_cache[:rows])
            torch.testing.assert_close(logits_t[0, :rows], logits_c[0], rtol=1e-4, atol=1e-4)
            hidden_cache = hidden_cache[0]


@pytest.mark.parametrize("anchor", [3, 17])
def test_eagle_unroll_is_the_cache_loop(target, store, anchor):
    drafter = perturbed(init_mtp(target, 1, seed=2, kind="eagle"))
    module = drafter.modules[0]
    seq = store[1]
    ids = torch.from_numpy(seq.input_ids.astype(np.int64))
    hidden = torch.from_numpy(seq.hidden.astype(np.float32))
    with torch.no_grad():
        train = unroll(module, ids[None], hidden[None], 3)
        logits, h, key, value = module_forward(module, ids[1:anchor + 2], hidden[:anchor + 1])
        torch.testing.assert_close(train[0][0][0, :anchor + 1], logits[0], rtol=1e-4, atol=1e-4)
        h = h[0, -1:]
        for j in (1, 2):
            logits, h, key, value = module_forward(module, ids[anchor + j + 1:anchor + j + 2], h,
                                                   start=anchor + j, key=key, value=value)
            h = h[0]
            torch.testing.assert_close(train[j][0][0, anchor], logits[0, 0], rtol=1e-4, atol=1e-4)


CONFIG = TrainConfig(epochs=10, batch_size=4, lr=3e-3, warmup_steps=4, checkpoint_every=100,
                     ttt_steps=3)


@pytest.fixture(scope="module")
def heads(target, store, tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp-run")
    logs = {}
    for kind in ("mtp", "eagle"):
        logs[kind] = []
        train_mtp(store, target, out, CONFIG, kind, num_modules=3,
                  run=RunControl(log=logs[kind].append))
    return out, logs


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_training_lowers_the_loss(heads, kind):
    logs = heads[1][kind]
    first = np.mean([s.metrics["loss"] for s in logs[:3]])
    last = np.mean([s.metrics["loss"] for s in logs[-3:]])
    assert last < 0.8 * first, (kind, first, last)


def test_trained_modules_export_and_draft_losslessly(tiny_hf_dir, target, heads, tmp_path):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.settings import SpeculationConfig
    from trt_spec.runtime.sampling import SamplingParams

    out, _ = heads
    assert len(load_drafter(out / "mtp", "mtp", target).modules) == 3
    engine = export_model(ExportConfig(str(tiny_hf_dir), tmp_path / "engine", "fp32",
                                       drafters={"mtp": out / "mtp", "eagle": out / "eagle"}))
    prompts = [[3, 8, 9, 10, 4, 3, 6, 40, 43], [3, 8, 20, 21, 22, 4, 3, 6]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [s.output_ids for s in generate_ids(Generator(engine, max_batch=2), prompts, params)]
    for method in ("mtp", "eagle"):
        gen = Generator(engine, method=method, max_batch=2,
                        speculation=SpeculationConfig(num_draft_tokens=4, min_acceptance=0))
        streams = generate_ids(gen, prompts, params)
        assert [s.output_ids for s in streams] == plain, method
        assert sum(s.stats.proposed_per_position[0] for s in streams) > 0, method
