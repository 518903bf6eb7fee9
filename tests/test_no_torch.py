"""The runtime must import and generate in a process where importing torch fails."""

from tests.no_torch import run_without_torch


def test_runtime_works_without_torch(tiny_engine):
    run_without_torch(f"""
        import trt_spec, trt_spec.runtime, trt_spec.cli
        import trt_spec.runtime.engine, trt_spec.runtime.generator, trt_spec.tools.bench
        from trt_spec.runtime.generator import Generator
        from trt_spec.runtime.sampling import SamplingParams
        from trt_spec.runtime.scheduler import generate_ids
        gen = Generator({str(tiny_engine)!r})
        out = generate_ids(gen, [[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.output_ids) == 4
        # structured outputs: llguidance is a base dependency and needs no torch either
        held = generate_ids(gen, [[5, 6, 7]], SamplingParams(max_tokens=8, regex="(ab|xy)c"))[0]
        assert held.finish_reason == "stop" and len(held.output_ids) <= 3, held.output_ids
    """)


def test_sampling_and_verification_import_without_torch():
    """The NumPy transforms and verification (and the engine that runs them) never reach
    their torch twin, runtime/sampling_torch.py, which only the torch backends import."""
    run_without_torch("""
        import numpy as np
        import trt_spec.runtime.sampling, trt_spec.runtime.verify, trt_spec.runtime.engine
        from trt_spec.runtime.sampling import SamplingParams, probs_from_logits
        from trt_spec.runtime.verify import verify_batch
        p = probs_from_logits(np.arange(8.0), 0.7, top_k=5, top_p=0.9)
        assert abs(p.sum() - 1) < 1e-12 and (p[:3] == 0).all()
        logits = np.random.default_rng(0).normal(size=(3, 8))
        out = verify_batch([np.array([1, 2])], [logits],
                           [SamplingParams(temperature=0.8, top_k=4, seed=1)], [0])
        assert out.num_emitted[0] >= 1
        assert "trt_spec.runtime.sampling_torch" not in sys.modules
    """)
