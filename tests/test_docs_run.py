"""The docs' commands and code blocks, run as written (their optional [..] parts left out; a server's
port and its clients' URLs moved to a free port).

Every command line in a bash block is run here, or named in ELSEWHERE with the test that runs what it
does (a cluster, GPUs, an install, a benchmark of minutes, the user's own files), so a new command in
the docs must be one or the other. Every Python block runs: the offline ones in order, one namespace per
page (a fragment reads `params` from PREAMBLE, as from the page's earlier examples), the client ones
against the page's server."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.utils import HANG_GUARD_S, serve_process
from tests.test_docs import DOCS, ROOT, blocks, shell_lines

DOC_URL = "http://127.0.0.1:8000"
PREAMBLE = "from llmpipe import LLM, SamplingParams\nparams = SamplingParams(max_tokens=16)\n"

# Commands not run here, by their first words: why, and where what they do is tested.
ELSEWHERE = {
    "make test": "the CI's own command (.ci/run)",
    "pip install": "an install: the CI's set-up installs the extras",
    "torchrun": "two nodes with GPUs: tests/distributed/test_smollm2_tensor_parallel.py launches torchrun on one node",
    "kubectl": "a Kubernetes cluster: tests/deploy/test_manifest.py checks the manifest it applies",
    "curl localhost:8000/v1/models": "the Kubernetes service above",
    "serve run": "Ray Serve's CLI: tests/deploy/test_data_parallel.py runs build_app's application",
    "llmpipe serve --data-parallel-size": "Ray replicas: tests/deploy/test_data_parallel.py serves them",
    "llmpipe bench multiturn": "a benchmark of the two servers above: tests/bench/test_multiturn.py runs it on a tiny model",
    "llmpipe bench latency": "a benchmark of minutes: tests/bench/test_plots.py runs it on a tiny model",
    "llmpipe bench lora": "a benchmark of minutes: tests/bench/test_lora_bench.py runs it on a tiny model",
    "llmpipe serve --enable-lora": "the user's adapter files: tests/server/test_lora_api.py serves adapters it writes",
    "llmpipe quantize": "the user's FILE and DIR: tests/quant/test_quantize_checkpoint.py quantizes and exports",
    "llmpipe eval perplexity": "the user's FILE and DIR: tests/eval/test_perplexity.py against transformers",
}
OFFLINE = ("llmpipe generate", "llmpipe diagnose --model", "llmpipe memory", "make demo")
SERVE = ("llmpipe serve --model",)
CLIENT = (f"curl {DOC_URL}", f"llmpipe diagnose --base-url {DOC_URL}")


def commands() -> list[tuple[Path, str]]:
    return [(path, line) for path in DOCS for block in blocks(path, "bash") for line in shell_lines(block)]


def kind_of(line: str) -> str | None:
    kinds = {"elsewhere": tuple(ELSEWHERE), "offline": OFFLINE, "serve": SERVE, "client": CLIENT}
    found = [kind for kind, prefixes in kinds.items() if line.startswith(prefixes)]
    return found[0] if len(found) == 1 else None


def as_written(line: str) -> list[str]:
    """The command's arguments after `llmpipe`, optional parts left out; `make demo` is its recipe's run."""
    if line.startswith("make demo"):
        makefile = (ROOT / "Makefile").read_text()
        prompt = re.search(r"^PROMPT\s*\?=\s*(.*)$", makefile, re.M).group(1)
        recipe = re.search(r"^demo:.*\n\t(.*)$", makefile, re.M).group(1)
        line = recipe.replace("$(VENV)/bin/", "").replace("$(PROMPT)", prompt)
    return shlex.split(re.sub(r"\[[^\]]*\]", "", line))[1:]


def llmpipe(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmpipe.cli", *args], capture_output=True, text=True,
                          timeout=HANG_GUARD_S, cwd=ROOT)


def test_every_command_is_run_here_or_its_stand_in_named():
    found = commands()
    assert found and not [(path.name, line) for path, line in found if kind_of(line) is None]
    named = {prefix for _, line in found for prefix in ELSEWHERE if line.startswith(prefix)}
    assert named == set(ELSEWHERE)  # no stale entry


@pytest.mark.slow
@pytest.mark.parametrize("doc,line", list({line: (p.name, line) for p, line in reversed(commands())
                                           if kind_of(line) == "offline"}.values())[::-1],
                         ids=lambda v: v[:70])  # a command on two pages (make demo) runs once
def test_offline_command_runs(doc, line):
    done = llmpipe(as_written(line))
    assert done.returncode == 0, f"{doc}: `{line}` failed:\n{done.stderr[-2000:]}"
    assert done.stdout.strip(), f"{doc}: `{line}` printed nothing"


def run_python(path: Path, block: str, namespace: dict) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(block, str(path), "exec"), namespace)


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if any("openai" not in b for b in blocks(p, "python"))],
                         ids=lambda p: p.name)
def test_offline_python_blocks_run_in_order(path):
    namespace: dict = {}
    exec(PREAMBLE, namespace)
    for block in blocks(path, "python"):
        if "openai" not in block:
            run_python(path, block, namespace)


def serves(path: Path) -> list[str]:
    return [line for block in blocks(path, "bash") for line in shell_lines(block) if kind_of(line) == "serve"]


def clients(path: Path) -> list[str]:
    lines = [line for block in blocks(path, "bash") for line in shell_lines(block) if kind_of(line) == "client"]
    return lines + [block for block in blocks(path, "python") if "openai" in block]


@pytest.mark.slow
@pytest.mark.parametrize("path", [p for p in DOCS if serves(p) or clients(p)], ids=lambda p: p.name)
def test_the_server_a_page_starts_answers_its_clients(path, tmp_path):
    """The page's serve command (or the README's, where the page has none) as written on a free port; then
    its curl lines, `diagnose --base-url` and openai-client blocks against it."""
    command = (serves(path) or serves(ROOT / "README.md"))[0]
    log = tmp_path / "serve.log"
    server, url = serve_process(*as_written(command), stderr=log.open("w"))
    try:
        assert httpx.get(f"{url}/v1/models").json()["data"]
        for client in clients(path):
            client = client.replace(DOC_URL, url)
            if client.startswith("curl"):
                done = subprocess.run(["bash", "-c", client], capture_output=True, text=True, timeout=HANG_GUARD_S)
                assert done.returncode == 0 and "data: [DONE]" in done.stdout, f"{path.name}: `{client}`: {done.stdout[-500:]}"
            elif client.startswith("llmpipe"):
                done = llmpipe(as_written(client))
                assert done.returncode == 0 and done.stdout.strip(), f"{path.name}: `{client}`:\n{done.stderr[-2000:]}"
            else:
                run_python(path, client, {})
    finally:
        server.kill()
        server.wait(HANG_GUARD_S)
