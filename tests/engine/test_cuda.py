"""The same engine on a CUDA device (skipped where there is none)."""

import pytest
import torch

from llmpipe import LLM, SamplingParams

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_cuda_greedy_tokens_equal_cpu(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen2"))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 13, 200]}, {"prompt_token_ids": list(range(3, 90))}]
    cpu = LLM(path, progress=False).generate(prompts, params)
    gpu = LLM(path, progress=False, device="cuda").generate(prompts, params)
    assert [o.outputs[0].token_ids for o in gpu] == [o.outputs[0].token_ids for o in cpu]
