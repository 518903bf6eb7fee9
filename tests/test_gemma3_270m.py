"""The real Gemma-3-270M (base; `trt-spec export --model gemma3-270m`) exported fp32, against
transformers on the same dequantized weights, by teacher forcing past its 512-token window.
Slow: the first run downloads and assembles the 253 MB GGUF (cached after)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from trt_spec.runtime.scheduler import generate_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

DATA = Path(__file__).resolve().parents[1] / "runtime" / "data" / "sharegpt-heldout.jsonl"
# Prompt lengths (tokens of one running text): short ones, and ones whose 64 forced tokens
# cross the 512-token sliding window or lie wholly past it.
PREFIXES = (24, 150, 470, 500, 530, 620, 800, 1000)
FORCED = 64
NEAR_TIE = 1e-3  # a reference top-2 logit gap below this may flip on float rounding


@pytest.fixture(scope="module")
def gemma_hf_dir():
    from trt_spec.export.checkpoint import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_engine(gemma_hf_dir, tmp_path_factory):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig("gemma3-270m",
                                     tmp_path_factory.mktemp("engines") / "gemma-fp32", "fp32",
                                     shipped_drafters=False))


def running_text(tokenizer) -> list[int]:
    """<bos> + the held-out prompts' text, joined: raw text, as a base model reads it."""
    texts = [m["content"] for line in DATA.read_text().splitlines()
             for m in json.loads(line)["messages"] if m["role"] == "user"]
    return tokenizer.encode("\n\n".join(texts))


def test_config(gemma_hf_dir):
    from trt_spec.export.checkpoint import load_target

    _, c = load_target(gemma_hf_dir)
    assert (c.family, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.vocab_size, c.sliding_window) == ("gemma3", 18, 640, 4, 1, 256, 262144, 512)
    assert [c.layer_window(i) for i in range(6)] == [512] * 5 + [0]
    assert (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)


def test_teacher_forcing_argmax_matches_transformers(gemma_hf_dir, gemma_engine):
    """8 prompts x 64 forced tokens (1- and 3-token steps after the prefill, as decoding and
    verification run): the exported graph's argmax equals transformers' at every position
    (outside near-ties, counted and bounded), logits close."""
    from trt_spec.runtime.backends.ort import OrtTarget
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.runtime.step_inputs import SlotTokens
    from trt_spec.runtime.tokenizer import Tokenizer

    manifest = load_manifest(gemma_engine)
    config = manifest.config
    tokens = running_text(Tokenizer(gemma_engine))
    assert tokens[0] == config.bos_token_id and len(tokens) > max(PREFIXES) + FORCED
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma_hf_dir,
                                                            dtype=torch.float32).eval()
    target = OrtTarget(gemma_engine / "target.onnx", config.num_layers,
                       config.max_position_embeddings)
    cache = KVCache(config, slots=1, max_len=max(PREFIXES) + FORCED + 8)
    agree, ties, worst = 0, 0, 0.0
    for p in PREFIXES:
        seq = tokens[:p + FORCED]
        slot = cache.allocate()
        target.step(cache, [SlotTokens(slot, seq[:p], [p - 1])])
        got, start = [], p
        while start < p + FORCED:
            n = min(1 if len(got) % 2 == 0 else 3, p + FORCED - start)
            got.append(target.step(cache, [SlotTokens(slot, seq[start:start + n],
                                                      list(range(n)))]).logits[0][:n])
            start += n
        cache.release(slot)
        got = np.concatenate(got)  # (FORCED, V): at positions p .. p + 63
        with torch.no_grad():
            want = ref(torch.tensor([seq]), logits_to_keep=FORCED).logits[0].numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        top2 = np.sort(want, axis=-1)[:, -2:]
        tie = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
        same = got.argmax(-1) == want.argmax(-1)
        assert same[~tie].all(), (p, np.flatnonzero(~same & ~tie))
        agree += int(same.sum())
        ties += int((~same & tie).sum())
    print(f"argmax agreement {agree}/{len(PREFIXES) * FORCED}, flips at near-ties {ties}, "
          f"max |logit diff| {worst:.2e}")
    assert ties <= 2 and worst < 5e-2


@pytest.fixture(scope="module")
def gemma_all_engine(gemma_hf_dir, tmp_path_factory):
    """Gemma-3-270M int4 with every drafter: a 6-layer self-draft and random MTP (2 modules),
    Eagle and Eagle3 heads, the vanilla / MTP / Eagle heads over the Eagle3 head's random
    8,192-token draft vocabulary of the 262,144 (--draft-vocab eagle3)."""
    from tests.random_drafters import random_eagle3, random_mtp
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    root = tmp_path_factory.mktemp("gemma-heads")
    target, _ = load_target(gemma_hf_dir)
    save_drafter(random_mtp(target, 2, seed=1), root / "mtp")
    save_drafter(random_mtp(target, 1, seed=2, kind="eagle"), root / "eagle")
    save_drafter(random_eagle3(target, seed=3, draft_vocab=8192), root / "eagle3")
    del target
    return export_model(ExportConfig(
        "gemma3-270m", tmp_path_factory.mktemp("engines") / "gemma-all", "int4", draft_layers=6,
        draft_vocab="eagle3", drafters={k: root / k for k in ("mtp", "eagle", "eagle3")},
        shipped_drafters=False))


def test_every_method_is_lossless(gemma_all_engine):
    """Greedy speculative output equals plain greedy for every method (raw-text prompts,
    batch 2, k = 3), the drafts mapped from the draft vocabulary to the target's."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.runtime.sampling import SamplingParams

    drafters = load_manifest(gemma_all_engine).data["drafters"]
    assert {k: drafters[k].get("draft_vocab_size") for k in drafters} == {
        "vanilla": 8192, "mtp": 8192, "eagle": 8192, "eagle3": 8192}
    texts = ["The capital of France is", "def reverse(s):\n    return"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    gen = Generator(gemma_all_engine, max_batch=2, max_len=256)
    ids = [gen.encode(t, chat=False) for t in texts]
    plain = [s.output_ids for s in generate_ids(gen, ids, params)]
    for method in ("ngram", "vanilla", "mtp", "eagle", "eagle3"):
        streams = generate_ids(gen, ids, params, method, 3)
        assert [s.output_ids for s in streams] == plain, method
        print(method, "proposed", sum(s.stats.proposed for s in streams),
              "accepted", sum(s.stats.accepted for s in streams))
