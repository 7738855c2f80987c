"""A rank that dies surfaces as one clear error naming it (not a hang), and every worker
process is gone afterwards; an engine nobody closes stops its workers when it is collected."""

import gc
import os
import signal
import time

import pytest
import torch.distributed as dist

from llmpipe import LLM, SamplingParams
from llmpipe.errors import LLMPipeError
from tests.distributed.test_tensor_parallel import OPTIONS, PROMPT, assert_same_or_near_tie

TIMEOUT_S = 10.0
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def gone(pid: int) -> bool:
    """Exited and reaped (a zombie still answers signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_killed_worker_stops_the_engine_with_a_clear_error_and_no_process_left(tiny_checkpoint):
    """Three ranks (llama_mha's 4 heads and 320-token vocabulary split unevenly: 2 + 1 + 1, 107 + 107 + 106):
    correct first, then rank 1 is killed mid-run while rank 2 lives on."""
    path = str(tiny_checkpoint("llama_mha"))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = LLM(path, **OPTIONS).generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    llm = LLM(path, tensor_parallel_size=3, distributed_timeout_s=TIMEOUT_S, **OPTIONS)
    actual = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    assert_same_or_near_tie(llm, PROMPT, expected.outputs[0].token_ids, actual.outputs[0].token_ids)

    engine, pids = llm.engine, llm.engine.core.runner.worker_pids
    engine.add_request("long", {"prompt_token_ids": PROMPT}, LONG)
    for _ in range(3):
        engine.step()
    os.kill(pids[0], signal.SIGKILL)
    start = time.perf_counter()
    # The message names the death (a collective that merely timed out would say so instead).
    with pytest.raises(LLMPipeError, match=rf"rank 1 \(pid {pids[0]}\) was killed by SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.perf_counter() - start < TIMEOUT_S + 60  # a hang guard
    assert all(gone(pid) for pid in pids)
    assert not dist.is_initialized()
    with pytest.raises(LLMPipeError, match="SIGKILL"):  # and it stays stopped
        engine.step()
    llm.close()


def test_dropping_the_llm_stops_its_workers(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama_gqa")), tensor_parallel_size=2, **OPTIONS)
    pids = llm.engine.core.runner.worker_pids
    assert pids and not any(gone(pid) for pid in pids)
    del llm
    gc.collect()
    assert all(gone(pid) for pid in pids)
    assert not dist.is_initialized()
