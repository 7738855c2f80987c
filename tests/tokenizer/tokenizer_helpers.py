"""Test helpers for the tokenizer tests: a deterministic corpus of varied texts, and a GGUF writer
that turns a tokenizer.json into a tiny byte-level GGUF (to reach paths SmolLM2 does not use)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import gguf
import numpy as np

TINY_GGUF_TEMPLATE = "{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
USER_DEFINED = "the"  # in the tiny vocabulary; marked user-defined it is matched whole ("o|the|r")
MISLABELED_CONTROL = "<｜begin▁of▁sentence｜>"  # outside the byte alphabet: not a real control token


def write_tokenizer_gguf(path: Path, tokenizer_json: Path, *, model: str = "gpt2", with_merges: bool = True) -> None:
    spec = json.loads(tokenizer_json.read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get) + [MISLABELED_CONTROL]
    specials = {added["content"] for added in spec["added_tokens"]} | {MISLABELED_CONTROL}
    kinds = [3 if t in specials else 4 if t == USER_DEFINED else 1 for t in tokens]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    if with_merges:
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(vocab["<s>"])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(TINY_GGUF_TEMPLATE)
    writer.add_tensor("placeholder", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


CODE = [
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += x[i];\n}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "const f = async (x) => { await g(x?.y ?? 0); };",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "<div class=\"a\">&nbsp;<span>hi</span></div>",
    "$ grep -rn 'TODO' src/ | wc -l && echo done",
    "{\"key\": [1, 2.5, null, true], \"nested\": {\"é\": \"ü\"}}",
]
UNICODE = [
    "héllo wörld, ça va? naïve café résumé",
    "e\u0301 a\u0300 o\u0308 (combining accents)",
    "日本語のテキストと漢字、そしてカタカナ。",
    "中文分词测试：今天天气很好！",
    "한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "שלום עולם",
    "Привет, мир! Ёжик в тумане.",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 ❤️‍🔥 🧑🏿‍💻",
    "Math: ∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ, √2 ≈ 1.414, α→β",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ and ﬁ ligature",
    "zero\u200bwidth\u200djoiner\ufeffbom",
]
WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n\n", " \t \n", "\u00a0", "\u3000", "\u2009", "    ", "\t\t"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "<unk>", "<|im_start", "|>", "< |im_end|>"]
WORDS = "the quick brown fox jumps over lazy dog I'm don't we'LL THEY'RE it's 's".split()


def _random_chars(rng: random.Random, count: int) -> str:
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x6FF), (0x3040, 0x30FF), (0x4E00, 0x4FFF),
              (0xAC00, 0xAC80), (0x1F300, 0x1F6FF), (0xE000, 0xE010), (0x10000, 0x10050)]
    chars = []
    for _ in range(count):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


def _number(rng: random.Random) -> str:
    return rng.choice([
        str(rng.randint(0, 10**rng.randint(1, 15))),
        f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 6)}f}",
        " ".join(str(rng.randint(0, 999)) for _ in range(rng.randint(2, 6))),
        f"{rng.randint(1, 12)}/{rng.randint(1, 28)}/{rng.randint(1900, 2100)}",
    ])


def _piece(rng: random.Random) -> str:
    kind = rng.randrange(7)
    if kind == 0:
        code = rng.choice(CODE)
        start = rng.randrange(len(code))
        return code[start : start + rng.randint(1, 60)]
    if kind == 1:
        return rng.choice(UNICODE)
    if kind == 2:
        return "".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 5)))
    if kind == 3:
        return _number(rng)
    if kind == 4:
        return rng.choice(SPECIALS)
    if kind == 5:
        return _random_chars(rng, rng.randint(1, 20))
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))


def varied_texts(count: int = 1200, seed: int = 0) -> list[str]:
    """Deterministic mix: code, scripts and emoji, whitespace runs, digits, special tokens, random chars."""
    rng = random.Random(seed)
    fixed = CODE + UNICODE + WHITESPACE + SPECIALS + ["", "a", "I'M HERE", "x" * 500, "🎉" * 50, "\n" * 40]
    generated = ["".join(_piece(rng) for _ in range(rng.randint(1, 6))) for _ in range(count - len(fixed))]
    return fixed + generated


def assert_encodes_like_reference(ours, reference, texts, add_special_tokens: bool) -> None:
    """Our encode equals the transformers tokenizer's on every text."""
    expected = reference(texts, add_special_tokens=add_special_tokens)["input_ids"]
    for text, ids in zip(texts, expected, strict=True):
        assert ours.encode(text, add_special_tokens=add_special_tokens) == ids, repr(text)
