"""End to end: with speculation, sampled tokens follow the target's exact distribution, computed
by transformers, even from a draft model that guesses badly."""

import pytest
import torch

from llmpipe import LLM, SamplingParams
from tests.spec.test_rejection import chi_square_p_value

VOCAB = 12
SAMPLES = 20_000
TEMPERATURE = 0.7
PROMPT = [1, 5, 7, 3, 5, 7]


def tiny_small_vocab(path, seed: int, scale: float):
    """A Llama with a 12-token vocabulary; `scale` sets how peaked its next-token distributions are."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, scale)
    model.save_pretrained(path)
    return model


def second_token_distribution(model) -> torch.Tensor:
    """P(second generated token) = Σ_t P(t | prompt) · P(· | prompt, t), at TEMPERATURE."""
    with torch.no_grad():
        first = (model(torch.tensor([PROMPT])).logits[0, -1] / TEMPERATURE).softmax(-1)
        inputs = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = (model(inputs).logits[:, -1] / TEMPERATURE).softmax(-1)
    return first @ second


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(tmp_path, method):
    target = tiny_small_vocab(tmp_path / "target", seed=0, scale=0.3)
    if method == "draft":
        tiny_small_vocab(tmp_path / "draft", seed=1, scale=0.6)  # unrelated and overconfident
        options = dict(speculative_model=str(tmp_path / "draft"), num_speculative_tokens=2)
    else:
        options = dict(speculative_method="ngram", prompt_lookup_min=1, num_speculative_tokens=2)
    llm = LLM(str(tmp_path / "target"), progress=False, max_num_seqs=1024, **options)
    torch.manual_seed(0)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * SAMPLES, params, use_tqdm=False)
    counts = torch.bincount(torch.tensor([o.outputs[0].token_ids[1] for o in outputs]), minlength=VOCAB)
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > SAMPLES / 4 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert chi_square_p_value(counts, second_token_distribution(target)) > 0.01
