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
