"""A GGUF embedding model's pooling, as llama.cpp's converter writes it ({arch}.pooling_type: 1 mean,
2 cls, 3 last; absent: the last token), against transformers' hidden states of the same weights."""

import pytest
import torch

from llmpipe import LLM

IDS = [1, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177, 188, 199, 210, 221, 232]


@pytest.mark.parametrize("pooling_type, pool", [
    (1, lambda hidden: hidden.mean(0)), (2, lambda hidden: hidden[0]), (3, lambda hidden: hidden[-1]),
    (None, lambda hidden: hidden[-1]),
])
def test_embeddings_pool_as_the_files_pooling_type_says(tiny_gguf, transformers_model, pooling_type, pool):
    extra = {} if pooling_type is None else {"llama.pooling_type": pooling_type}
    llm = LLM(str(tiny_gguf("llama_gqa", **extra)), progress=False, max_num_batched_tokens=8)  # pooled across chunks
    with torch.no_grad():
        hidden = transformers_model("llama_gqa").model(torch.tensor([IDS])).last_hidden_state[0]
    expected = torch.nn.functional.normalize(pool(hidden), dim=-1)
    embedding = torch.tensor(llm.embed([IDS], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(embedding, expected, atol=1e-5, rtol=0)
