"""Nodes and kernel time by op type, ours against onnxruntime-genai's graph (docs/quantization.md,
"The lean graph").

    .venv/bin/python scripts/lean_graph.py --past 128 \
        int4=engines/smollm2-135m/target.onnx \
        int4-plain=engines/lean-int4-plain/target.onnx \
        ortgenai=/root/.cache/trt-spec/smollm2-135m/ortgenai-int4/model.onnx

Each graph runs one new token after `past` cached ones at batch 1, in a raw ONNX Runtime session
made as the runtime makes it (runtime/backends/ort.py make_session: 2 intra-op threads, full
optimization), every layer's max-length cache buffer bound as both past and present (ours and
theirs alike). A graph of ours that takes `attention_min_rows` runs as `label@m` for each m of
--min-rows (1: the one-row kernels, 2: exact decoding's extra attention row), and `label-norows`
with the Pad / Slice pairs taken out (runtime/backends/rows_free.py, as fast decoding loads it): what the rows cost, measured.

Two measurements, interleaved across graphs so drift hits all alike:
- step ms: the median of --repeats timed steps, profiling off, and the process's CPU time per
  step (mean): with --threads 1 that is the graph's work alone, which a machine loaded by
  others inflates far less than the wall time;
- by op type: ORT's profiler (SessionOptions.enable_profiling) over --profiled steps, the kernel
  time (its `*_kernel_time` events) summed per op type and divided by the steps, with the
  kernels run per step. Profiling inflates every kernel; compare within a column.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from trt_spec.runtime.backends.huge_pages import huge_pages
from trt_spec.runtime.backends.ort import _shared_pool
from trt_spec.runtime.backends.rows_free import strip_attention_rows
from trt_spec.runtime.graph_io import ATTENTION_MIN_ROWS


def load_proto(path: Path) -> onnx.ModelProto:
    return onnx.load(str(path), load_external_data=True)


def in_place_cache(session, io, past_names, present_names, shape):
    """Binds one zero buffer per layer and kind as both past and present (kept alive)."""
    kept = []
    for past, present in zip(past_names, present_names):
        value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        io.bind_ortvalue_input(past, value)
        io.bind_ortvalue_output(present, value)
        kept.append(value)
    return kept


def one_token_feeds(past: int, theirs: bool, min_rows: int | None = None) -> dict:
    """The small inputs of a 1-token step after `past` cached tokens: onnxruntime-genai's
    graph (theirs) reads an attention mask, ours positions and GroupQueryAttention's lengths
    (and attention's minimum rows where min_rows is given)."""
    feeds = {"input_ids": np.array([[1]], np.int64)}
    if theirs:
        feeds["attention_mask"] = np.ones((1, past + 1), np.int64)
        return feeds
    feeds.update(position_ids=np.array([[past]], np.int64),
                 seqlens_k=np.array([past], np.int32),
                 query_seqlens=np.array([1], np.int32),
                 total_sequence_length=np.array(past + 1, np.int32),
                 logits_index=np.zeros((1, 1), np.int64))
    if min_rows is not None:
        feeds[ATTENTION_MIN_ROWS] = np.array(min_rows, np.int32)
    return feeds


class Graph:
    """One graph, one session, one bound 1-token step after `past`."""

    def __init__(self, label: str, source, past: int, profile: bool, min_rows: int | None):
        self.label = label
        self.session = session(source, profile)
        names = [i.name for i in self.session.get_inputs()]
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        self.io = self.session.io_binding()
        self.theirs = "attention_mask" in names
        pasts = [n for n in names if n.startswith("past_key_values.")]
        presents = [n.replace("past_key_values", "present") for n in pasts]
        _, kv_heads, _, head_dim = shapes[pasts[0]]
        if not isinstance(head_dim, int):  # theirs: a symbolic axis; genai_config.json says
            config = Path(source).with_name("genai_config.json")
            head_dim = json.loads(config.read_text())["model"]["decoder"]["head_size"]
        self.kept = in_place_cache(self.session, self.io, pasts, presents,
                                   (1, kv_heads, past + 16, head_dim))
        feeds = one_token_feeds(past, self.theirs, min_rows)
        for name, value in feeds.items():
            self.io.bind_cpu_input(name, value)
        for out in self.session.get_outputs():
            if not out.name.startswith("present"):
                self.io.bind_output(out.name, "cpu")

    def step(self) -> None:
        self.session.run_with_iobinding(self.io)


THREADS = [2]  # intra-op threads of every session (--threads)


def session(source, profile: bool):
    """make_session's options (runtime/backends/ort.py: 2 threads on the process-wide pool),
    profiling on demand; `source` a path or a serialized graph."""
    opts = ort.SessionOptions()
    if _shared_pool(THREADS[0]):  # the process-wide pool, as make_session sets it up
        opts.use_per_session_threads = False
    else:
        opts.intra_op_num_threads, opts.inter_op_num_threads = THREADS[0], 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    opts.enable_profiling = profile
    opts.profile_file_prefix = "/tmp/lean_graph_profile"
    with huge_pages():  # as make_session: every graph alike, whatever order they are made in
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def variants(label: str, path: Path, min_rows: list[int]) -> list[tuple]:
    """(label, source, min_rows) to run for one graph file: each m for ours with attention
    rows, and the same graph without them (serialized with its weights: ORT refuses external
    data outside the graph's folder, and engine folders are not ours to write)."""
    proto = onnx.load(str(path), load_external_data=False)
    if not any(i.name == ATTENTION_MIN_ROWS for i in proto.graph.input):
        return [(label, str(path), None)]
    stripped = strip_attention_rows(onnx.load(str(path)))  # weights in memory
    out = stripped.SerializeToString()
    return [(f"{label}@{m}", str(path), m) for m in min_rows] + [(f"{label}-norows", out, None)]


def profile_by_op(graph: Graph, steps: int, warm: int = 20) -> dict:
    """{op: (kernel ms per step, kernels per step)} from ORT's profiler, over `steps` steps
    after `warm` (profiled too, and left out: the profiler starts with the session)."""
    for _ in range(warm):
        graph.step()
    for _ in range(steps):
        graph.step()
    events = json.loads(Path(graph.session.end_profiling()).read_text())
    runs = sorted(e["ts"] for e in events if e.get("name") == "model_run")
    assert len(runs) == warm + steps, (len(runs), warm, steps)
    start_us = runs[warm]
    time_us, count = collections.Counter(), collections.Counter()
    for e in events:
        if (e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")
                and e["ts"] >= start_us):
            op = e["args"]["op_name"]
            time_us[op] += e["dur"]
            count[op] += 1
    return {op: (time_us[op] / steps / 1000, count[op] / steps) for op in time_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("graphs", nargs="+", help="label=path/to/graph.onnx")
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--min-rows", default="1,2", help="attention_min_rows values for ours")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--profiled", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2,
                    help="intra-op threads (1: the CPU time per step is the work alone, "
                         "robust to a loaded machine)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    THREADS[0] = args.threads
    runs = []
    for spec in args.graphs:
        label, path = spec.split("=", 1)
        runs += variants(label, Path(path), [int(m) for m in args.min_rows.split(",")])
    nodes = {label: collections.Counter(n.op_type for n in (
        onnx.load_from_string(source) if isinstance(source, bytes)
        else onnx.load(source, load_external_data=False)).graph.node) for label, source, _ in runs}
    timed = [Graph(label, source, args.past, False, m) for label, source, m in runs]
    for g in timed:
        for _ in range(20):
            g.step()
    times, cpu = collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(args.repeats):
        for g in timed:
            t0, c0 = time.perf_counter(), time.process_time()
            g.step()
            times[g.label].append((time.perf_counter() - t0) * 1000)
            cpu[g.label].append((time.process_time() - c0) * 1000)
    del timed
    profiles = {}
    for label, source, m in runs:
        g = Graph(label, source, args.past, True, m)
        profiles[label] = profile_by_op(g, args.profiled)
    report = {label: {"nodes": sum(nodes[label].values()), "nodes_by_op": dict(nodes[label]),
                      "step_ms": statistics.median(times[label]),
                      "step_cpu_ms": statistics.mean(cpu[label]),
                      "kernel_ms_by_op": {op: round(v[0], 4) for op, v in profiles[label].items()},
                      "kernels_by_op": {op: v[1] for op, v in profiles[label].items()}}
              for label, _, _ in runs}
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def table(report: dict) -> str:
    labels = list(report)
    ops = sorted({op for r in report.values() for op in r["kernel_ms_by_op"]},
                 key=lambda op: -max(r["kernel_ms_by_op"].get(op, 0) for r in report.values()))
    lines = ["| op type | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for op in ops:
        cells = []
        for label in labels:
            r = report[label]
            ms, n = r["kernel_ms_by_op"].get(op), r["kernels_by_op"].get(op, 0)
            cells.append("" if ms is None else f"{n:g} / {ms:.3f}")
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines.append("| kernels run / profiled kernel ms | " + " | ".join(
        f"{sum(report[l]['kernels_by_op'].values()):g} / "
        f"{sum(report[l]['kernel_ms_by_op'].values()):.2f}" for l in labels) + " |")
    lines.append("| nodes in the file | " + " | ".join(str(report[l]["nodes"]) for l in labels)
                 + " |")
    lines.append("| step ms (median, profiling off) | " + " | ".join(
        f"{report[l]['step_ms']:.2f}" for l in labels) + " |")
    lines.append("| step CPU ms (mean, profiling off) | " + " | ".join(
        f"{report[l]['step_cpu_ms']:.2f}" for l in labels) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
