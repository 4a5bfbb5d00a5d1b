"""What an upstream RequestState holds: its history, read the one way that survives a soft reset, and its stop ids."""

from __future__ import annotations


def history(state) -> tuple[list[int], list[int]]:
    """(prompt, completion so far) of an upstream RequestState; a soft reset folds the completion into its
    `initial_tokens` and remembers the prompt's length in `_true_initial_tokens` (HOOKS)."""
    true = state._true_initial_tokens
    if true:
        return state.initial_tokens[:true], state.initial_tokens[true:] + state.generated_tokens
    return state.initial_tokens, state.generated_tokens


def stop_ids(state) -> list[int]:
    """The ids that end a RequestState's completion, as upstream checks them (`_eos_token_ids`, HOOKS)."""
    return state._eos_token_ids
