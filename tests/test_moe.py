"""Mixtures of experts: exact rollouts on tiny Qwen3-MoE, OLMoE and Mixtral models, routing recorded by the engine's
own forward (prefix hits, forks, preemption, episodes), and routing replay in the trainer's forward."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import agreement, own_routing, prompts_of, reference_logprobs, row_tokens
from rollout import RolloutBatch, RolloutWorker, SamplingParams, Turn, WorkerConfig, replay_routing
from rollout.moe import Routing, find_routers
from rollout.moe import capture_routing
from rollout.testing import load_tiny_model
from trainers_integration.forward import completion_logprobs, pack

TOL = 1e-5
FAMILIES = ("qwen3_moe", "olmoe", "mixtral")


def assert_replayed(seen: torch.Tensor, batch) -> None:
    """Every row's positions of a right-padded trainer forward routed to exactly the experts the batch recorded."""
    width = seen.shape[0] // len(batch)
    for r, row in enumerate(batch.routing.rows):
        got = seen.view(len(batch), width, *row.shape[1:])[r, : row.shape[0]]
        assert torch.equal(got.sort(-1).values, row.long().sort(-1).values)


@pytest.fixture(scope="module", params=FAMILIES)
def moe(request, moe_paths):
    """A worker recording routing on a tiny MoE model shared in place (fp32, CPU)."""
    model, tok = load_tiny_model(moe_paths[request.param])
    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=256, record_routing=True), tokenizer=tok)
    yield worker
    worker.close()


def assert_exact(model, batch: RolloutBatch, temperature: float = 1.0) -> None:
    for r, completion in enumerate(batch.completion_token_lists()):
        full, _ = reference_logprobs(model, batch.prompt_ids[r], completion, temperature)
        gap = (batch.logprobs[r, : len(completion)] - full).abs().max()
        assert gap <= TOL, (r, float(gap))


def test_moe_rollouts_are_exact_and_record_the_trainers_own_routing(moe):
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=14, ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, max_new_tokens=9, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, max_new_tokens=12, ignore_eos=True, seed=5)]
    batch = moe.generate(prompts_of([1, 33, 20]), sampling=params)
    for r, p in enumerate(params[int(i)] for i in batch.prompt_index):
        full, _ = reference_logprobs(moe.model, batch.prompt_ids[r], batch.completion_token_lists()[r], p.temperature)
        assert (batch.logprobs[r, : len(full)] - full).abs().max() <= TOL
    routing = batch.routing
    names = tuple(r.name for r in find_routers(moe.model))
    assert routing.layers == names and len(names) == 2 and routing.top_k == 2
    assert all(row.dtype == torch.uint8 for row in routing.rows)
    assert routing.bytes_per_token == 4
    assert agreement(batch, moe.model) >= 0.999


def test_prefix_hits_and_forked_samples_keep_full_routing(moe):
    prompts = prompts_of([40, 37], seed=3)  # 2 full pages each: a re-sent prompt hits them
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=8, ignore_eos=True)
    first = moe.generate(prompts, sampling=sampling)
    second = moe.generate(prompts, sampling=sampling)
    assert second.stats["reused_tokens"] >= 64, second.stats
    for batch in (first, second):
        assert agreement(batch, moe.model) >= 0.999
    # the cached positions carry the routing their first computation recorded
    for r in range(len(second)):
        p = len(second.prompt_ids[r]) - 1
        assert torch.equal(second.routing.rows[r][:p], first.routing.rows[r][:p])


def test_preempted_and_restarted_requests_keep_full_routing(moe_paths, monkeypatch):
    from transformers.generation.continuous_batching.requests import RequestState

    model, tok = load_tiny_model(moe_paths["qwen3_moe"])
    resets = []
    original = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request",
                        lambda self: resets.append(self.generated_len()) or original(self))
    config = WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32, record_routing=True)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=20, ignore_eos=True)
    with RolloutWorker(model, config, tokenizer=tok) as worker:
        batch = worker.generate(prompts_of([9, 3, 10, 7, 8, 5, 9, 10], seed=9), params)
    assert any(n > 0 for n in resets), "requests were preempted mid-decode and re-prefilled"
    assert_exact(model, batch)
    assert agreement(batch, model) >= 0.999


class Echo:
    def __init__(self, prompt_index: int, sample_index: int) -> None:
        self.turn = 0

    def step(self, completion_ids: list[int]) -> Turn:
        self.turn += 1
        return Turn(observation_ids=[(37 * self.turn + i) % 480 + 10 for i in range(11)], reward=1.0)


def test_episodes_record_routing_over_observations_too(moe_paths):
    model, tok = load_tiny_model(moe_paths["olmoe"])
    with RolloutWorker(model, WorkerConfig(page_size=16, record_routing=True), tokenizer=tok) as worker:
        batch = worker.generate(prompts_of([12, 30]), SamplingParams(n=2, max_new_tokens=6, ignore_eos=True),
                                env=Echo, max_turns=3)
    assert batch.num_turns.tolist() == [3] * 4
    assert (~batch.action_mask & batch.completion_mask).any(), "observations are part of the rows"
    assert agreement(batch, model) >= 0.999


class Rewrites:
    """Turn 1 is answered with a whole new context (the prompt, the turn's last two tokens, an observation), as a
    template that rewrites history would: the episode's second segment starts there."""

    def __init__(self, prompts: list[list[int]], prompt_index: int) -> None:
        self.prompt, self.turn = prompts[prompt_index], 0

    def step(self, completion_ids: list[int]) -> Turn:
        self.turn += 1
        observation = [(41 * self.turn + i) % 480 + 10 for i in range(9)]
        if self.turn == 1:
            return Turn(context_ids=list(self.prompt) + list(completion_ids[-2:]) + observation)
        return Turn(observation_ids=observation, reward=1.0)


def test_episodes_restarted_from_new_context_record_each_segments_own_routing(moe_paths):
    model, tok = load_tiny_model(moe_paths["qwen3_moe"])
    prompts = prompts_of([12, 30])
    with RolloutWorker(model, WorkerConfig(page_size=16, record_routing=True), tokenizer=tok) as worker:
        batch = worker.generate(prompts, SamplingParams(n=2, max_new_tokens=6, ignore_eos=True),
                                env=lambda p, s: Rewrites(prompts, p), max_turns=3)
    assert batch.segment_index.tolist() == [0, 1] * 4 and batch.num_turns.tolist() == [3] * 8
    assert [len(p) for p in batch.prompt_ids[1::2]] == [12 + 2 + 9] * 2 + [30 + 2 + 9] * 2
    assert agreement(batch, model) >= 0.999  # every row's routing covers its own segment's positions, no hole
    for r, completion in enumerate(batch.completion_token_lists()):  # model tokens exact against their segment
        full, _ = reference_logprobs(model, batch.prompt_ids[r], completion)
        model_tokens = batch.action_mask[r, : len(completion)]
        assert (batch.logprobs[r, : len(completion)] - full).abs()[model_tokens].max() <= TOL


def test_rows_round_trip_keeps_routing(moe):
    batch = moe.generate(prompts_of([5, 9]), SamplingParams(n=2, max_new_tokens=4, ignore_eos=True))
    again = RolloutBatch.from_rows(batch.rows())
    assert again.routing.layers == batch.routing.layers
    assert all(torch.equal(a, b) for a, b in zip(again.routing.rows, batch.routing.rows))


def test_recording_is_refused_for_a_dense_model_and_an_unknown_router(tiny_path, moe_paths):
    dense, _ = load_tiny_model(tiny_path)
    with pytest.raises(ValueError, match="LlamaForCausalLM: it has no mixture-of-experts router"):
        RolloutWorker(dense, WorkerConfig(record_routing=True))
    model, _ = load_tiny_model(moe_paths["qwen3_moe"])
    router = model.model.layers[1].mlp.gate

    def sigmoid_router(hidden):  # DeepSeek-style gates: not the softmax form the recorder understands
        logits = torch.nn.functional.linear(hidden, router.weight)
        scores, indices = torch.topk(logits.sigmoid(), router.top_k, dim=-1)
        return logits, scores, indices

    router.forward = sigmoid_router
    with pytest.raises(ValueError, match=r"Qwen3MoeForCausalLM: its router 'model.layers.1.mlp.gate' "
                                         r"\(Qwen3MoeTopKRouter\) does not follow the form"):
        RolloutWorker(model, WorkerConfig(record_routing=True))


def test_recording_off_leaves_no_hooks_and_on_removes_them_at_close(moe_paths):
    model, tok = load_tiny_model(moe_paths["mixtral"])
    routers = [r.module for r in find_routers(model)]
    with RolloutWorker(model, WorkerConfig(page_size=16), tokenizer=tok) as worker:
        assert all(not r._forward_hooks for r in routers)
        assert worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3)).routing is None
    with RolloutWorker(model, WorkerConfig(page_size=16, record_routing=True), tokenizer=tok) as worker:
        assert all(r._forward_hooks for r in routers)
    assert all(not r._forward_hooks for r in routers) and not model._forward_hooks and not model._forward_pre_hooks


# ---------------------------------------------------------------------------------------------- replay


def perturbed(model, scale: float = 0.3, seed: int = 1):
    """A copy of the model whose routers' weights are nudged: its own routing differs from the recording. (Built
    fresh, not deep-copied: the live worker's hooks on the shared model must not come along.)"""
    other = type(model)(model.config)
    other.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(other):
            router.module.weight.add_(scale * torch.randn(router.module.weight.shape, generator=gen))
    return other


def trainer_forward(model, batch: RolloutBatch, rows=slice(None)):
    packed = pack(batch.prompt_ids[rows], batch.completion_ids[rows], batch.completion_mask[rows], 0)
    return packed, completion_logprobs(model, packed)[0]


def test_replay_forces_the_recorded_experts_under_perturbed_router_weights(moe):
    batch = moe.generate(prompts_of([7, 21, 16]), SamplingParams(n=2, max_new_tokens=10, ignore_eos=True))
    trainer = perturbed(moe.model)
    packed, _ = trainer_forward(trainer, batch)
    width = packed.input_ids.shape[1]
    with torch.no_grad(), capture_routing(trainer) as unreplayed:
        trainer_forward(trainer, batch)
    with replay_routing(trainer, batch), capture_routing(trainer) as replayed:
        _, logp = trainer_forward(trainer, batch)
    flips = 0
    for r, row in enumerate(batch.routing.rows):
        n = row.shape[0]
        got = replayed[0].view(len(batch), width, *row.shape[1:])[r, :n]
        assert torch.equal(got.sort(-1).values, row.long().sort(-1).values)
        own = unreplayed[0].view(len(batch), width, *row.shape[1:])[r, :n]
        flips += int((own.sort(-1).values != row.long().sort(-1).values).any(-1).sum())
    assert flips > 0, "the perturbed router alone would pick other experts"
    # gate weights come from the trainer's router: gradients reach it
    (logp * packed.mask).sum().backward()
    assert all(r.module.weight.grad is not None and r.module.weight.grad.abs().sum() > 0
               for r in find_routers(trainer))


def test_replay_on_the_rollout_model_reproduces_its_logprobs_and_leaves_it_untouched(moe):
    batch = moe.generate(prompts_of([6, 18]), SamplingParams(n=2, max_new_tokens=8, ignore_eos=True))
    hooks = [len(r.module._forward_hooks) for r in find_routers(moe.model)]  # the live recorder's
    with torch.no_grad():
        _, before = trainer_forward(moe.model, batch)
        with replay_routing(moe.model, batch, rows=[1, 2]):
            _, micro = trainer_forward(moe.model, batch, rows=slice(1, 3))
        _, after = trainer_forward(moe.model, batch)
    mask = batch.completion_mask
    assert (micro - batch.logprobs[1:3]).abs()[mask[1:3]].max() <= TOL
    assert torch.equal(before, after)
    assert [len(r.module._forward_hooks) for r in find_routers(moe.model)] == hooks


@pytest.fixture()
def gloo_group():
    """A one-process gloo group, as `accelerate launch` on CPU makes (DDP and FSDP2 need one)."""
    import torch.distributed as dist

    from rollout.fleet.collective import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def wrap_ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def wrap_fsdp2(model):
    """Every decoder layer its own FSDP2 unit, then the root (accelerate's transformer-layer wrap policy)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@pytest.mark.parametrize("wrap", [wrap_ddp, wrap_fsdp2], ids=["ddp", "fsdp2"])
def test_replay_under_real_ddp_and_fsdp2_wrappers(moe, gloo_group, wrap):
    batch = moe.generate(prompts_of([9]), SamplingParams(n=2, max_new_tokens=6, ignore_eos=True))
    wrapped = wrap(perturbed(moe.model))  # FSDP2: the routers' weights are DTensors outside their layer's forward
    assert [r.name for r in find_routers(wrapped)] == list(batch.routing.layers)  # DDP's `module.` prefix removed
    with torch.no_grad(), capture_routing(wrapped) as unreplayed:
        trainer_forward(wrapped, batch)
    with torch.no_grad(), replay_routing(wrapped, batch), capture_routing(wrapped) as seen:
        trainer_forward(wrapped, batch)
    assert_replayed(seen[0], batch)
    assert not torch.equal(seen[0], unreplayed[0])  # the perturbed routers alone would have picked other experts


def test_replay_rejects_a_mismatch_before_any_forward(moe, moe_paths):
    batch = moe.generate(prompts_of([8, 5]), SamplingParams(n=1, max_new_tokens=5, ignore_eos=True))
    routed = []
    model = moe.model
    with capture_routing(model) as routed:
        with pytest.raises(ValueError, match=r"input has shape \(2, 6\)"):
            with replay_routing(model, batch):
                model(input_ids=torch.zeros((2, 6), dtype=torch.long))
        swapped = pack([batch.prompt_ids[1], batch.prompt_ids[0]], batch.completion_ids[[1, 0]],
                       batch.completion_mask[[1, 0]], 0)
        with pytest.raises(ValueError, match="row 0 of the forward has token"):
            with replay_routing(model, batch):
                model(input_ids=swapped.input_ids, attention_mask=swapped.attention_mask)
        assert routed == [], "no router ran"
    other_arch = "mixtral" if batch.routing.num_experts == 8 else "olmoe"
    other, _ = load_tiny_model(moe_paths[other_arch])
    with pytest.raises(ValueError, match="experts|another model"):
        with replay_routing(other, batch):
            pass
    unrecorded = RolloutBatch.from_rows([dict_row(r) for r in batch.rows()])
    with pytest.raises(ValueError, match="batch.routing=None") as refused:
        with replay_routing(model, unrecorded):
            pass
    assert (refused.value.field, refused.value.value) == ("batch.routing", None)  # a nested field, dotted
    with pytest.raises(ValueError, match=r"rows=\[5\] is invalid") as refused:
        with replay_routing(model, batch, rows=[5]):
            pass
    assert (refused.value.field, refused.value.value) == ("rows", [5])
    short = RolloutBatch.from_rows(batch.rows())
    short = RolloutBatch(**{**short.__dict__, "routing": Routing(
        short.routing.layers, short.routing.num_experts, short.routing.top_k,
        (short.routing.rows[0][:-1], short.routing.rows[1]))})
    with pytest.raises(ValueError, match="batch row 0 has 13 tokens but routing for 11 positions"):
        with replay_routing(model, short):
            pass


def dict_row(row):
    from dataclasses import replace

    return replace(row, routing=None)


def test_score_returns_the_routing_of_its_own_forward(moe):
    from rollout import score

    batch = moe.generate(prompts_of([4, 19]), SamplingParams(n=2, max_new_tokens=7, ignore_eos=True))
    logprobs, routing = score(moe.model, batch.prompt_ids, batch.completion_token_lists(), return_routing=True,
                              max_batch_tokens=40)  # several packed batches
    assert routing.layers == batch.routing.layers and len(routing) == len(batch)
    for r, row in enumerate(routing.rows):
        assert row.dtype == torch.uint8 and row.shape == batch.routing.rows[r].shape
        assert torch.equal(row.long().sort(-1).values, own_routing(moe.model, row_tokens(batch, r))[:-1])
        assert (logprobs[r] - batch.logprobs[r, : len(logprobs[r])]).abs().max() <= TOL
    with torch.no_grad(), replay_routing(moe.model, RolloutBatch(**{**batch.__dict__, "routing": routing})):
        _, replayed = trainer_forward(moe.model, batch)
    assert (replayed - batch.logprobs).abs()[batch.completion_mask].max() <= TOL


def test_grpo_with_routing_replay_learns_on_the_tiny_moe(moe_paths):
    from trainers_integration.grpo import GRPOConfig, GRPOTrainer

    model, tok = load_tiny_model(moe_paths["qwen3_moe"])
    prompts = [tok.encode(p) for p in ("one plus two", "how many apples", "red blue green", "the cat is")]
    config = GRPOConfig(num_generations=6, max_new_tokens=8, routing_replay=True, micro_batch_size=8)
    worker = RolloutWorker(model, WorkerConfig(page_size=16, record_routing=True), tokenizer=tok)
    low = 128  # reward: the share of completion tokens with an id below 128 (a quarter of the vocabulary)

    def reward(batch):
        hits = (batch.completion_ids < low) & batch.completion_mask
        return hits.sum(1).float() / batch.completion_lengths.float()

    with worker:
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), reward, lambda step: prompts,
                              worker, config)
        history = trainer.train(10)
    rewards = [m["reward_mean"] for m in history]
    assert max(m["logprob_gap_max"] for m in history) < 1e-4
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_grpo_routing_replay_needs_recorded_rollouts(moe_paths):
    from trainers_integration.grpo import GRPOConfig, GRPOTrainer

    model, tok = load_tiny_model(moe_paths["olmoe"])
    config = GRPOConfig(num_generations=2, max_new_tokens=4, routing_replay=True)
    with RolloutWorker(model, WorkerConfig(page_size=16), tokenizer=tok) as worker:
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                              lambda b: torch.zeros(len(b)), lambda step: [[5, 6, 7]], worker, config)
        with pytest.raises(ValueError, match="routing_replay=True needs rollouts that recorded routing"):
            trainer.step()


def test_fleet_round_trip_carries_routing_of_generate_and_score(moe_paths):
    pytest.importorskip("ray")
    from rollout import RolloutFleet, score

    config = WorkerConfig(page_size=16, num_blocks=128, record_routing=True)
    fleet = RolloutFleet(moe_paths["mixtral"], num_workers=2, config=config)
    try:
        batch = fleet.generate(prompts_of([6, 23, 14]), SamplingParams(n=2, max_new_tokens=6, ignore_eos=True))
        pairs = (batch.prompt_ids, batch.completion_token_lists())
        logprobs, routing = fleet.score(*pairs, return_routing=True)
        none, empty = fleet.score([], [], return_routing=True)
    finally:
        fleet.close()
    local, _ = load_tiny_model(moe_paths["mixtral"])
    assert batch.routing is not None and len(batch.routing) == 6 and batch.routing.bytes_per_token == 4
    assert_exact(local, batch)
    assert agreement(batch, local) >= 0.999
    # score: each pair's experts come back with it, in input order, as the worker's own score records them
    own_logprobs, own = score(local, *pairs, return_routing=True)
    assert routing.layers == own.layers == batch.routing.layers and routing.bytes_per_token == 4
    assert routing.nbytes == 4 * sum(len(row_tokens(batch, r)) - 1 for r in range(len(batch)))
    same = total = 0
    for r, (got, want) in enumerate(zip(routing.rows, own.rows)):
        assert got.dtype == torch.uint8 and got.shape == want.shape == batch.routing.rows[r].shape
        equal = (got.long().sort(-1).values == want.long().sort(-1).values).all(-1)
        same, total = same + int(equal.sum()), total + equal.numel()
        assert (logprobs[r] - own_logprobs[r]).abs().max() <= TOL
    assert same / total >= 0.999
    assert none == [] and len(empty) == 0 and empty.layers == own.layers


def test_replay_on_a_peft_model_forces_the_recorded_experts(moe):
    pytest.importorskip("peft")
    from trainers_integration.lora import add_lora

    batch = moe.generate(prompts_of([11]), SamplingParams(n=2, max_new_tokens=6, ignore_eos=True))
    peft_model = add_lora(perturbed(moe.model), rank=4, target_modules=("q_proj", "v_proj"), seed=0)
    assert find_routers(peft_model)[0].name == batch.routing.layers[0]  # PEFT's base_model.model. prefix removed
    with torch.no_grad(), replay_routing(peft_model, batch), capture_routing(peft_model) as seen:
        trainer_forward(peft_model, batch)
    assert_replayed(seen[0], batch)


@contextlib.contextmanager
def experts_used(model):
    """The experts each MoE layer's `experts` module computed with in each forward (whatever hooks on the routers
    did): one (tokens, layers, top_k) int64 tensor per forward."""
    parents = [model.get_submodule(r.name.rsplit(".", 1)[0]) for r in find_routers(model)]
    captured, step = [], {}

    def keep(layer):
        def hook(module, args):
            step[layer] = args[1].detach().long().cpu()  # experts(hidden_states, top_k_index, top_k_weights)
            if len(step) == len(parents):
                captured.append(torch.stack([step.pop(i) for i in range(len(parents))], dim=1))
        return hook

    handles = [parent.experts.register_forward_pre_hook(keep(i)) for i, parent in enumerate(parents)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def test_ppo_with_routing_replay_forces_the_recorded_experts_in_every_policy_forward(moe):
    from trainers_integration.ppo import PPOConfig, PPOTrainer
    from trainers_integration.value import ValueHead

    batch = moe.generate(prompts_of([8, 15, 11]), SamplingParams(n=1, max_new_tokens=7, ignore_eos=True))
    width = max(len(row_tokens(batch, r)) for r in range(len(batch)))
    recorded = [row.long().sort(-1).values for row in batch.routing.rows]

    class RolloutSide:  # learn() trains on a batch generated elsewhere, then pushes the weights here
        policy_version, tokenizer = 0, None

        @staticmethod
        def metrics():
            from rollout.metrics.snapshot import WorkerMetrics

            return WorkerMetrics()  # nothing generated here

        def __init__(self):
            self.versions = []

        def update_weights(self, weights, version=None):
            self.versions.append(version)

    for replay in (True, False):
        policy = perturbed(moe.model)  # the trainer's routers differ from the ones that ran the rollout
        head = ValueHead.for_model(policy)
        optimizer = torch.optim.SGD([*policy.parameters(), *head.parameters()], lr=1e-3)
        side = RolloutSide()
        trainer = PPOTrainer(policy, head, optimizer, None, [], side, PPOConfig(num_epochs=2, routing_replay=replay))
        with experts_used(policy) as seen:
            trainer.learn(batch, [1.0, 0.0, 0.5])
        assert side.versions == [0, 1]
        assert len(seen) == 3, "the old values' forward and one per epoch"
        flips = 0
        for forward in seen:
            experts = forward.view(len(batch), width, *forward.shape[1:]).sort(-1).values
            for r, row in enumerate(recorded):
                flips += int((experts[r, : row.shape[0]] != row).any(-1).sum())
        assert (flips == 0) if replay else (flips > 0), (replay, flips)


def test_routing_travels_in_pickles_exactly_with_little_framing_per_row():
    import pickle

    gen = torch.Generator().manual_seed(0)
    for experts, dtype in ((8, torch.uint8), (300, torch.int16)):
        rows = tuple(torch.randint(0, experts, (n, 3, 2), generator=gen).to(dtype) for n in (100, 1, 37, 0))
        routing = Routing(("model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"),
                          experts, 2, rows)
        wire = pickle.dumps(routing)  # what Ray ships between an actor and the fleet
        back = pickle.loads(wire)
        assert back.layers == routing.layers and (back.num_experts, back.top_k) == (experts, 2)
        assert all(a.dtype == dtype and torch.equal(a, b) for a, b in zip(back.rows, rows))
        assert len(wire) <= routing.nbytes + 200 + 64 * len(rows), (len(wire), routing.nbytes)
