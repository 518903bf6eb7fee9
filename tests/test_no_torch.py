"""The runtime must import and generate in a process where importing torch fails."""

import subprocess
import sys
import textwrap


def test_runtime_works_without_torch(tiny_engine):
    code = textwrap.dedent(f"""
        import builtins, sys
        real_import = builtins.__import__
        def guarded(name, *args, **kwargs):
            if name.split(".")[0] in ("torch", "transformers"):
                raise ImportError(f"{{name}} is blocked in this test")
            return real_import(name, *args, **kwargs)
        builtins.__import__ = guarded
        import trt_spec, trt_spec.runtime, trt_spec.cli
        import trt_spec.runtime.engine, trt_spec.runtime.generator, trt_spec.runtime.bench
        from trt_spec.runtime.generator import Generator
        from trt_spec.runtime.sampling import SamplingParams
        gen = Generator({str(tiny_engine)!r})
        out = gen.generate_ids([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.output_ids) == 4
        assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
