"""SmolLM2-135M (float32) at tensor_parallel_size=2 against one process: 9 query heads over 3 KV
heads split unevenly (6 + 3 query heads, 2 + 1 KV heads), tied vocabulary-parallel head."""

import subprocess
import sys

import pytest

from llmpipe import LLM, SamplingParams
from tests.distributed.test_tensor_parallel import assert_same_or_near_tie
from tests.server.utils import HANG_GUARD_S, free_port

PROMPTS = ["How does inference work?", "The capital of France is", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.mark.slow
def test_smollm2_greedy_tokens_match_the_single_process_engine(smollm2_gguf):
    options = dict(progress=False, dtype="float32", kv_cache_memory="64MiB")
    single = LLM(str(smollm2_gguf), **options)
    expected = single.generate(PROMPTS, GREEDY, use_tqdm=False)
    with LLM(str(smollm2_gguf), tensor_parallel_size=2, **options) as parallel:
        actual = parallel.generate(PROMPTS, GREEDY, use_tqdm=False)
        ranks = parallel.engine.core.runner.rank_memory()
    for ours, theirs in zip(expected, actual):
        assert_same_or_near_tie(single, ours.prompt_token_ids, ours.outputs[0].token_ids, theirs.outputs[0].token_ids)
    full = single.engine.weight_bytes
    assert sum(r.weight_bytes for r in ranks) < 1.01 * full  # nothing but the norms is held twice
    assert all(r.weight_bytes < 0.6 * full for r in ranks)


@pytest.mark.slow
def test_a_torchrun_launch_serves_rank_0s_command_on_both_ranks(smollm2_gguf):
    """docs/features/parallelism.md's torchrun launch, on one node: rank 0 runs the command, rank 1 serves
    its shard; the text is the single-process engine's (float32 weights, greedy)."""
    command = ["generate", "How does inference work?", "--model", str(smollm2_gguf), "--dtype", "float32",
               "--temperature", "0", "--max-tokens", "8", "--tensor-parallel-size", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    launched = subprocess.run([*torchrun, "-m", "llmpipe.cli", *command], capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert launched.returncode == 0, launched.stderr[-2000:]
    single = subprocess.run([sys.executable, "-m", "llmpipe.cli", *command[:-2]], capture_output=True, text=True,
                            timeout=HANG_GUARD_S)
    assert launched.stdout.strip() and launched.stdout == single.stdout
    assert "[8 tokens" in launched.stderr
