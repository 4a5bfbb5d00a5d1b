"""RolloutFleet: the pure pieces without Ray (dispatch, buckets, the actor class in-process), then one module-scoped
fleet of 2 CPU actors on a real local Ray: order and exactness against a plain forward, caller-side rejection,
object-store and gloo broadcasts, an actor killed mid-generate, a hung actor and its timeout."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
import torch
from conftest import reference_logprobs

import rollout
from rollout import RolloutWorker, SamplingParams, Speculation, WorkerConfig
from rollout.fleet.actor import FleetActor, from_shared, model_source, to_shared
from rollout.fleet.collective import WeightGroup, free_port, layout, pack, unpack
from rollout.fleet.dispatch import Dispatcher
from rollout.fleet.homes import Homes
from rollout.model.weights import fingerprint
from rollout.testing import load_tiny_model

ray = pytest.importorskip("ray")

CONFIG = WorkerConfig(page_size=16, num_blocks=256)
TOL = 1e-4


def prompt_of(length: int, seed: int) -> list[int]:
    return torch.randint(10, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t + 0.3 * torch.randn(t.shape, generator=gen) * t.std() for name, t in model.state_dict().items()}


def assert_exact(model, batch, prompts, params) -> None:
    """Rows prompt-major, each sample once, prompt ids echoed, logprobs equal to a plain forward."""
    expected = [(i, j) for i, p in enumerate(params) for j in range(p.n)]
    assert list(zip(batch.prompt_index.tolist(), batch.sample_index.tolist())) == expected
    for r, completion in enumerate(batch.completion_token_lists()):
        i = int(batch.prompt_index[r])
        assert batch.prompt_ids[r] == prompts[i]
        p = params[i]
        full, truncated = reference_logprobs(model, prompts[i], completion, p.temperature, p.top_k, p.top_p)
        assert torch.allclose(batch.logprobs[r, : len(completion)], full, atol=TOL)
        assert torch.allclose(batch.sampling_logprobs[r, : len(completion)], truncated, atol=TOL)


# ---------------------------------------------------------------------- dispatch (no Ray)
def test_dispatch_deals_chunks_by_token_load_and_free_actors_pull_the_heaviest():
    plan = Dispatcher([90, 10, 10, 10, 10, 10, 40], slots=[0, 1], chunks_per_worker=2)
    assert [(c.jobs, c.cost) for c in plan.pending] == [((0,), 90), ((6,), 40), ((1, 3, 5), 30), ((2, 4), 20)]
    assert [(slot, c.cost) for slot, c in plan.assign([0, 1])] == [(0, 90), (1, 40)]
    assert plan.assign([0, 1]) == []  # one chunk in flight per actor: the rest wait for whoever frees up first
    plan.complete(1, plan.running[1][0])
    assert [(slot, c.cost) for slot, c in plan.assign([0, 1])] == [(1, 30)]  # the faster actor takes more
    assert plan.load(0) == 90 and plan.load(1) == 30


def test_dispatch_with_queued_chunks_prefers_the_least_loaded_actor_not_the_next_in_turn():
    plan = Dispatcher([90, 10, 10, 10, 10, 10, 40], slots=[0, 1], chunks_per_worker=2, max_in_flight=2)
    assert [(slot, c.cost) for slot, c in plan.assign([0, 1])] == [(0, 90), (1, 40), (1, 30), (0, 20)]
    assert plan.load(0) == 110 and plan.load(1) == 70  # round-robin: actor 0 would hold 120, actor 1 60


def test_dispatch_keeps_prompts_whole_and_hands_out_every_job_once():
    costs = [3 + 7 * (i % 5) for i in range(40)]
    plan = Dispatcher(costs, slots=range(3), chunks_per_worker=4)
    seen = []
    while not plan.finished:
        for slot, chunk in plan.assign(range(3)):
            seen.extend(chunk.jobs)
            plan.complete(slot, chunk)
    assert sorted(seen) == list(range(40))


def test_dispatch_requeues_only_the_jobs_a_dead_actor_had_not_streamed_back():
    plan = Dispatcher([5, 7, 9, 11], slots=[0, 1])
    (_, first), (_, second) = plan.assign([0, 1])
    assert plan.fail(0, done={first.jobs[0]}) == []
    assert [c.jobs for c in plan.pending] == [first.jobs[1:]] and plan.pending[0].cost == sum(
        [5, 7, 9, 11][j] for j in first.jobs[1:])
    assert plan.fail(1, done=set(second.jobs)) == [] and len(plan.pending) == 1  # nothing left of it: not requeued


def test_dispatch_requeues_a_dead_actors_jobs_and_gives_up_on_a_poison_prompt():
    plan = Dispatcher([5, 5, 5, 5], slots=[0, 1], max_attempts=2)
    plan.assign([0, 1])
    lost = plan.outstanding()[1]
    assert plan.fail(1) == [] and [j for c in plan.pending for j in c.jobs] == lost
    plan.complete(0, plan.running[0][0])
    assert [c.jobs for _, c in plan.assign([0])] == [tuple(lost)]  # only the survivor takes work
    assert plan.fail(0) == lost  # the jobs of the second death are given up (2 attempts)


def test_dispatch_sends_each_prompt_home_within_the_slack_and_a_free_actor_steals_only_when_idle():
    costs = [10] * 8
    homes = [0, 0, 0, 0, 0, 0, 1, None]  # six prompts at home on actor 0: more than its share of the load
    plan = Dispatcher(costs, slots=[0, 1], homes=homes)
    by_home = {c.home: c.jobs for c in plan.pending}
    assert by_home[0] == (0, 1, 2, 3, 4) and set(by_home[1]) == {5, 6, 7}  # 5 x 10 <= 40 x 1.25; the sixth moves
    assert sorted((slot, c.home) for slot, c in plan.assign([1, 0])) == [(0, 0), (1, 1)]
    plan = Dispatcher(costs, slots=[0, 1], homes=homes)
    assert [(slot, c.home) for slot, c in plan.assign([1])] == [(1, 1)]  # actor 0 busy elsewhere: 1 takes its own
    plan.complete(1, plan.running[1][0])
    assert [(slot, c.home) for slot, c in plan.assign([1])] == [(1, 0)]  # then steals rather than idle
    assert plan.fail(1) == [] and plan.pending[0].home == 0  # a requeued chunk keeps its home


def test_dispatch_without_known_homes_deals_as_before():
    costs = [90, 10, 10, 10, 10, 10, 40]
    plain = Dispatcher(costs, slots=[0, 1], chunks_per_worker=2)
    homed = Dispatcher(costs, slots=[0, 1], chunks_per_worker=2, homes=[None, 5, None, None, None, None, None])
    assert list(plain.pending) == list(homed.pending)


def test_homes_remember_the_last_actor_bounded_and_forget_a_replaced_one():
    homes = Homes(WorkerConfig(speculation=Speculation(drafts=("history",))), capacity=2)
    homes.ran([1, 2], 0)
    homes.ran([3], 1)
    homes.ran([1, 2], 1)  # ran again elsewhere: that actor now holds it
    homes.ran([4], 0)  # over capacity: the least recent ([3]) goes
    assert homes.of([[1, 2], [3], [4], [5]]) == [1, None, 0, None]
    homes.forget(0)
    assert homes.of([[4]]) == [None]
    assert Homes(WorkerConfig()).of([[1, 2]]) is None  # no history kept: no routing
    assert Homes(WorkerConfig(speculation=Speculation(drafts=("context",)))).of([[1]]) is None


# ---------------------------------------------------------------------- buckets and the gloo group (no Ray)
def _mixed_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).to(torch.bfloat16),
            "c": torch.arange(6).view(2, 3), "d": torch.randn(40, 40, generator=gen),
            "e": torch.randn(2, generator=gen)}



def test_a_call_still_queued_at_its_deadline_times_out_then_and_never_runs():
    """Found by the chaos soak (seed 3, 30 minutes: a TimeoutError 22 s late): a fleet call waits for one of MAX_CALLS
    threads, which calls blocked behind an update may all hold; its deadline passed in that queue unseen."""
    from concurrent.futures import ThreadPoolExecutor

    from rollout.fleet.future import CallCancel, FleetFuture, Groups

    pool, release, ran = ThreadPoolExecutor(1), threading.Event(), []
    busy = pool.submit(release.wait, 30)  # the only thread, held
    queued = pool.submit(ran.append, "ran")
    start = time.monotonic()
    future = FleetFuture(queued, CallCancel(lambda refs, timeout: []), Groups(1), start + 0.2, 0.2)
    with pytest.raises(TimeoutError, match=r"after 0.2s while queued .* never started"):
        future.result()
    assert 0.2 <= time.monotonic() - start < 1.0 and future.done() and future.cancelled()
    release.set()
    busy.result(timeout=30)
    pool.shutdown(wait=True)
    assert ran == []
    with ThreadPoolExecutor(1) as other:  # a call that finishes in time returns its result
        finished = other.submit(lambda: "rows")
        assert FleetFuture(finished, CallCancel(lambda refs, timeout: []), Groups(1), time.monotonic() + 5,
                           5).result() == "rows"

def test_buckets_round_trip_mixed_dtypes_and_respect_the_size_limit():
    tensors = _mixed_tensors()
    buckets = layout(list(tensors.items()), bucket_mb=1000 / 2**20)  # ~1000 bytes: forces several buckets
    assert len(buckets) >= 3 and all(len({tensors[e.name].dtype for e in b.entries}) == 1 for b in buckets)
    out = {}
    for bucket in buckets:
        out.update(unpack(bucket, pack(bucket, tensors, "cpu")))
    assert set(out) == set(tensors) and all(torch.equal(out[k], v) for k, v in tensors.items())


def test_shared_form_round_trips_every_dtype_without_copying():
    tensors = _mixed_tensors() | {"f8": torch.randn(4).to(torch.float8_e4m3fn), "m": torch.tensor([True, False])}
    shared = to_shared(tensors.items())
    back = from_shared(shared)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in tensors.items())
    assert back["a"].data_ptr() == tensors["a"].data_ptr()  # views all the way: Ray then copies once, into plasma


def test_gloo_group_broadcasts_every_bucket_to_every_rank():
    tensors, port, got = _mixed_tensors(), free_port(), {}
    buckets = layout(list(tensors.items()), bucket_mb=1000 / 2**20)

    staged = []  # (dtype, address) of every bucket rank 2 was handed

    def streamed(group) -> dict:
        out = {}
        for bucket in group.stream(buckets):
            staged.append({(t.dtype, t.untyped_storage().data_ptr()) for t in bucket.values()})
            out.update({k: t.clone() for k, t in bucket.items()})  # consumed before the next one lands
        return out

    def rank(r: int) -> None:
        group = WeightGroup("gloo", "127.0.0.1", port, r, 3, timeout_s=60)
        got[r] = group.send(buckets, tensors) if r == 0 else group.receive(buckets) if r == 1 else streamed(group)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert all(torch.equal(got[r][k], v) for r in (1, 2) for k, v in tensors.items())
    # streamed: one staging buffer per dtype, reused by every bucket of that dtype
    assert len(staged) == len(buckets) and len(set().union(*staged)) == len({b.dtype for b in buckets})


# ---------------------------------------------------------------------- the actor class, in-process
def test_actor_rebuilds_an_in_memory_model_with_identical_weights(tiny):
    model, tok = tiny
    for given in (model, (model.config, model.state_dict())):
        source, _, _ = model_source(given, tok)
        actor = FleetActor(source, CONFIG, tok)
        try:
            assert actor.state() == (0, fingerprint(model))
            streamed = dict(actor.generate([[5, 6, 7], [8, 9]], [SamplingParams(n=2, max_new_tokens=4)] * 2))
            rows, metrics = [streamed[0], streamed[1]], streamed[-1]  # one item per prompt, then the metrics
            assert [[(r.prompt_index, r.sample_index) for r in g] for g in rows] == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
            assert metrics.generated_tokens == sum(len(r.completion_ids) for g in rows for r in g)
        finally:
            actor.close()


def test_bad_fleet_arguments_fail_before_ray_starts(tiny_path):
    from rollout import RolloutFleet
    from rollout.fleet.resources import FleetResources

    for kwargs, field in [({"num_workers": 0}, "num_workers"), ({"chunks_per_worker": 0}, "chunks_per_worker"),
                          ({"resources": {"placement": "pack"}}, "placement"), ({"resources": {"num_gpus": -1}},
                                                                                 "num_gpus"),
                          ({"verify_every": 0}, "verify_every=0 is invalid")]:
        with pytest.raises(ValueError, match=field):
            RolloutFleet(tiny_path, **kwargs)
    with pytest.raises(ValueError, match="not a model object"):
        RolloutFleet("/nonexistent/checkpoint")
    assert not ray.is_initialized()
    assert FleetResources(num_gpus=1).bundle(16, 4) == {"CPU": 1, "GPU": 1}
    assert FleetResources().cpus(2, 2) == 0.5 and FleetResources().strategy() is None


def test_an_invalid_argument_raised_in_an_actor_keeps_its_type_and_attributes_through_rays_wrapper():
    from rollout import InvalidArgument
    from rollout.base.errors import invalid

    cause = invalid("prompt", "token id 600", "ids must be in [0, 512)", "tokenize it", "prompt 2", 2)
    relayed = ray.exceptions.RayTaskError("FleetActor.generate", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(relayed, InvalidArgument) and not str(relayed).startswith("prompt 2: ")
    assert (relayed.field, relayed.index, relayed.detail) == ("prompt", 2, cause.detail)


# ---------------------------------------------------------------------- a real fleet
@pytest.fixture(scope="module")
def fleet(tiny_path):
    from rollout import RolloutFleet

    fleet = RolloutFleet(tiny_path, num_workers=2, config=CONFIG, resources={"placement": "SPREAD"})
    yield fleet
    fleet.close()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def local(tiny_path):
    """The caller's copy of the weights the fleet should hold."""
    return load_tiny_model(tiny_path)[0]


def _stats(fleet) -> list[dict]:
    return ray.get([a.info.options(concurrency_group="control").remote() for a in fleet.actors])


def test_a_worker_and_a_fleet_keep_one_contract_and_their_servers_stop_on_the_same_ids(fleet, tiny_path, tmp_path):
    """The same checkpoint behind a RolloutWorker and a RolloutFleet reports the same Rollouts properties, and a server
    over either stops on the generation config's EOS list (here two ids, the second one a token greedy decoding
    writes): the fleet's server once stopped on the tokenizer's EOS only and ran past it."""
    import json
    import shutil
    import urllib.request

    import openai

    from rollout import RolloutFleet, Rollouts

    path = tmp_path / "two_eos"
    shutil.copytree(tiny_path, path)
    prompt = prompt_of(9, 3)
    with RolloutWorker(str(path), CONFIG) as worker:
        free = worker.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
        eos = worker.default_stop_ids
    stop = free.completion_token_lists()[0][3]  # greedy's 4th token: a second EOS id, not the tokenizer's
    assert stop not in free.completion_token_lists()[0][:3] and stop not in eos
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [*eos, stop]
    (path / "generation_config.json").write_text(json.dumps(config))
    with RolloutWorker(str(path), CONFIG) as worker, RolloutFleet(str(path), num_workers=1, config=CONFIG) as other:
        assert isinstance(worker, Rollouts) and isinstance(other, Rollouts)
        for name in ("vocab_size", "max_context", "max_request_tokens", "default_stop_ids", "model_name"):
            assert getattr(worker, name) == getattr(other, name), name
        assert worker.default_stop_ids == (*eos, stop) and worker.model_name == "two_eos"
        assert worker.supports_streaming and not other.supports_streaming
        answers = []
        for rollouts in (worker, other):
            with rollout.serve(rollouts, port=0) as server:
                client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=300)
                models = json.loads(urllib.request.urlopen(server.url + "/models", timeout=30).read())
                assert [m["id"] for m in models["data"]] == ["two_eos"]
                r = client.completions.create(model="two_eos", prompt=prompt, max_tokens=8, temperature=0)
                answers.append((r.choices[0].finish_reason, r.choices[0].model_extra["token_ids"]))
        assert answers[0] == answers[1] == ("stop", free.completion_token_lists()[0][:4])


def test_rows_come_back_in_input_order_and_equal_a_plain_forward(fleet, local):
    from rollout import Rollouts

    assert isinstance(fleet, Rollouts)  # what trainers type against, as a RolloutWorker is
    prompts = [prompt_of(n, seed) for seed, n in enumerate([3, 17, 5, 40, 9, 1, 28, 12])]
    params = [SamplingParams(n=1 + i % 3, temperature=[1.0, 0.0, 0.7][i % 3], top_k=[0, 0, 20][i % 3],
                             max_new_tokens=8 + 4 * i, top_logprobs=[0, 3, 5][i % 3]) for i in range(len(prompts))]
    before = [s["num_rows"] for s in _stats(fleet)]
    batch = fleet.generate(prompts, params)
    assert_exact(local, batch, prompts, params)
    for r, completion in enumerate(batch.completion_token_lists()):  # top lists travel with the actors' rows
        p, n = params[int(batch.prompt_index[r])], len(completion)
        with torch.no_grad():
            logits = local(torch.tensor([batch.prompt_ids[r] + completion])).logits[0, -n - 1: -1]
        expected = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1).topk(max(p.top_logprobs, 1))
        assert (batch.top_ids[r, :n, p.top_logprobs:] == -1).all()
        assert torch.allclose(batch.top_logprobs[r, :n, :p.top_logprobs], expected.values[:, :p.top_logprobs],
                              atol=TOL)
    assert batch.policy_version.tolist() == [0] * len(batch)
    assert all(s["num_rows"] > b for s, b in zip(_stats(fleet), before))  # both actors worked
    assert fleet.generate([]).prompt_ids == []
    text = fleet.generate(["the cat is", [{"role": "user", "content": "two plus two"}]],
                          SamplingParams(temperature=0.0, max_new_tokens=3), chat_template=True)
    tok = fleet.tokenizer
    assert text.prompt_ids[0] == tok.apply_chat_template([{"role": "user", "content": "the cat is"}],
                                                         add_generation_prompt=True, tokenize=True)["input_ids"]
    assert text.completion_texts() and len(text) == 2  # the caller's tokenizer decodes the batch


def test_bad_requests_fail_like_the_worker_before_any_actor_is_touched(fleet, tiny_path):
    calls = [s["num_calls"] for s in _stats(fleet)]
    bad = [([[1, 2, 3], [4, 600]], None), ([[]], None), ([[1, 2]], SamplingParams(max_new_tokens=2000)),
           ([[1], [2]], [SamplingParams()]), ("not a list", None)]
    with RolloutWorker(tiny_path, CONFIG) as worker:
        for prompts, sampling in bad:
            with pytest.raises(ValueError) as expected:
                worker.generate(prompts, sampling)
            with pytest.raises(ValueError) as got:
                fleet.generate(prompts, sampling)
            assert str(got.value) == str(expected.value)
    assert [s["num_calls"] for s in _stats(fleet)] == calls


def test_a_bad_update_is_rejected_and_changes_nothing(fleet, local):
    version, print_before = fleet.policy_version, fleet.weights_fingerprint()
    good = perturbed(local, seed=1)
    name = "model.layers.0.mlp.up_proj.weight"
    nan = dict(good, **{name: good[name].clone().index_fill_(0, torch.tensor([0]), float("nan"))})
    cases = [(dict(good, **{"model.nope.weight": good[name]}), {}), (dict(good, **{name: good[name][:-1]}), {}),
             (nan, {}), ({name: good[name]}, {"full": True}), (good, {"version": -1})]
    with RolloutWorker(copy.deepcopy(local), CONFIG) as worker:
        for weights, kwargs in cases:
            with pytest.raises(ValueError) as expected:
                worker.update_weights(weights, **kwargs)
            with pytest.raises(ValueError) as got:
                fleet.update_weights(weights, **kwargs)
            assert str(got.value) == str(expected.value)
    assert fleet.policy_version == version and fleet.weights_fingerprint() == print_before
    assert {s["version"] for s in _stats(fleet)} == {version}


def test_broadcast_then_generate_uses_only_the_new_weights(fleet, local):
    weights = perturbed(local, seed=2)
    local.load_state_dict(weights)
    assert fleet.update_weights(weights, version=7) == 7
    assert fleet.policy_version == 7 and fleet.weights_fingerprint() == fingerprint(local)
    prompts = [prompt_of(6 + i, 20 + i) for i in range(6)]
    params = [SamplingParams(n=2, max_new_tokens=12)] * len(prompts)
    batch = fleet.generate(prompts, params)
    assert batch.policy_version.tolist() == [7] * len(batch)
    assert_exact(local, batch, prompts, params)


def test_fingerprints_are_compared_on_every_kth_update_and_on_request(fleet, local):
    fleet.verify_every = 2
    try:
        before = [s["num_fingerprints"] for s in _stats(fleet)]
        for seed in (3, 4):
            weights = perturbed(local, seed=seed)
            local.load_state_dict(weights)
            fleet.update_weights(weights, version=7)  # the version later tests expect
        assert [s["num_fingerprints"] - b for s, b in zip(_stats(fleet), before)] == [1, 1]
        assert fleet.weights_fingerprint() == fingerprint(local)
        assert [s["num_fingerprints"] - b for s, b in zip(_stats(fleet), before)] == [2, 2]
    finally:
        fleet.verify_every = 1


def test_sleep_frees_every_actor_and_generate_wakes_them_on_current_weights(fleet, local):
    fleet.sleep()
    assert [s["sleeping"] for s in _stats(fleet)] == [True, True]
    prompts = [prompt_of(5 + i, 60 + i) for i in range(4)]
    params = [SamplingParams(n=2, max_new_tokens=6)] * len(prompts)
    batch = fleet.generate(prompts, params)
    assert batch.policy_version.tolist() == [fleet.policy_version] * len(batch)
    assert_exact(local, batch, prompts, params)
    fleet.sleep()
    fleet.wake()
    assert [s["sleeping"] for s in _stats(fleet)] == [False, False]


def test_score_splits_pairs_across_actors_in_input_order(fleet, local):
    pytest.importorskip("rollout.scoring")
    prompts = [prompt_of(4 + 3 * i, 40 + i) for i in range(6)]
    completions = [prompt_of(2 + i, 50 + i) for i in range(6)]
    scores = fleet.score(prompts, completions, temperature=0.8)
    for prompt, completion, got in zip(prompts, completions, scores):
        assert torch.allclose(got, reference_logprobs(local, prompt, completion, 0.8)[0], atol=TOL)
    same, top = fleet.score(prompts, completions, temperature=0.8, top_k=2)  # alternatives travel with their pair
    _, expected = rollout.score(local, prompts, completions, temperature=0.8, top_k=2)
    assert all(torch.equal(a, b) for a, b in zip(same, scores))
    for (ids, values, ranks), (ids0, values0, ranks0) in zip(top, expected):
        assert torch.equal(ids, ids0) and torch.equal(ranks, ranks0) and torch.allclose(values, values0, atol=TOL)
    with pytest.raises(ValueError, match="LlamaForCausalLM: it has no mixture-of-experts router"):
        fleet.score(prompts, completions, return_routing=True)  # refused before any pair is scored


def test_a_bad_pair_is_refused_on_the_callers_side_with_its_own_index(fleet, local):
    pytest.importorskip("rollout.scoring")
    from rollout import InvalidArgument
    from rollout.scoring import score

    calls = [s["num_calls"] for s in _stats(fleet)]
    prompts = [prompt_of(3 + i, 70 + i) for i in range(6)]
    completions = [prompt_of(2, 80 + i) for i in range(6)]
    completions[4] = [7, 600]  # outside the vocabulary; on an actor it would be pair 0, 1 or 2 of its chunk
    with pytest.raises(InvalidArgument) as expected:
        score(local, prompts, completions)
    with pytest.raises(InvalidArgument) as got:
        fleet.score(prompts, completions)
    assert type(got.value) is InvalidArgument and str(got.value) == str(expected.value)
    assert (got.value.field, got.value.index) == ("completion", 4)
    assert [s["num_calls"] for s in _stats(fleet)] == calls  # no actor was touched


def test_episodes_run_on_the_actors_with_the_calls_own_prompt_indices(fleet, local):
    from rollout import Turn

    class Counter:  # defined here so that Ray pickles it by value to the actors
        def __init__(self, prompt_index, sample_index):
            self.prompt_index, self.turns = prompt_index, 0

        def step(self, completion_ids):
            self.turns += 1
            obs = [10 + self.prompt_index, 11, 12 + self.turns]
            return Turn(obs, reward=float(self.prompt_index), done=self.turns == 1 + self.prompt_index % 3)

    prompts = [prompt_of(n, seed) for seed, n in enumerate([6, 20, 3, 33, 11, 8])]
    params = SamplingParams(n=2, max_new_tokens=5, ignore_eos=True)
    batch = fleet.generate(prompts, params, env=Counter, max_turns=4)
    assert batch.prompt_index.tolist() == [i for i in range(6) for _ in range(2)]
    assert batch.num_turns.tolist() == [1 + i % 3 for i in range(6) for _ in range(2)]
    assert batch.rewards.tolist() == [float(i * (1 + i % 3)) for i in range(6) for _ in range(2)]
    assert batch.finish_reason == ["done"] * 12 and batch.stats["reused_tokens"] > 0
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        full, _ = reference_logprobs(local, prompts[int(batch.prompt_index[r])], batch.completion_ids[r, :n].tolist())
        action = batch.action_mask[r, :n]
        assert torch.allclose(batch.logprobs[r, :n][action], full[action], atol=TOL)
        assert int((~action).sum()) == 3 * (int(batch.num_turns[r]) - 1)
    with pytest.raises(ValueError, match="max_turns"):
        fleet.generate(prompts, params, env=Counter, max_turns=0)


def test_segment_rows_come_back_from_the_actors_with_their_own_prompts(fleet, local):
    from rollout import Turn

    class Rewrite:  # defined here so that Ray pickles it by value to the actors
        def __init__(self, prompt_index, sample_index):
            self.prompt_index, self.turns = prompt_index, 0

        def step(self, completion_ids):
            self.turns += 1
            if self.turns == 1:
                return Turn(context_ids=[10 + self.prompt_index, 11, 12] + completion_ids[-2:], reward=1.0)
            return Turn(reward=2.0, done=True)

    prompts = [prompt_of(n, seed) for seed, n in enumerate([6, 20, 3, 33])]
    batch = fleet.generate(prompts, SamplingParams(n=2, max_new_tokens=5, ignore_eos=True), env=Rewrite, max_turns=3)
    assert batch.prompt_index.tolist() == [i for i in range(4) for _ in range(4)]
    assert batch.segment_index.tolist() == [0, 1] * 8 and batch.episode_index.tolist() == [e for e in range(8)
                                                                                             for _ in range(2)]
    assert batch.rewards.tolist() == [3.0] * 16 and batch.finish_reason == ["done"] * 16
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        ids = batch.completion_ids[r, :n].tolist()
        if batch.segment_index[r] == 0:
            assert batch.prompt_ids[r] == prompts[int(batch.prompt_index[r])]
        else:
            previous_turn = batch.completion_ids[r - 1, 3:5].tolist()  # the first segment's last two tokens
            assert batch.prompt_ids[r] == [10 + int(batch.prompt_index[r]), 11, 12] + previous_turn
        full, _ = reference_logprobs(local, batch.prompt_ids[r], ids)
        assert torch.allclose(batch.logprobs[r, :n], full, atol=TOL)


def test_a_slot_whose_replacements_keep_failing_to_start_waits_down_and_the_next_call_brings_it_back(
        fleet, local, caplog, monkeypatch):
    """Found by the chaos soak (seed 2): three replacements of one slot killed while starting made the fleet raise
    into the call that was waiting and never start that slot again. Now the call runs on the other actor, the slot
    stays down (logged), and the next call starts it again."""
    caplog.set_level(logging.WARNING, logger="rollout")
    replace, killed = fleet._replace, []

    def replace_then_kill(slot: int, why: str = "") -> None:  # each replacement of slot 0 dies while it starts
        replace(slot, why)
        if slot == 0 and len(killed) < 3:
            killed.append(fleet._actors[0])
            ray.kill(fleet._actors[0], no_restart=True)

    monkeypatch.setattr(fleet, "_replace", replace_then_kill)
    ray.kill(fleet.actors[0], no_restart=True)
    prompts = [prompt_of(6 + i, 90 + i) for i in range(6)]
    params = [SamplingParams(n=2, max_new_tokens=12, ignore_eos=True)] * len(prompts)
    batch = fleet.generate(prompts, params)  # served by actor 1 while slot 0 fails to start
    assert_exact(local, batch, prompts, params)
    assert len(killed) == 3 and fleet._down == {0}
    assert any("failed to start 3 times in a row" in r.getMessage() for r in caplog.records if r.name == "rollout")
    batch = fleet.generate(prompts, params)  # the next call starts slot 0 again
    assert_exact(local, batch, prompts, params)
    assert fleet._down == set() and 0 in set(fleet._starting) | fleet._ready()
    fleet._await_starts()  # what the call after it would wait for
    assert fleet._ready() == {0, 1} and fleet.weights_fingerprint() == fingerprint(local)


def test_an_actor_killed_mid_generate_loses_no_row_and_comes_back_on_current_weights(fleet, local, caplog):
    caplog.set_level(logging.WARNING, logger="rollout")
    victim, killed = fleet.actors[0], threading.Event()
    before = fleet.metrics()

    def kill_when_busy() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed.is_set():
            if ray.get(victim.info.options(concurrency_group="control").remote())["busy"]:
                ray.kill(victim)
                killed.set()
            time.sleep(0.01)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    prompts = [prompt_of(8 + i, 60 + i) for i in range(12)]
    params = [SamplingParams(n=2, max_new_tokens=40, ignore_eos=True)] * len(prompts)
    batch = fleet.generate(prompts, params)
    killed.set()
    killer.join()
    assert fleet.actors[0] is not victim  # it died holding work, and was replaced
    replaced = [r for r in caplog.records if r.name == "rollout" and "replacing actor 0" in r.getMessage()]
    assert len(replaced) == 1 and "died" in replaced[0].getMessage()  # logged, with the fatal error
    assert batch.policy_version.tolist() == [7] * len(batch)
    assert_exact(local, batch, prompts, params)
    # the replacement replayed the retained update: it holds version 7 and the same weights before taking work
    assert fleet.weights_fingerprint() == fingerprint(local) and {s["version"] for s in _stats(fleet)} == {7}
    batch = fleet.generate(prompts[:6], params[:6])
    assert_exact(local, batch, prompts[:6], params[:6])
    assert _stats(fleet)[0]["num_rows"] > 0  # the replacement took work
    after = fleet.metrics()  # the dead actor's counts stay in the totals: nothing goes backwards
    assert after.actor_replacements == before.actor_replacements + 1
    assert after.total.generated_tokens >= before.total.generated_tokens + int(batch.completion_lengths.sum())
    assert all(after.total.rows_finished[k] >= v for k, v in before.total.rows_finished.items())


def test_gloo_group_broadcast_sends_nothing_through_the_object_store(fleet, local, monkeypatch):
    fleet.init_weight_group("gloo")
    monkeypatch.setattr(ray, "put", lambda *a, **k: pytest.fail("ray.put during a group update"))
    weights = perturbed(local, seed=3)
    local.load_state_dict(weights)
    assert fleet.update_weights(weights) == 8
    monkeypatch.undo()
    assert fleet.weights_fingerprint() == fingerprint(local)
    prompts = [prompt_of(5, 30), prompt_of(11, 31)]
    params = [SamplingParams(n=3, max_new_tokens=10)] * 2
    batch = fleet.generate(prompts, params)
    assert batch.policy_version.tolist() == [8] * 6
    assert_exact(local, batch, prompts, params)


def test_a_hung_actor_times_out_naming_it_and_its_replacement_rejoins_the_group(fleet, local, monkeypatch):
    stalled = fleet.actors[1]
    ray.get(stalled.__ray_call__.remote(lambda self: setattr(self.worker, "submit", lambda *a, **k: time.sleep(300))))
    prompts = [prompt_of(5, 70 + i) for i in range(6)]
    params = [SamplingParams(n=2, max_new_tokens=6)] * len(prompts)
    with pytest.raises(TimeoutError, match=r"timed out after 3s with \d+/12 rows done; actor 1 \(pid \d+") as exc:
        fleet.generate(prompts, params, timeout=3)
    assert "actor 0" not in str(exc.value) and fleet.actors[1] is not stalled
    # the last update came over the group (not retained): the replacement copies a live peer's weights
    assert fleet.weights_fingerprint() == fingerprint(local) and {s["version"] for s in _stats(fleet)} == {8}
    monkeypatch.setattr(ray, "put", lambda *a, **k: pytest.fail("ray.put during a group update"))
    weights = perturbed(local, seed=4)  # the group lost a member: this update rebuilds it first
    local.load_state_dict(weights)
    assert fleet.update_weights(weights, version=9) == 9
    monkeypatch.undo()
    before = [s["num_rows"] for s in _stats(fleet)]
    batch = fleet.generate(prompts, params)
    assert batch.policy_version.tolist() == [9] * len(batch)
    assert_exact(local, batch, prompts, params)
    assert all(s["num_rows"] > b for s, b in zip(_stats(fleet), before))


def submit_until_busy(fleet, prompts: list[list[int]], max_new_tokens: int):
    """Submit n=2 long samples per prompt; return the future once every actor is generating."""
    params = [SamplingParams(n=2, max_new_tokens=max_new_tokens, ignore_eos=True)] * len(prompts)
    future = fleet.submit(prompts, params)
    deadline = time.monotonic() + 60
    while not all(s["busy"] for s in _stats(fleet)) and time.monotonic() < deadline:
        time.sleep(0.01)
    return future


def test_an_update_lands_on_every_actor_while_a_submitted_call_is_in_flight(fleet, local):
    old = copy.deepcopy(local)
    prompts = [prompt_of(6 + 5 * i, 90 + i) for i in range(6)]
    future = submit_until_busy(fleet, prompts, max_new_tokens=300)
    time.sleep(0.2)  # tokens are being sampled on both actors
    weights = perturbed(local, seed=5)
    local.load_state_dict(weights)
    assert fleet.update_weights(weights, version=10, in_flight="recompute") == 10  # does not wait for the call
    assert not future.done()
    batch = future.result(timeout=300)
    assert fleet.weights_fingerprint() == fingerprint(local) and {s["version"] for s in _stats(fleet)} == {10}
    spans = [set(batch.token_versions[r, : int(batch.completion_lengths[r])].tolist()) for r in range(len(batch))]
    assert all(s == {9, 10} for s in spans), spans  # every row really spans the switch
    for r, completion in enumerate(batch.completion_token_lists()):
        i, n = int(batch.prompt_index[r]), len(completion)
        versions = batch.token_versions[r, :n]
        for model, version in ((old, 9), (local, 10)):
            full, _ = reference_logprobs(model, prompts[i], completion)
            at = versions == version
            assert torch.allclose(batch.logprobs[r, :n][at], full[at], atol=TOL)
    cancelled = submit_until_busy(fleet, prompts, max_new_tokens=300)
    assert cancelled.cancel() and cancelled.done()
    again = fleet.generate(prompts[:2], [SamplingParams(n=1, max_new_tokens=5)] * 2)
    assert_exact(local, again, prompts[:2], [SamplingParams(n=1, max_new_tokens=5)] * 2)


def test_an_actor_dying_while_an_update_lands_mid_call_loses_no_row_and_versions_stay_true(fleet, local):
    old = copy.deepcopy(local)
    victim = fleet.actors[0]
    prompts = [prompt_of(5 + 3 * i, 120 + i) for i in range(6)]
    future = submit_until_busy(fleet, prompts, max_new_tokens=200)
    ray.kill(victim)
    weights = perturbed(local, seed=6)
    local.load_state_dict(weights)
    fleet.update_weights(weights, version=11, in_flight="recompute")
    batch = future.result(timeout=300)
    assert fleet.weights_fingerprint() == fingerprint(local)  # every actor, the replacement too, holds version 11
    assert fleet.actors[0] is not victim and {s["version"] for s in _stats(fleet)} == {11}
    assert sorted(zip(batch.prompt_index.tolist(), batch.sample_index.tolist())) == [(i, j) for i in range(6)
                                                                                     for j in range(2)]
    versions = set()
    for r, completion in enumerate(batch.completion_token_lists()):
        i, n = int(batch.prompt_index[r]), len(completion)
        row_versions = batch.token_versions[r, :n]
        versions |= set(row_versions.tolist())
        assert set(row_versions.tolist()) <= {10, 11}
        for model, version in ((old, 10), (local, 11)):  # every token exact under the weights that produced it
            full, _ = reference_logprobs(model, prompts[i], completion)
            at = row_versions == version
            assert torch.allclose(batch.logprobs[r, :n][at], full[at], atol=TOL)
    assert 11 in versions  # the replacement's re-run rows (and the survivor's tail) came from the new weights


def test_a_timeout_fires_on_time_while_an_update_waits_for_a_replacement_actor_to_start(fleet, local):
    """Found by the chaos soak (TimeoutErrors up to 56 s late): an update that finds a dead actor waits, holding the
    fleet's lock, for its replacement to start; a timed call waited for that lock before it looked at its deadline.
    Now it waits for the lock until its deadline only, raises, and its actors are replaced by the next call."""
    victim = fleet.actors[0]
    ray.kill(victim, no_restart=True)
    weights = perturbed(local, seed=7)
    local.load_state_dict(weights)
    updater = threading.Thread(target=fleet.update_weights, args=(weights,), kwargs=dict(version=12))
    updater.start()
    deadline = time.monotonic() + 60
    while not fleet._starting and time.monotonic() < deadline:  # the update found it dead and waits for its successor
        time.sleep(0.005)
    prompts = [prompt_of(5, 400 + i) for i in range(4)]
    params = [SamplingParams(n=2, max_new_tokens=8)] * len(prompts)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 0.3s \(the fleet was busy.*\) with 0/8 rows done"):
        fleet.generate(prompts, params, timeout=0.3)
    late = time.monotonic() - start - 0.3
    assert late < 1.0, f"the TimeoutError came {late:.2f} s late"  # POLL_S and one round of bookkeeping, at most
    assert updater.is_alive() and fleet._starting, "the replacement started before the timeout: nothing was tested"
    updater.join()
    assert fleet.actors[0] is not victim and fleet.weights_fingerprint() == fingerprint(local)
    batch = fleet.generate(prompts, params, timeout=300)
    assert batch.policy_version.tolist() == [12] * len(batch)
    assert_exact(local, batch, prompts, params)


def test_groups_stream_back_as_each_finishes_and_calls_run_side_by_side(fleet, local):
    prompts = [prompt_of(4 + i, 150 + i) for i in range(6)]
    budgets = [150, 4, 150, 9, 150, 14]
    params = [SamplingParams(n=2, max_new_tokens=b, ignore_eos=True) for b in budgets]
    future = fleet.submit(prompts, params)
    short = fleet.generate(prompts[:1], [SamplingParams(max_new_tokens=3)])  # a second call, beside the first
    assert len(short) == 1 and not future.done()
    order = []
    for group in future.as_completed(timeout=300):
        i = int(group.prompt_index[0])
        order.append(i)
        assert group.prompt_index.tolist() == [i, i] and group.sample_index.tolist() == [0, 1]
        assert (group.completion_lengths == budgets[i]).all() and group.prompt_ids[0] == prompts[i]
        for r, completion in enumerate(group.completion_token_lists()):
            full, _ = reference_logprobs(local, prompts[i], completion)
            assert torch.allclose(group.logprobs[r, : len(completion)], full, atol=TOL)
    assert sorted(order) == list(range(6)) and set(order[:3]) == {1, 3, 5}  # the short ones first
    assert future.result().prompt_index.tolist() == [i for i in range(6) for _ in range(2)]


def test_a_cancelled_fleet_call_counts_the_tokens_its_actors_threw_away_and_runs_done_callbacks(fleet):
    """FleetFuture keeps RolloutsFuture: add_done_callback(fn) gets the future once it is over (at once after), and
    discarded_tokens is what the actors' workers had sampled for the groups the cancel dropped (0 before)."""
    from rollout import RolloutsFuture

    prompts = [prompt_of(5 + i, 300 + i) for i in range(4)]
    before = fleet.metrics().total.sampled_tokens
    future = fleet.submit(prompts, SamplingParams(n=2, max_new_tokens=600, ignore_eos=True))
    assert isinstance(future, RolloutsFuture)
    seen = []
    future.add_done_callback(seen.append)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and fleet.metrics().total.sampled_tokens - before < 40:
        time.sleep(0.2)
    assert future.discarded_tokens == 0 and seen == []
    assert future.cancel() and future.cancelled()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.05)
    assert seen == [future]
    assert 20 <= future.discarded_tokens <= len(prompts) * 2 * 600  # what ran before the cancel, no more
    late = []
    future.add_done_callback(late.append)
    assert late == [future]


def test_the_collector_filters_and_carries_groups_on_the_fleet_exactly(fleet, local):
    from rollout import RolloutCollector, nonzero_std

    old = copy.deepcopy(local)
    prompts = [prompt_of(3 + i % 7, 200 + i) for i in range(120)]  # ~1 in 4 groups is accepted: room to spare
    params = SamplingParams(n=2, max_new_tokens=60, stop_token_ids=list(range(10, 15)))

    def reward(group):  # zero variance for even first tokens
        return torch.zeros(2) if group.prompt_ids[0][0] % 2 == 0 else (group.completion_lengths % 2).float()

    with RolloutCollector(fleet, prompts, params, reward_fn=reward, accept=nonzero_std, over_sample=2.0,
                          partial=True, max_staleness=1) as collector:
        first = collector.next_batch(3)
        weights = perturbed(local, seed=7)
        local.load_state_dict(weights)
        version = fleet.update_weights(weights, in_flight="recompute")
        second = collector.next_batch(3)
    assert first.stats["accepted_groups"] == second.stats["accepted_groups"] == 3
    models = {version - 1: old, version: local}
    for batch in (first, second):
        assert (batch.rewards.view(3, 2).std(dim=1) > 0).all()
        for r, completion in enumerate(batch.completion_token_lists()):
            prompt = prompts[int(batch.prompt_index[r])]
            assert batch.prompt_ids[r] == prompt
            versions = batch.token_versions[r, : len(completion)]
            for v in versions.unique().tolist():
                full, _ = reference_logprobs(models[v], prompt, completion)
                assert torch.allclose(batch.logprobs[r, : len(completion)][versions == v], full[versions == v],
                                      atol=TOL)
    assert set(second.stats["staleness_hist"]) <= {0, 1}
    deadline = time.monotonic() + 30
    while any(s["busy"] for s in _stats(fleet)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(s["busy"] for s in _stats(fleet))  # closed: nothing of the collector's runs on the actors


def test_fleet_metrics_total_every_actor_and_its_endpoint_serves_them(fleet, local):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    before = fleet.metrics()
    assert before.actors_ready == 2 and sorted(before.actors) == [0, 1]
    prompts = [prompt_of(5 + 4 * i, 200 + i) for i in range(8)]
    params = [SamplingParams(n=2, max_new_tokens=5 + i, ignore_eos=True) for i in range(8)]
    batch = fleet.generate(prompts, params)
    after = fleet.metrics()
    tokens = int(batch.completion_lengths.sum())
    assert after.total.generated_tokens - before.total.generated_tokens == tokens
    assert after.total.rows_finished["length"] - before.total.rows_finished.get("length", 0) == 16
    assert sum(m.generated_tokens - before.actors[slot].generated_tokens for slot, m in after.actors.items()) == tokens
    assert all(m.generated_tokens > before.actors[slot].generated_tokens for slot, m in after.actors.items())
    assert after.dispatch_imbalance >= 1.0 and after.total.kv_pages_total == 2 * CONFIG.num_blocks
    # a weight sync: counted once for the fleet, with the bytes of every tensor sent
    weights = {name: t.clone() for name, t in local.state_dict().items()}
    fleet.update_weights(weights, version=fleet.policy_version + 1)
    synced = fleet.metrics()
    assert synced.weight_syncs == after.weight_syncs + 1 and synced.weight_sync_seconds > after.weight_sync_seconds
    assert synced.weight_sync_bytes - after.weight_sync_bytes == sum(t.numel() * t.element_size()
                                                                     for t in weights.values())
    assert synced.total.weight_updates["wait"] == after.total.weight_updates.get("wait", 0) + 2  # on both actors
    server = fleet.serve_metrics(0)
    with pytest.raises(RuntimeError, match="already serves"):
        fleet.serve_metrics(0)
    text = urllib.request.urlopen(server.url, timeout=30).read().decode()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    now = fleet.metrics()  # nothing ran since the scrape: the same counts
    assert got[("rollout_generated_tokens_total", ())] == now.total.generated_tokens
    for slot, m in now.actors.items():
        assert got[("rollout_actor_generated_tokens_total", (("actor", str(slot)),))] == m.generated_tokens
    assert got[("rollout_fleet_weight_syncs_total", ())] == now.weight_syncs
    assert got[("rollout_fleet_actors_ready", ())] == 2 and got[("rollout_policy_version", ())] == fleet.policy_version


def test_fleet_metrics_waits_once_for_actors_that_do_not_answer_and_keeps_their_last_snapshot(fleet):
    before = fleet.metrics()
    for actor in fleet.actors:  # both "control" slots of every actor busy: metrics() cannot run there for 8 s
        for _ in range(2):
            actor.__ray_call__.options(concurrency_group="control").remote(lambda self: time.sleep(8))
    start = time.monotonic()
    stale = fleet.metrics(timeout=3)
    elapsed = time.monotonic() - start
    assert 3 <= elapsed < 5.5  # one timeout for the whole fleet, not one per actor (2 x 3 s)
    assert stale.actors == before.actors and stale.total == before.total
    time.sleep(max(0.0, 8.5 - (time.monotonic() - start)))  # the sleeps end: later tests find the slots free
    assert fleet.metrics().actors_ready == 2


def test_a_prompts_next_group_runs_on_the_actor_that_holds_its_history(fleet, monkeypatch):
    monkeypatch.setattr(fleet, "_homes", Homes(WorkerConfig(speculation=Speculation(drafts=("history",)))))
    prompts = [prompt_of(6 + 3 * i, 40 + i) for i in range(6)]
    params = SamplingParams(n=2, max_new_tokens=4)
    fleet.generate(prompts, params)
    first = fleet._homes.of(prompts)
    assert sorted(first) == [0, 0, 0, 1, 1, 1]  # dealt by load over both actors
    for prompt, slot in zip(prompts, first):  # as if each had run on the other actor: its history is there now
        fleet._homes.ran(prompt, 1 - slot)
    fleet.generate(prompts, params)  # dealt by load alone, each prompt would go where it went the first time
    assert fleet._homes.of(prompts) == [1 - slot for slot in first]


def test_close_stops_every_actor_and_the_ray_it_started(fleet):
    actors = fleet.actors
    fleet.close()
    assert not ray.is_initialized()
    assert fleet.actors == [] and len(actors) == 2
