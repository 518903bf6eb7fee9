"""onnxruntime-genai: its own model builder (int4, CPU) on the same HF weights our engine was
exported from, built once into CACHE/ortgenai-int4, and its generator loop.

min_length = max_length = prompt + N forces N new tokens (EOS is suppressed until then).
Each generate_next_token() is timed: the first one ends the prefill, the rest are decode steps.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trt_spec.runtime.files import atomic_folder
from trt_spec.tools.peers import PeerContext, decode_rate


def build_model(hf_dir: Path, out: Path, log: Path) -> Path:
    """`python -m onnxruntime_genai.models.builder -p int4 -e cpu` into `out` (atomically:
    built into a temporary folder, then renamed). Skipped when `out` is complete."""
    if (out / "genai_config.json").is_file():
        return out
    with atomic_folder(out) as tmp, tempfile.TemporaryDirectory() as cache:
        with open(log, "w") as f:  # the builder logs every node: keep it out of bench's output
            done = subprocess.run(
                [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
                 "-o", str(tmp), "-p", "int4", "-e", "cpu", "-c", cache],
                stdout=f, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise RuntimeError(f"onnxruntime-genai builder failed (exit {done.returncode}); "
                               f"see {log}")
    return out


class OrtGenaiPeer:
    name = "onnxruntime-genai"
    precision = "int4 (onnxruntime-genai builder)"
    num_draft_tokens = None

    def __init__(self):
        self.engine = "onnxruntime-genai"
        self.model = None
        self.folder = None  # the model folder load() built or found
        self.vocab_size = 0

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("onnxruntime_genai") is None:
            return False, "onnxruntime-genai is not installed (pip install -e '.[bench]')"
        for module in ("torch", "transformers"):  # the builder reads the HF checkpoint
            if importlib.util.find_spec(module) is None:
                return False, f"{module} is not installed (the builder needs it)"
        return True, ""

    def load(self, ctx: PeerContext) -> None:
        import onnxruntime_genai as og

        from trt_spec.tools.peers.hf import hf_dir

        folder = build_model(hf_dir(ctx), ctx.cache / "ortgenai-int4",
                             ctx.cache / "ortgenai-int4.log")
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": ctx.threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)
        # plain temperature sampling is top-k over the whole vocabulary (top_k 0 is not "off")
        self.vocab_size = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
        self.folder = folder
        self.engine = f"onnxruntime-genai {og.__version__}, {folder}"

    def decode(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
               seed: int, speculative: dict | None = None):
        """Its generator loop, each generate_next_token() timed -> (output ids, stamps, the
        time before the prefill, the generator); `speculative`: set_speculative_options."""
        import numpy as np
        import onnxruntime_genai as og

        assert self.model is not None, "load() first"
        params = og.GeneratorParams(self.model)
        total = len(prompt_ids) + max_new_tokens
        options = {"min_length": total, "max_length": total, "do_sample": temperature > 0,
                   "batch_size": 1}
        if temperature > 0:
            options.update(temperature=temperature, top_k=self.vocab_size, top_p=1.0, random_seed=seed)
        params.set_search_options(**options)
        if speculative:
            params.set_speculative_options(**speculative)
        generator = og.Generator(self.model, params)
        stamps = []
        t0 = time.perf_counter()
        generator.append_tokens(np.asarray([prompt_ids], dtype=np.int32))  # the prefill
        while not generator.is_done():
            generator.generate_next_token()
            stamps.append(time.perf_counter())
        output_ids = [int(t) for t in generator.get_sequence(0)[len(prompt_ids):]]
        return output_ids, stamps, t0, generator

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int) -> dict:
        output_ids, stamps, t0, _ = self.decode(prompt_ids, max_new_tokens, temperature, seed)
        assert len(output_ids) == len(stamps), (len(output_ids), len(stamps))
        return {"tokens_per_s": decode_rate(stamps), "completion_tokens": len(output_ids),
                "target_forwards": len(output_ids), "ttft_s": stamps[0] - t0 if stamps else None,
                "output_ids": output_ids}

    def close(self) -> None:
        self.model = None


class OrtGenaiNgramPeer(OrtGenaiPeer):
    """onnxruntime-genai's own n-gram speculation in its C++ loop (0.18:
    `GeneratorParams.set_speculative_options`): 3-gram lookup drafting at most k tokens, with
    its adaptive k and cooldown on (of the settings tried on this model, the fastest). Greedy
    runs also decode plainly once per prompt, so the row says whether its speculative output
    equals its own plain output (its multi-row kernels round differently, and it has no exact
    mode); τ and acceptance come from its own statistics (`get_speculative_stats`)."""

    name = "onnxruntime-genai-ngram"
    NGRAM = 3

    def __init__(self):
        super().__init__()
        self._plain: dict[tuple[int, ...], list[int]] = {}  # its own greedy output, by prompt

    def load(self, ctx: PeerContext) -> None:
        import onnxruntime_genai as og

        if not hasattr(og.GeneratorParams, "set_speculative_options"):
            raise RuntimeError(f"onnxruntime-genai {og.__version__} has no speculative "
                               "decoding (0.18 or later)")
        super().load(ctx)
        self.num_draft_tokens = ctx.num_draft_tokens
        self.engine += f", n-gram {self.NGRAM}, adaptive k, cooldown"

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int) -> dict:
        output_ids, stamps, t0, generator = self.decode(
            prompt_ids, max_new_tokens, temperature, seed,
            {"ngram_size": self.NGRAM, "max_draft_tokens": self.num_draft_tokens,
             "min_adaptive_k": 1, "cooldown": True})
        stats = generator.get_speculative_stats()
        result = {"tokens_per_s": decode_rate(stamps), "completion_tokens": len(output_ids),
                  "target_forwards": int(stats.get("target_forward_passes") or 0) or None,
                  "ttft_s": stamps[0] - t0 if stamps else None, "output_ids": output_ids,
                  "acceptance_rate": stats.get("acceptance_rate")}
        if temperature == 0:
            key, t1 = tuple(prompt_ids), time.perf_counter()
            if key not in self._plain:
                self._plain[key] = super().generate(prompt_ids, max_new_tokens, 0.0,
                                                    seed)["output_ids"]
            result["same_as_own_plain"] = self._plain[key] == output_ids
            result["untimed_s"] = time.perf_counter() - t1  # not part of its decoding
        return result


class GraphScorer:
    """onnxruntime-genai's decoder graph in a plain ONNX Runtime session, for teacher forcing:
    one forward over a whole sequence (an empty past), its logits at every position."""

    def __init__(self, folder: Path, threads: int):
        import numpy as np

        from trt_spec.runtime.backends.ort import make_session

        decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
        self.session = make_session(folder / decoder["filename"], threads)
        self.names = decoder["inputs"], decoder["outputs"]
        empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]),
                         np.float32)
        self.past = {self.names[0][f"past_{kind}_names"] % i: empty
                     for i in range(decoder["num_hidden_layers"]) for kind in ("key", "value")}

    def __call__(self, ids: list[int], start: int):
        """Logits for positions start-1 .. len(ids)-2 (each predicts ids[i + 1])."""
        import numpy as np

        feeds = {self.names[0]["input_ids"]: np.asarray([ids], np.int64),
                 self.names[0]["attention_mask"]: np.ones((1, len(ids)), np.int64),
                 **self.past}
        logits = self.session.run([self.names[1]["logits"]], feeds)[0][0]
        return logits[start - 1:len(ids) - 1]


def built_model(engine: str) -> Path:
    """The onnxruntime-genai model built from an engine folder's source model (built once,
    cached beside the other peers' derived weights); ValueError where it cannot be."""
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.tools.peers import PEERS, peer_context
    from trt_spec.tools.peers.hf import hf_dir

    ok, reason = PEERS["onnxruntime-genai"]().available()
    if not ok:
        raise ValueError(f"onnxruntime-genai: {reason}")
    ctx = peer_context(load_manifest(engine, verify="none").data, None, 4, engine)
    return build_model(hf_dir(ctx), ctx.cache / "ortgenai-int4", ctx.cache / "ortgenai-int4.log")
