#!/usr/bin/env python3
"""The GPU check, one script (<= 8 minutes on an H200):

    python scripts/gpu_check.py --model MODEL --reference gpu-reference.json --out OUT \
        [--eagle3 DIR] [--mtp DIR] [--eagle DIR] [--draft DIR | --draft-layers N] \
        [--device cuda] [--max-new-tokens 64] [--tie-tol 0.01] [--budget-s 280]

Sections (each records ok / seconds / error in OUT/gpu_check.json, rewritten after every
section; one failing section never stops the others):
    environment   versions, device, TF32 off (fp32 comparisons)
    load          the torch-cuda backend from MODEL (+ drafters), CUDA graphs on
    reference     the GPU target, teacher-forced on each reference sequence (ORT fp32, CPU):
                  every reference token is the GPU argmax up to a near-tie (gap <= tie_tol)
    methods       every method available (none, ngram, + drafters): greedy output with CUDA
                  graphs, identical-to-reference count, and lossless by teacher forcing on the
                  GPU target (each emitted token within tie_tol of the argmax); tokens/s
    device_loop   the device-resident loop (runtime/device/loop.py, one CUDA graph per phase):
                  tokens/s at batch 1 and 8 for every method, its speed-up over plain decoding
                  and tau, beside the host loop's plain decoding; device_loop.json and a plot,
                  device_loop.png (tokens/s per method and batch)
    speed         the host loop: tokens/s with and without CUDA graphs, batch 1 and 8 (none,
                  and the best drafter)
    plugins       trt_spec.plugins.kernel_check.run(results), when that module exists
    tensorrt      when `tensorrt` imports: build the engines and run the trt backend

MODEL and the drafter folders go to export/checkpoint.py resolve_model / load_target and
export/drafter_checkpoint.py load_drafter. Make the reference beforehand on the CPU:
    python scripts/gpu_reference.py --model MODEL --out gpu-reference.json
Runs from a plain checkout too (no `pip install -e .`): the trt_spec package is mapped onto
the repository's folders here.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bootstrap() -> None:
    """`import trt_spec.runtime` from a checkout that is not installed: pyproject maps the
    folders export/, runtime/, plugins/, train/ into trt_spec; do the same on its __path__."""
    try:
        import trt_spec.runtime  # noqa: F401 - installed (pip install -e .)
    except ImportError:
        sys.path.insert(0, str(ROOT))
        for name in [m for m in sys.modules if m == "trt_spec" or m.startswith("trt_spec.")]:
            del sys.modules[name]
        import trt_spec

        trt_spec.__path__.append(str(ROOT))
        import trt_spec.runtime  # noqa: F401


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Check:
    """Runs named sections, records each one's result or error, writes the JSON after each."""

    def __init__(self, out: Path, budget_s: float):
        self.out = out
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.results: dict = {"sections": {}}

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def run(self, name: str, fn, *args, min_left: float = 0.0):
        if self.left() < min_left:
            log(f"{name}: skipped ({self.left():.0f} s left of the budget)")
            self.results["sections"][name] = {"ok": None, "skipped": "time budget"}
            self.save()
            return None
        log(f"{name} ...")
        t = time.perf_counter()
        entry: dict = {}
        try:
            value = fn(*args)
            entry = {"ok": True, **(value if isinstance(value, dict) else {})}
        except Exception as e:  # noqa: BLE001 - record it, go on with the next section
            entry = {"ok": False, "error": f"{type(e).__name__}: {e}",
                     "traceback": traceback.format_exc()[-4000:]}
            value = None
            log(f"{name}: FAILED: {entry['error']}")
        entry["seconds"] = round(time.perf_counter() - t, 2)
        self.results["sections"][name] = entry
        log(f"{name}: {'ok' if entry['ok'] else 'failed'} in {entry['seconds']} s")
        self.save()
        return value

    def save(self) -> None:
        self.results["total_s"] = round(time.perf_counter() - self.t0, 2)
        (self.out / "gpu_check.json").write_text(json.dumps(self.results, indent=1, default=str))


# --- sections --------------------------------------------------------------------------------

def environment(device: str) -> dict:
    import torch

    # fp32 comparisons against the CPU reference: no TF32 anywhere
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    env = {"python": platform.python_version(), "torch": torch.__version__,
           "cuda_available": torch.cuda.is_available(), "device": device}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but torch.cuda.is_available() is False")
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   capability=list(torch.cuda.get_device_capability()))
    for name in ("triton", "onnxruntime", "transformers", "onnx", "gguf", "tensorrt"):
        try:
            module = __import__(name)
            env[name] = getattr(module, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - absent or broken: just say so
            env[name] = f"not importable ({type(e).__name__})"
    return env


def load(args) -> dict:
    from trt_spec.export.torch_backend import TorchGraphs
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids

    heads = {k: getattr(args, k) for k in ("mtp", "eagle", "eagle3") if getattr(args, k)}
    graphs, manifest = TorchGraphs.from_model(args.model, heads, args.draft_layers, args.draft,
                                              args.device, cuda_graphs=args.device != "cpu",
                                              pad=True)
    ref = args.ref
    c = manifest.config
    for key in ("vocab_size", "hidden_size", "num_layers"):
        if ref["config"][key] != getattr(c, key):
            raise ValueError(f"the reference's {key} {ref['config'][key]} != the model's "
                             f"{getattr(c, key)}: another model?")
    longest = max(len(i["prompt_ids"]) + len(i["output_ids"]) for i in ref["items"])
    # room for the longest reference, the speed runs, and k + 1 verify rows past the end
    max_len = min(c.max_position_embeddings,
                  longest + max(2 * args.max_new_tokens, args.speed_tokens) + 16)
    args.gen = Generator.from_graphs(manifest, graphs, max_batch=8, max_len=max_len)
    args.graphs = graphs
    from trt_spec.runtime.generator import available_methods

    args.methods = available_methods(manifest)
    from trt_spec.runtime.methods import METHODS

    args.methods_device = [m for m in args.methods if METHODS[m].device]
    return {"methods": args.methods, "max_len": max_len, "cuda_graphs": graphs.cuda_graphs,
            "config": c.to_dict()}


def teacher_forced(gen, prompt_ids: list[int], output_ids: list[int], tol: float) -> dict:
    """Is each output token the target's argmax given its prefix, up to a near-tie?"""
    import numpy as np

    from trt_spec.tools.fidelity import score

    logits = score(gen, prompt_ids + output_ids, len(prompt_ids))  # [n, vocab]
    n = len(output_ids)
    logits = logits[:n]
    top = logits.max(-1)
    chosen = logits[np.arange(n), output_ids]
    gaps = top - chosen  # 0 where the token is the argmax
    return {"positions": n, "argmax": int((gaps == 0).sum()),
            "near_ties": int(((gaps > 0) & (gaps <= tol)).sum()),
            "violations": int((gaps > tol).sum()), "max_gap": float(gaps.max(initial=0.0))}


def reference_fidelity(args) -> dict:
    totals = {"positions": 0, "argmax": 0, "near_ties": 0, "violations": 0, "max_gap": 0.0}
    for item in args.ref["items"]:
        r = teacher_forced(args.gen, item["prompt_ids"], item["output_ids"], args.tie_tol)
        for k in ("positions", "argmax", "near_ties", "violations"):
            totals[k] += r[k]
        totals["max_gap"] = max(totals["max_gap"], r["max_gap"])
    if totals["violations"]:
        raise AssertionError(f"{totals['violations']} reference tokens are not the GPU target's "
                             f"argmax within {args.tie_tol}: {totals}")
    return totals


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def generate(gen, method: str, prompts: list[list[int]], new_tokens: int, k: int = 4):
    """-> (streams, seconds); every stream decodes exactly new_tokens tokens."""
    import torch

    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.scheduler import generate_ids

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    streams = generate_ids(gen, prompts, params, method, None if method == "none" else k)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return streams, time.perf_counter() - t


def summary(streams, seconds: float) -> dict:
    tokens = sum(len(s.output_ids) for s in streams)
    forwards = sum(s.stats.target_forwards for s in streams)
    proposed = sum(s.stats.proposed for s in streams)
    return {"tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "tau": round(tokens / forwards, 3) if forwards else None,
            "acceptance": round(sum(s.stats.accepted for s in streams) / proposed, 3) if proposed
            else None}


def methods(args, check: Check) -> dict:
    items = args.ref["items"][:8]
    prompts = [i["prompt_ids"] for i in items]
    refs = [i["output_ids"][:args.max_new_tokens] for i in items]
    report, failures = {}, []
    for method in args.methods:
        if check.left() < 20:
            report[method] = {"skipped": "time budget"}
            continue
        try:
            generate(args.gen, method, prompts[:2], 8)  # capture the common buckets
            streams, seconds = generate(args.gen, method, prompts, args.max_new_tokens)
            outs = [s.output_ids for s in streams]
            tf = [teacher_forced(args.gen, p, o, args.tie_tol) for p, o in zip(prompts, outs)]
            r = {**summary(streams, seconds),
                 "identical_to_reference": sum(o == ref for o, ref in zip(outs, refs)),
                 "prompts": len(prompts),
                 "first_divergence": [first_divergence(o, ref) for o, ref in zip(outs, refs)],
                 "violations": sum(t["violations"] for t in tf),
                 "near_ties": sum(t["near_ties"] for t in tf),
                 "max_gap": max(t["max_gap"] for t in tf)}
            r["ok"] = r["violations"] == 0
        except Exception as e:  # noqa: BLE001 - one method failing does not stop the others
            r = {"ok": False, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()[-3000:]}
        if not r["ok"]:
            failures.append(method)
        report[method] = r
        log(f"  {method}: {json.dumps({k: v for k, v in r.items() if k != 'traceback'})}")
    report["graph_stats"] = args.graphs.stats()
    if failures:
        raise AssertionError(f"methods not lossless or failing: {failures}; {report}")
    return report


def device_loop(args, check: Check) -> dict:
    """Every method on the device loop at batch 1 and 8 (greedy, speed_tokens new tokens, k =
    --k), plain decoding on the host loop beside it; writes device_loop.json and the plot."""
    gen = args.gen
    prompts = [i["prompt_ids"] for i in args.ref["items"]]
    report: dict = {"k": args.k, "new_tokens": args.speed_tokens, "runs": {}}
    runs = report["runs"]
    for batch in (1, 8):
        batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
        for loop, methods in (("device", args.methods_device), ("host", ["none"])):
            gen.configure(executor=loop)
            for method in methods:
                name = f"{loop}/{method}/batch{batch}"
                if check.left() < 15:
                    runs[name] = {"skipped": "time budget"}
                    continue
                try:
                    generate(gen, method, batch_prompts, 8, args.k)  # warm-up: capture
                    streams, seconds = generate(gen, method, batch_prompts, args.speed_tokens,
                                                args.k)
                    runs[name] = summary(streams, seconds)
                except Exception as e:  # noqa: BLE001 - one run failing does not stop the rest
                    runs[name] = {"error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-2000:]}
                log(f"  {name}: {json.dumps({k: v for k, v in runs[name].items() if k != 'traceback'})}")
    gen.configure(executor="device")  # (the loops the runs used)
    report["loops"] = {f"{method}/{loop.k_max}": dict(loop.stats)  # (one loop a method)
                       for method, loop in gen.device_executor.loops.items()}
    gen.configure(executor="auto")
    for name, r in runs.items():  # speed-up over plain decoding on the same loop and batch
        loop, method, batch = name.split("/")
        plain = runs.get(f"{loop}/none/{batch}", {}).get("tokens_per_s")
        if plain and r.get("tokens_per_s"):
            r["speedup"] = round(r["tokens_per_s"] / plain, 3)
    (check.out / "device_loop.json").write_text(json.dumps(report, indent=1))
    report["plot"] = plot_device_loop(runs, check.out / "device_loop.png", args)
    return report


def plot_device_loop(runs: dict, path: Path, args) -> str:
    """Tokens/s per method (bars) at batch 1 and 8, the host loop's plain decoding beside."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return svg_bars(runs, path.with_suffix(".svg"), args)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, batch in zip(axes, (1, 8)):
        names = [n for n in runs if n.endswith(f"/batch{batch}") and runs[n].get("tokens_per_s")]
        labels = [n.rsplit("/", 1)[0].replace("device/", "").replace("host/none", "host plain")
                  for n in names]
        values = [runs[n]["tokens_per_s"] for n in names]
        bars = ax.bar(labels, values, color=["C1" if n.startswith("host") else "C0"
                                             for n in names])
        for b, n in zip(bars, names):
            tau = runs[n].get("tau")
            ax.annotate(f"tau {tau:.2f}" if tau else "", (b.get_x() + b.get_width() / 2,
                        b.get_height()), ha="center", va="bottom", fontsize=8)
        ax.set_title(f"batch {batch} (aggregate tokens/s)")
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"device loop, greedy, k={args.k}, {args.speed_tokens} new tokens, "
                 f"{args.device}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def svg_bars(runs: dict, path: Path, args) -> str:
    """The same plot as plain SVG, for a machine without matplotlib."""
    bars = [(n, r["tokens_per_s"], r.get("tau")) for n, r in runs.items() if r.get("tokens_per_s")]
    top = max((v for _, v, _ in bars), default=1.0)
    width, height, bar = 60 + 70 * len(bars), 340, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'font-family="sans-serif" font-size="10">',
             f'<text x="10" y="16" font-size="12">device loop, greedy, k={args.k}, '
             f'{args.speed_tokens} new tokens, {args.device}: tokens/s</text>']
    for i, (name, value, tau) in enumerate(bars):
        x, h = 40 + 70 * i, 240 * value / top
        color = "#e08030" if name.startswith("host") else "#3070c0"
        parts += [f'<rect x="{x}" y="{280 - h:.1f}" width="{bar}" height="{h:.1f}" '
                  f'fill="{color}"/>',
                  f'<text x="{x}" y="{275 - h:.1f}">{value:.0f}'
                  + (f" τ{tau:.2f}" if tau else "") + "</text>",
                  f'<text x="{x}" y="295">{name.split("/")[1]}</text>',
                  f'<text x="{x}" y="308">{name.split("/")[0]} {name.split("/")[2]}</text>']
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")
    return str(path)


def set_graphs(graphs, on: bool) -> None:
    """CUDA graphs (and bucket padding) on or off for every loaded module."""
    for t in graphs.loaded.values():
        t.cuda_graphs = on and graphs.cuda_graphs
        t.pad = on


def speed(args, check: Check) -> dict:
    args.gen.configure(executor="host")  # this section times the host loop's graphs
    prompt = args.ref["items"][0]["prompt_ids"]
    drafters = [m for m in ("eagle3", "mtp", "eagle", "vanilla") if m in args.methods]
    report = {}
    for method in ["none"] + drafters[:1]:
        for batch in (1, 8):
            for graphs_on in (True, False):
                name = f"{method}/batch{batch}/{'graphs' if graphs_on else 'eager'}"
                if check.left() < 15:
                    report[name] = {"skipped": "time budget"}
                    continue
                set_graphs(args.graphs, graphs_on)
                try:
                    generate(args.gen, method, [prompt] * batch, 8)  # warm-up / capture
                    streams, seconds = generate(args.gen, method, [prompt] * batch,
                                                args.speed_tokens)
                    report[name] = summary(streams, seconds)
                except Exception as e:  # noqa: BLE001
                    report[name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"  {name}: {report[name]}")
    set_graphs(args.graphs, True)
    args.gen.configure(executor="auto")
    for method in ["none"] + drafters[:1]:
        for batch in (1, 8):
            g, e = (report.get(f"{method}/batch{batch}/{m}", {}).get("tokens_per_s")
                    for m in ("graphs", "eager"))
            if g and e:
                report[f"{method}/batch{batch}/speedup"] = round(g / e, 2)
    return report


def plugins(check: Check) -> dict:
    try:
        from trt_spec.plugins import gpu_check as plugin_check
    except ImportError as e:
        return {"skipped": f"trt_spec.plugins.kernel_check is not there ({e})"}
    results: dict = {}
    try:
        plugin_check.run(results)
    finally:
        check.results["plugins_results"] = results
    return {"recorded": sorted(results)}


def tensorrt_section(args) -> dict:
    try:
        import tensorrt as trt
    except ImportError as e:
        return {"skipped": f"tensorrt is not importable here ({e})"}
    import tempfile

    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.export.trt_build import build
    from trt_spec.runtime.backends.trt import TrtTarget  # noqa: F401 - imports on this machine

    folder = Path(tempfile.mkdtemp(prefix="gpu-check-trt-"))
    engine_dir = export_model(ExportConfig(args.model, folder / "fp32", "fp32",
                                           shipped_drafters=False))
    info = build(engine_dir, max_batch=8, max_draft_tokens=4, log=log)
    return {"tensorrt": trt.__version__, "built": info}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="a HF folder or .gguf (resolve_model)")
    ap.add_argument("--reference", required=True, help="JSON from scripts/gpu_reference.py")
    ap.add_argument("--out", required=True, help="folder for gpu_check.json")
    ap.add_argument("--mtp", default=None)
    ap.add_argument("--eagle", default=None)
    ap.add_argument("--eagle3", default=None)
    ap.add_argument("--draft", default=None, help="a vanilla draft model (HF folder)")
    ap.add_argument("--draft-layers", type=int, default=0, help="a layer-truncated self-draft")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--speed-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (device_loop)")
    ap.add_argument("--tie-tol", type=float, default=0.01,
                    help="logit gap under which two tokens count as a near-tie")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="later sections are skipped once this much time has passed")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.ref = json.loads(Path(args.reference).read_text())
    args.max_new_tokens = min(args.max_new_tokens, args.ref["max_new_tokens"])
    bootstrap()

    check = Check(out, args.budget_s)
    check.results["args"] = {k: v for k, v in vars(args).items() if k != "ref"}
    check.run("environment", environment, args.device)
    loaded = check.run("load", load, args)
    if loaded is not None:
        check.run("reference", reference_fidelity, args, min_left=30)
        check.run("methods", methods, args, check, min_left=30)
        check.run("device_loop", device_loop, args, check, min_left=30)
        check.run("speed", speed, args, check, min_left=20)
    check.run("plugins", plugins, check)
    check.run("tensorrt", tensorrt_section, args)
    failed = [n for n, s in check.results["sections"].items() if s.get("ok") is False]
    log(f"done in {check.results['total_s']} s; failed sections: {failed or 'none'}; "
        f"results in {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
