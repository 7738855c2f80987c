"""`llmpipe memory` for compressed attention: KV bytes of DeepSeek V4 (window + CSA + HCA) and MLA
(DeepSeek V2 / V3 / V3.2) configs, read from config.json alone, per layer kind.

What a DeepSeek V4 layer keeps per sequence of T tokens, as transformers' `DeepseekV4HCACache` /
`DeepseekV4CSACache` hold it (`compress_ratios`: 0 window only, 4 CSA, 128 HCA):
- every layer: the sliding window of `sliding_window` tokens of one shared K=V vector of `head_dim` (the
  reference keeps `sliding_window - 1` between steps and appends the new token: attention reads `sliding_window`);
- CSA and HCA: one compressed entry of `head_dim` per `ratio` tokens (`compressed_kv["compressor"]`);
- CSA: the lightning indexer's keys, one of `index_head_dim` per entry (`compressed_kv["indexer"]`);
- pending compressor state: the T mod ratio tokens waiting for the next entry (`buffer_kv` and `buffer_gate`, at
  the projection width: 2 × `head_dim` for CSA, `head_dim` for HCA, 2 × `index_head_dim` for the indexer) and,
  for CSA, the last closed window's Ca half that the next entry pools (`overlap_kv`, `overlap_gate`:
  ratio × `head_dim`, and ratio × `index_head_dim` for the indexer).
Everything is counted in `dtype`. (The reference holds the overlap gate in float32, its float32 position bias
already added; an engine can store the raw gate and add the bias when it pools.)

The published 9.62 GiB of DeepSeek-V4-Pro at 1,048,576 tokens in bfloat16 is the compressed entries and the
indexer keys: 30 CSA × 262,144 × (512 + 128) × 2 B + 31 HCA × 8,192 × 512 × 2 B = 10,326,376,448 B = 9.617 GiB.
The window (61 × 128 × 512 × 2 B = 7.6 MiB) and the pending state (0.3 MB) make 9.625 GiB, still 9.62 rounded;
the same table's 1.20 GiB at 131,072 tokens (1.21 with the window) shows it leaves the window out. The real
checkpoints store most of each entry in fp8 and the indexer keys in fp4: these are bfloat16 figures, as published.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from llmpipe.config import DTYPES
from llmpipe.errors import ModelLoadError
from llmpipe.models.deepseek_v4.config import CSA, HCA, WINDOW, config_int, layer_schedule

V4_MODEL_TYPES = {"deepseek_v4"}
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "deepseek_v32"}
KIND_NAMES = {WINDOW: "window only", CSA: "CSA", HCA: "HCA"}

# Published configs (their attention and cache fields), shipped in llmpipe/diagnose/configs/.
NAMED_CONFIGS = {"deepseek-v4-pro": "deepseek_v4_pro.json", "deepseek-v4-flash": "deepseek_v4_flash.json",
                 "deepseek-v3.2": "deepseek_v32.json"}


@dataclass
class LayerKindKV:
    """One kind of layer at `context` tokens, all its layers together, bytes."""
    kind: str
    layers: int
    bytes_per_token: float  # growth: what each further token adds, averaged over a ratio's worth of tokens
    window: int = 0
    entries: int = 0  # compressed entries (V4) or latents (MLA)
    indexer: int = 0
    pending: int = 0

    @property
    def total(self) -> int:
        return self.window + self.entries + self.indexer + self.pending


@dataclass
class CompressedKVPlan:
    model: str
    dtype: str
    context: int
    batch: int
    kinds: list[LayerKindKV]
    notes: list[str] = field(default_factory=list)

    @property
    def kv_bytes_per_sequence(self) -> int:
        return sum(k.total for k in self.kinds)

    @property
    def kv_bytes_per_token(self) -> float:
        return sum(k.bytes_per_token for k in self.kinds)

    @property
    def total_bytes(self) -> int:
        return self.batch * self.kv_bytes_per_sequence


def read_config(source: str) -> tuple[dict, str] | None:
    """A named config, a config .json or a Hugging Face directory → (config, name) when it is a compressed-
    attention config this planner handles, else None (the dense planner's case)."""
    if source in NAMED_CONFIGS:
        return json.loads(files("llmpipe.diagnose").joinpath("configs", NAMED_CONFIGS[source]).read_text()), source
    path = Path(source).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if path.suffix != ".json" or not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: not a readable config.json ({e})") from e
    return (cfg, source) if cfg.get("model_type") in V4_MODEL_TYPES | MLA_MODEL_TYPES else None


def plan_compressed_kv(cfg: dict, model: str, *, dtype: str = "bfloat16", context: int | None = None,
                       batch: int = 1) -> CompressedKVPlan:
    context = context or config_int(cfg, "max_position_embeddings")
    width = DTYPES[dtype].itemsize
    kinds = _v4_kinds(cfg, context, width) if cfg["model_type"] in V4_MODEL_TYPES else [_mla_kind(cfg, context, width)]
    plan = CompressedKVPlan(model, dtype, context, batch, [k for k in kinds if k.layers])
    if cfg["model_type"] in V4_MODEL_TYPES:
        gib = sum(k.entries + k.indexer for k in plan.kinds) / 2**30
        plan.notes.append(f"compressed entries and indexer keys alone (the published tables leave the window and the "
                          f"pending state out): {gib:.3f} GiB")
    return plan


def _v4_kinds(cfg: dict, context: int, width: int) -> list[LayerKindKV]:
    head_dim, window = config_int(cfg, "head_dim"), min(context, config_int(cfg, "sliding_window"))
    types, rates = layer_schedule(cfg)
    kinds = [LayerKindKV(KIND_NAMES[WINDOW], types.count(WINDOW), 0.0,
                         window=types.count(WINDOW) * window * head_dim * width)]
    for layer_type in (CSA, HCA):
        layers, ratio = types.count(layer_type), rates[layer_type]
        entries, left = context // ratio, context % ratio
        index_dim = config_int(cfg, "index_head_dim") if layer_type == CSA and layers else 0
        dims = head_dim + index_dim
        pending = left * 2 * (2 * dims if layer_type == CSA else head_dim)  # kv and gate of the waiting tokens
        if layer_type == CSA and entries:
            pending += 2 * ratio * dims  # the last closed window's Ca half: kv and gate
        kinds.append(LayerKindKV(
            f"{KIND_NAMES[layer_type]} (ratio {ratio})", layers, layers * dims * width / ratio,
            window=layers * window * head_dim * width, entries=layers * entries * head_dim * width,
            indexer=layers * entries * index_dim * width, pending=layers * pending * width))
    return kinds


def _mla_kind(cfg: dict, context: int, width: int) -> LayerKindKV:
    """MLA caches one latent (`kv_lora_rank`) and the shared RoPE key (`qk_rope_head_dim`) per token and layer;
    V3.2's sparse attention adds the indexer's key (`index_head_dim`)."""
    layers, index_dim = config_int(cfg, "num_hidden_layers"), cfg.get("index_head_dim", 0)
    latent = config_int(cfg, "kv_lora_rank") + config_int(cfg, "qk_rope_head_dim")
    return LayerKindKV(f"MLA ({latent} latent" + (f" + {index_dim} indexer)" if index_dim else ")"), layers,
                       layers * (latent + index_dim) * width, entries=layers * context * latent * width,
                       indexer=layers * context * index_dim * width)

