"""A tiny tokenizer that speaks tool calls: a chat template with tools and a matching response template.

The template renders tool schemas in a system block, an assistant's calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and tool results as `<|tool|>...<|end|>`; the response
template is what `tokenizer.parse_response` (transformers >= 5.13) reads to turn a model turn back into a message
with `tool_calls`. The markup strings are special tokens trained into the vocabulary, so every id stays below
`vocab_size` and fits a tiny model built with the same size.

`build_reasoning_chat_tokenizer` is the same with a `<think>...</think>` reasoning block, rendered the way reasoning
models' templates render history (DeepSeek-R1's, Qwen3's for earlier queries): an assistant message shows its
reasoning only while it is the chat's last message. It reads `enable_thinking` (Qwen3's) and `reasoning_effort`
(gpt-oss's) when they are passed. Rendered again after tool results, an earlier turn loses its
reasoning, so the new chat is not the token history plus the tool results: the history is rewritten.
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


REASONING_TOKENS = TOOL_TOKENS + ("<think>", "</think>")

REASONING_CHAT_TEMPLATE = TOOL_CHAT_TEMPLATE.replace(
    "{%- if m['content'] is string %}",
    "{%- if m['role'] == 'assistant' and m['reasoning_content'] is string and loop.last %}"
    "<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{%- if m['content'] is string %}", 1).replace(
    # the switches reasoning templates read: Qwen3's enable_thinking (an empty reasoning block when false) and
    # gpt-oss's reasoning_effort (a system line); left undefined, they render nothing
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}",
    "{%- if add_generation_prompt %}<|assistant|>"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}", 1)
REASONING_CHAT_TEMPLATE = ("{%- if reasoning_effort is defined %}<|system|>Reasoning: {{ reasoning_effort }}<|end|>"
                           "{% endif %}" + REASONING_CHAT_TEMPLATE)

REASONING_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        **TOOL_RESPONSE_TEMPLATE["fields"],
    },
}


def build_chat_tokenizer(vocab_size: int = 512, seed: int = 0):
    """The tiny BPE tokenizer of `build_tokenizer`, with tool-call markup, a tool-aware chat template and the
    response template `parse_response` reads. Turns end with `<|end|>`: use its id as the stop token."""
    tokenizer = build_tokenizer(vocab_size, seed=seed, extra_special_tokens=TOOL_TOKENS)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.response_template = TOOL_RESPONSE_TEMPLATE
    return tokenizer


def build_reasoning_chat_tokenizer(vocab_size: int = 512, seed: int = 0):
    """`build_chat_tokenizer` with `<think>...</think>` reasoning that the template drops from every assistant message
    but the last (a history-rewriting template, as reasoning models have); `parse_response` reads the reasoning into
    `reasoning_content`. Turns end with `<|end|>`."""
    tokenizer = build_tokenizer(vocab_size, seed=seed, extra_special_tokens=REASONING_TOKENS)
    tokenizer.chat_template = REASONING_CHAT_TEMPLATE
    tokenizer.response_template = REASONING_RESPONSE_TEMPLATE
    return tokenizer
