"""`llmpipe bench latency --speculative-method ngram draft`: batch-1 decode speed with and without
speculative decoding, in one run, on two kinds of chat prompt.

input-grounded: the answer copies much of the prompt (rewrite a passage, edit a code block), where
prompt lookup shines; open-ended: free answers, where only a draft model can guess ahead. The
target runs in float32; the default draft is the same checkpoint with its weights in INT4.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from importlib import resources

from tqdm import tqdm

from llmpipe.bench.report import format_table, write_json
from llmpipe.llm import LLM
from llmpipe.outputs import RequestOutput
from llmpipe.sampling_params import SamplingParams

CODE = '''def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    return sum((v - m) ** 2 for v in values) / len(values)
'''


def _passage(start: str, lines: int) -> str:
    text = resources.files("llmpipe.eval").joinpath("data/hamlet.txt").read_text(encoding="utf-8")
    at = text.index(start)
    return "\n".join(text[at:].splitlines()[:lines])


def prompt_sets() -> dict[str, list[str]]:
    return {
        "input-grounded": [
            f"Rewrite this passage as plain prose, keeping every line's wording:\n\n{_passage('Tush, tush', 12)}",
            f"Repeat this code, adding a docstring to each function:\n\n```python\n{CODE}```",
            f"Rename the variable `values` to `data` everywhere in this code and show the result:\n\n```python\n{CODE}```",
            f"Summarize this passage, quoting its most important lines:\n\n{_passage('Who hath relieved you', 14)}",
        ],
        "open-ended": [
            "What are the benefits of regular exercise?",
            "Write a short story about a robot who learns to paint.",
            "Explain how a refrigerator keeps food cold.",
            "Give me five tips for learning a new language.",
        ],
    }


@dataclass
class SetResult:
    tokens: int = 0
    decode_seconds: float = 0.0
    same_tokens: int = 0  # prompts whose greedy output equals the run without speculation

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds else 0.0


def decode_time(output: RequestOutput) -> tuple[int, float]:
    """Tokens after the first, and the seconds they took (the decode phase)."""
    times = output.metrics.token_times
    return len(times) - 1, times[-1] - times[0]


def run_set(
    llm: LLM, prompts: list[str], params: SamplingParams, reference: list[list[int]] | None
) -> tuple[SetResult, list[list[int]]]:
    result, outputs = SetResult(), []
    for i, prompt in enumerate(prompts):
        output = llm.chat([{"role": "user", "content": prompt}], params)[0]
        tokens, seconds = decode_time(output)
        result.tokens += tokens
        result.decode_seconds += seconds
        outputs.append(output.outputs[0].token_ids)
        result.same_tokens += reference is not None and outputs[-1] == reference[i]
    return result, outputs


def spec_options(args, method: str) -> dict:
    options = dict(speculative_method=method, num_speculative_tokens=args.num_speculative_tokens)
    if method == "draft":
        options |= dict(speculative_model=args.speculative_model or args.model,
                        speculative_quantization=args.speculative_quantization)
    return options


def run(args) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.spec_output_len)
    sets = prompt_sets()
    report: dict = {"model": args.model, "target_dtype": "float32", "output_len": args.spec_output_len,
                    "num_speculative_tokens": args.num_speculative_tokens, "results": []}
    configs = [("none", {})] + [(m, spec_options(args, m)) for m in args.speculative_method]
    references: dict[str, list[list[int]]] = {}
    for name, options in tqdm(configs, desc="bench speculative", unit="config"):
        llm = LLM(args.model, progress=False, dtype="float32", **options)
        for set_name, prompts in sets.items():
            before = llm.engine.stats().spec_decode
            result, outputs = run_set(llm, prompts, params, references.get(set_name))
            references.setdefault(set_name, outputs)
            entry = {"method": name, "prompts": set_name, "decode_tokens_per_s": result.tokens_per_s,
                     "tokens": result.tokens, "same_greedy_tokens": f"{result.same_tokens}/{len(prompts)}"}
            after = llm.engine.stats().spec_decode
            if after is not None:
                drafts = after.num_drafts - before.num_drafts
                proposed = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                entry |= {"acceptance_rate": accepted / proposed if proposed else 0.0,
                          "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0, "drafts": drafts}
            report["results"].append(entry)
        llm.close()
        del llm
        gc.collect()
    baseline = {r["prompts"]: r["decode_tokens_per_s"] for r in report["results"] if r["method"] == "none"}
    for r in report["results"]:
        r["speedup"] = r["decode_tokens_per_s"] / baseline[r["prompts"]] if baseline[r["prompts"]] else 0.0
    return report


def table(report: dict) -> str:
    rows = [["method", "prompts", "decode tok/s", "speed-up", "acceptance", "mean accepted len", "same greedy"]]
    for r in report["results"]:
        rows.append([
            r["method"], r["prompts"], f"{r['decode_tokens_per_s']:.1f}", f"{r['speedup']:.2f}x",
            f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r else "-",
            f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-",
            r["same_greedy_tokens"] if r["method"] != "none" else "-",
        ])
    footer = f"k = {report['num_speculative_tokens']}, target float32, greedy, {report['output_len']} tokens per prompt"
    return format_table(rows) + "\n" + footer


def main(args) -> None:
    report = run(args)
    print(table(report))
    print(f"wrote {write_json(args.output.replace('latency', 'speculative'), report)}")
