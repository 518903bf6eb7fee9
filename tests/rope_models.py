"""Tiny random models whose configs are published configs shrunk (layers, width, vocabulary,
and the lengths, so that positions past each RoPE threshold are cheap to reach), for the
RoPE / architecture parity tests (tests/test_rope.py) and scripts/families_table.py.

Each entry: (architecture, transformers config class, config kwargs, threshold). The
threshold is the position from which the scaling acts differently: longrope switches to its
long factors at rows p + 1 > original_max_position_embeddings, dynamic NTK grows its base at
p + 1 > max_position_embeddings; for the static kinds it is original_max_position_embeddings
(the wavelength / correction bands are set by it). What is kept from each published config is
named beside it; the longrope factor lists are synthetic (monotone like the published ones:
short near 1, long rising), of the published length rotary_dim / 2.
"""

from __future__ import annotations

import torch

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rms_norm_eps=1e-5)


def longrope_factors(half: int, long_max: float) -> dict:
    return {"short_factor": [1.0 + 0.05 * i / half for i in range(half)],
            "long_factor": [long_max ** (i / (half - 1)) for i in range(half)]}


MODELS = {
    # Llama-3.1-8B: theta 5e5, llama3 factor 8, low 1, high 4, original 8192 -> 64,
    # max 131072 -> 512
    "llama3.1": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
        max_position_embeddings=512, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 64),
    # Llama-3.2-1B: llama3 factor 32, tied head, head_dim 64 (hidden / heads)
    "llama3.2": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rope_theta=500000.0,
        max_position_embeddings=512, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), 64),
    # Qwen2.5-7B-Instruct with the YaRN block its card gives: factor 4, original 32768 -> 64
    "qwen2.5-yarn": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
        max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}), 64),
    # Qwen2.5 without scaling (its configs carry sliding_window with use_sliding_window false)
    "qwen2.5": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, sliding_window=32,
        use_sliding_window=False, max_position_embeddings=256, tie_word_embeddings=True), 64),
    # linear position interpolation (e.g. LongChat / CodeLlama-style factor 2)
    "llama-linear": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_scaling={"type": "linear", "factor": 2.0}), 64),
    # dynamic NTK, factor 2: the base grows past max_position_embeddings (64 -> 128 positions)
    "llama-dynamic": ("LlamaForCausalLM", "LlamaConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 64),
    # Phi-3-mini-128k-instruct: MHA, untied, longrope (transformers 4's "type"), original
    # 4096 -> 32, max 131072 -> 256, sliding_window 262144 -> 1024 (past every position)
    "phi3-mini-128k": ("Phi3ForCausalLM", "Phi3Config", dict(
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        original_max_position_embeddings=32, sliding_window=1024, tie_word_embeddings=False,
        rope_scaling={"type": "longrope", **longrope_factors(8, 48.0)}), 32),
    # Phi-3.5-mini-instruct: the same shape, other factors
    "phi3.5-mini": ("Phi3ForCausalLM", "Phi3Config", dict(
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        original_max_position_embeddings=32, sliding_window=1024, tie_word_embeddings=False,
        rope_scaling={"type": "longrope", **longrope_factors(8, 60.0)}), 32),
    # Phi-4-mini-instruct: GQA, tied, partial_rotary_factor 0.75 (rotary 96 of 128 -> 48 of 64)
    "phi4-mini": ("Phi3ForCausalLM", "Phi3Config", dict(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=256, original_max_position_embeddings=32,
        partial_rotary_factor=0.75, tie_word_embeddings=True,
        rope_scaling={"type": "longrope", **longrope_factors(24, 40.0)}), 32),
    # Phi-3-mini-4k-instruct: default RoPE, sliding_window 2047 of 4096 -> 23 of 128
    "phi3-mini-4k": ("Phi3ForCausalLM", "Phi3Config", dict(
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        sliding_window=23, tie_word_embeddings=False), 32),
    # Mistral-7B-v0.1: sliding_window 4096 of 32768 -> 16 of 128, GQA, theta 1e4
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(
        num_attention_heads=4, num_key_value_heads=1, sliding_window=16,
        max_position_embeddings=128, tie_word_embeddings=False), 32),
    # Qwen3-0.6B: q/k norms, head_dim 128 != hidden / heads -> 32 of 64 / 4, tied, theta 1e6
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1e6,
        max_position_embeddings=128, tie_word_embeddings=True), 64),
}
NAMES = tuple(MODELS)
LENGTH_DEPENDENT = ("phi3-mini-128k", "phi3.5-mini", "phi4-mini", "llama-dynamic")


def hf_config(name: str):
    import transformers

    _, config_cls, extra, _ = MODELS[name]
    return getattr(transformers, config_cls)(**{**COMMON, **extra})


def make_hf(folder, name: str, seed: int = 0):
    """The random tiny model `name`, saved as a Hugging Face folder with a tokenizer. Norm
    weights and biases (initialized to constants) get noise so the comparisons see them."""
    import transformers

    from tests.tiny_tokenizer import save_tiny_tokenizer

    arch = MODELS[name][0]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(hf_config(name)).eval()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key or key.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder, VOCAB)
    return folder


def hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def cached_logits(model, ids: list[int], prefill: int) -> torch.Tensor:
    """transformers with a KV cache: a `prefill`-token forward, then one token per call (the
    length-dependent kinds decide per call, by max(position_ids) + 1) -> logits [len(ids), V].
    `model` freshly loaded: dynamic NTK keeps its grown base from one call to the next."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        step = model(torch.tensor([ids[:prefill]]), cache=cache, use_cache=True)
        out.append(step.logits[0])
        for p in range(prefill, len(ids)):
            step = model(torch.tensor([[ids[p]]]), cache=cache, use_cache=True,
                         position_ids=torch.tensor([[p]]))
            out.append(step.logits[0])
    return torch.cat(out)


def greedy_cached(folder, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy decoding, one token per call with a cache."""
    from transformers import DynamicCache

    model, ids = hf_model(folder), list(prompt)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
        for _ in range(n):
            ids.append(int(logits.argmax()))
            logits = model(torch.tensor([[ids[-1]]]), cache=cache, use_cache=True,
                           position_ids=torch.tensor([[len(ids) - 1]])).logits[0, -1]
    return ids[len(prompt):]
