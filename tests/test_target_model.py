"""The export module against transformers on the same weights (fp32)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.export.model import empty_cache  # noqa: E402


def forward_full(model, config, ids, max_len=64):
    """One prefill of every token, logits at every position. ids: [1, T]."""
    t = ids.shape[1]
    cache = empty_cache(config, 1, max_len)
    out = model(ids, torch.arange(t)[None], torch.tensor([t - 1], dtype=torch.int32),
                torch.tensor([t], dtype=torch.int32), torch.tensor(max_len, dtype=torch.int32),
                torch.arange(t)[None], *cache)
    return out


def compare_to_transformers(folder, ids, atol):
    model, config = load_target(folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(ids, output_hidden_states=True)
        logits, hidden, features, *_ = forward_full(model, config, ids)
    torch.testing.assert_close(logits, expected.logits, atol=atol, rtol=0)
    # hidden_states[-1] in transformers is the final-normed output.
    torch.testing.assert_close(hidden, expected.hidden_states[-1], atol=atol, rtol=0)
    # hidden_states[i] is the input to layer i.
    want = torch.cat([expected.hidden_states[i] for i in config.eagle3_layers], dim=-1)
    torch.testing.assert_close(features, want, atol=atol, rtol=0)
    return (logits - expected.logits).abs().max().item()


def test_tiny_matches_transformers(tiny_hf_dir):
    ids = torch.randint(3, 128, (1, 17), generator=torch.Generator().manual_seed(1))
    assert compare_to_transformers(tiny_hf_dir, ids, atol=1e-4) <= 1e-3


def test_incremental_equals_full(tiny_hf_dir):
    """Prefill, decode, a 3-token step after a past, and a rewind, against one full pass."""
    model, config = load_target(tiny_hf_dir)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = forward_full(model, config, ids)[0][0]  # (12, V)
        cache = empty_cache(config, 1, 64)
        got = []

        def step(start, tokens, cache):
            n = tokens.shape[1]
            out = model(tokens, torch.arange(start, start + n)[None],
                        torch.tensor([start + n - 1], dtype=torch.int32),
                        torch.tensor([n], dtype=torch.int32), torch.tensor(64, dtype=torch.int32),
                        torch.arange(n)[None], *cache)
            return out[0][0], list(out[3:])

        lg, cache = step(0, ids[:, :5], cache); got.append(lg)
        lg, cache = step(5, ids[:, 5:6], cache); got.append(lg)
        # write 3 wrong tokens, rewind by not counting them, then the right ones
        _, cache = step(6, torch.full((1, 3), 7), cache)
        lg, cache = step(6, ids[:, 6:9], cache); got.append(lg)
        lg, cache = step(9, ids[:, 9:12], cache); got.append(lg)
    torch.testing.assert_close(torch.cat(got), full, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2_hf_dir):
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(3))
    assert compare_to_transformers(smollm2_hf_dir, ids, atol=1e-3) <= 1e-3
