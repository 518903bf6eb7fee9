"""Where our plain step's time goes against onnxruntime-genai's, graph by graph and session by
session (docs/quantization.md, "The lean graph": the levers).

    .venv/bin/python scripts/plain_levers.py --engine engines/lean-int4-plain \
        --ortgenai $TRT_SPEC_CACHE/smollm2-135m/ortgenai-int4 --repeats 400

One bound 1-token step after --past cached tokens, at one intra-op thread, every variant's
step interleaved with the others' so a loaded machine's drift hits all alike; the figure is
the process's CPU time per step (mean), the graph's work alone. Every session of a run is
made alike: --pool global as the runtime makes them (make_session: the process-wide pool),
--pool session as onnxruntime-genai does (default options, a one-thread pool of its own);
ORT allows one of the two in a process, so the harness is compared by the ratio. Every
session's memory is collapsed onto huge pages (runtime/backends/huge_pages.py; on 4 KiB pages
the order the sessions were made in moved a step by 7-14%), TRT_SPEC_HUGE_PAGES=0 leaves
them all on 4 KiB pages. Variants:
- theirs: their model.onnx;
- ours: our target without attention rows, loaded as fast decoding loads it (rewritten,
  weights from the engine folder's external data);
- ours-in-memory: the same graph serialized with its weights (no external data);
- ours-plain-head: also without the head's top-k rescoring (logits = the 4-bit head);
- ours-logits-only: also without the hidden_states / eagle3_features outputs;
- ours-no-zero-points: ours with MatMulNBits' zero points dropped (timing only);
- ours-topN (--tops): ours with the head's top N rescored (its /lm_head/top rewritten);
- ours-big-cache: ours with the runtime's max-length cache buffer (--max-len) instead of
  past + 16 rows (theirs: onnxruntime-genai sizes it to the request).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from lean_graph import one_token_feeds  # (scripts/: run as a script, its folder is on the path)
from trt_spec.runtime.backends.huge_pages import huge_pages
from trt_spec.runtime.backends.ort import make_session
from trt_spec.runtime.backends.rows_free import (EXTERNAL_FOLDER, rows_free_model,
                                                 strip_attention_rows)

HEAD = "/lm_head"  # export's head: /lm_head/approx (4-bit), then its top-k rescored from int8


def drop_dead(graph) -> None:
    """Removes the nodes no graph output depends on, and initializers no node reads."""
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    for init in [i for i in graph.initializer if i.name not in needed]:
        graph.initializer.remove(init)


def plain_head(model):
    """A copy of a target graph whose logits are the 4-bit head's (`/lm_head/approx`), its
    top-k rescoring from the int8 rows (TopK, GatherBlockQuantized, MatMul, ScatterElements)
    taken out."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    (head,) = [n for n in graph.node if n.name == HEAD + "/approx/MatMulNBits"]
    (scatter,) = [n for n in graph.node if n.output and n.output[0] == "logits"]
    assert scatter.op_type == "ScatterElements", scatter.name
    graph.node.remove(scatter)
    head.output[0] = "logits"
    drop_dead(graph)
    return out


def with_top(model, top: int):
    """A copy of a target graph whose head rescores its `top` highest logits (the
    `/lm_head/top` initializer: 128 under int4, 16 under int4-plain)."""
    import onnx
    from onnx import numpy_helper

    out = onnx.ModelProto()
    out.CopyFrom(model)
    (init,) = [i for i in out.graph.initializer if i.name == HEAD + "/top"]
    init.CopyFrom(numpy_helper.from_array(np.array([top], np.int64), init.name))
    return out


def without_outputs(model, names):
    """A copy of a target graph without the outputs `names`, and what only they read."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [o for o in out.graph.output if o.name not in names]
    del out.graph.output[:]
    out.graph.output.extend(kept)
    drop_dead(out.graph)
    return out


def without_zero_points(model):
    """A copy with every MatMulNBits' zero points dropped (symmetric codes: for timing only,
    its outputs differ)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    for node in out.graph.node:
        if node.op_type == "MatMulNBits" and len(node.input) > 3:
            del node.input[3:]
    drop_dead(out.graph)
    return out


def genai_session(source, folder: Path | None = None) -> ort.InferenceSession:
    """A session as onnxruntime-genai makes one at one thread: default options."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
    opts.log_severity_level = 3
    if folder is not None:
        opts.add_session_config_entry(EXTERNAL_FOLDER, str(folder))
    with huge_pages():
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def _ours_bytes(source: bytes) -> ort.InferenceSession:
    """make_session's options for a graph serialized with its weights (no engine folder)."""
    opts = ort.SessionOptions()
    opts.use_per_session_threads = False  # the process-wide pool make_session set up
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    with huge_pages():
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


class Step:
    """One session and one bound 1-token step after `past`, its cache `rows` long."""

    def __init__(self, session: ort.InferenceSession, past: int, rows: int, head_dim: int):
        self.session, self.io = session, session.io_binding()
        inputs = {i.name: i.shape for i in session.get_inputs()}
        pasts = [n for n in inputs if n.startswith("past_key_values.")]
        self.kept = []
        for name in pasts:
            value = ort.OrtValue.ortvalue_from_numpy(
                np.zeros((1, inputs[name][1], rows, head_dim), np.float32))
            self.io.bind_ortvalue_input(name, value)
            self.io.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
            self.kept.append(value)
        feeds = one_token_feeds(past, theirs="attention_mask" in inputs)
        for name, value in feeds.items():
            self.io.bind_cpu_input(name, value)
        for out in session.get_outputs():
            if not out.name.startswith("present"):
                self.io.bind_output(out.name, "cpu")

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.io)


def variants(engine: Path, theirs: Path, past: int, max_len: int, pool: str,
             tops: tuple[int, ...] = ()) -> dict[str, Step]:
    """pool: "global" (every session on the process-wide pool, as the runtime runs) or
    "session" (every session with its own one-thread pool, as onnxruntime-genai runs; ORT
    allows only one of the two in a process)."""
    target = engine / "target.onnx"
    free = rows_free_model(target)
    head = plain_head(onnx.load_from_string(free))
    only = without_outputs(head, ("hidden_states", "eagle3_features"))
    in_memory = strip_attention_rows(onnx.load(str(target))).SerializeToString()
    folder = engine.resolve()
    if pool == "global":
        def session(source, external=True):
            if isinstance(source, bytes) and not external:
                return _ours_bytes(source)
            return make_session(target if isinstance(source, bytes) else Path(source), 1,
                                source if isinstance(source, bytes) else None)
    else:
        def session(source, external=True):
            return genai_session(source, folder if isinstance(source, bytes) and external
                                 else None)
    rows, hd = past + 16, 64
    return {
        "theirs": Step(session(str(theirs / "model.onnx")), past, rows, hd),
        "ours": Step(session(free), past, rows, hd),
        "ours-in-memory": Step(session(in_memory, external=False), past, rows, hd),
        "ours-plain-head": Step(session(head.SerializeToString()), past, rows, hd),
        "ours-logits-only": Step(session(only.SerializeToString()), past, rows, hd),
        "ours-big-cache": Step(session(free), past, max_len, hd),
        "ours-no-zero-points": Step(session(without_zero_points(
            onnx.load_from_string(free)).SerializeToString()), past, rows, hd),
        **{f"ours-top{top}": Step(session(with_top(onnx.load_from_string(free), top)
                                          .SerializeToString()), past, rows, hd)
           for top in tops},
        # second copies: how far two sessions of one graph differ (placement, noise)
        "theirs-2": Step(session(str(theirs / "model.onnx")), past, rows, hd),
        "ours-2": Step(session(free), past, rows, hd),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", type=Path, default=Path("engines/lean-int4-plain"))
    ap.add_argument("--ortgenai", type=Path, required=True)
    ap.add_argument("--past", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=400)
    ap.add_argument("--pool", choices=["global", "session"], default="global")
    ap.add_argument("--skip", default="")
    ap.add_argument("--tops", default="", help="comma-separated widths of the head's rescoring "
                    "to time as variants ours-topN (e.g. 16,128)")
    args = ap.parse_args()
    tops = tuple(int(t) for t in args.tops.split(",") if t)
    steps = variants(args.engine, args.ortgenai, args.past, args.max_len, args.pool, tops)
    steps = {k: v for k, v in steps.items() if k not in args.skip.split(",")}
    for step in steps.values():
        for _ in range(20):
            step()
    cpu = collections.defaultdict(list)
    for _ in range(args.repeats):
        for label, step in steps.items():
            c0 = time.process_time()
            step()
            cpu[label].append((time.process_time() - c0) * 1000)
    theirs = statistics.mean(cpu["theirs"])
    print("| variant | CPU ms a step | against theirs |")
    print("|---|---|---|")
    for label, values in cpu.items():
        mean = statistics.mean(values)
        print(f"| {label} | {mean:.2f} | {theirs / mean:.3f}x |")


if __name__ == "__main__":
    main()
