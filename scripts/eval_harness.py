"""`make eval`: lm-evaluation-harness against `trt-spec serve`, and the same tasks on the fp32
checkpoint in transformers (lm_eval's own `hf` model).

Tasks (tests/data/eval/, local JSONL, nothing downloaded):
    trt_spec_mc    214 multiple-choice questions by loglikelihood, through local-completions
                   (echo + logprobs, token-id prompts batched per request), tokenizer read
                   from the engine folder
    trt_spec_gen   20 short greedy answers through local-chat-completions

Reported (JSON): accuracy of the served engine and of transformers fp32 on the same items and
their difference; item-for-item agreement of the choices; the generation answers of
`--method none` against speculation (identical when lossless); requests the server refused
(/metrics, must be 0). With --fp32-engine the fp32 engine is served and compared too.

    python scripts/eval_harness.py --engine engines/smollm2-135m --json eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "tests" / "data" / "eval"
MC, GEN = "trt_spec_mc", "trt_spec_gen"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(engine: str, *args: str, threads: int | None = None):
    """`trt-spec serve ENGINE ARGS` on a free port until the block ends -> its base URL."""
    port = free_port()
    # a harness sends many prompts at once: a larger prefill budget per step than serving's
    # default (16, chosen for decoding streams' pace) reads them in fewer steps
    cmd = [sys.executable, "-m", "trt_spec.cli", "serve", "--engine", engine, "--port",
           str(port), "--served-model-name", "model", "--max-waiting", "128",
           "--max-prefill-tokens", "256", *args]
    if threads:
        cmd += ["--threads", str(threads)]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"trt-spec serve exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > 180:
                raise RuntimeError("trt-spec serve was not healthy after 180 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def refused(url: str) -> int:
    """Requests the server refused (4xx, 429, 5xx: request_rejected_total) or failed."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0
    for line in text.splitlines():
        m = re.match(r'trt_spec:request_(rejected|success)_total\{(.*)\} (\S+)$', line)
        if m and (m.group(1) == "rejected" or 'finished_reason="error"' in m.group(2)
                  or 'finished_reason="abort"' in m.group(2)):
            total += int(float(m.group(3)))
    return total


def evaluate(model: str, model_args: dict, task: str, limit: int | None, **kw) -> dict:
    """One lm_eval run of `task` -> {"metrics": ..., "samples": [...] in doc order}."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=[task],
                          task_manager=TaskManager(include_path=str(TASKS)), limit=limit,
                          log_samples=True, **kw)
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    return {"metrics": out["results"][task], "samples": samples}


def choices(run: dict) -> list[int]:
    """The option each multiple-choice item picks (highest loglikelihood)."""
    return [max(range(len(s["filtered_resps"])), key=lambda i: s["filtered_resps"][i][0])
            for s in run["samples"]]


def answers(run: dict) -> list[str]:
    return [s["filtered_resps"][0] for s in run["samples"]]


def mc_served(url: str, engine: str, limit: int | None, batch: int) -> dict:
    args = {"model": "model", "base_url": f"{url}/v1/completions", "tokenizer": engine,
            "tokenizer_backend": "huggingface", "batch_size": batch, "max_retries": 1,
            "num_concurrent": 1, "max_length": 2048}
    return evaluate("local-completions", args, MC, limit)


def gen_served(url: str, limit: int | None) -> dict:
    args = {"model": "model", "base_url": f"{url}/v1/chat/completions", "max_retries": 1,
            "num_concurrent": 1}
    return evaluate("local-chat-completions", args, GEN, limit, apply_chat_template=True)


def mc_hf(hf_dir: str, limit: int | None, batch: int) -> dict:
    args = {"pretrained": hf_dir, "dtype": "float32", "device": "cpu"}
    return evaluate("hf", args, MC, limit, batch_size=batch)


def summary(run: dict) -> dict:
    m = run["metrics"]
    return {"acc": m["acc,none"], "acc_norm": m["acc_norm,none"], "items": len(run["samples"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--fp32-engine", default=None, help="also serve this fp32 engine and "
                    "compare its choices with transformers' item for item")
    ap.add_argument("--hf-model", default="smollm2-135m", help="the fp32 checkpoint for "
                    "transformers: a known model name or a Hugging Face folder")
    ap.add_argument("--method", default="auto", help="the speculative method compared with "
                    "--method none on the generation task")
    ap.add_argument("--limit", type=int, default=None, help="items per task (default: all)")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per request")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.chdir(ROOT)  # the tasks' data paths are relative to the repository
    from trt_spec.export.checkpoint import resolve_model

    report: dict = {"engine": a.engine, "method": a.method, "limit": a.limit}
    with served(a.engine, "--method", "none", threads=a.threads) as url:
        mc = mc_served(url, a.engine, a.limit, a.batch_size)
        plain = gen_served(url, a.limit)
        report["refused"] = refused(url)
    with served(a.engine, "--method", a.method, threads=a.threads) as url:
        spec = gen_served(url, a.limit)
        report["refused"] += refused(url)
    hf = mc_hf(str(resolve_model(a.hf_model)), a.limit, a.batch_size)
    report["mc"] = {"served": summary(mc), "transformers_fp32": summary(hf)}
    report["mc"]["acc_difference_points"] = 100 * (summary(mc)["acc"] - summary(hf)["acc"])
    report["mc"]["same_choice"] = sum(x == y for x, y in zip(choices(mc), choices(hf)))
    if a.fp32_engine:
        with served(a.fp32_engine, "--method", "none", threads=a.threads) as url:
            fp32 = mc_served(url, a.fp32_engine, a.limit, a.batch_size)
            report["refused"] += refused(url)
        report["mc"]["served_fp32"] = summary(fp32)
        report["mc"]["fp32_same_choice"] = sum(x == y for x, y in
                                               zip(choices(fp32), choices(hf)))
    same = [x == y for x, y in zip(answers(plain), answers(spec))]
    report["generation"] = {"items": len(same), "identical": sum(same),
                            "differing": [i for i, s in enumerate(same) if not s]}
    print(json.dumps(report, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
