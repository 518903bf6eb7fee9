"""onnxruntime-genai: its own model builder (int4, CPU) on the same HF weights our engine was
exported from, built once into CACHE/ortgenai-int4, and its generator loop.

min_length = max_length = prompt + N forces N new tokens (EOS is suppressed until then).
Each generate_next_token() is timed: the first one ends the prefill, the rest are decode steps.
Under a JSON schema its guidance (llguidance inside: `set_guidance("json_schema", ...)`, with
its fast-forward tokens on, the grammar-forced tokens appended without a forward of their
own, as ours draft them) holds the output, which ends with the JSON (max_length = prompt + N
only caps it); the tokens a step added are read from its token count.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trt_spec.runtime.files import atomic_folder
from trt_spec.tools.peers import PeerContext, chunk_stamps, decode_rate, plain_key


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
            lines = [x for x in Path(log).read_text(errors="replace").splitlines() if x.strip()]
            raise RuntimeError(f"onnxruntime-genai builder failed (exit {done.returncode}: "
                               f"{lines[-1].strip() if lines else 'no output'}); see {log}")
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
        self.model = self._open(folder, ctx.threads)
        # plain temperature sampling is top-k over the whole vocabulary (top_k 0 is not "off")
        self.vocab_size = json.loads((folder / "genai_config.json").read_text())["model"]["vocab_size"]
        self.folder = folder
        self.engine = f"onnxruntime-genai {og.__version__}, {folder}"

    def holds_schemas(self) -> tuple[bool, str]:
        import onnxruntime_genai as og

        if not hasattr(og.GeneratorParams, "set_guidance"):
            return False, f"onnxruntime-genai {og.__version__} has no guidance (set_guidance)"
        return True, ""

    def decode(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
               seed: int, speculative: dict | None = None, json_schema: dict | None = None):
        """Its generator loop, each generate_next_token() timed -> (output ids, a stamp per
        output token, the time before the prefill, the steps that added tokens, the
        generator); `speculative`: set_speculative_options; `json_schema`: its guidance."""
        import numpy as np
        import onnxruntime_genai as og

        assert self.model is not None, "load() first"
        params = og.GeneratorParams(self.model)
        total = len(prompt_ids) + max_new_tokens
        options = {"max_length": total, "do_sample": temperature > 0, "batch_size": 1}
        if json_schema is None:  # N tokens, EOS ignored; under a schema, the JSON's end
            options["min_length"] = total
        if temperature > 0:
            options.update(temperature=temperature, top_k=self.vocab_size, top_p=1.0, random_seed=seed)
        params.set_search_options(**options)
        if json_schema is not None:
            params.set_guidance("json_schema", json.dumps(json_schema), True)
        if speculative:
            params.set_speculative_options(**speculative)
        generator = og.Generator(self.model, params)
        chunks = []  # (when, tokens added) per step that added any
        t0 = time.perf_counter()
        generator.append_tokens(np.asarray([prompt_ids], dtype=np.int32))  # the prefill
        count = generator.token_count()
        while not generator.is_done():
            generator.generate_next_token()
            now, added = time.perf_counter(), generator.token_count() - count
            count += added
            if added:
                chunks.append((now, added))
        output_ids = [int(t) for t in generator.get_sequence(0)[len(prompt_ids):]]
        stamps = chunk_stamps(chunks)
        assert len(stamps) == len(output_ids), (len(stamps), len(output_ids))
        return output_ids, stamps, t0, len(chunks), generator

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict:
        output_ids, stamps, t0, steps, _ = self.decode(prompt_ids, max_new_tokens,
                                                       temperature, seed, None, json_schema)
        return {"tokens_per_s": decode_rate(stamps), "completion_tokens": len(output_ids),
                # forced tokens (a schema's) come without a forward of their own
                "target_forwards": steps, "ttft_s": stamps[0] - t0 if stamps else None,
                "output_ids": output_ids}

    @staticmethod
    def _open(folder: Path, threads: int):
        """og.Model on `folder`, every session (target and draft) at `threads` intra-op."""
        import onnxruntime_genai as og

        sessions = {"session_options": {"intra_op_num_threads": threads,
                                        "inter_op_num_threads": 1}}
        sections = json.loads((folder / "genai_config.json").read_text())["model"]
        config = og.Config(str(folder))
        config.overlay(json.dumps({"model": {k: sessions for k in ("decoder", "draft")
                                             if k in sections}}))
        return og.Model(config)

    def close(self) -> None:
        self.model = None


class OrtGenaiSpeculativePeer(OrtGenaiPeer):
    """onnxruntime-genai speculating in its own C++ loop (0.18:
    `GeneratorParams.set_speculative_options`), k = bench's first --num-draft-tokens, its
    adaptive k and cooldown on. Greedy runs also decode plainly once per prompt (with the
    same target), so the row says whether its speculative output equals its own plain
    output (its multi-row kernels round differently, and it has no exact mode); τ and
    acceptance come from its own statistics (`get_speculative_stats`)."""

    def __init__(self):
        super().__init__()
        self._plain: dict[tuple, list[int]] = {}  # its own greedy output, by prompt and schema

    def load(self, ctx: PeerContext) -> None:
        require_speculation()
        super().load(ctx)
        self.num_draft_tokens = ctx.num_draft_tokens

    def speculative_options(self) -> dict:
        return {"max_draft_tokens": self.num_draft_tokens, "min_adaptive_k": 1,
                "cooldown": True}

    def plain_output(self, prompt_ids: list[int], max_new_tokens: int, seed: int,
                     json_schema: dict | None = None) -> list[int]:
        return super().generate(prompt_ids, max_new_tokens, 0.0, seed, json_schema)["output_ids"]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict:
        output_ids, stamps, t0, _, generator = self.decode(
            prompt_ids, max_new_tokens, temperature, seed, self.speculative_options(),
            json_schema)
        stats = generator.get_speculative_stats()
        forwards = int(stats.get("target_forward_passes") or 0) or None
        result = {"tokens_per_s": decode_rate(stamps), "completion_tokens": len(output_ids),
                  # under a schema its statistics leave out the steps it decodes plainly
                  # (standard_fallback_steps) and the forced tokens: tau unknown
                  "target_forwards": forwards if json_schema is None else None,
                  "ttft_s": stamps[0] - t0 if stamps else None, "output_ids": output_ids,
                  "acceptance_rate": stats.get("acceptance_rate")}
        if temperature == 0:
            key, t1 = plain_key(prompt_ids, json_schema), time.perf_counter()
            if key not in self._plain:
                self._plain[key] = self.plain_output(prompt_ids, max_new_tokens, seed,
                                                     json_schema)
            result["same_as_own_plain"] = self._plain[key] == output_ids
            result["untimed_s"] = time.perf_counter() - t1  # not part of its decoding
        return result


class OrtGenaiNgramPeer(OrtGenaiSpeculativePeer):
    """Its n-gram speculation: 3-gram lookup drafting at most k tokens (of the settings tried
    on this model, adaptive k with cooldown was the fastest)."""

    name = "onnxruntime-genai-ngram"
    NGRAM = 3
    SWEEPS_K = True  # bench runs it once per integer --num-draft-tokens

    def load(self, ctx: PeerContext) -> None:
        super().load(ctx)
        self.engine += f", n-gram {self.NGRAM}, adaptive k, cooldown"

    def speculative_options(self) -> dict:
        return {"ngram_size": self.NGRAM, **super().speculative_options()}


class OrtGenaiDraftPeer(OrtGenaiSpeculativePeer):
    """Its draft-model speculation with our shipped vanilla draft, written in the form its
    loader takes: the draft as a Hugging Face folder through its own builder (int4, as the
    target), and a model folder whose genai_config.json names it under model.draft. The
    plain runs it is compared with load the target alone."""

    name = "onnxruntime-genai-draft"
    SWEEPS_K = True  # bench runs it once per integer --num-draft-tokens

    def __init__(self):
        super().__init__()
        self.plain_model = None

    def load(self, ctx: PeerContext) -> None:
        import onnxruntime_genai as og

        require_speculation()
        target, draft, folder = draft_model_folders(ctx)
        self.model, self.plain_model = self._open(folder, ctx.threads), self._open(target, ctx.threads)
        self.vocab_size = json.loads((target / "genai_config.json").read_text())["model"]["vocab_size"]
        self.folder, self.num_draft_tokens = folder, ctx.num_draft_tokens
        self.engine = (f"onnxruntime-genai {og.__version__}, {target}, draft {draft} "
                       f"(our vanilla draft), k = {self.num_draft_tokens}")

    def speculative_options(self) -> dict:
        # a constant k: its adaptive k (min_adaptive_k 1) re-anchors the target after most
        # rejections with this draft, nearly doubling its forwards (79 for 41 rounds, 64
        # tokens, measured on a held-out prompt)
        return {"max_draft_tokens": self.num_draft_tokens}

    def plain_output(self, prompt_ids: list[int], max_new_tokens: int, seed: int,
                     json_schema: dict | None = None) -> list[int]:
        model, self.model = self.model, self.plain_model
        try:
            return super().plain_output(prompt_ids, max_new_tokens, seed, json_schema)
        finally:
            self.model = model

    def close(self) -> None:
        super().close()
        self.plain_model = None


def require_speculation() -> None:
    import onnxruntime_genai as og

    if not hasattr(og.GeneratorParams, "set_speculative_options"):
        raise RuntimeError(f"onnxruntime-genai {og.__version__} has no speculative "
                           "decoding (0.18 or later)")


def draft_model_folders(ctx: PeerContext) -> tuple[Path, Path, Path]:
    """(the target's model, the draft's, the folder that loads both), each built once into
    the peers' cache; ValueError where the engine has no vanilla draft."""
    from trt_spec.export.hf_draft import draft_to_hf
    from trt_spec.tools.peers.hf import hf_dir

    if not ctx.draft:
        raise ValueError("the engine has no vanilla draft")
    source = hf_dir(ctx)
    target = build_model(source, ctx.cache / "ortgenai-int4", ctx.cache / "ortgenai-int4.log")
    draft = build_draft(source, draft_to_hf(source, ctx.draft, ctx.cache / "hf-draft"),
                        ctx.cache / "ortgenai-draft-int4", ctx.cache / "ortgenai-draft-int4.log")
    return target, draft, speculative_folder(target, draft, ctx.cache / "ortgenai-int4-draft")


def build_draft(source_hf: Path, draft_hf: Path, out: Path, log: Path) -> Path:
    """The draft's HF folder through the builder into `out`. The draft folder has no
    tokenizer, which the builder writes out: the target's tokenizer files are linked beside
    it in a staging folder. Rebuilt when the draft changed (its source stamp)."""
    stamp = (draft_hf / "trt_spec_source.json").read_text()
    done = out / "trt_spec_source.json"
    if done.is_file() and done.read_text() == stamp and (out / "genai_config.json").is_file():
        return out
    with tempfile.TemporaryDirectory() as stage:
        for f in draft_hf.iterdir():
            (Path(stage) / f.name).symlink_to(f.resolve())
        for f in source_hf.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
                (Path(stage) / f.name).symlink_to(f.resolve())
        if out.exists():
            shutil.rmtree(out)
        build_model(Path(stage), out, log)
    done.write_text(stamp)
    return out


def speculative_folder(target: Path, draft: Path, out: Path) -> Path:
    """A model folder onnxruntime-genai loads as target + draft: the target's files linked,
    the draft's folder linked as draft/, and genai_config.json = the target's with the
    draft's decoder section under model.draft (its filename relative to this folder)."""
    config = json.loads((target / "genai_config.json").read_text())
    decoder = json.loads((draft / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["draft"] = {**decoder, "filename": f"draft/{decoder['filename']}"}
    with atomic_folder(out) as tmp:
        for f in target.iterdir():
            if f.name != "genai_config.json":
                (tmp / f.name).symlink_to(f.resolve())
        (tmp / "draft").symlink_to(draft.resolve(), target_is_directory=True)
        (tmp / "genai_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out


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
