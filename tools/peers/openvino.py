"""OpenVINO GenAI: `LLMPipeline` on the model's own GGUF (the file our engine was exported
from: its GGUF reader takes llama-family Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K weights), on the CPU.

It is fed our prompt token ids (a `TokenizedInputs`, so no chat template of its own is
applied) and returns token ids. A streamer stamps each chunk of new tokens as it arrives
(prompt lookup hands several over at once: they share a stamp); time to first token is the
first chunk's stamp. Without a schema it decodes N tokens with EOS ignored; under a JSON
schema its structured output (`StructuredOutputConfig(json_schema=...)` in the
GenerationConfig) holds the answer, which ends at EOS once the JSON is complete.

openvino-lookup is its prompt lookup (`LLMPipeline(..., prompt_lookup=True)`: the last
`max_ngram_size` tokens looked up in the context, at most `num_assistant_tokens` = k drafted);
greedy runs also decode plainly once per prompt on a second, plain pipeline, so the row says
whether its output equals its own plain output.
"""

from __future__ import annotations

import importlib.util
import time

from trt_spec.tools.peers import PeerContext, chunk_stamps, decode_rate, plain_key


class OpenVinoPeer:
    name = "openvino"
    precision = "GGUF (OpenVINO)"
    num_draft_tokens = None

    def __init__(self):
        self.engine = "openvino"
        self.pipe = None

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("openvino_genai") is None:
            return False, "openvino-genai is not installed (pip install -e '.[bench]')"
        return True, ""

    def pipeline_options(self) -> dict:
        return {}

    def load(self, ctx: PeerContext) -> None:
        import openvino_genai as ov_genai

        from trt_spec.tools.peers.llamacpp import gguf_file

        gguf = gguf_file(ctx.model)
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF {str(gguf)!r} does not exist")
        self.threads, self.gguf = ctx.threads, gguf
        self.pipe = self.open(self.pipeline_options())
        quant = gguf.stem.rsplit(".", 1)[-1] if "." in gguf.stem else ""
        self.precision = f"{quant} GGUF (OpenVINO)".strip()
        self.engine = f"OpenVINO GenAI {ov_genai.__version__}, {gguf}"

    def open(self, options: dict):
        """An LLMPipeline on the GGUF, on the CPU, at the context's threads."""
        import openvino_genai as ov_genai

        return ov_genai.LLMPipeline(str(self.gguf), "CPU", INFERENCE_NUM_THREADS=self.threads,
                                    **options)

    def holds_schemas(self) -> tuple[bool, str]:
        import openvino_genai as ov_genai

        if not hasattr(ov_genai, "StructuredOutputConfig"):
            return False, (f"OpenVINO GenAI {ov_genai.__version__} has no structured output "
                           "(StructuredOutputConfig)")
        return True, ""

    def config(self, max_new_tokens: int, temperature: float, seed: int,
               json_schema: dict | None):
        import json

        import openvino_genai as ov_genai

        c = ov_genai.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                                      ignore_eos=json_schema is None)
        if temperature > 0:  # plain temperature sampling (its top_k is off by default), as
            c.temperature, c.top_p, c.rng_seed = temperature, 1.0, seed  # our SamplingParams
        if json_schema is not None:
            c.structured_output_config = ov_genai.StructuredOutputConfig(
                json_schema=json.dumps(json_schema))
        return c

    def decode(self, pipe, prompt_ids: list[int], config) -> tuple[list[int], list[float], float]:
        """One generate() -> (output ids, a stamp per output token, the time before it)."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        chunks = []

        class Stamps(ov_genai.StreamerBase):
            def write(self, token) -> ov_genai.StreamingStatus:
                chunks.append((time.perf_counter(), len(token) if isinstance(token, list) else 1))
                return ov_genai.StreamingStatus.RUNNING

            def end(self) -> None:
                pass

        ids = np.asarray([prompt_ids], dtype=np.int64)  # (1, T)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        t0 = time.perf_counter()
        out = pipe.generate(inputs, config, Stamps())
        output_ids = [int(t) for t in out.tokens[0]]
        stamps = chunk_stamps(chunks)
        # the streamer is not handed EOS: it ends the output without a chunk of its own
        assert len(stamps) in (len(output_ids), len(output_ids) - 1), (len(stamps), len(output_ids))
        return output_ids, stamps, t0

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict:
        assert self.pipe is not None, "load() first"
        output_ids, stamps, t0 = self.decode(
            self.pipe, prompt_ids, self.config(max_new_tokens, temperature, seed, json_schema))
        return {"tokens_per_s": decode_rate(stamps), "completion_tokens": len(output_ids),
                "target_forwards": None if self.num_draft_tokens else len(output_ids),
                "ttft_s": stamps[0] - t0 if stamps else None, "output_ids": output_ids}

    def close(self) -> None:
        self.pipe = None


class OpenVinoLookupPeer(OpenVinoPeer):
    """Its prompt lookup: 3-gram lookup in the context, at most k tokens drafted."""

    name = "openvino-lookup"
    NGRAM = 3
    SWEEPS_K = True  # bench runs it once per integer --num-draft-tokens

    def __init__(self):
        super().__init__()
        self.plain_pipe = None  # opened when a greedy run is first compared with it
        self._plain: dict[tuple, list[int]] = {}  # its own greedy output, by prompt and schema

    def pipeline_options(self) -> dict:
        return {"prompt_lookup": True}

    def load(self, ctx: PeerContext) -> None:
        super().load(ctx)
        self.num_draft_tokens = ctx.num_draft_tokens
        self.engine += f", prompt lookup (n-gram {self.NGRAM}, k = {self.num_draft_tokens})"

    def config(self, max_new_tokens: int, temperature: float, seed: int,
               json_schema: dict | None):
        c = super().config(max_new_tokens, temperature, seed, json_schema)
        c.num_assistant_tokens, c.max_ngram_size = self.num_draft_tokens, self.NGRAM
        return c

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict:
        result = super().generate(prompt_ids, max_new_tokens, temperature, seed, json_schema)
        if temperature == 0:
            key, t1 = plain_key(prompt_ids, json_schema), time.perf_counter()
            if key not in self._plain:
                if self.plain_pipe is None:
                    self.plain_pipe = self.open({})
                config = OpenVinoPeer.config(self, max_new_tokens, 0.0, seed, json_schema)
                self._plain[key] = self.decode(self.plain_pipe, prompt_ids, config)[0]
            result["same_as_own_plain"] = self._plain[key] == result["output_ids"]
            result["untimed_s"] = time.perf_counter() - t1  # not part of its decoding
        return result

    def close(self) -> None:
        super().close()
        self.plain_pipe = None
