"""train/engine_target.py on the tiny target's fp32 engine: the engine generator answers what
the torch generator answers (slots refilled, a conversation continued in its slot), the
engine's features are the torch target's, the distill stage runs on it, and drafters
fine-tune from saved ones (--init-from)."""

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.cli import main
from trt_spec.export.checkpoint import load_target
from trt_spec.export.drafter_checkpoint import load_drafter
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train import distill_data
from trt_spec.train.batch_generate import BatchedGenerator, Continue, Job
from trt_spec.train.data import Example, tokenize_all
from trt_spec.train.distill_data import DistillConfig
from trt_spec.train.eagle3 import train_eagle3
from trt_spec.train.engine_target import EngineFeatures, EngineGenerator, EngineTarget
from trt_spec.train.live import LiveFeatures
from trt_spec.train.loop import RunControl, TrainConfig
from trt_spec.train.mtp import train_mtp


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(tiny_hf_dir)[0]


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return EngineTarget(tiny_engine)


def answers(gen, jobs, on_answer=None):
    got = {}

    def record(a):
        got[a.key] = a
        return on_answer(a) if on_answer else None

    gen.run(jobs, set(), record)
    return got


def test_engine_generator_answers_what_the_torch_generator_does(target, engine):
    # 5 jobs through 2 slots (finished ones leave, the tail moves into the freed slot), and a
    # sequence that goes on in its slot with the tokens of a next turn
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.config.vocab_size, size=n).tolist() for n in (3, 9, 5, 12, 7)]
    budgets = [6, 2, 9, 4, 7]

    def go_on(a):
        return Continue("next", [7, 8, 3], 5) if a.key == 0 else None

    got = {}
    for name, gen in (("torch", BatchedGenerator(target, 2, 48, dtype=torch.float32)),
                      ("engine", EngineGenerator(engine, 2, 48))):
        got[name] = answers(gen, [Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))],
                            go_on)
    assert set(got["engine"]) == set(got["torch"]) == {0, 1, 2, 3, 4, "next"}
    for key, a in got["torch"].items():
        assert got["engine"][key].tokens == a.tokens, key
    assert [len(got["engine"][i].tokens) for i in range(5)] == budgets


def test_engine_generator_samples_at_the_temperature(engine):
    gen = EngineGenerator(engine, 4, 32, seed=3)
    logits = torch.tensor([[0.0, 2.0, 1.0]] * 4)
    draws = torch.cat([gen.sample(logits, torch.ones(4)) for _ in range(400)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.06)


def test_engine_features_are_the_targets(target, engine):
    rng = np.random.default_rng(1)
    examples = [Example(f"e{i}", rng.integers(3, 128, n).astype(np.int32),
                        rng.random(n) > 0.3) for i, n in enumerate((30, 17, 41))]
    layers = tuple(target.config.eagle3_layers)
    ours = EngineFeatures(engine, examples, 8, layers).batch([0, 1, 2])
    ref = LiveFeatures(target, examples, 8, "cpu").batch([0, 1, 2])
    assert torch.equal(ours.input_ids, ref.input_ids) and torch.equal(ours.loss_mask, ref.loss_mask)
    assert torch.equal(ours.lengths, ref.lengths)
    for name in ("hidden", "eagle3", "topk_probs"):
        a, b = getattr(ours, name), getattr(ref, name)
        assert a.shape == b.shape, name
        assert float((a - b).abs().max()) <= 2e-3 * max(1.0, float(b.abs().max())), name
    real = ref.loss_mask | (torch.arange(ref.input_ids.shape[1])[None] < ref.lengths[:, None])
    assert torch.equal(ours.topk_ids[..., 0][real], ref.topk_ids[..., 0][real])
    assert (ours.hidden[1, 17:] == 0).all()  # padding stays zero
    with pytest.raises(ValueError, match="no examples"):
        EngineFeatures(engine, [], 8, layers)


def test_engine_refuses_another_models_target(engine, target):
    import dataclasses

    other = dataclasses.replace(target.config, hidden_size=target.config.hidden_size * 2)
    with pytest.raises(ValueError, match="hidden_size"):
        engine.check_model(other)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        EngineTarget(engine.folder.parent)


def test_distill_on_the_engine_writes_shards_and_keeps_them_apart(target, engine,
                                                                 tiny_hf_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_hf_dir)
    convs = read_conversations(write_sharegpt(tmp_path / "d.json",
                                              sharegpt_records(4, turns=2)))[0]
    stop = [tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]]
    config = DistillConfig(samples=1, max_new_tokens=5, max_context=200, shard_conversations=2,
                           slots=3, backend="engine")
    out = tmp_path / "answers"
    assert distill_data.distill(target, tokenizer, convs, out, stop, config, model_id="t",
                                engine=engine) == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["engine"] == engine.identity and "dtype" not in manifest
    rebuilt = distill_data.conversations(out, convs, tokenizer)
    assert {c.id for c in rebuilt} == {f"{c.id}#{v}" for c in convs for v in (0, 1)}
    # the greedy answers are the engine's: the fp32 torch generator gives the same tokens
    torch_out = tmp_path / "torch"
    distill_data.distill(target, tokenizer, convs, torch_out, stop,
                         DistillConfig(samples=0, max_new_tokens=5, max_context=200,
                                       shard_conversations=2, slots=3, dtype="float32"),
                         model_id="t")
    greedy = {c.id: c.messages for c in distill_data.conversations(torch_out, convs, tokenizer)}
    for c in rebuilt:
        if c.id.endswith("#0"):
            assert c.messages == greedy[c.id], c.id
    with pytest.raises(ValueError, match="other settings"):  # never a mix of the two
        distill_data.distill(target, tokenizer, convs, out, stop, DistillConfig(
            samples=1, max_new_tokens=5, max_context=200, shard_conversations=2, slots=3),
            model_id="t")
    with pytest.raises(ValueError, match="no engine folder"):
        distill_data.distill(target, tokenizer, convs, tmp_path / "x", stop, config, model_id="t")


@pytest.fixture(scope="module")
def engine_store(target, engine, tiny_hf_dir, tmp_path_factory):
    path = write_sharegpt(tmp_path_factory.mktemp("data") / "d.json", sharegpt_records(12))
    examples = tokenize_all(load_tokenizer(tiny_hf_dir), read_conversations(path)[0], max_len=64)
    return EngineFeatures(engine, examples, 16, tuple(target.config.eagle3_layers))


CONFIG = TrainConfig(epochs=3, batch_size=4, lr=3e-3, warmup_steps=2, ttt_steps=2)


def same_weights(a, b) -> bool:
    return all(torch.allclose(x.float(), y.float(), atol=1e-6)
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_eagle3_fine_tunes_from_a_saved_head(target, engine_store, tmp_path):
    first = tmp_path / "first"
    train_eagle3(engine_store, target, first, CONFIG, draft_vocab_size=48)
    saved = load_drafter(first / "eagle3", "eagle3", target)
    # a near-zero learning rate: the fine-tuned head is the saved one, draft vocabulary and all
    # (the draft_vocab_size asked for is the saved head's, not 40)
    still = tmp_path / "still"
    metrics = train_eagle3(engine_store, target, still, TrainConfig(
        epochs=1, batch_size=4, lr=1e-12, warmup_steps=0, ttt_steps=2), 40,
        RunControl(max_steps=1), init=first / "eagle3")
    again = load_drafter(still / "eagle3", "eagle3", target)
    assert torch.equal(again.d2t, saved.d2t) and len(again.d2t) == 48
    assert same_weights(again.modules[0], saved.modules[0]) and same_weights(again.fc, saved.fc)
    assert metrics["step"] == 1
    # with a real learning rate the weights move, the embedding stays the target's
    moved = tmp_path / "moved"
    train_eagle3(engine_store, target, moved, CONFIG, 48, RunControl(max_steps=3),
                 init=first / "eagle3")
    tuned = load_drafter(moved / "eagle3", "eagle3", target)
    assert not same_weights(tuned.modules[0], saved.modules[0])
    assert torch.equal(tuned.modules[0].embed_tokens.weight, target.embed_tokens.weight)


def test_mtp_fine_tunes_from_saved_modules(target, engine_store, tmp_path):
    first = tmp_path / "first"
    train_mtp(engine_store, target, first, CONFIG, "mtp", num_modules=2)
    saved = load_drafter(first / "mtp", "mtp", target)
    still = tmp_path / "still"
    train_mtp(engine_store, target, still, TrainConfig(epochs=1, batch_size=4, lr=1e-12,
                                                       warmup_steps=0),
              "mtp", num_modules=3, run=RunControl(max_steps=1), init=first / "mtp")
    again = load_drafter(still / "mtp", "mtp", target)
    assert len(again.modules) == 2  # the saved drafter's count, not num_modules
    assert all(same_weights(a, b) for a, b in zip(again.modules, saved.modules))


@pytest.fixture
def cli_args(tiny_hf_dir, tmp_path):
    data = write_sharegpt(tmp_path / "d.json", sharegpt_records(30))
    return ["train", "--model", str(tiny_hf_dir), "--data", str(data), "--max-tokens", "300",
            "--max-len", "48", "--batch-size", "4", "--top-k", "8", "--draft-vocab", "48"]


def test_cli_trains_on_engine_features_then_fine_tunes(cli_args, tiny_engine, tmp_path):
    first = CliRunner().invoke(main, cli_args + [
        "--method", "eagle3,mtp", "--out", str(tmp_path / "a"), "--features", "engine",
        "--engine", str(tiny_engine), "--num-modules", "2"])
    assert first.exit_code == 0, first.output
    tuned = CliRunner().invoke(main, cli_args + [
        "--method", "eagle3,mtp", "--out", str(tmp_path / "b"), "--features", "engine",
        "--engine", str(tiny_engine), "--init-from", str(tmp_path / "a"), "--max-steps", "2"])
    assert tuned.exit_code == 0, tuned.output
    metrics = json.loads(tuned.stdout)
    assert metrics["eagle3"]["step"] == 2 and metrics["mtp"]["step"] == 2


@pytest.mark.parametrize("extra, message", [
    (["--features", "engine"], "--features engine need --engine FOLDER"),
    (["--answers", "distill", "--gen-backend", "engine", "--answer-tokens", "16"],
     "--gen-backend engine need --engine"),
    (["--gen-backend", "onnx"], "Invalid value for '--gen-backend'"),
])
def test_cli_engine_options_say_what_is_missing(cli_args, tmp_path, extra, message):
    result = CliRunner().invoke(main, cli_args + ["--method", "eagle3", "--out",
                                                  str(tmp_path / "r")] + extra)
    assert result.exit_code != 0 and message in result.output, result.output


def test_cli_init_from_names_the_missing_drafter(cli_args, tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(main, cli_args + ["--method", "mtp", "--out", str(tmp_path / "r"),
                                                  "--init-from", str(tmp_path / "empty")])
    assert result.exit_code != 0
    assert "no mtp drafter there" in result.output, result.output


def test_a_signal_stops_training_after_the_step_with_its_state_saved(target, engine_store,
                                                                     tmp_path):
    # SIGTERM (as `kill` or a job system sends it) in the middle of step 2: the step finishes,
    # its state is saved, the run stops with Stopped; --resume then finishes it, and the
    # result is the uninterrupted run's
    import os
    import signal

    from trt_spec.train.loop import Stopped, train_loop

    config = TrainConfig(epochs=2, batch_size=4, lr=3e-3, warmup_steps=1, ttt_steps=2,
                         checkpoint_every=1000)

    def run(out, resume=False, signal_at=None):
        from trt_spec.train.eagle3 import draft_vocab, eagle3_loss, init_eagle3, target_to_draft

        d2t, _ = draft_vocab(np.ones(target.config.vocab_size), 48)
        drafter = init_eagle3(target, d2t)
        index = target_to_draft(d2t, target.config.vocab_size)
        calls = []

        def loss(batch):
            calls.append(1)
            if len(calls) == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)
            return eagle3_loss(drafter, batch, index, 2, 0.8)

        metrics = train_loop(engine_store, {"fc": drafter.fc, "step": drafter.modules[0]}, loss,
                             config, out / "state.pt", {}, RunControl(resume=resume))
        return metrics, drafter

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match="stopped at step 2 of"):
        run(tmp_path, signal_at=2)
    assert torch.load(tmp_path / "state.pt", weights_only=False)["step"] == 2
    resumed, a = run(tmp_path, resume=True)
    (tmp_path / "whole").mkdir()
    whole, b = run(tmp_path / "whole")
    assert resumed["done"] and resumed["step"] == whole["step"]
    assert same_weights(a.modules[0], b.modules[0])
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are put back
