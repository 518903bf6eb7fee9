"""`python -m trt_spec.tools.peers --engine DIR`: builds, once, what the peers derive from the
engine's model (the HF draft for transformers-assisted, the onnxruntime-genai int4 model and
its draft-model folder, the draft as a GGUF for llama.cpp-draft), so
that `trt-spec bench --peers` only loads them. A peer that cannot be prepared is reported and
skipped, as bench would."""

from __future__ import annotations

import argparse
import sys

from trt_spec.runtime.manifest import load_manifest
from trt_spec.tools.peers import PEERS, peer_context


def build_hf_draft(ctx) -> str:
    from trt_spec.export.hf_draft import draft_to_hf
    from trt_spec.tools.peers.hf import hf_dir

    if not ctx.draft:
        raise ValueError("the engine has no vanilla draft")
    return str(draft_to_hf(hf_dir(ctx), ctx.draft, ctx.cache / "hf-draft"))


def build_ortgenai(ctx) -> str:
    from trt_spec.tools.peers.hf import hf_dir
    from trt_spec.tools.peers.ortgenai import build_model

    return str(build_model(hf_dir(ctx), ctx.cache / "ortgenai-int4",
                           ctx.cache / "ortgenai-int4.log"))


def build_ortgenai_draft(ctx) -> str:
    from trt_spec.tools.peers.ortgenai import draft_model_folders

    return str(draft_model_folders(ctx)[2])


def build_gguf_draft(ctx) -> str:
    from trt_spec.export.gguf_draft import draft_to_gguf
    from trt_spec.tools.peers.llamacpp import gguf_file

    if not ctx.draft:
        raise ValueError("the engine has no vanilla draft")
    return str(draft_to_gguf(gguf_file(ctx.model), ctx.draft, ctx.cache / "draft.gguf"))


def prepare(engine: str) -> dict[str, str]:
    """{peer: the folder built (or found), or why not}."""
    ctx = peer_context(load_manifest(engine, verify="none").data, None, 4, engine)
    done = {}
    for name, build in (("transformers-assisted", build_hf_draft),
                        ("onnxruntime-genai", build_ortgenai),
                        ("onnxruntime-genai-draft", build_ortgenai_draft),
                        ("llama.cpp-draft", build_gguf_draft)):
        ok, reason = PEERS[name]().available()
        if not ok:
            done[name] = f"not prepared: {reason}"
            continue
        try:
            done[name] = build(ctx)
        except Exception as e:  # bench will skip this peer with the same reason
            done[name] = f"not prepared: {type(e).__name__}: {e}"
    return done


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m trt_spec.tools.peers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", required=True, help="engine folder (its manifest names "
                                                        "the model and the vanilla draft)")
    args = parser.parse_args()
    try:
        done = prepare(args.engine)
    except ValueError as e:  # not an engine folder, or no source model in its manifest
        sys.exit(f"peers: {e}")
    for name, what in done.items():
        print(f"{name}: {what}", file=sys.stderr)


if __name__ == "__main__":
    main()
