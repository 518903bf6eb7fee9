"""The batched answer generator (train/batch_generate.py) against TargetModel.forward, and the
self-distilled data stage (train/distill_data.py): every human turn, sampled variants, shards
that resume, on the tiny target."""

import json
from collections import deque

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.script_util import load_script
from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.export.checkpoint import load_target
from trt_spec.export.model import empty_cache
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train import distill_data
from trt_spec.train.batch_generate import BatchedGenerator, Continue, Job
from trt_spec.train.distill_data import DistillConfig


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(tiny_hf_dir)[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_hf_dir):
    return load_tokenizer(tiny_hf_dir)


@pytest.fixture(scope="module")
def convs(tmp_path_factory):
    path = write_sharegpt(tmp_path_factory.mktemp("data") / "d.json",
                          sharegpt_records(6, turns=3))
    return read_conversations(path)[0]


def greedy_reference(target, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens by full recomputation with TargetModel.forward (no cache reuse)."""
    c = target.config
    ids = list(prompt)
    for _ in range(steps):
        n = len(ids)
        logits = target(torch.tensor([ids]), torch.arange(n)[None],
                        torch.tensor([n - 1], dtype=torch.int32),
                        torch.tensor([n], dtype=torch.int32), torch.tensor(n, dtype=torch.int32),
                        torch.tensor([[n - 1]]), *empty_cache(c, 1, 64))[0]
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_batched_greedy_matches_the_reference_with_slots_refilled(target):
    # 5 jobs of different lengths through 2 slots: finished sequences leave, the last running
    # one moves into the freed slot, waiting jobs are prefilled into the free slots
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.config.vocab_size, size=n).tolist() for n in (3, 9, 5, 12, 7)]
    budgets = [6, 2, 9, 4, 7]
    gen = BatchedGenerator(target, slots=2, max_len=40, dtype=torch.float32)
    got = {}
    stats = gen.run([Job(i, p, b) for i, (p, b) in enumerate(zip(prompts, budgets))], set(),
                    lambda a: got.__setitem__(a.key, a))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        assert got[i].tokens == greedy_reference(target, p, b), i
        assert not got[i].stopped
    assert stats.new_tokens == sum(budgets)
    assert max(stats.by_batch) == 2


def test_stop_tokens_end_an_answer_and_are_not_kept(target):
    prompt = [5, 6, 7, 8]
    ref = greedy_reference(target, prompt, 6)
    stop = ref[3]
    first = ref.index(stop)
    gen = BatchedGenerator(target, slots=1, max_len=32, dtype=torch.float32)
    got = []
    gen.run([Job("a", prompt, 6)], {stop}, got.append)
    assert got[0].tokens == ref[:first] and got[0].stopped


@pytest.mark.parametrize("stop_at", [None, 2])
def test_a_continued_sequence_matches_reading_it_whole(target, stop_at):
    # turn 2 goes on in turn 1's slot (only its new tokens are read), beside another sequence
    prompt, between = [5, 9, 13, 4], [7, 8, 3]
    stop = set() if stop_at is None else {greedy_reference(target, prompt, 3)[stop_at]}
    got = {}

    def on_answer(a):
        got[a.key] = a
        return Continue("t1", between, 5) if a.key == "t0" else None

    gen = BatchedGenerator(target, slots=2, max_len=64, dtype=torch.float32)
    gen.run([Job("t0", prompt, 4), Job("other", [6, 6, 2], 7)], stop, on_answer)
    first = got["t0"].tokens
    assert len(first) == (4 if stop_at is None else stop_at)
    # a stop token is not kept: the tokens between take its place
    want = greedy_reference(target, prompt + first + between, 5)
    assert got["t1"].tokens[:len(want)] == want[:len(got["t1"].tokens)]
    assert got["t1"].stopped or got["t1"].tokens == want


def test_a_continuation_without_room_is_dropped(target):
    dropped = []
    gen = BatchedGenerator(target, slots=1, max_len=12, dtype=torch.float32)
    gen.run([Job("t0", [5, 6, 7], 4)], set(), lambda a: Continue("t1", [1] * 6, 3),
            on_dropped=dropped.append)
    assert dropped == ["t1"]


def test_sampling_follows_the_temperature_and_the_seed(target):
    gen = BatchedGenerator(target, slots=4, max_len=32, dtype=torch.float32, seed=3)
    logits = torch.tensor([[0.0, 2.0, 1.0]] * 4)
    assert gen.sample(logits, torch.zeros(4)).tolist() == [1, 1, 1, 1]
    draws = torch.cat([gen.sample(logits, torch.ones(4)) for _ in range(500)])
    freq = torch.bincount(draws, minlength=3).float() / len(draws)
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.05)
    again = BatchedGenerator(target, slots=4, max_len=32, dtype=torch.float32, seed=3)
    assert torch.equal(again.sample(logits, torch.ones(4)), gen.__class__(
        target, 4, 32, dtype=torch.float32, seed=3).sample(logits, torch.ones(4)))


def test_follow_up_jobs_join_while_others_run(target):
    gen = BatchedGenerator(target, slots=2, max_len=48, dtype=torch.float32)
    jobs = deque([Job(("a", 0), [4, 5, 6], 3), Job(("b", 0), [7, 8], 8)])
    seen = []

    def on_answer(a):
        seen.append(a.key)
        name, turn = a.key
        if turn < 2:
            jobs.append(Job((name, turn + 1), [4, 5] + a.tokens, 3))

    ticks = []
    stats = gen.run(jobs, set(), on_answer, tick=lambda s: ticks.append(s.new_tokens),
                    tick_seconds=0)
    assert sorted(seen) == [(n, t) for n in "ab" for t in range(3)]
    assert ticks == sorted(ticks) and 0 < ticks[-1] <= stats.new_tokens  # progress each step
    assert stats.seconds > 0
    assert seen.index(("a", 1)) < seen.index(("b", 0))  # a's next turn did not wait for b


def test_distill_answers_every_turn_in_variants(target, tokenizer, convs, tmp_path):
    config = DistillConfig(samples=2, max_new_tokens=6, max_context=200, shard_conversations=2,
                           slots=4, dtype="float32")
    stop = [tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]]
    done = distill_data.distill(target, tokenizer, convs, tmp_path, stop, config, model_id="t")
    assert done == 3 and len(list(tmp_path.glob("shard-*.npz"))) == 3
    arrays = distill_data.read_shards(tmp_path)
    variants = np.concatenate([a["variant"] for a in arrays])
    turns = np.concatenate([a["turn"] for a in arrays])
    temps = np.concatenate([a["temperature"] for a in arrays])
    assert set(variants) == {0, 1, 2} and set(turns) == {0, 1, 2}
    assert (temps[variants == 0] == 0).all()
    assert ((temps[variants > 0] >= 0.6) & (temps[variants > 0] <= 1.0)).all()
    rebuilt = distill_data.conversations(tmp_path, convs, tokenizer)
    by_id = {c.id: c for c in rebuilt}
    first = by_id[f"{convs[0].id}#1"]
    users = [m["content"] for m in convs[0].messages if m["role"] == "user"]
    assert [m["content"] for m in first.messages if m["role"] == "user"] == users
    assert [m["role"] for m in first.messages] == ["user", "assistant"] * 3
    assert distill_data.token_count(tmp_path) == sum(int(a["offsets"][-1]) for a in arrays)
    distill_report = load_script("distill_report")
    report = distill_report.summary(tmp_path)
    convs_ids = np.concatenate([a["conv"] for a in arrays])
    assert report["trajectories"] == len(set(zip(convs_ids.tolist(), variants.tolist())))
    assert report["shards"] == 3
    assert report["answers"] == len(variants) and sum(report["answers_by_turn"].values()) == \
        len(variants)
    assert "| answer tokens |" in distill_report.markdown(tmp_path)


def test_turn_prompts_carry_the_trajectorys_own_answers(target, tokenizer, convs, tmp_path):
    seen = []
    original = distill_data.Trajectory.messages

    def spy(self, turns):
        msgs = original(self, turns)
        seen.append((self.conv_id, self.variant, msgs))
        return msgs

    distill_data.Trajectory.messages = spy
    try:
        config = DistillConfig(samples=0, max_new_tokens=4, max_context=200,
                               shard_conversations=8, slots=3, dtype="float32")
        distill_data.distill(target, tokenizer, convs[:1], tmp_path, [0], config, model_id="t")
    finally:
        distill_data.Trajectory.messages = original
    last = [m for cid, v, m in seen if len(m) == 5][0]  # turn 3: u1 a1 u2 a2 u3
    answers = distill_data.read_shards(tmp_path)[0]
    tok = answers["tokens"]
    a1 = tokenizer.decode(tok[answers["offsets"][0]:answers["offsets"][1]].astype(int).tolist())
    assert last[1] == {"role": "assistant", "content": a1}


def test_shards_resume_and_refuse_other_settings(target, tokenizer, convs, tmp_path):
    config = DistillConfig(samples=1, max_new_tokens=4, max_context=100, shard_conversations=2,
                           slots=4, dtype="float32")
    distill_data.distill(target, tokenizer, convs[:2], tmp_path, [0], config, model_id="t")
    first = (tmp_path / "shard-00000.npz").stat().st_mtime_ns
    # more conversations, same settings: shard 0 is kept, shards 1 and 2 are added
    assert distill_data.distill(target, tokenizer, convs, tmp_path, [0], config,
                                model_id="t") == 3
    assert (tmp_path / "shard-00000.npz").stat().st_mtime_ns == first
    with pytest.raises(ValueError, match="other settings.*samples"):
        distill_data.distill(target, tokenizer, convs, tmp_path, [0],
                             DistillConfig(samples=2, max_new_tokens=4, max_context=100,
                                           shard_conversations=2, dtype="float32"),
                             model_id="t")


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="temperatures"):
        DistillConfig(t_min=1.2, t_max=0.8)
    with pytest.raises(ValueError, match="max_context"):
        DistillConfig(max_new_tokens=256, max_context=256)
    with pytest.raises(ValueError, match="turns"):
        DistillConfig(turns=0)


def test_cli_distill_then_train(tiny_hf_dir, tmp_path):
    from trt_spec.cli import main

    data = write_sharegpt(tmp_path / "d.json", sharegpt_records(12, turns=2))
    out = tmp_path / "run"
    args = ["train", "--method", "eagle3", "--model", str(tiny_hf_dir), "--data", str(data),
            "--out", str(out), "--answers", "distill", "--samples", "1", "--answer-tokens", "8",
            "--max-len", "64", "--heldout-conversations", "2", "--gen-dtype", "float32",
            "--draft-vocab", "64", "--batch-size", "4", "--max-steps", "2"]
    only = CliRunner().invoke(main, args + ["--data-only"])
    assert only.exit_code == 0, only.output
    assert list((out / "answers").glob("shard-*.npz")) and not (out / "eagle3").exists()
    full = CliRunner().invoke(main, args)
    assert full.exit_code == 0, full.output
    assert (out / "eagle3").is_dir()
    bad = CliRunner().invoke(main, args + ["--temperatures", "1.0,0.5"])
    assert bad.exit_code != 0 and "'1.0,0.5'" in bad.output
    wrong = CliRunner().invoke(main, args[:args.index("--answers")] + ["--data-only"])
    assert wrong.exit_code != 0 and "--data-only" in wrong.output
    (tmp_path / "a-file").write_text("")
    into_file = CliRunner().invoke(main, args + ["--answers-dir", str(tmp_path / "a-file")])
    assert into_file.exit_code != 0 and "is a file" in into_file.output


def test_shards_overlap_in_the_batch(target, tokenizer, convs, tmp_path, monkeypatch):
    # one conversation per shard, greedy: a shard alone could never fill 4 slots
    seen = []
    run = BatchedGenerator.run

    def spy(self, jobs, stop_ids, on_answer, stats=None, **kw):
        stats = run(self, jobs, stop_ids, on_answer, stats, **kw)
        seen.append(dict(stats.by_batch))
        return stats

    monkeypatch.setattr(BatchedGenerator, "run", spy)
    config = DistillConfig(samples=0, max_new_tokens=5, max_context=100, shard_conversations=1,
                           slots=4, dtype="float32")
    written = []
    assert distill_data.distill(target, tokenizer, convs, tmp_path, [0], config, model_id="t",
                                progress=written.append) == len(convs)
    assert max(seen[0]) == 4
    assert [p.shards_done for p in written] == list(range(1, len(convs) + 1))


def test_the_model_identity_does_not_depend_on_the_transformers_that_wrote_the_config(tmp_path):
    """The same model's config as transformers 4 and 5 write it (names, dtype, RoPE
    spelling, version) has one identity; a change to the model's numbers has another."""
    v4 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
          "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
          "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
          "tie_word_embeddings": True, "rope_theta": 100000.0, "rope_scaling": None,
          "torch_dtype": "float32", "transformers_version": "4.57.1"}
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5 |= {"dtype": "float32", "transformers_version": "5.25.0",
           "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    data = tmp_path / "data.json"
    data.write_text("[]")
    ids = []
    for i, config in enumerate([v4, v5, v4 | {"rope_theta": 10000.0}, v4 | {"hidden_size": 512}]):
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config, indent=2 + i))
        (folder / "model.safetensors").write_bytes(b"w" * 10)
        ids.append(distill_data.model_identity(folder, data))
    assert ids[0] == ids[1]
    assert len(set(ids[1:])) == 3
