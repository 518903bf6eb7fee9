"""`trt-spec export`: a model (and its drafters) -> an engine folder (export/pipeline.py). The
options map onto export/config.py ExportConfig, the drafters' onto its drafters by method."""

from __future__ import annotations

from pathlib import Path

import click

from trt_spec.cli.options import fail


HUB = ("a Hugging Face hub repository, org/name[@revision] (fetched into the hub's cache: "
       "HF_HOME, HF_TOKEN, HF_HUB_OFFLINE and HF_ENDPOINT apply; safetensors only)")


def folder_or_hub_name(ctx, param, value):
    """A drafter's checkpoint: an existing folder or a hub name, checked before anything loads
    (the download itself waits for the export)."""
    from trt_spec.export.hub import FORMS, hub_name

    if value is None or Path(value).is_dir():
        return value
    try:
        if hub_name(value) is not None:
            return value
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    raise click.BadParameter(f"{value!r} is not a folder, nor a hub name ({FORMS})", ctx=ctx,
                             param=param)


def renamed(ctx, param, value):
    raise click.BadParameter(f"{value!r}: export's --backend is now --lower-for ort|trt (the "
                             "runtime the graphs are lowered for); --backend names the runtime "
                             "backend of generate", ctx=ctx, param=param)


@click.command()
@click.option("--model", default="smollm2-135m", show_default=True,
              help="A known model name (smollm2-135m, gemma3-270m), a local .gguf file, a "
                   "Hugging Face folder (config.json + safetensors + tokenizer) of a Llama, "
                   "Mistral, Qwen2/2.5, Qwen3 or Gemma 3 (text) model, or " + HUB + ", e.g. "
                   "meta-llama/Llama-3.2-1B-Instruct. A local path wins over a hub name; "
                   "hf://org/name is always the hub's.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "int4", "int4-head8",
                                                "int4-plain", "int8-rows"]),
              default=None,
              help="Precision of the exported graphs: fp32 / int8 / int4 weights for ort "
                   "[default: int4: 4-bit blocks plus each block's residual, which keeps a Q4_1 "
                   "GGUF's weights, and a tied head read at 4 bits with each row's top 128 "
                   "logits at 8; int4-head8: the same with the whole head at 8 bits (slower, "
                   "the distribution's tail exact); int4-plain: without the residual, 4% "
                   "smaller and not the same model, the head's top 16 at 8 bits: the lean graph; "
                   "int8-rows: 8-bit weights times each row of activations quantized to 8 bits "
                   "at run time, on the integer GEMM, whose cost "
                   "barely grows with the rows a step runs (slower alone, faster for batches, "
                   "prefill and verification: for a server)]; fp32 / fp16 for trt, which builds "
                   "strongly typed from the graph's dtypes [default: fp16].")
@click.option("--lower-for", "lower_for", type=click.Choice(["ort", "trt"]), default="ort",
              show_default=True,
              help="The runtime the graphs are lowered for: ONNX Runtime, or TensorRT "
                   "(TRT_Attention / TRT_KVCacheUpdate / the trt_spec::SpecVerify plugin; build "
                   "them with `trt-spec build`).")
@click.option("--backend", "renamed_backend", default=None, hidden=True, expose_value=False,
              callback=lambda ctx, param, value: value is None or renamed(ctx, param, value),
              help="Renamed: --lower-for (--backend is the runtime backend of generate).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output engine folder [default: engines/<model name>].")
@click.option("--draft-layers", type=click.IntRange(min=0), default=0, show_default=True,
              help="Also export a vanilla draft: the target's first N layers + its final norm "
                   "and head (a layer-truncated self-draft). 0: none.")
@click.option("--draft-model", default=None,
              help="Also export a vanilla draft from this model (name, .gguf, HF folder or "
                   "hub name org/name[@revision]; the target's vocabulary).")
@click.option("--mtp", default=None, callback=folder_or_hub_name,
              help="Also export MTP modules from this folder: DeepSeek-V3 layout "
                   "(model.layers.{L+i}.*, may be the target's own checkpoint) or trt-spec's "
                   "drafter.json + model.safetensors. A folder, or a hub name "
                   "org/name[@revision].")
@click.option("--eagle", default=None, callback=folder_or_hub_name,
              help="Also export an Eagle module (one MTP-style module, looped) from this "
                   "folder (or hub name org/name[@revision]): either MTP layout (module 0 "
                   "is used).")
@click.option("--eagle3", default=None, callback=folder_or_hub_name,
              help="Also export an Eagle3 head from this folder: EAGLE3 checkpoint "
                   "(fc/midlayer/d2t or model.fc/model.layers.0 layouts, config.json) or "
                   "trt-spec's own format. A folder, or a hub name org/name[@revision]. The "
                   "target's feature layers follow the head's.")
@click.option("--shipped-drafters/--no-shipped-drafters", default=True, show_default=True,
              help="For a known model, also export the drafters trained for it and shipped in "
                   "drafters/<model>/ (eagle3, mtp, eagle and the vanilla draft), each unless "
                   "its own option (or --draft-layers) names another.")
@click.option("--draft-vocab", default=None, metavar="eagle3|none",
              help="The vocabulary the vanilla draft's and the MTP / Eagle heads draft over: "
                   "eagle3 (the Eagle3 head's draft vocabulary: only those rows of their head "
                   "are exported, a smaller read per drafted token) or none (the full head) "
                   "[default: eagle3 when an Eagle3 head is exported, else none].")
@click.option("--force", is_flag=True, help="Export again even if --out is up to date.")
def export(model, precision, lower_for, out, draft_layers, draft_model, mtp, eagle, eagle3,
           shipped_drafters, draft_vocab, force):
    """Export a model (and optionally its drafters) to an engine folder."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    try:
        config = ExportConfig(model, out, precision, lower_for,
                              drafters={"vanilla": draft_model, "mtp": mtp, "eagle": eagle,
                                        "eagle3": eagle3},
                              draft_layers=draft_layers, draft_vocab=draft_vocab,
                              shipped_drafters=shipped_drafters)
        path = export_model(config, force)
    except (ValueError, FileNotFoundError, KeyError) as e:
        fail(e)
    click.echo(str(path))
