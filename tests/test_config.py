"""SamplingParams and WorkerConfig reject bad values at construction, naming field, value, rule and fix; the
InvalidArgument they raise carries those as attributes, and keeps them across a pickle (a Ray actor's boundary)."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from rollout import InvalidArgument, SamplingParams, WorkerConfig
from rollout.base.errors import invalid, preview


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n=0 is invalid: must be an integer >= 1"),
    ({"n": 2.0}, "n=2.0 is invalid"),
    ({"temperature": -0.1}, "temperature=-0.1 is invalid: must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature=nan is invalid"),
    ({"temperature": "1"}, "temperature='1' is invalid"),
    ({"top_k": -2}, r"top_k=-2 is invalid: must be an integer >= 0, or -1 \(disabled\). Fix: use 0 \(or -1\) to "
                    "disable top-k"),
    ({"top_p": 0.0}, r"top_p=0.0 is invalid: must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p=1.5 is invalid"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 is invalid"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids=-2 is invalid"),
    ({"seed": 2**63}, "seed=9223372036854775808 is invalid: must be an integer in"),
    ({"seed": 1.5}, "seed=1.5 is invalid"),
    ({"min_p": 1.05}, r"min_p=1.05 is invalid: must be a finite number in \[0, 1\]"),
    ({"repetition_penalty": -1.1}, "repetition_penalty=-1.1 is invalid"),
    ({"min_new_tokens": -3}, "min_new_tokens=-3 is invalid"),
])
def test_bad_sampling_values_are_value_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_are_frozen_and_normalise_stop_ids():
    params = SamplingParams(stop_token_ids=[3, 4])
    assert params.stop_token_ids == (3, 4) and hash(params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.n = 2  # type: ignore[misc]


@pytest.mark.parametrize("kwargs, message", [
    ({"page_size": 2}, "page_size=2 is invalid: must be an integer >= 4"),
    ({"num_blocks": 0}, "num_blocks=0 is invalid"),
    ({"max_batch_tokens": 0}, "max_batch_tokens=0 is invalid"),
    ({"kv_cache_memory_mb": 0}, "kv_cache_memory_mb=0 is invalid"),
    ({"max_cache_tokens": 8}, "max_cache_tokens=8 is invalid: must be an integer >= 16"),
    ({"in_flight": "drop"}, "in_flight='drop' is invalid: must be one of"),
    ({"max_retries": -1}, "max_retries=-1 is invalid"),
    ({"prefix_caching": 1}, "prefix_caching=1 is invalid: must be a bool"),
    ({"kv_cache_memory_fraction": 0.0}, r"kv_cache_memory_fraction=0.0 is invalid: must be a number in \(0, 1\]"),
    ({"kv_cache_memory_fraction": 1.01}, "kv_cache_memory_fraction=1.01 is invalid"),
    ({"kv_cache_memory_fraction": True}, "kv_cache_memory_fraction=True is invalid"),
    ({"kv_cache_memory_fraction": 0.5, "kv_cache_memory_mb": 100},
     r"kv_cache_memory_fraction=0.5 is invalid: is exclusive with kv_cache_memory_mb \(set to 100\). Fix: set one"),
    ({"max_request_tokens": 0}, "max_request_tokens=0 is invalid"),
    ({"cuda_graphs": "on"}, "cuda_graphs='on' is invalid: must be one of"),
])
def test_bad_worker_config_values_are_value_errors_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(**kwargs)


def test_an_invalid_argument_carries_its_parts_and_its_message_is_the_documented_one():
    error = invalid("max_new_tokens", 9, "too long", "shorten it", "prompt 3", 3)
    assert isinstance(error, ValueError)
    assert (error.field, error.value, error.rule, error.fix, error.where, error.index) == (
        "max_new_tokens", 9, "too long", "shorten it", "prompt 3", 3)
    assert str(error) == "prompt 3: max_new_tokens=9 is invalid: too long. Fix: shorten it."
    assert error.detail == "max_new_tokens=9 is invalid: too long. Fix: shorten it."
    unlocated = invalid("top_p", 1.5, "must be in (0, 1]", "use 1.0 to disable top-p")
    assert str(unlocated) == unlocated.detail == "top_p=1.5 is invalid: must be in (0, 1]. Fix: use 1.0 to disable " \
        "top-p."
    assert (unlocated.where, unlocated.index) == ("", None)
    with pytest.raises(InvalidArgument) as raised:
        SamplingParams(top_k=-2)
    assert (raised.value.field, raised.value.value, raised.value.index) == ("top_k", -2, None)
    with pytest.raises(InvalidArgument) as raised:
        WorkerConfig(in_flight="drop")
    assert (raised.value.field, raised.value.value) == ("in_flight", "drop")


def test_an_invalid_argument_pickles_with_every_attribute():
    error = invalid("prompt", preview(list(range(100))), "ids must be in [0, 512)", "tokenize it", "prompt 7", 7)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is InvalidArgument and str(back) == str(error)
    assert (back.field, repr(back.value), back.rule, back.fix, back.where, back.index) == (
        "prompt", repr(error.value), error.rule, error.fix, "prompt 7", 7)
