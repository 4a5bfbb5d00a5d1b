"""SkyRL's and TRL's control routes (rollout/server/admin/): `/sleep?level=2`, `/get_world_size` and the weight-update
fence `/start_weight_update` ... `/finish_weight_update`, with the bodies SkyRL's RemoteInferenceClient
(skyrl/backends/skyrl_train/inference_servers/remote_inference_client.py) and TRL's async GRPO VLLMClient
(trl/experimental/async_grpo/vllm_client.py) send. Logprobs are checked against a teacher-forced forward of the weights
of the version that made them."""

from __future__ import annotations

import datetime
import json
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch
import torch.distributed as dist
from conftest import background, free_port, perturbed, reference_logprobs, wait_for_tokens
from safetensors.torch import save_file

import rollout
from rollout import RolloutWorker, WorkerConfig
from rollout.model.weights import fingerprint
from rollout.testing import load_tiny_model

TOL = 1e-5
KEY = "root"
PROMPT = [5, 17, 42, 9, 3]


@pytest.fixture(scope="module")
def versions(tiny_path, tmp_path_factory):
    """{0: model, 1: model} and version 1's tensors in two checkpoint directories (the chunks of one update)."""
    v0, _ = load_tiny_model(tiny_path)
    v1, _ = load_tiny_model(tiny_path)
    v1.load_state_dict(perturbed(v0, 1))
    state = {k: v.contiguous() for k, v in v1.state_dict().items()}
    names = sorted(state)
    chunks = []
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        path = tmp_path_factory.mktemp(f"chunk{i}")
        save_file({k: state[k] for k in part}, str(path / "model.safetensors"))
        chunks.append(str(path))
    return {0: v0, 1: v1}, chunks


@pytest.fixture(scope="module")
def served(tiny_path):
    """(worker, server): a worker with its own copy of version 0, served with the admin routes behind KEY."""
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as worker, \
            rollout.serve(worker, port=0, model_name="tiny", admin=True, admin_key=KEY) as server:
        yield worker, server


def call(server, method: str, path: str, body: dict | None = None, params: dict | None = None,
         key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    query = f"?{urllib.parse.urlencode(params, doseq=True)}" if params else ""
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    request = urllib.request.Request(server.url.removesuffix("/v1") + path + query, data=data, headers=headers,
                                     method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def sample(server) -> tuple[list[int], list[float], list[int]]:
    """One seeded completion of PROMPT: (token ids, logprobs, versions)."""
    status, out = call(server, "POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "logprobs": 0,
                                                           "seed": 1, "ignore_eos": True})
    assert status == 200, out
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], choice["token_versions"]


def assert_made_by(model, tokens: list[int], logprobs: list[float]) -> None:
    full, _ = reference_logprobs(model, PROMPT, tokens)
    assert float((torch.tensor(logprobs) - full).abs().max()) <= TOL


def test_skyrl_sleep_level_2_frees_what_level_1_frees_and_keeps_the_weights(served):
    worker, server = served
    before = worker.weights_fingerprint()
    # SkyRL's RemoteInferenceClient.sleep(): POST /sleep with params {"level": "2"} (its default level)
    assert call(server, "POST", "/sleep", params={"level": "2"}) == (200, {"status": "sleeping"})
    assert worker.is_sleeping and worker.weights_fingerprint() == before
    assert call(server, "POST", "/wake_up", params={"tags": ["kv_cache"]})[0] == 200 and not worker.is_sleeping
    assert call(server, "POST", "/sleep", params={"level": "1", "tags": ["kv_cache"]})[0] == 200 and worker.is_sleeping
    assert call(server, "POST", "/wake_up")[0] == 200 and not worker.is_sleeping
    for params, param in [({"level": "3"}, "level"), ({"level": "2", "tags": ["weights"]}, "tags"),
                          ({"tags": ["gpu"]}, "tags")]:
        status, out = call(server, "POST", "/sleep", params=params)
        assert status == 400 and out["error"]["param"] == param and not worker.is_sleeping, out


def test_get_world_size_answers_the_ranks_this_server_joins_with_under_skyrls_and_trls_paths(served):
    _, server = served
    assert call(server, "GET", "/get_world_size") == (200, {"world_size": 1})  # SkyRL's, TRL async GRPO's
    assert call(server, "GET", "/get_world_size/") == (200, {"world_size": 1})  # TRL's VLLMClient
    assert call(server, "GET", "/get_world_size", key=None)[0] == 401


def test_a_fenced_update_in_two_chunks_lands_whole_at_finish_and_not_before(served, versions):
    worker, server = served
    models, chunks = versions
    start = int(worker.policy_version)
    assert fingerprint(worker.model) == fingerprint(models[0])
    # TRL's VLLMClient.start_weight_update body
    assert call(server, "POST", "/start_weight_update", {"is_checkpoint_format": True}) == \
        (200, {"message": "Weight update started"})
    status, out = call(server, "POST", "/start_weight_update", {"is_checkpoint_format": True})
    assert status == 409, out  # one fence at a time
    status, out = call(server, "POST", "/update_weights", {"weight_dir": chunks[0]})
    assert status == 200 and out["staged"] > 0 and "policy_version" not in out, out
    tokens, logprobs, token_versions = sample(server)  # half staged: still version 0, untouched
    assert token_versions == [start] * 8 and int(worker.policy_version) == start
    assert_made_by(models[0], tokens, logprobs)
    status, out = call(server, "POST", "/update_weights", {"weight_dir": chunks[0]})
    assert status == 400 and out["error"]["param"].startswith("weights['"), out  # a tensor staged twice
    status, out = call(server, "POST", "/update_weights", {"weight_dir": chunks[1], "version": 9})
    assert status == 400 and out["error"]["param"] == "version", out  # the version belongs to finish
    assert call(server, "POST", "/update_weights", {"weight_dir": chunks[1]})[0] == 200
    # TRL's VLLMClient.finish_weight_update posts no body
    status, out = call(server, "POST", "/finish_weight_update")
    assert status == 200 and out["policy_version"] == start + 1, out
    assert fingerprint(worker.model) == fingerprint(models[1])
    tokens, logprobs, token_versions = sample(server)
    assert token_versions == [start + 1] * 8
    assert_made_by(models[1], tokens, logprobs)
    assert call(server, "POST", "/finish_weight_update")[0] == 409  # the fence is closed


def test_a_fence_with_one_bad_tensor_applies_nothing_and_names_it(served, versions, tmp_path):
    worker, server = served
    models, chunks = versions
    before, version = worker.weights_fingerprint(), int(worker.policy_version)
    name = "model.layers.0.mlp.up_proj.weight"
    shape = tuple(models[0].state_dict()[name].shape)
    save_file({name: torch.zeros(shape[0] + 1, shape[1])}, str(tmp_path / "model.safetensors"))
    rest = [c for c in chunks if name not in _names(c)]
    status, out = call(server, "POST", "/start_weight_update", {"is_checkpoint_format": False})
    assert status == 400 and out["error"]["param"] == "is_checkpoint_format", out
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    for chunk in rest:
        assert call(server, "POST", "/update_weights", {"weight_dir": chunk})[0] == 200
    assert call(server, "POST", "/update_weights", {"weight_dir": str(tmp_path)})[0] == 200  # staged, not yet read
    status, out = call(server, "POST", "/finish_weight_update", {"weight_version": str(version + 5)})
    message = out["error"]["message"]
    assert status == 400 and f"weights['{name}'] has shape {(shape[0] + 1, shape[1])}" in message, out
    assert worker.weights_fingerprint() == before and int(worker.policy_version) == version
    assert call(server, "POST", "/finish_weight_update")[0] == 409  # nothing left staged
    assert call(server, "POST", "/start_weight_update", {})[0] == 200
    status, out = call(server, "POST", "/finish_weight_update", {"weight_version": str(version + 5)})
    assert status == 400 and "no tensors were staged" in out["error"]["message"], out  # an empty fence
    assert int(worker.policy_version) == version


def test_skyrls_non_colocated_sync_pause_keep_fence_over_a_gloo_group_then_resume_is_exact_per_token(served,
                                                                                                   versions,
                                                                                                   slow_steps):
    """SkyRL's broadcast flow (its inference_architecture docs): /pause?mode=keep, the update in chunks broadcast by
    the trainer's group between /start_weight_update and /finish_weight_update, /resume; the row frozen mid-way
    continues on the new weights, each token exact under the version that made it."""
    worker, server = served
    models, _ = versions
    old = 1 if fingerprint(worker.model) == fingerprint(models[1]) else 0
    new, version = 1 - old, int(worker.policy_version)
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    joined = background(call, server, "POST", "/init_weight_transfer_engine", {"init_info": info})
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout)  # the trainer: rank 0 hosts the store
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    assert joined()[0] == 200
    body = {"prompt": PROMPT, "max_tokens": 48, "logprobs": 0, "seed": 2, "ignore_eos": True}
    running = background(call, server, "POST", "/v1/completions", body)
    wait_for_tokens(worker, 2)  # with slow_steps the 48 tokens take > 1.4 s: the pause finds the row mid-way
    assert call(server, "POST", "/pause", params={"mode": "keep"}) == (200, {"status": "paused"})
    assert call(server, "POST", "/start_weight_update", {"is_checkpoint_format": True})[0] == 200
    state = {k: v.contiguous() for k, v in models[new].state_dict().items()}
    names = list(state)
    for part in (names[: len(names) // 2], names[len(names) // 2:]):
        update_info = {"names": part, "dtype_names": [str(state[n].dtype).removeprefix("torch.") for n in part],
                       "shapes": [list(state[n].shape) for n in part]}
        staged = background(call, server, "POST", "/update_weights", {"update_info": update_info})
        for name in part:
            group.broadcast(state[name], 0).wait()
        status, out = staged()
        assert status == 200 and "policy_version" not in out, out
        assert int(worker.policy_version) == version  # staged, not applied
    status, out = call(server, "POST", "/finish_weight_update", {"weight_version": str(version + 10)})
    assert status == 200 and out["policy_version"] == version + 10, out
    assert call(server, "POST", "/resume")[0] == 200
    status, out = running()
    assert status == 200, out
    choice = out["choices"][0]
    tokens, logprobs, token_versions = choice["token_ids"], choice["logprobs"]["token_logprobs"], \
        choice["token_versions"]
    assert token_versions[0] == version and token_versions[-1] == version + 10  # the row straddles the update
    gaps = {}
    for v, model in ((version, models[old]), (version + 10, models[new])):
        full, _ = reference_logprobs(model, PROMPT, tokens)
        gaps[v] = max(abs(lp - float(full[t])) for t, lp in enumerate(logprobs) if token_versions[t] == v)
        gaps[(v, "other")] = max(abs(lp - float(full[t])) for t, lp in enumerate(logprobs) if token_versions[t] != v)
    # fp32 rounding over 48 positions of the perturbed weights reaches 1.05e-5 (measured); a token computed on the
    # other version's weights (stale KV, a half-applied update) is off by more than 1e-3
    assert gaps[version] <= 2 * TOL and gaps[version + 10] <= 2 * TOL, gaps
    assert gaps[(version, "other")] > 1e-3 and gaps[(version + 10, "other")] > 1e-3, gaps


def join_group(server) -> "dist.ProcessGroupGloo":
    """The trainer's side of /init_weight_transfer_engine (rank 0 of a two-rank gloo group)."""
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    joined = background(call, server, "POST", "/init_weight_transfer_engine", {"init_info": info})
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout)
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    assert joined()[0] == 200
    return group


def send_packed(group, tensors: list[torch.Tensor], buffer_bytes: int) -> int:
    """vLLM's packed broadcast as its NCCL engine's trainer side sends it (packed=True): each tensor's bytes in order,
    a buffer broadcast once its byte count passes buffer_bytes, the rest last. Returns the broadcasts made."""
    pending: list[torch.Tensor] = []
    sent = 0
    for tensor in tensors:
        pending.append(tensor.contiguous().view(torch.uint8).view(-1))
        if sum(t.numel() for t in pending) > buffer_bytes:
            group.broadcast(torch.cat(pending), 0).wait()
            pending, sent = [], sent + 1
    if pending:
        group.broadcast(torch.cat(pending), 0).wait()
        sent += 1
    return sent


@pytest.mark.parametrize("buffer_bytes", [None, 4096])
def test_trl_async_grpo_packed_update_inside_the_fence_lands_whole(served, versions, buffer_bytes):
    """TRL's WeightTransferClient.send_weights (trl/experimental/async_grpo/weight_transfer.py): /start_weight_update,
    /update_weights with the trainer's update_info (async_grpo_trainer.py: named_parameters, "packed": true) while
    rank 0 broadcasts packed buffers, /finish_weight_update. None: vLLM's default 1 GiB buffer (one broadcast); 4096
    bytes: many buffers, a tensor crossing each bound."""
    worker, server = served
    models, _ = versions
    target = 1 if fingerprint(worker.model) == fingerprint(models[0]) else 0
    version = int(worker.policy_version)
    group = join_group(server)
    params = dict(models[target].named_parameters())
    update_info = {"names": list(params), "dtype_names": [str(p.dtype).split(".")[-1] for p in params.values()],
                   "shapes": [list(p.shape) for p in params.values()], "packed": True}
    if buffer_bytes is not None:
        update_info["packed_buffer_size_bytes"] = buffer_bytes
    assert call(server, "POST", "/start_weight_update", {"is_checkpoint_format": True})[0] == 200
    staged = background(call, server, "POST", "/update_weights", {"update_info": update_info})
    with torch.no_grad():
        sent = send_packed(group, [p.detach() for p in params.values()], buffer_bytes or 1024 ** 3)
    status, out = staged()
    assert status == 200 and out["staged"] == len(params), out
    assert sent == 1 if buffer_bytes is None else sent > 10
    assert call(server, "POST", "/finish_weight_update")[1]["policy_version"] == version + 1
    assert fingerprint(worker.model) == fingerprint(models[target])
    tokens, logprobs, token_versions = sample(server)
    assert token_versions == [version + 1] * 8
    assert_made_by(models[target], tokens, logprobs)
    status, out = call(server, "POST", "/update_weights", {"update_info": update_info | {"packed": "yes"}})
    assert status == 400 and out["error"]["param"] == "update_info.packed", out


def _names(path: str) -> list[str]:
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as f:
        return list(f.keys())
