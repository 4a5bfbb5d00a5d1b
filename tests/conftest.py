"""Shared fixtures: a tiny model built locally once per session, loaded back through from_pretrained."""

from __future__ import annotations

import pytest
import torch

from rollout.testing import build_tiny_model, load_tiny_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="session")
def tiny_tied_qwen_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def moe_paths(tmp_path_factory):
    """Tiny mixture-of-experts models (Qwen3-MoE, OLMoE, Mixtral), built locally once per session."""
    root = tmp_path_factory.mktemp("moe")
    return {arch: build_tiny_model(root / arch, arch=arch) for arch in ("qwen3_moe", "olmoe", "mixtral")}


@pytest.fixture()
def inject_engine_fault(monkeypatch):
    """inject(at_step): from then on, the at_step-th engine step (counted across engines) raises inside the forward,
    killing the engine thread; the worker rebuilds its engine and re-runs what was in flight."""
    from rollout.engine.upstream.runner import RolloutModelRunner

    def inject(at_step: int) -> None:
        original = RolloutModelRunner._forward_process_and_sample
        steps = {"n": 0}

        def flaky(self, *args):
            steps["n"] += 1
            if steps["n"] == at_step:
                raise RuntimeError("injected engine fault")
            return original(self, *args)

        monkeypatch.setattr(RolloutModelRunner, "_forward_process_and_sample", flaky)

    return inject


@pytest.fixture()
def tiny(tiny_path):
    """A fresh (model, tokenizer) pair, fp32 sdpa on CPU."""
    return load_tiny_model(tiny_path)


def reference_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0,
                       top_k: int = 0, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: one plain teacher-forced forward of prompt + completion.

    Returns (full-vocabulary logprobs of log_softmax(logits / T), logprobs under the top-k / top-p truncated and
    renormalised distribution), one per completion token. Greedy (T == 0) uses T = 1 and truncated logprob 0.
    """
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
    target = torch.tensor(completion)[:, None]
    temp = 1.0 if temperature == 0 else temperature
    full = torch.log_softmax(logits / temp, dim=-1)
    if temperature == 0:
        return full.gather(1, target).squeeze(1), torch.zeros(len(completion))
    truncated = []
    for row, tok in zip(logits / temp, completion):
        keep = torch.ones_like(row, dtype=torch.bool)
        order = torch.argsort(row, descending=True)
        if top_k > 0:
            keep[order[top_k:]] = False
        probs = torch.softmax(row.masked_fill(~keep, float("-inf")), dim=-1)
        if top_p < 1.0:
            cumulative = 0.0
            for idx in order.tolist():
                if not keep[idx]:
                    continue
                if cumulative >= top_p:
                    keep[idx] = False
                cumulative += float(probs[idx])
        truncated.append(torch.log_softmax(row.masked_fill(~keep, float("-inf")), dim=-1)[tok])
    return full.gather(1, target).squeeze(1), torch.stack(truncated)
