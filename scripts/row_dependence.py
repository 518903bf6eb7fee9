"""Which nodes of an engine's target graph give a row a result that depends on the other rows.

Exact decoding needs a token's logits to be bitwise the same whether the token ran alone (a
plain 1-token step) or among other rows (a verification, other streams of a batch). This
script measures it node by node on this machine: it saves ONNX Runtime's optimized form of
`target.onnx` (the graph the kernels actually run), exposes every node's output, then runs the
same token of one stream (same past) alone and inside steps of other shapes, and compares that
token's row of every float output bitwise. It prints, per shape, the first nodes whose row
differs and the op types that differ first (the others differ because their inputs do).

    python scripts/row_dependence.py --engine engines/smollm2-135m --rows 1,2,3,4,5,8,16
    qemu-x86_64 -cpu max .venv/bin/python scripts/row_dependence.py --engine ...   # AVX2 kernels

A shape is written BxT: B streams of T new tokens each (the probed token is stream 0's first
new token; the other streams decode their own tokens after the same past).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from trt_spec.runtime.backends.ort import make_session
from trt_spec.runtime.backends.cpu import cpu_flags
from trt_spec.runtime.graph_io import ATTENTION_MIN_ROWS
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import load_manifest
from trt_spec.runtime.step_inputs import SlotTokens, build_step_inputs


def optimized_with_every_output(target: Path, out_dir: Path) -> tuple[Path, list[str]]:
    """ORT's optimized graph (level ALL, this machine) with every float node output exposed."""
    optimized = out_dir / "optimized.onnx"
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(optimized)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                  "optimized.data")
    opts.add_session_config_entry(
        "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(target), opts, providers=["CPUExecutionProvider"])
    model = onnx.load(str(optimized), load_external_data=False)
    graph_outputs = {o.name for o in model.graph.output}
    exposed = []
    for node in model.graph.node:
        for name in node.output:
            if name and name not in graph_outputs:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
                exposed.append(name)
    onnx.save(model, str(out_dir / "exposed.onnx"))
    return out_dir / "exposed.onnx", exposed


def node_table(path: Path) -> dict[str, tuple[str, str]]:
    """output name -> (node name, op type), in graph order."""
    model = onnx.load(str(path), load_external_data=False)
    return {o: (n.name, n.op_type) for n in model.graph.node for o in n.output if o}


class ExposedTarget:
    """Runs the exposed graph with the runtime's own step inputs over a host KV cache."""

    def __init__(self, path: Path, manifest, threads: int | None):
        opts_session = make_session(path, threads)
        self.session = opts_session
        self.config = manifest.config
        self.names = [o.name for o in self.session.get_outputs()]
        self.inputs = {i.name for i in self.session.get_inputs()}

    def run(self, cache: KVCache, requests: list[SlotTokens], min_rows: int) -> dict:
        step = build_step_inputs(cache, requests, self.config.max_position_embeddings, 1)
        feeds = dict(step.feeds)
        if ATTENTION_MIN_ROWS in self.inputs:
            feeds[ATTENTION_MIN_ROWS] = np.array(min_rows, np.int32)
        for i, view in enumerate(cache.views(step.lo, step.hi)):
            kind = "key" if i % 2 == 0 else "value"
            feeds[f"past_key_values.{i // 2}.{kind}"] = view
        wanted = [n for n in self.names if not n.startswith("present")]
        values = self.session.run(wanted, feeds)
        return dict(zip(wanted, values))


def first_row(x: np.ndarray) -> np.ndarray | None:
    """Stream 0's first new token's row of a per-token float tensor ([B, T, D] or [B*T, D])."""
    if x.dtype != np.float32 or x.ndim < 2:
        return None
    return x.reshape(-1, x.shape[-1])[0]


def compare(alone: dict, other: dict, order: list[str]) -> list[str]:
    """Output names (graph order) whose probed row differs bitwise."""
    differ = []
    for name in order:
        a, b = alone.get(name), other.get(name)
        if a is None or b is None:
            continue
        ra, rb = first_row(a), first_row(b)
        if ra is None or rb is None or ra.shape != rb.shape:
            continue
        if not np.array_equal(ra.view(np.uint32), rb.view(np.uint32)):
            differ.append(name)
    return differ


def roots(differ: list[str], table: dict, model: onnx.ModelProto) -> list[str]:
    """Differing outputs none of whose node's inputs differ: where a difference starts."""
    producer_inputs = {o: list(n.input) for n in model.graph.node for o in n.output}
    bad = set(differ)
    return [d for d in differ if not any(i in bad for i in producer_inputs.get(d, []))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="engine folder with target.onnx")
    ap.add_argument("--shapes", default="1x2,1x3,1x5,2x1,3x1,4x1,2x3,4x5",
                    help="step shapes BxT to compare with the token alone (default %(default)s)")
    ap.add_argument("--alone", default="1x1",
                    help="the reference shape BxT (default %(default)s: the token alone)")
    ap.add_argument("--min-rows", default="1,2",
                    help="attention_min_rows values to try, where the graph takes it")
    ap.add_argument("--past", type=int, default=12, help="tokens in the cache before the step")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the findings here")
    args = ap.parse_args()

    manifest = load_manifest(Path(args.engine))
    target = manifest.path(manifest.graph("target")["files"][0])
    config = manifest.config
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ref_b, ref_t = (int(v) for v in args.alone.split("x"))
    streams = max([ref_b] + [b for b, _ in shapes])
    findings = {"cpu_flags": cpu_flags(), "ort": ort.__version__, "engine": args.engine,
                "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        exposed, _ = optimized_with_every_output(target, Path(tmp))
        table = node_table(exposed)
        model = onnx.load(str(exposed), load_external_data=False)
        order = [o for n in model.graph.node for o in n.output if o]
        runner = ExposedTarget(exposed, manifest, args.threads)
        cache = KVCache(config, slots=streams, max_len=args.past + 16)
        prompt = rng.integers(3, config.vocab_size, args.past).tolist()
        for s in range(streams):
            cache.allocate()
        runner.run(cache, [SlotTokens(s, prompt, [args.past - 1]) for s in range(streams)], 1)
        new = rng.integers(3, config.vocab_size, 16).tolist()
        for m in [int(v) for v in args.min_rows.split(",")]:
            cache.lengths[:] = args.past
            alone = runner.run(cache, [SlotTokens(s, new[s:s + ref_t], list(range(ref_t)))
                                       for s in range(ref_b)], m)
            for b, t in shapes:
                cache.lengths[:] = args.past
                other = runner.run(cache, [SlotTokens(s, new[s:s + t], list(range(t)))
                                           for s in range(b)], m)
                differ = compare(alone, other, order)
                starts = roots(differ, table, model)
                ops = Counter(table[d][1] for d in starts)
                logits = "logits" in differ
                print(f"min_rows {m} shape {b}x{t}: {len(differ)} outputs differ"
                      f" (logits {'differ' if logits else 'equal'}); first at "
                      + ", ".join(f"{op} x{c}" for op, c in ops.most_common()) if differ else
                      f"min_rows {m} shape {b}x{t}: every row bitwise equal")
                for d in starts[:3]:
                    print(f"    {table[d][1]:<28} {table[d][0]}")
                findings["results"].append({
                    "min_rows": m, "shape": f"{b}x{t}", "differ": len(differ),
                    "logits_differ": logits, "first_ops": dict(ops),
                    "first_nodes": [table[d][0] for d in starts[:10]]})
    if args.json:
        Path(args.json).write_text(json.dumps(findings, indent=1) + "\n")


if __name__ == "__main__":
    main()
