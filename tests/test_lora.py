"""LoRA through PEFT as a first-class path: adapter names as PEFT writes them, adapter-only updates (worker, fleet,
trainers, TRL's peft_config), exact merge-for-generation, and `rollout demo --lora` learning."""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft", reason="PEFT is not installed: pip install 'rollout[peft]'")

from conftest import reference_logprobs  # noqa: E402

from rollout import RolloutWorker, SamplingParams, WorkerConfig  # noqa: E402
from rollout.model.adapters import merged, peft_names  # noqa: E402
from rollout.model.weights import fingerprint, plan_update  # noqa: E402
from rollout.testing import load_tiny_model  # noqa: E402
from trainers_integration.lora import add_lora, trainable  # noqa: E402
from trainers_integration.rollouts import policy_weights, push_weights, shares_model  # noqa: E402

GAP = 1e-4


def lora_policy(path, seed: int = 0, scale: float = 0.05):
    """A PEFT model with non-zero adapters (LoRA's B starts at zero, which would hide a missing update)."""
    model, tok = load_tiny_model(path)
    policy = add_lora(model, rank=8, seed=seed)
    nudge(policy, seed + 1, scale)
    return policy, tok


def nudge(policy, seed: int, scale: float = 0.05) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in trainable(policy):
            param.add_(scale * torch.randn(param.shape, generator=gen))


def nbytes(weights: dict) -> int:
    return sum(t.numel() * t.element_size() for t in weights.values())


def adapter_names_only(weights: dict) -> bool:
    return bool(weights) and all("lora_" in name for name in weights)


def assert_rows_match(model, batch, tol: float = GAP) -> float:
    worst = 0.0
    for r, completion in enumerate(batch.completion_token_lists()):
        full, _ = reference_logprobs(model, batch.prompt_ids[r], completion)
        worst = max(worst, float((batch.logprobs[r, : len(completion)] - full).abs().max()))
    assert worst < tol, worst
    return worst


# ---------------------------------------------------------------------- names and updates
def test_peft_names_map_to_the_state_dict_and_cover_only_the_adapter(tiny_path):
    policy, _ = lora_policy(tiny_path)
    exported = peft.get_peft_model_state_dict(policy)
    names = peft_names(policy)
    assert set(names) == set(exported) and adapter_names_only(exported)
    state = policy.state_dict()
    assert all(names[n] in state and torch.equal(state[names[n]], t) for n, t in exported.items())
    assert ".default." in next(iter(names.values())) and ".default." not in next(iter(names))
    assert peft_names(load_tiny_model(tiny_path)[0]) == {}  # no adapters: nothing to translate


def test_a_worker_holding_its_own_peft_copy_takes_adapter_only_updates_in_either_spelling(tiny_path):
    policy, tok = lora_policy(tiny_path)
    with RolloutWorker(copy.deepcopy(policy), WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        for step, spelling in ((1, "peft"), (2, "state_dict")):
            nudge(policy, 10 + step)
            weights = policy_weights(policy)  # what the trainers push: PEFT's names, adapter only
            assert adapter_names_only(weights) and nbytes(weights) < nbytes(policy.state_dict()) / 4
            if spelling == "state_dict":
                weights = {peft_names(policy)[n]: t for n, t in weights.items()}
            assert worker.update_weights(weights, version=step) == step
            assert worker.weights_fingerprint() == fingerprint(policy)
        batch = worker.generate([tok.encode("one two three"), tok.encode("red")],
                                SamplingParams(n=2, max_new_tokens=6))
        assert_rows_match(policy, batch)


def test_adapter_names_are_rejected_with_the_fix_by_a_model_without_adapters(tiny_path):
    policy, _ = lora_policy(tiny_path)
    plain, _ = load_tiny_model(tiny_path)
    with pytest.raises(ValueError, match="no adapters: build the rollout side from the PEFT model"):
        plan_update(plain, policy_weights(policy))


def test_push_weights_refreshes_a_shared_peft_model_and_sends_only_the_adapter_otherwise(tiny_path):
    policy, tok = lora_policy(tiny_path)
    sent = []

    class Copy:  # a rollout side holding its own copy
        def update_weights(self, weights, version):
            sent.append((set(weights), version))

    push_weights(Copy(), policy, version=3)
    assert sent == [(set(peft.get_peft_model_state_dict(policy)), 3)]
    with RolloutWorker(policy.get_base_model(), WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        assert shares_model(worker, policy)  # adapters injected in place into the model the worker holds
        push_weights(worker, policy, version=4)
        assert worker.policy_version == 4


# ---------------------------------------------------------------------- merge for generation
def test_merging_for_generation_restores_the_base_bytes_exactly(tiny_path):
    policy, _ = lora_policy(tiny_path, scale=0.3)
    before = fingerprint(policy)
    pointers = {n: p.data_ptr() for n, p in policy.named_parameters()}
    probe = torch.tensor([[5, 9, 33, 70]])
    with torch.no_grad():
        unmerged_logits = policy(input_ids=probe).logits
        with merged(policy) as merge:
            assert merge.layers == 14  # 7 projections x 2 layers
            merged_logits = policy(input_ids=probe).logits
            assert fingerprint(policy) != before  # the base weights really hold the adapters now
    assert fingerprint(policy) == before  # a plain unmerge() would leave fp32 rounding behind
    assert {n: p.data_ptr() for n, p in policy.named_parameters()} == pointers
    assert torch.allclose(merged_logits, unmerged_logits, atol=1e-4)


@pytest.mark.parametrize("merge", [True, False])
def test_a_worker_generates_exactly_merged_or_not_and_leaves_the_model_exact(tiny_path, merge):
    policy, tok = lora_policy(tiny_path, scale=0.3)
    before = fingerprint(policy)
    with RolloutWorker(policy, WorkerConfig(num_blocks=64, merge_adapters=merge), tokenizer=tok) as worker:
        batch = worker.generate([tok.encode("one two three four"), tok.encode("the cat")],
                                SamplingParams(n=3, max_new_tokens=8))
        assert fingerprint(policy) == before
        assert_rows_match(policy, batch)
        nudge(policy, 99)  # an optimizer step on the shared adapters, then refresh: the next call merges them
        worker.refresh()
        batch = worker.generate([tok.encode("how many apples")], SamplingParams(n=2, max_new_tokens=8))
        assert_rows_match(policy, batch)


@pytest.mark.parametrize("merge", [True, False])
def test_drafted_rows_on_a_peft_policy_equal_plain_ones_merged_or_not(tiny_path, monkeypatch, merge):
    """Speculation on a LoRA policy: the verify forward runs the adapters as a decode step does (merged into the
    weights or not), so the drafted rows are speculation off's and as exact."""
    import dataclasses

    from rollout import Speculation
    from rollout.engine.speculation import speculator
    from rollout.testing import ReplayDrafts

    policy, tok = lora_policy(tiny_path, scale=0.3)
    prompts = [tok.encode("one two three four"), tok.encode("the cat")]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=4)
    config = WorkerConfig(num_blocks=64, page_size=4, merge_adapters=merge)
    with RolloutWorker(policy, config, tokenizer=tok) as worker:
        plain = worker.generate(prompts, params)
    monkeypatch.setattr(speculator, "DraftIndex", ReplayDrafts.of_batch(plain, len(tok)))
    speculating = dataclasses.replace(config, speculation=Speculation(mode="always"))
    with RolloutWorker(policy, speculating, tokenizer=tok) as worker:
        drafted = worker.generate(prompts, params)
        counts = worker.engine.speculation
    assert counts.accepted > 0 and counts.rolled_back > 0
    assert torch.equal(drafted.completion_ids, plain.completion_ids)
    # a verify step's forward has other shapes than a decode step's, so its products sum in another order: each run is
    # held to the reference, and the two to twice fp32's 1e-5 (1.0e-5 apart on an AVX2 EPYC, under 1e-5 on AVX-512)
    assert float((drafted.logprobs - plain.logprobs).abs().max()) <= 2e-5
    assert_rows_match(policy, plain)
    assert_rows_match(policy, drafted)


def test_an_adapter_update_landing_while_adapters_are_merged_leaves_exact_weights(tiny_path):
    policy, tok = lora_policy(tiny_path, scale=0.3)
    target = copy.deepcopy(policy)
    nudge(target, 7)
    with RolloutWorker(policy, WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        before = fingerprint(policy)
        worker._enter_generation_mode()  # what a call in flight holds: the adapters merged
        try:
            # a peer restoring from this worker, and its fingerprint, see the weights, not the merged bytes
            assert fingerprint(worker.state_dict()) == worker.weights_fingerprint() == before != fingerprint(policy)
            worker.update_weights(policy_weights(target), version=5)  # unmerge exactly, apply, merge again
            assert worker.weights_fingerprint() == fingerprint(target)
        finally:
            worker._leave_generation_mode()
        assert fingerprint(policy) == fingerprint(target) and worker.policy_version == 5


# ---------------------------------------------------------------------- trainers and the demo
def test_grpo_on_a_peft_policy_pushes_only_adapters_to_a_worker_holding_its_own_copy(tiny_path):
    from trainers_integration import GRPOConfig, GRPOTrainer
    from trainers_integration.demo import make_prompts, target_reward

    policy, tok = lora_policy(tiny_path)
    base_before = {n: t.clone() for n, t in policy.state_dict().items() if "lora_" not in n}
    with RolloutWorker(copy.deepcopy(policy), WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        pushed = []
        update = worker.update_weights
        worker.update_weights = lambda weights, **kw: pushed.append(set(weights)) or update(weights, **kw)
        trainer = GRPOTrainer(policy, torch.optim.AdamW(trainable(policy), lr=1e-2),
                              target_reward(tok.convert_tokens_to_ids("7")), make_prompts(tok, 4, seed=0), worker,
                              GRPOConfig(num_generations=4, max_new_tokens=8))
        history = trainer.train(3)
        assert worker.weights_fingerprint() == fingerprint(policy)
    assert len(pushed) == 4 and all(names == set(peft.get_peft_model_state_dict(policy)) for names in pushed)
    assert max(m["logprob_gap_max"] for m in history) < GAP
    assert all(torch.equal(t, policy.state_dict()[n]) for n, t in base_before.items())  # the base stays frozen


def test_demo_lora_learns(tmp_path, capsys):
    from trainers_integration.demo import main

    rc = main(["--lora", "--steps", "16", "--seed", "0", "--out", str(tmp_path / "demo"), "--plot", ""])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    first, last = (float(x) for x in out[-1].removeprefix("reward: ").split(" -> "))
    assert last - first >= 0.3, out[-1]


# ---------------------------------------------------------------------- TRL's own LoRA path
@pytest.mark.parametrize("shared", [True, False])
def test_trl_with_peft_config_shares_in_place_or_syncs_adapters_only(tiny_path, tmp_path, monkeypatch, shared):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trainers_integration.trl import OldLogprobs, RolloutGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    model, tok = load_tiny_model(tiny_path)
    # shared: the worker holds the policy itself, and TRL injects the adapters into it in place; otherwise the
    # rollout side is its own PeftModel with the same adapter shapes
    rollout_side = model if shared else peft.get_peft_model(load_tiny_model(tiny_path)[0], copy.deepcopy(config))
    dataset = datasets.Dataset.from_dict({"prompt": ["the cat is", "one plus two", "how many apples", "red blue"]})
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=8, max_steps=2, learning_rate=5e-2, bf16=False,
                          gradient_checkpointing=False, report_to="none", logging_steps=1, use_cpu=True,
                          save_strategy="no", seed=0, temperature=0.9)
    with RolloutWorker(rollout_side, WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        pushed = []
        update = worker.update_weights
        worker.update_weights = lambda weights, **kw: pushed.append(set(weights)) or update(weights, **kw)
        trainer = RolloutGRPOTrainer(model=model, rollouts=worker, reward_funcs=lambda completions, **kw: [
            sum(ch.isdigit() for ch in c) / 8 for c in completions], args=args, train_dataset=dataset,
            processing_class=tok, peft_config=config,
            old_logprobs=OldLogprobs(check_every=1))  # TRL's forward and correction on every step: the gaps below
        trainer.train()
        policy = trainer.accelerator.unwrap_model(trainer.model)
        assert isinstance(policy, peft.PeftModel) and shares_model(worker, policy) == shared
        assert len(pushed) == (0 if shared else 2)  # pushed before each generation; TRL pushes none after its last
        push_weights(worker, policy, version=2)
        assert worker.weights_fingerprint() == fingerprint(policy if not shared else policy.get_base_model())
    assert all(adapter_names_only(dict.fromkeys(names)) for names in pushed)
    gaps = [h["sampling/sampling_logp_difference/max"] for h in trainer.state.log_history
            if "sampling/sampling_logp_difference/max" in h]
    assert len(gaps) == 2 and max(gaps) < GAP, gaps
