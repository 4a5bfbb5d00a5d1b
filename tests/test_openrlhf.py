"""OpenRLHF's rollout side on this engine (trainers_integration/openrlhf.py), driven as OpenRLHF's trainer drives its
vLLM actor. OpenRLHF needs vLLM and GPUs and cannot be installed here, so its side is a test double written from its
source (read at OpenRLHF 0.11, commit 3c3be623): the call sequences and argument shapes of
`openrlhf/trainer/ppo_utils/samples_generator.py` (`_dispatch_prompts_to_vllm`), `openrlhf/utils/agent.py`
(`SingleTurnAgentExecutor.execute`, what it reads of the RequestOutput), `openrlhf/trainer/ray/ppo_actor.py`
(`_init_vllm_sync_group`, `broadcast_to_vllm`), `openrlhf/trainer/ppo_trainer.py` (wake_up(["weights"]) before a
sync under --vllm.enable_sleep) and `openrlhf/trainer/ppo_trainer_async.py` (pause_generation / resume_generation
around a sync). A Ray actor handle is replaced by `ActorHandle` (each method on the actor's one event loop, as a Ray
async actor runs them); vLLM's SamplingParams by `VLLMSamplingParams` (its field names and defaults)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
import types
from copy import deepcopy
from dataclasses import dataclass

import pytest
import torch

from conftest import TOL, free_port, perturbed, reference_logprobs, wait_for_tokens
from rollout import RolloutWorker, SamplingParams, WorkerConfig, fingerprint
from rollout.testing import load_tiny_model
from trainers_integration.openrlhf import OpenRLHFEngine, TrainerGroup

TEMPERATURE = 0.9
PROMPTS = ("the cat is", "one plus two")


@dataclass
class VLLMSamplingParams:
    """vLLM's SamplingParams as far as the engine reads it: vLLM's field names and defaults."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class ActorHandle:
    """A Ray actor handle as OpenRLHF uses one: `handle.method.remote(...)` runs the method on the actor's single
    event loop (a Ray async actor's) and returns a future standing for the ObjectRef; `ray_get` waits on them."""

    def __init__(self, engine: OpenRLHFEngine) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def __getattr__(self, name: str):
        method = getattr(self.engine, name)

        def remote(*args, **kwargs) -> concurrent.futures.Future:
            if inspect.iscoroutinefunction(method):
                return asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self.loop)
            future: concurrent.futures.Future = concurrent.futures.Future()
            self.loop.call_soon_threadsafe(lambda: future.set_result(method(*args, **kwargs)))
            return future

        return types.SimpleNamespace(remote=remote)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def ray_get(refs):
    return [ref.result(timeout=120) for ref in refs] if isinstance(refs, list) else refs.result(timeout=120)


class SingleTurnExecutor:
    """OpenRLHF's SingleTurnAgentExecutor.execute without a reward model, step for step: tokenize the prompt without
    special tokens, a dynamic max_tokens when None, `await llm_engine.generate(ids, deepcopy(params),
    multi_modal_data=None)`, then outputs[0].token_ids, finish_reason == "length", and per token
    `logprobs[i].get(token_id).logprob` after zeros for the prompt."""

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        prompt_ids = hf_tokenizer(text=prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
        params = sampling_params
        if params.max_tokens is None:
            params = deepcopy(sampling_params)
            params.max_tokens = max(1, max_length - len(prompt_ids))
        prompt_ids = prompt_ids[-(max_length - params.max_tokens):]
        output = (await llm_engine.generate(prompt_ids, deepcopy(params), multi_modal_data=None)).outputs[0]
        action = output.token_ids
        logprobs = None
        if sampling_params.logprobs is not None and output.logprobs is not None:
            logprobs = [0.0] * len(prompt_ids)
            for token, entry in zip(action, output.logprobs):
                logprobs.append(entry.get(token).logprob if entry.get(token) is not None else 0.0)
        return {"prompt": prompt, "label": label, "observation_tokens": prompt_ids + action,
                "action_ranges": [(len(prompt_ids), len(prompt_ids) + len(action))], "rollout_log_probs": logprobs,
                "truncated": output.finish_reason == "length", "reward": None, "scores": None, "extra_logs": {}}


def dispatch(engines: list[ActorHandle], tokenizer, prompts, n_samples: int, max_new_tokens: int) -> list[dict]:
    """`SamplesGenerator._dispatch_prompts_to_vllm` and the gathering of `_generate_vllm`, with the correction on
    (logprobs=1): the least-loaded engine per prompt, one generate_responses per prompt."""
    params = VLLMSamplingParams(temperature=TEMPERATURE, top_p=1.0, top_k=-1, max_tokens=max_new_tokens,
                                min_tokens=1, skip_special_tokens=False, logprobs=1)
    loads = ray_get([engine.get_num_unfinished_requests.remote() for engine in engines])
    refs = []
    for prompt in prompts:
        index = min(range(len(engines)), key=lambda i: loads[i])
        loads[index] += n_samples
        refs.append(engines[index].generate_responses.remote(
            prompt=prompt, label="", sampling_params=params, max_length=2048, hf_tokenizer=tokenizer,
            num_samples=n_samples, images=None))
    return [response for responses in ray_get(refs) for response in responses]


def init_sync_group(engines: list[ActorHandle]) -> TrainerGroup:
    """`PolicyModelActor._init_vllm_sync_group` with tensor_parallel_size 1 and the gloo backend: every engine's
    init_process_group fired, rank 0's group built (TrainerGroup in place of vLLM's stateless group), then waited."""
    port = free_port()
    refs = [engine.init_process_group.remote("127.0.0.1", port, i + 1, len(engines) + 1, "openrlhf", backend="gloo",
                                             use_ray=False) for i, engine in enumerate(engines)]
    group = TrainerGroup("127.0.0.1", port, len(engines) + 1, "gloo")
    ray_get(refs)
    return group


def broadcast_to_vllm(engines: list[ActorHandle], group: TrainerGroup, model, on_param=None) -> None:
    """`PolicyModelActor.broadcast_to_vllm` with prefix caching on (ZeRO-1/2, no IPC): reset_prefix_cache fired, then
    per parameter update_weight.remote(name, dtype, shape, empty_cache=count == num_params), rank 0's broadcast,
    ray.get; the cache resets waited on last."""
    resets = [engine.reset_prefix_cache.remote() for engine in engines]
    params = list(model.named_parameters())
    for count, (name, param) in enumerate(params, start=1):
        refs = [engine.update_weight.remote(name, dtype=param.dtype, shape=param.shape,
                                            empty_cache=count == len(params)) for engine in engines]
        group.broadcast(param.data, src=0, stream=None)
        ray_get(refs)
        if on_param is not None:
            on_param(count, len(params))
    ray_get(resets)


def assert_exact(responses: list[dict], model, stop_ids: tuple[int, ...]) -> None:
    """Every row's rollout logprobs are a teacher-forced fp32 forward of its own tokens at TEMPERATURE (top_k -1,
    top_p 1: the sampled distribution is the full softmax, but for min_tokens=1, which takes the stop ids out of the
    first token's), zeros on the prompt."""
    assert responses
    for response in responses:
        (start, end), = response["action_ranges"]
        tokens, logprobs = response["observation_tokens"], torch.tensor(response["rollout_log_probs"])
        assert end == len(tokens) and 1 <= end - start <= 8 and len(logprobs) == len(tokens)
        assert torch.equal(logprobs[:start], torch.zeros(start))
        full, _ = reference_logprobs(model, tokens[:start], tokens[start:], temperature=TEMPERATURE)
        with torch.no_grad():
            first = model(torch.tensor([tokens[:start]])).logits[0, -1].float()
        first[list(stop_ids)] = float("-inf")
        full[0] = torch.log_softmax(first / TEMPERATURE, dim=-1)[tokens[start]]
        assert float((logprobs[start:] - full).abs().max()) <= TOL
        assert not response["truncated"] or end - start == 8


@pytest.fixture()
def engine(tiny_path):
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        handle = ActorHandle(OpenRLHFEngine(worker, executor=SingleTurnExecutor()))
        yield worker, handle
        handle.close()


def test_openrlhfs_dispatch_gets_every_row_with_exact_rollout_logprobs(engine, tiny):
    worker, handle = engine
    model, tok = tiny
    responses = dispatch([handle], tok, PROMPTS, n_samples=4, max_new_tokens=8)
    assert len(responses) == 8 and [r["prompt"] for r in responses] == [p for p in PROMPTS for _ in range(4)]
    for response, prompt in zip(responses, [p for p in PROMPTS for _ in range(4)]):
        (start, _), = response["action_ranges"]
        assert response["observation_tokens"][:start] == tok(text=prompt, add_special_tokens=False)["input_ids"]
    assert_exact(responses, model, worker.default_stop_ids)
    assert ray_get(handle.get_num_unfinished_requests.remote()) == 0


def test_a_seeded_request_is_the_workers_own_rows_in_vllms_shape(engine):
    worker, handle = engine
    prompt = [5, 17, 42, 8]
    params = VLLMSamplingParams(n=3, temperature=TEMPERATURE, top_k=20, top_p=0.9, seed=7, max_tokens=10,
                                stop_token_ids=[3], logprobs=0)
    out = ray_get(handle.generate.remote(prompt, params))
    own = worker.generate([prompt], SamplingParams(n=3, temperature=TEMPERATURE, top_k=20, top_p=0.9, seed=7,
                                                   max_new_tokens=10, stop_token_ids=(3,)))
    assert out.prompt_token_ids == prompt and out.finished and len(out.outputs) == 3
    for i, (sample, ids) in enumerate(zip(out.outputs, own.completion_token_lists())):
        assert sample.index == i and sample.token_ids == ids and sample.finish_reason == own.finish_reason[i]
        assert [list(entry) for entry in sample.logprobs] == [[t] for t in ids]  # the sampled token's entry only
        lps = [entry[t].logprob for entry, t in zip(sample.logprobs, ids)]
        assert lps == own.sampling_logprobs[i, :len(ids)].tolist()
        assert sample.cumulative_logprob == pytest.approx(sum(lps), abs=1e-6)
        assert sample.stop_reason == (3 if sample.finish_reason == "stop" and ids[-1] == 3 else None)
    none = ray_get(handle.generate.remote(prompt, VLLMSamplingParams(max_tokens=4, seed=1)))
    assert none.outputs[0].logprobs is None and none.outputs[0].cumulative_logprob is None  # logprobs=None asks none


def test_a_sleeping_engine_gets_the_trainers_weights_over_a_gloo_group_exactly_at_the_last_parameter(engine, tiny):
    """--vllm.enable_sleep: sleep after generation, wake_up(["weights"]) and broadcast_to_vllm, wake_up() and
    generate: the weights land bit for bit, once, at the parameter sent with empty_cache=True, and the new rows are
    exact under them."""
    worker, handle = engine
    model, tok = tiny
    model.load_state_dict(perturbed(model, seed=3))
    version = worker.policy_version
    group = init_sync_group([handle])
    ray_get(handle.sleep.remote())
    assert worker.is_sleeping
    ray_get(handle.wake_up.remote(tags=["weights"]))
    assert worker.is_sleeping  # the weights never left: only the KV cache wakes it

    def staged_until_the_last(count: int, total: int) -> None:
        assert worker.policy_version == (version + 1 if count == total else version)

    broadcast_to_vllm([handle], group, model, on_param=staged_until_the_last)
    assert worker.weights_fingerprint() == fingerprint(model)
    ray_get(handle.wake_up.remote())
    assert not worker.is_sleeping
    assert_exact(dispatch([handle], tok, PROMPTS, n_samples=2, max_new_tokens=8), model, worker.default_stop_ids)


def test_a_sync_inside_pause_generation_continues_the_frozen_rows_exact_on_each_tokens_weights(engine, tiny,
                                                                                              tiny_path, monkeypatch,
                                                                                              slow_steps):
    """OpenRLHF's async trainer with partial rollouts: pause_generation, broadcast_to_vllm, resume_generation while a
    request is mid-way; it finishes, its tokens before the sync exact under the old weights, after under the new."""
    worker, handle = engine
    old, _ = tiny
    new, _ = load_tiny_model(tiny_path)
    new.load_state_dict(perturbed(new, seed=4))
    group = init_sync_group([handle])
    futures, submit = [], worker.submit  # each call's future, for its rows' per-token versions
    monkeypatch.setattr(worker, "submit", lambda *a, **k: futures.append(submit(*a, **k)) or futures[-1])
    prompt = [5, 17, 42, 8]
    params = VLLMSamplingParams(temperature=TEMPERATURE, max_tokens=40, ignore_eos=True, logprobs=1)
    running = handle.generate.remote(prompt, params)
    wait_for_tokens(worker, 3)
    ray_get(handle.pause_generation.remote())
    broadcast_to_vllm([handle], group, new)
    ray_get(handle.resume_generation.remote())
    sample = ray_get(running).outputs[0]
    versions = futures[0].result().token_versions[0, :len(sample.token_ids)]
    assert versions[0] < versions[-1] == worker.policy_version and sample.policy_version == int(versions[0])
    lps = torch.tensor([entry[t].logprob for entry, t in zip(sample.logprobs, sample.token_ids)])
    for model, at in ((old, versions == versions[0]), (new, versions == versions[-1])):
        full, _ = reference_logprobs(model, prompt, sample.token_ids, temperature=TEMPERATURE)
        assert float((lps[at] - full[at]).abs().max()) <= 2 * TOL  # 40 positions on perturbed weights: fp32 rounding


@pytest.mark.parametrize("method, args, kwargs, match", [
    ("generate", ([5, 6], VLLMSamplingParams()), {"multi_modal_data": {"image": [object()]}}, "multi_modal_data="),
    ("generate", ([5, 6], VLLMSamplingParams(stop=["\n"])), {}, "sampling_params.stop="),
    ("init_process_group", ("127.0.0.1", 1, 1, 2, "openrlhf"), {"backend": "gloo", "use_ray": True}, "use_ray="),
    ("wake_up", (), {"tags": ["kv"]}, "tags=.*'kv'"),
    ("sleep", (3,), {}, "level=3"),
])
def test_what_the_engine_cannot_do_is_refused_naming_the_argument(engine, method, args, kwargs, match):
    _, handle = engine
    with pytest.raises(ValueError, match=match):
        ray_get(getattr(handle, method).remote(*args, **kwargs))


def test_weights_before_the_group_and_cuda_ipc_are_refused_with_the_fix(engine):
    _, handle = engine
    with pytest.raises(RuntimeError, match="before init_process_group"):
        ray_get(handle.update_weight.remote("lm_head.weight", dtype=torch.float32, shape=(2, 2), empty_cache=True))
    with pytest.raises(RuntimeError, match="sync_backend gloo"):
        ray_get(handle.update_weight_cuda_ipc.remote("lm_head.weight", torch.float32, (2, 2), {}))


def test_the_engine_answers_every_method_openrlhfs_actor_defines():
    """The public methods of OpenRLHF's RolloutRayActor (vllm_engine.py, 0.11) with their parameter names."""
    theirs = {"init_process_group": ["master_address", "master_port", "rank_offset", "world_size", "group_name",
                                     "backend", "use_ray"],
              "update_weight": ["name", "dtype", "shape", "empty_cache"],
              "update_weight_cuda_ipc": ["name", "dtype", "shape", "ipc_handles", "empty_cache"],
              "reset_prefix_cache": [], "pause_generation": [], "resume_generation": [], "sleep": ["level"],
              "wake_up": ["tags"], "generate": ["prompt_token_ids", "sampling_params", "multi_modal_data"],
              "get_num_unfinished_requests": [],
              "generate_responses": ["prompt", "label", "sampling_params", "max_length", "hf_tokenizer", "num_samples",
                                     "images"]}
    for name, parameters in theirs.items():
        assert list(inspect.signature(getattr(OpenRLHFEngine, name)).parameters)[1:] == parameters, name


def test_a_fleet_or_a_stray_config_is_refused(tiny_path):
    with pytest.raises(ValueError, match="rollouts='object' is invalid"):
        OpenRLHFEngine(object(), executor=SingleTurnExecutor())
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        with pytest.raises(ValueError, match="config=.*is invalid"):
            OpenRLHFEngine(worker, config=WorkerConfig(), executor=SingleTurnExecutor())
