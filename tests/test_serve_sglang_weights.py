"""SGLang's weight-update routes over a trainer's group (rollout/server/admin/sglang.py): /init_weights_update_group
and /update_weights_from_distributed with the bodies AReaL's SGLangBackend (areal/engine/sglang_remote.py) and slime's
SGLangEngine (slime/backends/sglang_utils/sglang_engine.py) send, slime's other calls there (/flush_cache,
/destroy_weights_update_group, /health_generate), AReaL's VLLMBackend two-step
(/areal_set_update_weight_meta, /areal_update_weights_xccl; areal/engine/vllm_remote.py), SGLang's flattened bucket,
and the refusal of /update_weights_from_tensor. The test process is the trainer's rank 0, built over gloo as AReaL's
and slime's `init_custom_process_group` builds it (torch's rendezvous and `_new_process_group_helper`), so the
server's store keys are checked against torch's own. Weights are checked by fingerprint against the trainer's model,
and a following /generate's logprobs against a teacher-forced fp32 forward of those weights."""

from __future__ import annotations

import datetime
import itertools
import json
import urllib.error
import urllib.request

import pytest
import torch
import torch.distributed as dist
from conftest import background, free_port, perturbed, post_json, reference_logprobs

import rollout
from rollout import RolloutWorker, WorkerConfig
from rollout.model.weights import fingerprint
from rollout.testing import load_tiny_model

TOL = 1e-5
KEY = "root"
PROMPT = [5, 17, 42, 9, 3, 88, 120, 7]
GROUP_NAMES = (f"update_weight_group_{i}" for i in itertools.count())  # torch keeps each name once per process


@pytest.fixture(scope="module")
def versions(tiny_path):
    """Three sets of weights: the served one (0) and two a trainer sends."""
    base, _ = load_tiny_model(tiny_path)
    models = {0: base}
    for seed in (1, 2):
        model, _ = load_tiny_model(tiny_path)
        model.load_state_dict(perturbed(base, seed))
        models[seed] = model
    return models


@pytest.fixture(scope="module")
def served(tiny_path):
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as worker, \
            rollout.serve(worker, port=0, model_name="tiny", admin=True, admin_key=KEY) as server:
        yield worker, server


def post(server, path: str, body: dict | None, key: str | None = KEY) -> tuple[int, object]:
    return post_json(server, path, body, key)


def trainer_rank0(port: int, group_name: str):
    """Rank 0 as init_custom_process_group builds it (areal/engine/core/distributed.py, slime's init_process_group):
    torch's tcp:// rendezvous, a PrefixStore named for the group, torch's own group constructor."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=60)
    store, rank, world_size = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = _new_process_group_helper(world_size, rank, [], dist.Backend("gloo"),
                                         dist.PrefixStore(group_name, store), group_name=group_name, timeout=timeout,
                                         group_desc=group_name)
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    return group


def join(server, path: str = "/init_weights_update_group"):
    """AReaL's build_init_weights_group_request payload (PP = 1, one server of one rank), the trainer's rank 0 built
    while the request waits. Returns (group, group_name)."""
    port, name = free_port(), next(GROUP_NAMES)
    payload = {"master_address": "127.0.0.1", "master_port": str(port), "rank_offset": 1, "world_size": 2,
               "backend": "gloo", "group_name": name}
    joined = background(post, server, path, payload)
    group = trainer_rank0(port, name)
    assert joined() == (200, {"success": True, "message": f"joined weight update group {name!r}"})
    return group, name


def specs(model) -> tuple[list[str], list[str], list[list[int]], list[torch.Tensor]]:
    """AReaL's ParamSpecs (name, dtype as "bfloat16"-style strings, shape) of named_parameters, and the tensors."""
    params = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    return (list(params), [str(p.dtype).split("torch.")[1] for p in params.values()],
            [list(p.shape) for p in params.values()], list(params.values()))


def update(server, group, path: str, body: dict, tensors: list[torch.Tensor], flattened: bool = False):
    """POST the update while rank 0 broadcasts: one tensor at a time (AReaL's fsdp_engine, slime's
    update_weights_from_distributed), or SGLang's flattened bucket (every tensor's bytes back to back, once)."""
    answered = background(post, server, path, body)
    with torch.no_grad():
        if flattened:
            dist.broadcast(torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]), src=0, group=group)
        for tensor in [] if flattened else tensors:
            dist.broadcast(tensor, src=0, group=group)
    return answered()


def generate_matches(server, model, seed: int) -> list[int]:
    """An SGLang /generate after the update: its logprobs against a teacher-forced fp32 forward of `model`."""
    status, out = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8,
                       "ignore_eos": True, "sampling_seed": seed}, "return_logprob": True})
    assert status == 200, out
    tokens = [t for _, t, _ in out["meta_info"]["output_token_logprobs"]]
    logprobs = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    full, _ = reference_logprobs(model, PROMPT, tokens)
    assert float((logprobs - full).abs().max()) <= TOL
    return tokens


def test_areal_sglang_backend_bucketed_update_over_its_group_lands_the_trainers_weights(served, versions):
    """AReaL's xccl flow (fsdp_engine._update_weights_from_distributed): /pause_generation, one
    /update_weights_from_distributed per bucket (build_distributed_weight_update_requests' body) while rank 0
    broadcasts each tensor, /continue_generation."""
    worker, server = served
    target = 2 if fingerprint(worker.model) != fingerprint(versions[2]) else 1
    group, name = join(server)
    names, dtypes, shapes, tensors = specs(versions[target])
    version = int(worker.policy_version)
    assert post(server, "/pause_generation", {})[0] == 200
    half = len(names) // 2
    for part in (slice(0, half), slice(half, None)):
        body = {"names": names[part], "dtypes": dtypes[part], "shapes": shapes[part], "group_name": name,
                "abort_all_requests": True}
        status, out = update(server, group, "/update_weights_from_distributed", body, tensors[part])
        assert status == 200 and out["success"] is True and out["message"] == "Weights updated", out
    assert post(server, "/continue_generation", {})[0] == 200
    assert int(worker.policy_version) == version + 2  # each bucket is an update of its own outside a fence
    assert fingerprint(worker.model) == fingerprint(versions[target])
    request = urllib.request.Request(server.url.removesuffix("/v1") + "/get_weight_version",
                                     headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=60) as response:  # what the server says it serves
        assert json.loads(response.read())["weights_fingerprint"] == fingerprint(versions[target])
    generate_matches(server, versions[target], seed=3)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_slime_update_sets_its_weight_version_and_sglangs_flattened_bucket_lands_the_same(served, versions,
                                                                                         load_format):
    """slime's SGLangEngine.update_weights_from_distributed body (dtypes without "torch.", flush_cache false,
    weight_version a string; load_format only when given), per tensor or as SGLang's flattened bucket."""
    worker, server = served
    target = 1 if fingerprint(worker.model) != fingerprint(versions[1]) else 2
    group, name = join(server)
    names, dtypes, shapes, tensors = specs(versions[target])
    new = int(worker.policy_version) + 7
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": name, "flush_cache": False,
            "weight_version": str(new)}
    if load_format is not None:
        body["load_format"] = load_format
    status, out = update(server, group, "/update_weights_from_distributed", body, tensors,
                         flattened=load_format is not None)
    assert status == 200 and out["success"] is True and out["policy_version"] == new, out
    assert "flushed all the same" in out["message"]  # flush_cache=false is said not to be honoured
    assert fingerprint(worker.model) == fingerprint(versions[target])
    status, out = post(server, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["weight_version"] == str(new)
    generate_matches(server, versions[target], seed=4)


def test_areal_vllm_backend_two_step_update_and_its_pause_routes(served, versions):
    """AReaL's VLLMBackend: /areal_init_weights_update_group, /areal_pause_generation, /areal_set_update_weight_meta
    with names, dtypes, shapes and group_name, then /areal_update_weights_xccl with {} while rank 0 broadcasts,
    /areal_continue_generation."""
    worker, server = served
    target = 1 if fingerprint(worker.model) != fingerprint(versions[1]) else 2
    group, name = join(server, "/areal_init_weights_update_group")
    names, dtypes, shapes, tensors = specs(versions[target])
    version = int(worker.policy_version)
    assert post(server, "/areal_pause_generation", {})[1]["success"] is True and worker.is_paused
    status, out = post(server, "/areal_set_update_weight_meta",
                       {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": name})
    assert status == 200 and out["success"] is True and int(worker.policy_version) == version, out
    status, out = update(server, group, "/areal_update_weights_xccl", {}, tensors)
    assert status == 200 and out["success"] is True and out["policy_version"] == version + 1, out
    assert post(server, "/areal_continue_generation", {})[1]["success"] is True and not worker.is_paused
    assert fingerprint(worker.model) == fingerprint(versions[target])
    generate_matches(server, versions[target], seed=5)


def test_inside_the_fence_sglangs_buckets_are_staged_and_land_as_one_update(served, versions):
    """AReaL's buckets between /start_weight_update and /finish_weight_update: one version bump for all of them."""
    worker, server = served
    target = 1 if fingerprint(worker.model) != fingerprint(versions[1]) else 2
    group, name = join(server)
    names, dtypes, shapes, tensors = specs(versions[target])
    before, version = fingerprint(worker.model), int(worker.policy_version)
    assert post(server, "/start_weight_update", {"is_checkpoint_format": True})[0] == 200
    half = len(names) // 2
    for part in (slice(0, half), slice(half, None)):
        body = {"names": names[part], "dtypes": dtypes[part], "shapes": shapes[part], "group_name": name}
        status, out = update(server, group, "/update_weights_from_distributed", body, tensors[part])
        assert status == 200 and out["success"] is True and "policy_version" not in out, out
        assert fingerprint(worker.model) == before and int(worker.policy_version) == version  # staged only
    status, out = post(server, "/finish_weight_update", {"weight_version": str(version + 3)})
    assert status == 200 and out["policy_version"] == version + 3, out
    assert fingerprint(worker.model) == fingerprint(versions[target])
    generate_matches(server, versions[target], seed=6)


def test_a_bad_update_is_refused_in_sglangs_shape_and_changes_nothing(served, versions):
    worker, server = served
    group, name = join(server)
    before, version = fingerprint(worker.model), int(worker.policy_version)
    names, dtypes, shapes, tensors = specs(versions[1])
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": name}
    # refused before the transfer (the trainer's broadcast would then time out): the field named, nothing applied
    for change, param in [({"group_name": "other"}, "group_name"), ({"dtypes": ["float33"] * len(names)}, "dtypes"),
                          ({"load_format": "direct"}, "load_format"), ({"flush": True}, "flush")]:
        status, out = post(server, "/update_weights_from_distributed", body | change)
        assert status == 400 and out["success"] is False and out["error"]["param"] == param, out
    # a tensor of the wrong shape arrives whole, then fails validation: 400 naming it, no weight changed
    bad = names.index("model.layers.0.mlp.up_proj.weight")
    shapes_bad = [s if i != bad else [s[0] + 1, s[1]] for i, s in enumerate(shapes)]
    tensors_bad = [t if i != bad else torch.zeros(shapes_bad[bad]) for i, t in enumerate(tensors)]
    status, out = update(server, group, "/update_weights_from_distributed", body | {"shapes": shapes_bad}, tensors_bad)
    assert status == 400 and out["success"] is False, out
    assert f"weights['{names[bad]}'] has shape" in out["message"]
    assert fingerprint(worker.model) == before and int(worker.policy_version) == version
    status, out = post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["gAR="]})
    assert status == 400 and out["error"]["param"] == "serialized_named_tensors" and "CUDA IPC" in out["message"]
    status, out = post(server, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
    assert status == 400 and out["success"] is False and out["error"]["param"] == "model_path", out
    assert fingerprint(worker.model) == before and int(worker.policy_version) == version
    assert post(server, "/update_weights_from_distributed", body, key=None)[0] == 401
    assert post(server, "/areal_update_weights_xccl", {}, key="wrong")[0] == 403


# ---------------------------------------------------------------------------------------------- slime's other routes
def get(server, path: str, key: str | None = KEY) -> tuple[int, bytes]:
    """A GET as slime's SGLangEngine sends /flush_cache and /health_generate (requests.get, no body)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_slimes_flush_cache_between_pause_and_continue_forgets_the_prefix_cache(served):
    """slime's update_weights (slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py):
    /pause_generation {}, then SGLangEngine.flush_cache's GET /flush_cache, then /continue_generation."""
    worker, server = served
    prompt = [(7 * i + 3) % 500 + 1 for i in range(40)]  # two full pages of 16: what the prefix cache keeps
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True}
    status, first = post(server, "/generate", body)
    assert status == 200, first
    reused = worker.metrics().prefix_cache_reused_tokens
    assert post(server, "/generate", body)[1]["output_ids"] == first["output_ids"]
    assert worker.metrics().prefix_cache_reused_tokens == reused + 32  # the cache serves the two pages
    assert post(server, "/pause_generation", {})[0] == 200
    assert get(server, "/flush_cache") == (200, b"Cache flushed.\n")
    assert post(server, "/continue_generation", {})[0] == 200
    reused = worker.metrics().prefix_cache_reused_tokens
    status, again = post(server, "/generate", body)
    assert status == 200 and again["output_ids"] == first["output_ids"]
    assert worker.metrics().prefix_cache_reused_tokens == reused  # nothing was matched after the flush
    tokens = again["output_ids"]
    logprobs = torch.tensor([lp for lp, _, _ in again["meta_info"]["output_token_logprobs"]])
    full, _ = reference_logprobs(worker.model, prompt, tokens)
    assert float((logprobs - full).abs().max()) <= TOL
    assert get(server, "/flush_cache", key=None)[0] == 401  # an admin route
    status, out = post(server, "/flush_cache", {"all": True})
    assert status == 400 and out["error"]["param"] == "all"  # SGLang's takes no body


def test_slimes_destroy_weights_update_group_leaves_the_group_and_a_new_one_can_be_joined(served, versions):
    """slime's disconnect_rollout_engines_from_distributed: SGLangEngine.destroy_weights_update_group's body
    {"group_name"}, answered as SGLang answers (a group it has not joined: 400, "does not exist"), then its next
    /init_weights_update_group and update."""
    worker, server = served
    group, name = join(server)
    status, out = post(server, "/destroy_weights_update_group", {"group_name": name})
    assert (status, out) == (200, {"success": True, "message": f"left weight update group {name!r}"})
    status, out = post(server, "/destroy_weights_update_group", {"group_name": name})
    assert status == 400 and out["success"] is False and out["error"]["param"] == "group_name", out
    assert "does not exist" in out["message"]
    names, dtypes, shapes, _ = specs(versions[1])
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": name}
    status, out = post(server, "/update_weights_from_distributed", body)
    assert status == 409 and out["success"] is False, out  # nothing to receive from: no broadcast awaited
    target = 1 if fingerprint(worker.model) != fingerprint(versions[1]) else 2
    group, name = join(server)
    names, dtypes, shapes, tensors = specs(versions[target])
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": name}
    status, out = update(server, group, "/update_weights_from_distributed", body, tensors)
    assert status == 200 and out["success"] is True, out
    assert fingerprint(worker.model) == fingerprint(versions[target])
    assert post(server, "/destroy_weights_update_group", {"group_name": "other"})[0] == 400  # not the one joined
    assert post(server, "/destroy_weights_update_group", {"group_name": name}, key=None)[0] == 401
    assert post(server, "/destroy_weights_update_group", {"group_name": name, "rid": 1})[1]["error"]["param"] == "rid"
    assert post(server, "/destroy_weights_update_group", {"group_name": name})[0] == 200


def test_health_generate_runs_one_token_and_says_503_when_asleep_or_paused(served, monkeypatch):
    """slime's _wait_server_healthy and SGLangEngine.health_generate: GET /health_generate, 200 or not."""
    from rollout.server.sglang import generate

    worker, server = served
    before = worker.metrics()
    assert get(server, "/health_generate", key=None) == (200, b"")  # no key needed, as /health
    after = worker.metrics()
    assert (after.generated_tokens, after.prompt_tokens) == (before.generated_tokens + 1, before.prompt_tokens + 1)
    assert post(server, "/release_memory_occupation", {})[0] == 200 and worker.is_sleeping
    status, out = get(server, "/health_generate")
    assert status == 503 and "asleep" in json.loads(out)["error"]["message"] and worker.is_sleeping
    assert post(server, "/resume_memory_occupation", {})[0] == 200
    monkeypatch.setattr(generate, "HEALTH_TIMEOUT_S", 0.5)
    assert post(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    status, out = get(server, "/health_generate")
    assert status == 503 and "within 0.5 s" in json.loads(out)["error"]["message"]
    assert post(server, "/continue_generation", {})[0] == 200
    monkeypatch.undo()
    assert get(server, "/health_generate")[0] == 200
