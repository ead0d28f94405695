"""Chat templates by name, for tokenizers that ship none (tiktoken and SentencePiece files, bare
``tokenizer.json`` files): ``--chat-template chatml|llama3|mistral|gemma``.

Each writes its turns with the special tokens of its model family and ends assistant turns
with that family's end-of-turn token; a build checks that the tokenizer has those tokens as
special tokens (``Encoder.chat_end_token``) before reading any data.

>>> sorted(CHAT_TEMPLATES)
['chatml', 'gemma', 'llama3', 'mistral']
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ConfigError

# The chat template of Mistral-7B-Instruct-v0.1, used with the default tokenizer, which has none.
MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)

CHAT_TEMPLATES = {
    # Qwen, SmolLM2, OpenHermes and others: <|im_start|>role\n...<|im_end|>\n
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # Llama 3, 3.1, 3.2: turns end with <|eot_id|>, not the tokenizer's EOS <|end_of_text|>.
    "llama3": (
        "{{ bos_token }}{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "mistral": MISTRAL_INSTRUCT_V01_CHAT_TEMPLATE,
    # Gemma: the assistant's role is "model"; a system turn goes into the first user turn, as Gemma 3's own template
    # writes it (Gemma has no system role).
    "gemma": (
        "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
        "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
        "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if message['role'] == 'system' %}{{ raise_exception('Gemma has a system turn only first') }}{% endif %}"
        "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' "
        "+ (first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
}


def resolve_chat_template(option: str | None, tokenizer_template: str | None) -> str | None:
    """``--chat-template``: a name of CHAT_TEMPLATES, a Jinja template, or a file holding one; else the tokenizer's."""
    if option is None:
        return tokenizer_template
    if option in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[option]
    if "{" in option:
        return option
    path = Path(option)
    if not path.is_file():
        names = "|".join(CHAT_TEMPLATES)
        raise ConfigError(f"--chat-template {option}: no such file; pass {names}, a Jinja template, or a file holding one")
    return path.read_text(encoding="utf-8")
