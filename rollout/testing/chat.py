"""A tiny tokenizer that speaks tool calls: a chat template with tools and a matching response template.

The template renders tool schemas in a system block, an assistant's calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and tool results as `<|tool|>...<|end|>`; the response
template is what `tokenizer.parse_response` (transformers >= 5.13) reads to turn a model turn back into a message
with `tool_calls`. The markup strings are special tokens trained into the vocabulary, so every id stays below
`vocab_size` and fits a tiny model built with the same size.
"""

from __future__ import annotations

from .tiny import build_tokenizer

TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<|tool|>")

TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}<|system|>{% for t in tools %}{{ t | tojson }}{% endfor %}<|end|>{% endif %}"
    "{%- for m in messages %}<|{{ m['role'] }}|>"
    "{%- if m['content'] is string %}{{ m['content'] }}{% endif %}"
    "{%- if m['tool_calls'] %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}"
    "<|end|>{% endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

TOOL_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close": "<|end|>", "content": "text"},
    },
}


def build_chat_tokenizer(vocab_size: int = 512, seed: int = 0):
    """The tiny BPE tokenizer of `build_tokenizer`, with tool-call markup, a tool-aware chat template and the
    response template `parse_response` reads. Turns end with `<|end|>`: use its id as the stop token."""
    tokenizer = build_tokenizer(vocab_size, seed=seed, extra_special_tokens=TOOL_TOKENS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer
