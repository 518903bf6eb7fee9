"""The sizes users run (docs/benchmarks.md): for random-weight models in the shapes of
published 0.5B-3B checkpoints, our int4-plain engine beside onnxruntime-genai's int4 build of
the same checkpoint, our step-cost curve c(T)/c(1), and the speed-up each of our methods
should reach there with the acceptance measured on SmolLM2's held-out prompts.

    .venv/bin/python scripts/sizes_table.py --acceptance smollm2.json [--sizes qwen2.5-0.5b ...]
        [--work /tmp/sizes]

Speed does not depend on the weights' values, so each size is a transformers model built
from its published config alone (random init, bf16 safetensors, SmolLM2's tokenizer beside
it: its ids are all below every vocabulary here); SmolLM2-135M itself is its real checkpoint.
Stages, each skipped when its output is already in WORK/<size>/ (1B+ exports take many
minutes on 2 cores, so the driver resumes):

    hf/           the checkpoint                     (a subprocess: its memory is given back)
    ours/         trt-spec export --precision int4-plain
    theirs        onnxruntime-genai's builder -p int4 -e cpu, where bench's peer looks for it
    plain.json    trt-spec bench --methods none --peers onnxruntime-genai (interleaved)
    costs.json    trt-spec bench --step-costs: c(T) for T = 1..9

The prediction (tools/speedup_model.py) is tau / (E[c(k_i + 1)] / c(1) + drafting / c(1)),
with tau and the steps' drafted lengths k_i from the SmolLM2 run (`trt-spec bench
--no-spec-fallback --json`, so each drafter's own acceptance, every step drafting k) and c(T)
from this size. Drafting: a lookup (ngram, suffix) takes the same microseconds at any size;
a model drafter is assumed to grow with its target, keeping SmolLM2's drafting / c(1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TRT_SPEC = [str(ROOT / ".venv/bin/trt-spec")]
TOKENIZER = Path.home() / ".cache/trt-spec/smollm2-135m/hf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
LOOKUPS = {"ngram", "suffix"}  # drafting cost in absolute time; the rest scale with c(1)

# the published configs' shapes (layers, widths, heads, vocabulary, RoPE); all tie the head.
# smollm2-135m is the real checkpoint (trt-spec export's cached HF folder): the reference row
REAL = {"smollm2-135m": Path.home() / ".cache/trt-spec/smollm2-135m/hf"}
SIZES = {
    "smollm2-135m": {},
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5,
                        max_position_embeddings=131072,
                        rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192}),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                         max_position_embeddings=32768),
    "qwen2.5-3b": dict(model_type="qwen2", hidden_size=2048, intermediate_size=11008,
                       num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=32768),
}


def make_checkpoint(name: str, out: Path) -> None:
    """Random weights in the size's shapes, written as a HF folder (bf16, as published); a
    real checkpoint (REAL) is linked instead."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if name in REAL:
        out.symlink_to(REAL[name], target_is_directory=True)
        return
    kwargs = dict(SIZES[name])
    config = AutoConfig.for_model(kwargs.pop("model_type"), tie_word_embeddings=True,
                                  bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                                  **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for f in TOKENIZER_FILES:
        if (TOKENIZER / f).is_file():
            shutil.copy(TOKENIZER / f, tmp / f)
    tmp.rename(out)


def limit_memory(gib: float) -> None:
    """Caps this process and every stage it starts (address space): on a machine whose
    memory others share, a size too large fails with MemoryError instead of waking the OOM
    killer."""
    import resource

    cap = int(gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def wait_for_memory(gib: float, poll_s: float = 30.0) -> None:
    """Until the machine has `gib` available (MemAvailable): others' jobs come and go."""
    import time

    while True:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        available = int(info["MemAvailable"].split()[0]) / 2**20
        if available >= gib:
            return
        print(f"waiting: {available:.1f} GiB available, {gib} needed", flush=True)
        time.sleep(poll_s)


def run(cmd: list[str], log: Path) -> None:
    """`cmd` with its output appended to `log`, its peak RSS and wall time logged after it."""
    print("$", " ".join(cmd), flush=True)
    cmd = ["/usr/bin/time", "-f", "peak RSS %M KB, %e s wall", *cmd]
    with open(log, "a") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: {' '.join(cmd)}; see {log}")


def theirs_folder(engine: Path) -> Path:
    """Where bench's onnxruntime-genai peer looks for its build of the engine's source."""
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.tools.peers import peer_context

    manifest = load_manifest(engine)
    return peer_context(manifest.data, 2, 4, manifest.folder).cache / "ortgenai-int4"


def stages(name: str, work: Path, args) -> None:
    """Every stage of one size whose output is missing, in order."""
    from trt_spec.tools.peers.ortgenai import build_model

    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / "log.txt"
    hf, ours = folder / "hf", folder / "ours"
    if not (hf / "config.json").is_file():
        run([sys.executable, __file__, "--checkpoint", name, "--work", str(work)], log)
    if not (ours / "manifest.json").is_file():
        wait_for_memory(args.max_memory_gib)
        run(TRT_SPEC + ["export", "--model", str(hf), "--precision", "int4-plain",
                        "--out", str(ours)], log)
    theirs = theirs_folder(ours)
    if not (theirs / "genai_config.json").is_file():
        print(f"building onnxruntime-genai's int4 into {theirs}", flush=True)
        theirs.parent.mkdir(parents=True, exist_ok=True)
        build_model(hf, theirs, folder / "theirs.log")
    if not (folder / "plain.json").is_file():
        run(TRT_SPEC + ["bench", "--engine", str(ours), "--methods", "none",
                        "--peers", "onnxruntime-genai", "--prompts", args.prompts,
                        "--num-prompts", str(args.num_prompts), "--max-new-tokens",
                        str(args.max_new_tokens), "--repeats", str(args.repeats),
                        "--threads", "2", "--json", str(folder / "plain.json")], log)
    if not (folder / "costs.json").is_file():
        run(TRT_SPEC + ["bench", "--engine", str(ours), "--step-costs", "--past",
                        str(args.past), "--threads", "2", "--json",
                        str(folder / "costs.json")], log)


# Without --acceptance: τ measured on SmolLM2-135M's 16 held-out ShareGPT prompts x 96 tokens,
# greedy, k = 1 / 2 / 4 (docs/benchmarks.md, "Exact decoding on each kind of CPU", the Intel
# Xeon with AMX, commit e0cd18c), and drafting per drafted token / c(1) (MTP 0.43 and Eagle3
# 0.30 c(1) at k = 4: "Performance on the CPU"; a lookup's is a few µs)
SMOLLM2_TAU = {"ngram": {1: 1.20, 2: 1.26, 4: 1.27}, "suffix": {1: 1.23, 2: 1.31, 4: 1.29},
               "mtp": {1: 1.17, 2: 1.18, 4: 1.18}, "eagle3": {1: 1.10, 2: 1.11, 4: 1.10}}
DRAFT_PER_TOKEN = {"ngram": 0.0, "suffix": 0.0, "mtp": 0.43 / 4, "eagle3": 0.30 / 4}


def predictions(acceptance: dict | None, costs_ms: dict[int, float]) -> dict[str, float]:
    """The predicted speed-up over plain decoding of every speculative configuration, with
    this size's c(T): from a SmolLM2 bench JSON (each row's τ and drafted lengths; drafting
    rescaled as the module docstring says), or without one from SMOLLM2_TAU, every step
    verifying k + 1 rows (pessimistic for a lookup, which drafts nothing where nothing
    matches)."""
    if acceptance is None:
        return {f"{m} k={k}": round(tau / (costs_ms[k + 1] / costs_ms[1]
                                           + k * DRAFT_PER_TOKEN[m]), 3)
                for m, taus in SMOLLM2_TAU.items() for k, tau in taus.items()
                if k + 1 in costs_ms}
    from trt_spec.tools.speedup_model import k_max, predict

    smol = {int(t): ms for t, ms in next(iter(acceptance["step_costs_ms"].values()))["ms"].items()}
    out = {}
    for r in acceptance["results"]:
        if not r.get("num_draft_tokens") or r["workload"] != "prompts" or r.get("peer"):
            continue
        if k_max(r["num_draft_tokens"]) + 1 > max(costs_ms):
            continue
        row = dict(r)
        if r["method"] not in LOOKUPS:  # drafting / c(1) as on SmolLM2
            row["propose_us_per_step"] = r["propose_us_per_step"] * costs_ms[1] / smol[1]
        predict(row, costs_ms)
        out[f"{r['method']} k={r['num_draft_tokens']}"] = round(row["predicted_speedup"], 3)
    return out


def summary(name: str, work: Path, acceptance: dict | None) -> dict:
    folder = work / name
    plain = json.loads((folder / "plain.json").read_text())
    costs = json.loads((folder / "costs.json").read_text())
    rate = {(r.get("peer") and r["engine"]) or r["method"]: r["tokens_per_s"]["median"]
            for r in plain["results"] if r["workload"] == "prompts"}
    past = next(iter(costs["ms"]))
    ms = {int(t): v for t, v in costs["ms"][past].items()}
    theirs = next((v for k, v in rate.items() if k.startswith("onnxruntime-genai")), None)
    return {"size": name, "ours_none": rate.get("none"), "ours_none_fast": rate.get("none-fast"),
            "theirs": theirs, "past": int(past), "c_ms": ms,
            "ratio": {t: round(v / ms[1], 3) for t, v in ms.items()},
            "predicted": predictions(acceptance, ms)}


def layer_shapes(name: str) -> list[str]:
    """The K x N of our graph's four MatMulNBits a layer: q/k/v fused, o, gate/up fused,
    down (the head apart)."""
    c = SIZES[name]
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * c.get("head_dim", h // c["num_attention_heads"])
    return [f"{h}x{h + 2 * kv}", f"{h}x{h}", f"{h}x{2 * i}", f"{i}x{h}"]


def body_estimate(name: str, row_costs: dict, form: str = "nbits4") -> dict[int, float]:
    """c(T) of the layers' MatMuls alone, in ms: layers x the sum of scripts/row_costs.py's
    single-matrix times (its JSON) of one layer's shapes. Where a whole step cannot be
    exported here, this is its largest part (the head, attention and norms left out)."""
    shapes = layer_shapes(name)
    ts = row_costs[shapes[0]][form]["us"]
    layers = SIZES[name]["num_hidden_layers"]
    return {int(t): layers * sum(row_costs[s][form]["us"][t] for s in shapes) / 1000
            for t in ts}


def markdown(rows: list[dict]) -> str:
    """The two tables of docs/benchmarks.md: speeds and c(T)/c(1); predicted speed-ups."""
    ts = range(2, 9)
    lines = ["| size | ours none | ours none-fast | onnxruntime-genai | ours / theirs | c(1) ms | "
             + " | ".join(f"c({t})/c(1)" for t in ts) + " |",
             "|---" * (6 + len(ts)) + "|"]
    for r in rows:
        ratio = r["ours_none"] / r["theirs"] if r["theirs"] else float("nan")
        lines.append(f"| {r['size']} | {r['ours_none']:.1f} | {r['ours_none_fast']:.1f} | "
                     f"{r['theirs']:.1f} | {ratio:.2f} | {r['c_ms'][1]:.1f} | "
                     + " | ".join(f"{r['ratio'][t]:.2f}" for t in ts) + " |")
    methods = list(dict.fromkeys(m.split()[0] for r in rows for m in r["predicted"]))
    if methods:
        lines += ["", "| size | " + " | ".join(methods) + " |", "|---" * (1 + len(methods)) + "|"]
        for r in rows:
            best = []
            for m in methods:
                ks = {key: v for key, v in r["predicted"].items() if key.split()[0] == m}
                key = max(ks, key=ks.get)
                best.append(f"{ks[key]:.2f} ({key.split()[1]})")
            lines.append(f"| {r['size']} | " + " | ".join(best) + " |")
    return "\n".join(lines)


def body_table(sizes: list[str], row_costs: dict, acceptance: dict | None) -> str:
    """Per size and form: the layers' MatMuls' c(1) ms and c(T)/c(1), and the speed-ups they
    predict (the best k per method) over plain decoding on the first form (nbits4: a form
    whose one row costs more pays that on every step)."""
    lines = []
    for name in sizes:
        if name in REAL or any(s not in row_costs for s in layer_shapes(name)):
            continue
        forms = list(next(iter(row_costs.values())))
        plain = body_estimate(name, row_costs, forms[0])[1]
        for form in forms:
            ms = body_estimate(name, row_costs, form)
            best = {}
            for key, v in predictions(acceptance, ms).items():
                v *= plain / ms[1]
                m = key.split()[0]
                if v > best.get(m, (0, ""))[0]:
                    best[m] = (v, key.split()[1])
            lines.append(f"| {name} | {form} | {ms[1]:.1f} | "
                         + " | ".join(f"{ms[t] / ms[1]:.2f}" for t in sorted(ms) if t > 1)
                         + " | " + ", ".join(f"{m} {v:.2f} ({k})" for m, (v, k) in best.items())
                         + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES)[:4], choices=list(SIZES))
    ap.add_argument("--work", type=Path, default=Path("/tmp/sizes"))
    ap.add_argument("--acceptance", help="SmolLM2's `trt-spec bench --json` with drafters")
    ap.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--max-memory-gib", type=float, default=12.0,
                    help="address-space cap of every stage (default 12)")
    ap.add_argument("--body-costs", type=Path,
                    help="scripts/row_costs.py's JSON over every size's layer shapes: print "
                         "each size's layer-MatMul c(T)/c(1) and the speed-ups it predicts")
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)  # the hf/ stage's subprocess
    args = ap.parse_args()
    if args.checkpoint:
        make_checkpoint(args.checkpoint, args.work / args.checkpoint / "hf")
        return
    limit_memory(args.max_memory_gib)
    acceptance = json.loads(Path(args.acceptance).read_text()) if args.acceptance else None
    if args.body_costs:
        print(body_table(args.sizes, json.loads(args.body_costs.read_text()), acceptance))
        return
    rows = []
    for name in args.sizes:  # one after the other: each holds GBs while it runs
        stages(name, args.work, args)
        rows.append(summary(name, args.work, acceptance))
        (args.work / "table.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows[-1]), flush=True)
    print(markdown(rows))


if __name__ == "__main__":
    main()
