"""Chat templates rendered as transformers' apply_chat_template(..., tokenize=False) renders them."""

from __future__ import annotations

import pytest

from llmpipe.errors import InvalidRequestError
from llmpipe.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke about 🐍 and 日本."},
        {"role": "assistant", "content": "Why did the  python\n\tcross the road?"},
        {"role": "user", "content": "Again, <|im_start|> and {{ braces }} included."},
        {"role": "assistant", "content": "", "name": None},
        {"role": "user", "content": "ok"},
    ],
]


def _cases():
    for index, messages in enumerate(CONVERSATIONS):
        for add_generation_prompt in (True, False):
            yield pytest.param(messages, add_generation_prompt, id=f"conv{index}-gen{add_generation_prompt}")


@pytest.mark.slow
@pytest.mark.parametrize(("messages", "add_generation_prompt"), list(_cases()))
def test_gguf_chat_template_matches_transformers(smollm2_tokenizer, smollm2_reference, messages,
                                                 add_generation_prompt):
    expected = smollm2_reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize(("messages", "add_generation_prompt"), list(_cases()))
def test_hf_dir_chat_template_matches_transformers(tiny_tokenizer, tiny_reference, messages, add_generation_prompt):
    expected = tiny_reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        special_tokens=tokenizer.special_tokens,
        chat_template=template,
    )


def test_template_variables_match_transformers(tiny_tokenizer, tiny_reference):
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ unk_token }}|{{ pad_token is defined }}|{{ tools }}|"
        "{{ messages | tojson }}|{% for m in messages %}{% generation %}{{ m.reasoning_content }}"
        "{% endgeneration %}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|{{ strftime_now('%Y')|length }}\n"
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n  [{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
    )
    messages = [{"role": "user", "content": "<b>&", "thinking": "hmm"}]
    expected = tiny_reference.apply_chat_template(messages, tokenize=False, chat_template=template)
    assert _with_template(tiny_tokenizer, template).apply_chat_template(messages, add_generation_prompt=False) == (
        expected
    )


def test_model_without_chat_template_refuses_chat_requests(tiny_tokenizer):
    with pytest.raises(InvalidRequestError, match="no chat template"):
        _with_template(tiny_tokenizer, None).apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_becomes_invalid_request(tiny_tokenizer):
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('roles must alternate') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="roles must alternate"):
        _with_template(tiny_tokenizer, template).apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.append({'role': 'x'}) }}",  # the immutable sandbox forbids mutating inputs
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # and reaching Python internals
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    ],
)
def test_untrusted_template_cannot_escape_the_sandbox(tiny_tokenizer, template):
    with pytest.raises(InvalidRequestError):
        _with_template(tiny_tokenizer, template).apply_chat_template([{"role": "user", "content": "hi"}])
