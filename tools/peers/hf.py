"""transformers `generate` (fp32, the same HF weights our engine was exported from), plain and
with assisted generation (our vanilla draft converted to an HF LlamaForCausalLM).

Timing: a streamer timestamps every put() of new tokens (assisted generation puts the accepted
tokens of one step together: they share a stamp). Target forwards are counted by a forward
hook on the target, so tau = completion tokens / target forwards, prefill included, as ours.
"""

from __future__ import annotations

import copy
import importlib.util
import time

from trt_spec.tools.peers import PeerContext, decode_rate


def hf_dir(ctx: PeerContext):
    from trt_spec.export.checkpoint import resolve_model

    return resolve_model(ctx.model)


class TransformersPeer:
    name = "transformers"
    precision = "fp32"
    num_draft_tokens = None

    def __init__(self):
        self.engine = "transformers"
        self.model = None
        self.assistant = None

    def available(self) -> tuple[bool, str]:
        for module in ("torch", "transformers"):
            if importlib.util.find_spec(module) is None:
                return False, f"{module} is not installed (pip install -e '.[export]')"
        return True, ""

    def load(self, ctx: PeerContext) -> None:
        import torch
        import transformers

        folder = hf_dir(ctx)
        torch.set_num_threads(ctx.threads)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).eval()
        ignore_eos(self.model)
        self.engine = f"transformers {transformers.__version__} generate, {folder}"

    def holds_schemas(self) -> tuple[bool, str]:
        return False, ("transformers generate has no JSON-schema constraint of its own (it "
                       "takes an outside logits processor)")

    def search_options(self, max_new_tokens: int, temperature: float) -> dict:
        """Plain temperature sampling (no top-k / top-p), as our SamplingParams' defaults."""
        if temperature == 0:
            return {"max_new_tokens": max_new_tokens, "do_sample": False}
        return {"max_new_tokens": max_new_tokens, "do_sample": True, "temperature": temperature,
                "top_k": 0, "top_p": 1.0}

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict:
        import torch

        assert self.model is not None, "load() first"
        assert json_schema is None, "holds_schemas() says no"
        streamer = stamp_streamer()
        forwards = []  # one entry per target forward
        hook = self.model.register_forward_hook(lambda *_: forwards.append(1))
        torch.manual_seed(seed)
        ids = torch.tensor([prompt_ids])  # (1, T)
        try:
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                          streamer=streamer, **self.extra(),
                                          **self.search_options(max_new_tokens, temperature))
        finally:
            hook.remove()
        output_ids = out[0, len(prompt_ids):].tolist()
        assert len(output_ids) == len(streamer.stamps), (len(output_ids), len(streamer.stamps))
        return {"tokens_per_s": decode_rate(streamer.stamps),
                "completion_tokens": len(output_ids), "target_forwards": len(forwards),
                "ttft_s": streamer.stamps[0] - t0 if streamer.stamps else None,
                "output_ids": output_ids}

    def extra(self) -> dict:
        return {}

    def close(self) -> None:
        self.model = self.assistant = None


class AssistedPeer(TransformersPeer):
    """Assisted generation: our vanilla draft proposes exactly k tokens a step (constant
    schedule, no confidence cut-off), the target verifies them in one forward."""
    name = "transformers-assisted"

    def load(self, ctx: PeerContext) -> None:
        import torch
        import transformers

        from trt_spec.export.hf_draft import draft_to_hf

        if not ctx.draft:
            raise ValueError("the engine has no vanilla draft to assist with")
        super().load(ctx)
        folder = draft_to_hf(hf_dir(ctx), ctx.draft, ctx.cache / "hf-draft")
        self.assistant = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32).eval()
        ignore_eos(self.assistant)
        g = self.assistant.generation_config
        self.num_draft_tokens = g.num_assistant_tokens = ctx.num_draft_tokens
        g.num_assistant_tokens_schedule = "constant"
        g.assistant_confidence_threshold = 0.0
        self.engine = (f"transformers {transformers.__version__} assisted generation "
                       f"(k={ctx.num_draft_tokens}, draft {folder})")

    def extra(self) -> dict:
        return {"assistant_model": self.assistant}


def ignore_eos(model) -> None:
    """generate() fills every unset option from model.generation_config: with no EOS there,
    there is no EOS stopping criterion, and EOS is a token like any other (as our
    ignore_eos)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.eos_token_id


def stamp_streamer():
    """A transformers streamer that records when each new token arrives. The first put() is
    the prompt (generate echoes it); later ones hold one or more new tokens."""
    from transformers.generation.streamers import BaseStreamer

    class _Stamps(BaseStreamer):
        def __init__(self):
            self.stamps: list[float] = []
            self.prompt_seen = False

        def put(self, value) -> None:
            now = time.perf_counter()
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.stamps += [now] * value.numel()

        def end(self) -> None:
            pass

    return _Stamps()
