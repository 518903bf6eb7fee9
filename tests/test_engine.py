"""Generation through the ORT runtime against a plain torch greedy loop."""

import json

import numpy as np
import pytest

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.manifest import EngineFolderError, load_manifest
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids


def torch_greedy(tiny_hf_dir, prompt_ids, n):
    """Reference: full recomputation each token (no cache), argmax."""
    torch = pytest.importorskip("torch")
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.model import empty_cache

    model, config = load_target(tiny_hf_dir)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            t = len(ids)
            logits = model(torch.tensor([ids]), torch.arange(t)[None],
                           torch.tensor([t - 1], dtype=torch.int32),
                           torch.tensor([t], dtype=torch.int32), torch.tensor(128, dtype=torch.int32),
                           torch.tensor([[t - 1]]), *empty_cache(config, 1, 128))[0]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


PROMPTS = [[5, 17, 99, 3], [42, 8, 77, 61, 23, 11, 90], [4]]


def test_greedy_matches_torch_loop(tiny_hf_dir, tiny_engine):
    gen = Generator(tiny_engine, max_batch=1)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        got = generate_ids(gen, [prompt], params)[0].output_ids
        assert got == torch_greedy(tiny_hf_dir, prompt, 20)


def test_batched_streams_equal_one_at_a_time(tiny_engine):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    single = Generator(tiny_engine, max_batch=1)
    batched = Generator(tiny_engine, max_batch=3)
    # different max_tokens make streams finish at different steps
    alone = [generate_ids(single, [p], params)[0].output_ids for p in PROMPTS]
    together = [s.output_ids for s in generate_ids(batched, PROMPTS, params)]
    assert together == alone
    # more prompts than slots: queued, and the cache is reused
    queued = [s.output_ids for s in generate_ids(single, PROMPTS, params)]
    assert queued == alone


def test_sampling_reproducible_with_seed(tiny_engine):
    gen = Generator(tiny_engine, max_batch=2)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, seed=7,
                            ignore_eos=True)
    a = generate_ids(gen, [PROMPTS[0]], params)[0].output_ids
    b = generate_ids(gen, [PROMPTS[0]], params)[0].output_ids
    c = generate_ids(gen, [PROMPTS[0]], SamplingParams(**{**params.__dict__, "seed": 8}))[0].output_ids
    assert a == b and a != c


def test_stop_conditions(tiny_engine):
    gen = Generator(tiny_engine, max_batch=1)
    free = generate_ids(gen, [PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 10
    # stop token id: the 4th generated token
    stop_id = free.output_ids[3]
    s = generate_ids(gen, [PROMPTS[1]], SamplingParams(max_tokens=10, stop_token_ids=(stop_id,),
                                                      ignore_eos=True))[0]
    assert s.finish_reason == "stop" and s.output_ids == free.output_ids[:free.output_ids.index(stop_id) + 1]
    # stop string: the text of the 3rd token; the text is cut before it
    word = gen.tokenizer.decode([free.output_ids[2]])
    s = generate_ids(gen, [PROMPTS[1]], SamplingParams(max_tokens=10, stop=(word,), ignore_eos=True))[0]
    assert s.finish_reason == "stop" and word not in s.text
    # EOS ends a stream unless ignored (make the 2nd generated token the EOS here)
    eos = free.output_ids[1]
    gen.engine.stops.eos_ids = {eos}
    s = generate_ids(gen, [PROMPTS[1]], SamplingParams(max_tokens=10))[0]
    assert s.finish_reason == "stop"
    assert s.output_ids == free.output_ids[:free.output_ids.index(eos) + 1]
    s = generate_ids(gen, [PROMPTS[1]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert s.output_ids == free.output_ids
    # the context bound: a prompt that leaves no room is refused
    small = Generator(tiny_engine, max_batch=1, max_len=8)
    with pytest.raises(ValueError, match="the prompt has 8 tokens"):
        generate_ids(small, [[5] * 8], SamplingParams())
    s = generate_ids(small, [[5] * 4], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert s.finish_reason == "length" and len(s.prompt_ids) + len(s.output_ids) == 9


def test_chat_template_is_applied(tiny_engine):
    gen = Generator(tiny_engine)
    chat = gen.encode([{"role": "user", "content": "a b"}])
    assert gen.tokenizer.decode(chat, skip_special_tokens=False).split() == \
        ["<|im_start|>", "user", "a", "b", "<|im_end|>", "<|im_start|>", "assistant"]
    assert gen.encode("a b", chat=False) == gen.tokenizer.encode("a b")
    assert gen.encode("a b") == chat  # the default for a model with a template


def test_corrupt_or_mismatched_folder_is_refused(tiny_engine, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_engine, bad)
    data = bad / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(EngineFolderError, match="target.onnx.data: checksum differs"):
        Generator(bad)
    with open(data, "ab") as f:
        f.write(b"x")
    with pytest.raises(EngineFolderError, match="target.onnx.data has .* bytes"):
        load_manifest(bad)
    data.unlink()
    with pytest.raises(EngineFolderError, match="target.onnx.data is missing"):
        load_manifest(bad)
    manifest = json.loads((tiny_engine / "manifest.json").read_text())
    shutil.rmtree(bad)
    shutil.copytree(tiny_engine, bad)
    (bad / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(EngineFolderError, match="format_version 99"):
        load_manifest(bad)
    with pytest.raises(EngineFolderError, match="does not exist"):
        load_manifest(tmp_path / "nowhere")
