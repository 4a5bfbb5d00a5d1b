"""rollout.model.loading: the one checkpoint loader (worker, scoring, CLI and fleet actors) and its dtype rule."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rollout import RolloutWorker, WorkerConfig, score
from rollout.model.loading import (load_model, load_tokenizer, loading_attention, model_from_state_dict, pad_token_id,
                                   resolve_dtype)
from rollout.testing import load_tiny_model


@pytest.fixture(scope="module")
def bf16_path(tiny_path, tmp_path_factory) -> Path:
    """The tiny checkpoint saved in bfloat16, without its tokenizer."""
    model, _ = load_tiny_model(tiny_path)
    path = tmp_path_factory.mktemp("bf16") / "ckpt"
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_the_dtype_rule_is_fp32_on_cpu_and_the_checkpoints_own_elsewhere_unless_told():
    assert resolve_dtype("cpu") == torch.float32
    assert resolve_dtype("cuda") == resolve_dtype(torch.device("cuda", 1)) == "auto"
    assert resolve_dtype("cpu", torch.bfloat16) == torch.bfloat16 and resolve_dtype("cuda", torch.float16) == \
        torch.float16
    assert loading_attention("auto") == loading_attention(None) == "sdpa"
    assert loading_attention("rollout_paged") == "rollout_paged"


def test_a_bf16_checkpoint_loads_in_fp32_on_cpu_its_own_dtype_off_cpu_and_as_told(bf16_path):
    model, tokenizer = load_model(bf16_path, device="cpu")
    assert dtypes(model) == {torch.float32} and model.device.type == "cpu"
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer is None  # none saved: token-id inputs still work
    told, _ = load_model(bf16_path, device="cpu", dtype=torch.bfloat16)
    assert dtypes(told) == {torch.bfloat16}
    elsewhere, _ = load_model(bf16_path, device="meta")  # any device but the CPU: the checkpoint's own dtype
    assert dtypes(elsewhere) == {torch.bfloat16} and elsewhere.device.type == "meta"


def test_the_tokenizer_saved_next_to_a_checkpoint_is_found(tiny_path, bf16_path):
    model, tokenizer = load_model(tiny_path, device="cpu")
    assert tokenizer is not None and tokenizer("the cat")["input_ids"]
    assert load_tokenizer(str(bf16_path)) is None
    mine = object()
    assert load_model(tiny_path, mine, device="cpu")[1] is mine  # a given tokenizer wins


def test_a_model_object_comes_back_as_it_is(tiny):
    model, tok = tiny
    assert load_model(model, tok) == (model, tok)


@pytest.mark.parametrize("bad", ["/nonexistent/checkpoint", 42, None])
def test_a_bad_path_is_a_value_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match=r"model_or_path=.* is invalid: not a model object nor a local checkpoint "
                                         r"directory\. Fix: pass a PreTrainedModel"):
        load_model(bad)


def test_a_file_is_not_a_checkpoint_directory(tiny_path):
    with pytest.raises(ValueError, match="model_or_path=.*config.json"):
        load_model(Path(tiny_path) / "config.json")


def test_every_entry_point_goes_through_the_loader(bf16_path, tmp_path):
    # worker and scoring: fp32 on CPU from a bf16 checkpoint, and the same error for a bad path
    with RolloutWorker(bf16_path, WorkerConfig(num_blocks=16)) as worker:
        assert dtypes(worker.model) == {torch.float32} and worker.tokenizer is None
    with pytest.raises(ValueError, match="model_or_path='/nonexistent' is invalid"):
        RolloutWorker("/nonexistent")
    with pytest.raises(ValueError, match="model_or_path='/nonexistent' is invalid"):
        score("/nonexistent", [[1]], [[2]])
    copy = tmp_path / "copy"
    shutil.copytree(bf16_path, copy)
    assert len(score(copy, [[1, 2]], [[3]])[0]) == 1


def test_a_live_models_weights_rebuild_it_in_their_dtype_when_told(tiny):
    model, _ = tiny
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    told = model_from_state_dict(model.config, state, model.generation_config, dtype=torch.bfloat16, device="cpu")
    assert dtypes(told) == {torch.bfloat16}
    assert all(torch.equal(told.state_dict()[k], v) for k, v in state.items())
    assert told.generation_config is model.generation_config
    assert dtypes(model_from_state_dict(model.config, state, device="cpu")) == {torch.float32}  # the CPU rule


def test_the_pad_id_falls_back_to_zero(tiny):
    _, tok = tiny
    assert pad_token_id(tok) == tok.pad_token_id and pad_token_id(None) == 0

    class NoPad:
        pad_token_id = None

    assert pad_token_id(NoPad()) == 0
