"""train/eagle3.py on the tiny target: the training forward is the exported head's cache
forward (step 0 and every unrolled step), training lowers the loss and resumes exactly, and
the trained head loads, exports and drafts losslessly."""

import dataclasses

import numpy as np
import pytest
import torch

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.export.checkpoint import load_target
from trt_spec.export.drafter_checkpoint import load_drafter
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train.data import tokenize_all
from trt_spec.train.eagle3 import draft_vocab, init_eagle3, target_to_draft, train_eagle3
from trt_spec.train.loop import lr_factor
from trt_spec.train.unroll import unroll
from trt_spec.train.features import FeatureConfig, FeatureStore, extract
from trt_spec.train.loop import RunControl, TrainConfig
from trt_spec.runtime.scheduler import generate_ids

STEPS = 3


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(tiny_hf_dir)[0]


@pytest.fixture(scope="module")
def store(target, tiny_hf_dir, tmp_path_factory):
    path = write_sharegpt(tmp_path_factory.mktemp("data") / "d.json", sharegpt_records(16))
    convs, _ = read_conversations(path)
    examples = tokenize_all(load_tokenizer(tiny_hf_dir), convs, max_len=64)
    folder = tmp_path_factory.mktemp("features")
    extract(target, examples, folder, FeatureConfig(top_k=16, shard_tokens=300), "tiny")
    return FeatureStore(folder)


def cache_forward(drafter, ids: torch.Tensor, feats: torch.Tensor, anchor: int, steps: int):
    """The exported module's way: prefill rows 0..anchor, then one loop row per step
    (teacher-forced tokens). -> [step 0 logits [anchor + 1, V], step j logits [V] ...]."""
    step, c = drafter.modules[0], drafter.config
    max_len = anchor + steps + 1
    key = torch.zeros(1, c.num_kv_heads, max_len, c.head_dim)
    value = torch.zeros_like(key)
    total = torch.tensor(max_len, dtype=torch.int32)
    rows = anchor + 1
    pos = torch.arange(rows)[None]
    logits, h, key, value = step(ids[None, 1:rows + 1], drafter.fc(feats[None, :rows]), pos,
                                 torch.tensor([rows - 1], dtype=torch.int32),
                                 torch.tensor([rows], dtype=torch.int32), total, pos, key, value)
    out, hidden = [logits[0]], h[:, -1:]
    for j in range(1, steps):
        p = anchor + j
        logits, hidden, key, value = step(
            ids[None, p + 1:p + 2], hidden, torch.tensor([[p]]),
            torch.tensor([p], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), total,
            torch.tensor([[0]]), key, value)
        out.append(logits[0, 0])
    return out


def random_head(target, seed=3):
    counts = np.random.default_rng(seed).integers(0, 50, target.config.vocab_size)
    d2t, _ = draft_vocab(counts, 40)
    drafter = init_eagle3(target, d2t, seed=seed)
    with torch.no_grad():  # move the norms off 1 so a mix-up of them shows
        for name, p in drafter.modules[0].named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


@pytest.mark.parametrize("anchor", [0, 5, 20])
def test_unroll_is_the_cache_forward(target, store, anchor):
    drafter = random_head(target)
    seq = store[0]
    ids = torch.from_numpy(seq.input_ids.astype(np.int64))
    feats = torch.from_numpy(seq.eagle3.astype(np.float32))
    assert anchor + STEPS + 1 < len(ids)
    with torch.no_grad():
        train = unroll(drafter.modules[0], ids[None], drafter.fc(feats[None]), STEPS)
        cached = cache_forward(drafter, ids, feats, anchor, STEPS)
    torch.testing.assert_close(train[0][0][0, :anchor + 1], cached[0], rtol=1e-4, atol=1e-4)
    for j in range(1, STEPS):
        torch.testing.assert_close(train[j][0][0, anchor], cached[j], rtol=1e-4, atol=1e-4)


def test_draft_vocab_layout():
    counts = np.array([5, 0, 9, 9, 1, 7])
    d2t, t2d = draft_vocab(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [2, 3, 5]  # most frequent, in id order
    assert t2d.tolist() == [False, False, True, True, False, True]
    assert target_to_draft(d2t, 6).tolist() == [-1, -1, 0, 1, -1, 2]
    assert (torch.arange(6) + draft_vocab(counts, 6)[0]).tolist() == list(range(6))
    with pytest.raises(ValueError, match="draft vocabulary size 7: must be in 1..6"):
        draft_vocab(counts, 7)


CONFIG = TrainConfig(epochs=12, batch_size=4, lr=3e-3, warmup_steps=4, checkpoint_every=10,
                     ttt_steps=STEPS)


@pytest.fixture(scope="module")
def trained(target, store, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3-run")
    logs = []
    metrics = train_eagle3(store, target, out, CONFIG, draft_vocab_size=48,
                           run=RunControl(log=logs.append))
    return out, logs, metrics


def test_training_lowers_the_loss(trained):
    _, logs, metrics = trained
    assert metrics["done"] and metrics["step"] == logs[-1].total == len(logs)
    first = np.mean([s.metrics["loss"] for s in logs[:4]])
    last = np.mean([s.metrics["loss"] for s in logs[-4:]])
    assert last < 0.8 * first, (first, last)
    assert last / first < 0.8
    assert 0 < metrics["draft_vocab_coverage"] <= 1
    assert logs[-1].lr < logs[5].lr  # the cosine went down


def test_bf16_autocast_trains_like_fp32(target, store, trained, tmp_path):
    # the same run under bf16 autocast: its loss curve follows fp32's, and it still learns
    _, logs, _ = trained
    amp_logs = []
    train_eagle3(store, target, tmp_path, dataclasses.replace(CONFIG, amp=True), 48,
                 RunControl(log=amp_logs.append))
    fp32 = np.array([s.metrics["loss"] for s in logs])
    bf16 = np.array([s.metrics["loss"] for s in amp_logs])
    assert abs(bf16[0] - fp32[0]) < 0.02 * fp32[0]
    assert np.mean(bf16[-4:]) < 0.8 * np.mean(bf16[:4])
    assert abs(np.mean(bf16[-4:]) - np.mean(fp32[-4:])) < 0.1 * np.mean(fp32[-4:])


class StepClock:
    """time.perf_counter for train/loop.py that advances 10 ms a call: the loop's steps take
    the same time however loaded the machine is (the fitted length is then the same too)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.01
        return self.now


def test_fit_schedule_ends_the_cosine_at_the_time_limit(target, store, tmp_path, monkeypatch):
    from trt_spec.train import loop

    monkeypatch.setattr(loop, "time", StepClock())
    config = dataclasses.replace(CONFIG, epochs=200, fit_schedule=True)
    logs = []
    metrics = train_eagle3(store, target, tmp_path, config, 48,
                           RunControl(log=logs.append, max_seconds=1.5))
    assert metrics["done"] and metrics["step"] == metrics["total_steps"]
    assert metrics["total_steps"] < logs[0].total  # shortened from the 200 epochs' length
    total = metrics["total_steps"]  # the last step ran the schedule's last lr, near its floor
    assert logs[-1].lr == pytest.approx(config.lr * lr_factor(total - 1, total, config))
    assert logs[-1].lr < 1.2 * config.lr * config.min_lr_ratio
    state = torch.load(tmp_path / "eagle3-state.pt", weights_only=False)
    assert state["total"] == metrics["total_steps"]


def test_resume_gives_the_uninterrupted_result(target, store, trained, tmp_path):
    out_clean = trained[0]

    def killed_at_step_17(log):
        if log.step == 17:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle3(store, target, tmp_path, CONFIG, 48, RunControl(log=killed_at_step_17))
    assert torch.load(tmp_path / "eagle3-state.pt", weights_only=False)["step"] == 10
    train_eagle3(store, target, tmp_path, CONFIG, 48, RunControl(resume=True))
    a = load_drafter(out_clean / "eagle3", "eagle3", target)
    b = load_drafter(tmp_path / "eagle3", "eagle3", target)
    for (name, x), (_, y) in zip(a.modules[0].state_dict().items(),
                                 b.modules[0].state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(a.fc.fc.weight, b.fc.fc.weight, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="written by another run"):
        train_eagle3(store, target, tmp_path, dataclasses.replace(CONFIG, lr=1e-3), 48,
                     RunControl(resume=True))


def test_trained_head_loads_with_the_training_numbers(target, store, trained):
    out, _, _ = trained
    loaded = load_drafter(out / "eagle3", "eagle3", target)
    assert len(loaded.d2t) == 48 and loaded.feature_layers == store.feature_layers
    seq = store[1]
    ids = torch.from_numpy(seq.input_ids.astype(np.int64))
    feats = torch.from_numpy(seq.eagle3.astype(np.float32))
    with torch.no_grad():
        train = unroll(loaded.modules[0], ids[None], loaded.fc(feats[None]), 1)[0][0][0]
        cached = cache_forward(loaded, ids, feats, len(ids) - 2, 1)[0]
    torch.testing.assert_close(train[:len(ids) - 1], cached, rtol=1e-4, atol=1e-4)


def test_trained_head_exports_and_drafts_losslessly(tiny_hf_dir, trained, tmp_path):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.settings import SpeculationConfig
    from trt_spec.runtime.sampling import SamplingParams

    out, _, _ = trained
    engine = export_model(ExportConfig(str(tiny_hf_dir), tmp_path / "engine", "fp32",
                                       drafters={"eagle3": out / "eagle3"}))
    prompts = [[3, 8, 9, 10, 4, 3, 6, 40, 43], [3, 8, 20, 21, 22, 4, 3, 6]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = generate_ids(Generator(engine, max_batch=2), prompts, params)
    spec = Generator(engine, method="eagle3", max_batch=2,
                     speculation=SpeculationConfig(num_draft_tokens=3, min_acceptance=0))
    streams = generate_ids(spec, prompts, params)
    assert [s.output_ids for s in streams] == [s.output_ids for s in plain]
    assert sum(s.stats.proposed_per_position[0] for s in streams) > 0  # it did draft


def test_evaluate_prefers_the_trained_head(target, store, trained, tmp_path):
    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.train.eagle3 import evaluate_eagle3

    out, _, _ = trained
    head = load_drafter(out / "eagle3", "eagle3", target)
    save_drafter(init_eagle3(target, head.d2t, seed=0, feature_layers=head.feature_layers),
                 tmp_path / "untrained")
    after = evaluate_eagle3(store, target, out / "eagle3", CONFIG)
    before = evaluate_eagle3(store, target, tmp_path / "untrained", CONFIG)
    assert after["loss"] < before["loss"] and after["acc_0"] > before["acc_0"]
    assert set(after) == {"loss", *(f"{m}_{j}" for m in ("loss", "acc") for j in range(STEPS))}


def test_lr_schedule():
    from trt_spec.train.loop import lr_factor

    config = TrainConfig(warmup_steps=20, min_lr_ratio=0.1)
    long = [lr_factor(s, 1000, config) for s in range(1000)]
    assert long[0] == pytest.approx(1 / 20) and long[19] == 1.0 and long[-1] == pytest.approx(0.1, abs=1e-4)
    assert all(a >= b for a, b in zip(long[19:], long[20:]))  # cosine: never up
    short = [lr_factor(s, 21, config) for s in range(21)]
    assert short[1] == 1.0 and short[-1] < 0.2  # a 21-step run warms up for 2 steps only
