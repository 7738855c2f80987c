"""A checkpoint's hidden_act is the MLP's activation (not SiLU whatever it says), or a clear error:
tiny random Llama checkpoints with each activation against transformers (float32)."""

import pytest
import torch
import transformers

from llmpipe import LLM, SamplingParams, UnsupportedModelError
from tests.utils import TINY_CONFIGS, build_checkpoint

PROMPT = [1, 17, 250, 33, 91, 5, 160, 77, 300, 12, 64, 128, 3, 99, 201, 45]


def checkpoint(tmp_path_factory, hidden_act: str):
    class_name, extra = TINY_CONFIGS["llama_gqa"]
    return build_checkpoint(class_name, {**extra, "hidden_act": hidden_act}, tmp_path_factory.mktemp(hidden_act))


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh", "gelu_new", "relu"])
def test_the_named_activation_gives_transformers_logits_and_tokens(tmp_path_factory, hidden_act):
    path = checkpoint(tmp_path_factory, hidden_act)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), progress=False)
    with torch.no_grad():
        theirs = reference(torch.tensor([PROMPT])).logits[0]
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                      pad_token_id=0)[0, len(PROMPT):].tolist()
    torch.testing.assert_close(llm.engine.score(PROMPT), theirs, atol=1e-4, rtol=0)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids == expected


def test_an_activation_llmpipe_does_not_compute_is_refused_by_name(tmp_path_factory):
    path = checkpoint(tmp_path_factory, "quick_gelu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'quick_gelu' is not supported"):
        LLM(str(path), progress=False)
