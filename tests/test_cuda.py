"""What the engine turns on for a CUDA device (rollout/engine/device/cuda.py), decided here on CPU for stand-in models that
say they live on CUDA: the attention "auto" picks, the decode fast path's width, CUDA graphs and async batching. The
paths themselves need a GPU: benchmarks/gpu/gpu.sh runs them (and this suite) there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout import WorkerConfig
from rollout.engine.device import cuda, sizing
from rollout.engine.attention import resolve_attn_implementation
from rollout.engine.upstream import NAME


def stand_in(device: str, attn: str, max_positions: int | None = 4096, dtype=torch.bfloat16):
    config = SimpleNamespace(_attn_implementation=attn, max_position_embeddings=max_positions)
    config.get_text_config = lambda: config
    return SimpleNamespace(device=torch.device(device), config=config, dtype=dtype)


@pytest.mark.parametrize("device, attn, dtype, flash_imports, expected", [
    ("cpu", "sdpa", torch.bfloat16, True, NAME),
    ("cuda", "sdpa", torch.bfloat16, True, "flash_attention_2"),
    ("cuda", "sdpa", torch.float32, True, NAME),  # flash has no fp32 kernels
    ("cuda", "sdpa", torch.bfloat16, False, NAME),  # PyTorch's own kernels, no dense mask
    ("cuda", "flash_attention_3", torch.bfloat16, False, "flash_attention_3"),  # the model's own flash stays
    ("mps", "sdpa", torch.bfloat16, True, None),  # elsewhere: the model's own
])
def test_auto_attention_is_mask_free_and_flash_on_cuda_when_it_can_run(monkeypatch, device, attn, dtype,
                                                                         flash_imports, expected):
    monkeypatch.setattr(cuda, "flash_attn_imports", lambda: flash_imports)
    assert resolve_attn_implementation("auto", stand_in(device, attn, dtype=dtype)) == expected
    assert resolve_attn_implementation("sdpa", stand_in(device, attn, dtype=dtype)) == "sdpa"


def test_flash_attn_is_used_only_when_it_really_imports():
    try:
        import flash_attn  # noqa: F401
        imports = True
    except Exception:
        imports = False
    assert cuda.flash_attn_imports() is (imports and torch.cuda.is_available())


@pytest.mark.parametrize("device, attn, policy, expected", [
    ("cuda", "flash_attention_2", "auto", True),
    ("cuda", "flash_attention_2", "off", False),
    ("cuda", NAME, "auto", False),  # plans each step on the host
    ("cuda", "sdpa", "auto", False),  # a dense mask: padded graph shapes cost more than they save
    ("cpu", "flash_attention_2", "auto", False),
])
def test_cuda_graphs_and_async_batching_only_where_every_hook_allows_them(device, attn, policy, expected):
    assert cuda.captures(stand_in(device, attn), WorkerConfig(cuda_graphs=policy)) is expected


def test_the_decode_fast_path_holds_the_longest_request_within_the_cache():
    flash = stand_in("cuda", "flash_attention_2", max_positions=4096)
    assert sizing.block_table_width(flash, WorkerConfig(page_size=16), num_blocks=10_000) == 4096 // 16 + 1
    assert sizing.block_table_width(flash, WorkerConfig(page_size=16), num_blocks=100) == 100
    assert sizing.block_table_width(flash, WorkerConfig(page_size=16, max_request_tokens=1000), 10_000) == 64
    # rollout_paged reads and writes pages itself, on any device; other attentions need per-token indices
    for device in ("cuda", "cpu"):
        paged = stand_in(device, NAME, max_positions=4096)
        assert sizing.block_table_width(paged, WorkerConfig(page_size=16), 10_000) == 4096 // 16 + 1
    assert sizing.block_table_width(stand_in("cpu", "flash_attention_2"), WorkerConfig(), 10_000) == 0
    assert sizing.block_table_width(stand_in("cuda", "sdpa"), WorkerConfig(), 10_000) == 0
