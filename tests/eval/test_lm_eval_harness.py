"""lm-evaluation-harness's `local-completions` against llmpipe's server (an engine core process, as
`llmpipe serve` runs it) scores the same as the harness's own `hf` backend on the same weights.

The model is the embedded SmolLM2-135M GGUF: served with `quantization=None` (its Q4_1 weights
dequantized to float32), and, for the `hf` backend, those dequantized weights written as a
transformers checkpoint. Two tiny local tasks (`dataset_path: json`): a multiple-choice one
(loglikelihoods: echo + logprobs, prompt lists with batch_size > 1) and a generate_until one. The
harness is given only the model's name and base_url: it finds /tokenizer_info and uses the
server's tokenizer (tokenizer_backend=auto → remote).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import save_file

from llmpipe.loader import load_checkpoint
from llmpipe.loader.hf_config import hf_config_dict
from llmpipe.tokenizer.hf_tokenizer import save_hf_tokenizer
from tests.server.utils import core_process_engine, live_server

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2"
LOGLIKELIHOOD_TOLERANCE = 1e-3  # a sum of a few float32 logprobs through 30 layers, two implementations
MULTIPLE_CHOICE = [
    {"question": "The capital of France is", "choices": ["Paris", "London", "Berlin"], "answer": 0},
    {"question": "The color of the sky on a clear day is", "choices": ["green", "blue", "red"], "answer": 1},
    {"question": "Two plus two equals", "choices": ["seven", "ten", "four"], "answer": 2},
    {"question": "The opposite of hot is", "choices": ["cold", "loud", "tall"], "answer": 0},
    {"question": "A baby cat is called a", "choices": ["puppy", "kitten", "calf"], "answer": 1},
    {"question": "Ice is frozen", "choices": ["water", "sand", "wood"], "answer": 0},
]  # the harness joins question and choice with its target_delimiter, a space
GENERATION = [
    {"question": "Question: What is the capital of France?\nAnswer:", "answer": " Paris"},
    {"question": "Question: How many legs does a dog have?\nAnswer:", "answer": " Four"},
    {"question": "Question: What color is grass?\nAnswer:", "answer": " Green"},
]


def write_tasks(directory: Path) -> list[str]:
    """A multiple-choice task and a generate_until task over local JSONL files, in `directory`."""
    directory.mkdir()
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}"}
    tasks = {
        "llmpipe_tiny_mc": ({"output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
                             "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
                            MULTIPLE_CHOICE),
        "llmpipe_tiny_gen": ({"output_type": "generate_until",
                              "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False},
                              "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]},
                             GENERATION),
    }
    for name, (spec, docs) in tasks.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        dataset = {"data_files": {"test": str(data)}, "cache_dir": str(directory / "datasets")}
        (directory / f"{name}.yaml").write_text(json.dumps({"task": name, **common, **spec, "dataset_kwargs": dataset}))
    return list(tasks)


def write_dequantized_checkpoint(gguf: Path, directory: Path) -> Path:
    """The GGUF's weights as llmpipe dequantizes them (what quantization=None serves), as a
    transformers checkpoint: config.json, model.safetensors, the tokenizer."""
    checkpoint = load_checkpoint(str(gguf))
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config_dict(checkpoint.config)))
    save_file({name: checkpoint.source.read(name).float().contiguous() for name in checkpoint.source.shapes()},
              str(directory / "model.safetensors"))
    save_hf_tokenizer(checkpoint.tokenizer, directory)
    return directory


def evaluate(model: str, model_args: dict, tasks: list[str], task_dir: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # Only these tasks: indexing the harness's own thousands of task files takes ~20 s.
    task_manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=task_manager, batch_size=4,
                           log_samples=True, bootstrap_iters=0)


def per_doc(results: dict, task: str) -> list:
    """Each doc's responses as the harness filtered them: (loglikelihood, is_greedy) per choice, or the text."""
    return [sample["filtered_resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_local_completions_scores_as_the_hf_backend_on_the_same_weights(smollm2_gguf, tmp_path):
    task_dir = tmp_path / "tasks"
    tasks = write_tasks(task_dir)
    reference_dir = write_dequantized_checkpoint(smollm2_gguf, tmp_path / "dequantized")
    with live_server(core_process_engine(str(smollm2_gguf), quantization=None), model_name=MODEL_NAME) as url:
        served = evaluate("local-completions", {"model": MODEL_NAME, "base_url": f"{url}/v1/completions"}, tasks, task_dir)
    reference = evaluate("hf", {"pretrained": str(reference_dir), "dtype": "float32", "device": "cpu"}, tasks, task_dir)

    for task, metric in (("llmpipe_tiny_mc", "acc,none"), ("llmpipe_tiny_gen", "exact_match,none")):
        assert served["results"][task][metric] == reference["results"][task][metric], task
    ours, theirs = per_doc(served, "llmpipe_tiny_mc"), per_doc(reference, "llmpipe_tiny_mc")
    assert len(ours) == len(MULTIPLE_CHOICE)
    for doc_ours, doc_theirs in zip(ours, theirs):
        for (ll_ours, greedy_ours), (ll_theirs, greedy_theirs) in zip(doc_ours, doc_theirs):
            assert abs(ll_ours - ll_theirs) <= LOGLIKELIHOOD_TOLERANCE
            assert greedy_ours == greedy_theirs
    assert per_doc(served, "llmpipe_tiny_gen") == per_doc(reference, "llmpipe_tiny_gen")
    assert served["results"]["llmpipe_tiny_mc"]["acc,none"] > 0.5  # the model answers most of these: real scores
