"""The RL control plane over HTTP (`rollout serve --admin`, rollout/server/admin/routes.py), driven over loopback.

Weights of version 1 are the tiny model's perturbed (conftest.perturbed); every logprob a response carries is checked
against a plain teacher-forced forward of the weights of the version its token says made it.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
import torch.distributed as dist
from conftest import background, free_port, perturbed, reference_logprobs
from safetensors.torch import save_file

import rollout
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.model.weights import fingerprint
from rollout.testing import load_tiny_model

TOL = 1e-5
PROMPT = [5, 17, 42, 9, 3]


@pytest.fixture(scope="module")
def versions(tiny_path, tmp_path_factory):
    """{0: model, 1: model}: the weights of versions 0 and 1, and the checkpoint directory of version 1."""
    v0, _ = load_tiny_model(tiny_path)
    v1, _ = load_tiny_model(tiny_path)
    v1.load_state_dict(perturbed(v0, 1))
    path = tmp_path_factory.mktemp("v1")
    v1.save_pretrained(path)
    return {0: v0, 1: v1}, str(path)


@pytest.fixture()
def admin(tiny_path):
    """(worker, server): a worker with its own copy of version 0, served with the admin routes."""
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as worker, \
            rollout.serve(worker, port=0, model_name="tiny", admin=True) as server:
        yield worker, server


def call(server, method: str, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    """(status, JSON body) of an admin request."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def complete(server, max_tokens: int = 12, seed: int = 1) -> dict:
    """One sampled completion of PROMPT (token ids in): its choice, with token ids, logprobs and versions."""
    client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_tokens, logprobs=0, seed=seed,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    return {"ids": c.model_extra["token_ids"], "logprobs": c.logprobs.token_logprobs,
            "versions": c.model_extra["token_versions"], "policy_version": c.model_extra["policy_version"]}


def gaps(models: dict, row: dict) -> dict[int, float]:
    """Max |logprob - teacher-forced forward of the weights of the token's own version|, per version."""
    full = {v: reference_logprobs(m, PROMPT, row["ids"])[0] for v, m in models.items() if v in row["versions"]}
    return {v: max(abs(lp - float(full[v][t])) for t, (lp, tv) in enumerate(zip(row["logprobs"], row["versions"]))
                   if tv == v) for v in full}


def assert_exact(models: dict, row: dict) -> None:
    assert row["policy_version"] == min(row["versions"])
    assert all(g <= TOL for g in gaps(models, row).values()), gaps(models, row)


# ---------------------------------------------------------------------------------------------- mounting and keys
def test_admin_routes_are_absent_without_admin(tiny_path):
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16)) as worker, \
            rollout.serve(worker, port=0, model_name="tiny") as server:
        for method, path in [("POST", "/pause"), ("GET", "/is_paused"), ("POST", "/update_weights"),
                             ("POST", "/sleep"), ("GET", "/get_weight_version")]:
            assert call(server, method, path, {} if method == "POST" else None)[0] == 404, path
        assert not worker.is_paused and not worker.is_sleeping


def test_admin_routes_refuse_without_the_key(tiny_path):
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16)) as worker, \
            rollout.serve(worker, port=0, model_name="tiny", api_key="user", admin=True, admin_key="root") as server:
        assert call(server, "POST", "/pause?mode=keep", {})[0] == 401
        assert call(server, "POST", "/pause?mode=keep", {}, key="user")[0] == 403  # the API key is not the admin's
        assert call(server, "GET", "/is_paused", key="wrong")[0] == 403
        assert not worker.is_paused
        assert call(server, "POST", "/pause?mode=keep", {}, key="root") == (200, {"status": "paused"})
        assert call(server, "GET", "/is_paused", key="root") == (200, {"is_paused": True})
        assert call(server, "POST", "/resume", {}, key="root")[0] == 200 and not worker.is_paused
        with pytest.raises(ValueError, match="admin_key"):  # beyond loopback a key is required: nothing listens
            rollout.server.Server(worker, host="0.0.0.0", port=0, admin=True)
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16)) as worker, \
            rollout.serve(worker, port=0, model_name="tiny", api_key="user", admin=True) as server:
        assert call(server, "GET", "/is_paused")[0] == 401  # no admin key: the API key guards them
        assert call(server, "GET", "/is_paused", key="user") == (200, {"is_paused": False})


def test_rollout_serve_admin_refuses_a_public_host_without_a_key_before_loading(tiny_path, capsys, monkeypatch):
    from rollout.cli.serve import main

    monkeypatch.delenv("ROLLOUT_ADMIN_KEY", raising=False)
    monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
    assert main([str(tiny_path), "--admin", "--host", "0.0.0.0"]) == 2
    assert "admin_key=None is invalid" in capsys.readouterr().err


class WithoutPause:
    """A Rollouts without pause / resume / reset_prefix_cache (as a RolloutFleet is): the rest is the worker's."""

    pause = resume = reset_prefix_cache = None

    def __init__(self, worker):
        self.worker = worker

    def __getattr__(self, name):
        return getattr(self.worker, name)


def test_a_rollouts_without_pause_answers_501_and_still_takes_updates(tiny_path, versions):
    models, path = versions
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16)) as worker, \
            rollout.serve(WithoutPause(worker), port=0, model_name="tiny", admin=True) as server:
        status, body = call(server, "POST", "/pause", {})
        assert status == 501 and "pause()" in body["error"]["message"]
        assert call(server, "POST", "/reset_prefix_cache", {})[0] == 501
        assert call(server, "POST", "/update_weights", {"weight_dir": path})[1]["policy_version"] == 1
        assert worker.weights_fingerprint() == fingerprint(models[1])


# ---------------------------------------------------------------------------------------------- weight updates
def test_an_update_from_a_checkpoint_dir_gives_the_new_weights_logprobs_and_version(admin, versions):
    worker, server = admin
    models, path = versions
    assert_exact(models, before := complete(server))
    assert before["versions"] == [0] * 12
    assert call(server, "POST", "/update_weights", {"weight_dir": path}) == \
        (200, {"success": True, "message": "Weights updated", "policy_version": 1})
    after = complete(server)
    assert after["versions"] == [1] * 12 and after["policy_version"] == 1
    assert_exact(models, after)
    assert max(gaps({0: models[0]}, {**after, "versions": [0] * 12}).values()) > 1e-3  # the weights did change
    status, body = call(server, "GET", "/get_weight_version")
    assert status == 200 and body == {"weight_version": "1", "policy_version": 1,
                                      "weights_fingerprint": fingerprint(models[1])}
    # SGLang's name, with the version the trainer chose
    status, body = call(server, "POST", "/update_weights_from_disk", {"model_path": path, "weight_version": "7"})
    assert (status, body["policy_version"]) == (200, 7)
    assert worker.policy_version == 7


def test_a_bad_checkpoint_is_a_400_naming_the_tensor_and_nothing_changes(admin, versions, tmp_path):
    worker, server = admin
    models, _ = versions
    state = {k: v.clone() for k, v in models[1].state_dict().items()}
    up = state.pop("model.layers.0.mlp.up_proj.weight")
    shape = dict(state, **{"model.layers.0.mlp.up_proj.weight": up[:-1].clone()})
    name = dict(state, **{"model.layers.0.mlp.upp_proj.weight": up})
    before = worker.weights_fingerprint()
    for bad, tensor in [(shape, "model.layers.0.mlp.up_proj.weight"), (name, "model.layers.0.mlp.upp_proj.weight")]:
        directory = tmp_path / tensor.replace(".", "_")
        directory.mkdir()
        save_file(bad, directory / "model.safetensors")
        status, body = call(server, "POST", "/update_weights", {"weight_dir": str(directory)})
        assert status == 400 and repr(tensor) in body["error"]["message"], body
    status, body = call(server, "POST", "/update_weights", {"weight_dir": str(tmp_path / "missing")})
    assert status == 400 and body["error"]["param"] == "weight_dir"
    status, body = call(server, "POST", "/update_weights", {"weight_dir": str(tmp_path), "in_flight": "later"})
    assert status == 400 and body["error"]["param"] in ("weight_dir", "in_flight")
    # a field with no meaning here is refused by name; an update from a group never joined is a conflict
    assert call(server, "POST", "/update_weights", {"weight_dir": str(tmp_path), "load_format": "auto"})[1][
        "error"]["param"] == "load_format"
    assert call(server, "POST", "/update_weights_from_disk", {"model_path": str(tmp_path), "flush_cache": False})[1][
        "error"]["param"] == "flush_cache"
    assert call(server, "POST", "/update_weights", {"update_info": {"names": []}})[0] == 409
    info = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2}
    assert call(server, "POST", "/init_weight_transfer_engine", {"init_info": info})[1]["error"]["param"] == \
        "init_info.rank_offset"
    assert worker.weights_fingerprint() == before and worker.policy_version == 0
    assert_exact(models, row := complete(server)) and row["versions"] == [0] * 12


def test_an_update_under_concurrent_generation_tags_every_token_with_the_version_that_made_it(admin, versions):
    worker, server = admin
    models, path = versions
    rows: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda s=s: rows.__setitem__(s, complete(server, 64, seed=s)))
               for s in range(3)]
    client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0, timeout=120)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=100, logprobs=0, seed=9, stream=True,
                                       extra_body={"ignore_eos": True})
    streamed = {"ids": [], "logprobs": [], "versions": [], "policy_version": None}
    for chunk in stream:
        for c in chunk.choices:
            streamed["ids"] += c.model_extra.get("token_ids", [])
            streamed["logprobs"] += c.logprobs.token_logprobs if c.logprobs else []
            streamed["versions"] += c.model_extra.get("token_versions", [])
            streamed["policy_version"] = c.model_extra.get("policy_version", streamed["policy_version"])
        if len(streamed["ids"]) >= 4 and not threads[0].is_alive() and worker.policy_version == 0:
            [t.start() for t in threads]
            status, body = call(server, "POST", "/update_weights", {"weight_dir": path, "in_flight": "recompute"})
            assert (status, body["policy_version"]) == (200, 1)
    [t.join() for t in threads]
    assert len(streamed["ids"]) == 100 and streamed["versions"][0] == 0 and streamed["versions"][-1] == 1
    for row in [streamed, *rows.values(), complete(server)]:
        assert row["versions"] == sorted(row["versions"])
        assert_exact(models, row)
    assert complete(server)["versions"] == [1] * 12


def test_an_update_broadcast_by_the_trainers_gloo_group(admin, versions):
    worker, server = admin
    models, _ = versions
    port = free_port()
    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    joined = background(call, server, "POST", "/init_weight_transfer_engine", {"init_info": info})
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timeout)  # the trainer: rank 0 hosts the store
    group = dist.ProcessGroupGloo(store, 0, 2, timeout)
    assert joined() == (200, {"message": "Weight transfer initialized"})
    state = models[1].state_dict()
    update_info = {"names": list(state), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in state.values()],
                   "shapes": [list(t.shape) for t in state.values()]}
    updated = background(call, server, "POST", "/update_weights", {"update_info": update_info, "version": 3})
    for tensor in state.values():
        group.broadcast(tensor.contiguous(), 0).wait()
    assert updated() == (200, {"success": True, "message": "Weights updated", "policy_version": 3})
    assert worker.weights_fingerprint() == fingerprint(models[1])
    row = complete(server)
    assert row["versions"] == [3] * 12
    assert_exact({3: models[1]}, row)
    # names checked after the transfer (the group stays in step with the trainer): a 400 naming it, nothing applied
    bad = background(call, server, "POST", "/update_weights", {"update_info": {
        "names": ["lm_head.weights"], "dtype_names": ["float32"], "shapes": [list(state["lm_head.weight"].shape)]}})
    group.broadcast(state["lm_head.weight"].contiguous(), 0).wait()
    status, body = bad()
    assert status == 400 and "'lm_head.weights'" in body["error"]["message"] and worker.policy_version == 3



def start_long(server, worker, max_tokens: int = 64, seed: int = 3):
    """A completion started in the background, returned once the engine runs it (so a pause finds it in flight)."""
    running = background(complete, server, max_tokens, seed)
    deadline = time.monotonic() + 60
    while worker.metrics().requests_running == 0 and running.running() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert running.running(), "finished before it could be paused"
    return running


# ---------------------------------------------------------------------------------------------- pause, sleep, cache
@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_pause_then_resume_gives_the_same_rows(admin, versions, mode):
    worker, server = admin
    models, _ = versions
    expected = worker.generate([PROMPT], SamplingParams(max_new_tokens=64, seed=4, ignore_eos=True))
    running = start_long(server, worker, 64, 4)
    assert call(server, "POST", f"/pause?mode={mode}", {}) == (200, {"status": "paused"})
    assert call(server, "GET", "/is_paused") == (200, {"is_paused": True})
    deadline = time.monotonic() + 10
    while mode == "wait" and running.running() and time.monotonic() < deadline:
        time.sleep(0.01)  # its HTTP response may still be on its way to the client when /pause returns
    assert running.running() == (mode != "wait")  # "wait" returned once it finished; the others hold it
    waiting = background(complete, server, 64, 4)
    frozen = worker.metrics().sampled_tokens
    time.sleep(0.5)
    assert worker.metrics().sampled_tokens == frozen and waiting.running()  # nothing generates while paused
    assert call(server, "POST", "/resume", {}) == (200, {"status": "resumed"})
    for row in (running(), waiting()):
        assert row["ids"] == expected.completion_token_lists()[0]
        assert_exact(models, row)
    assert call(server, "GET", "/is_paused") == (200, {"is_paused": False})


def test_an_update_while_paused_recomputes_the_frozen_rows(admin, versions):
    worker, server = admin
    models, path = versions
    running = start_long(server, worker, 40)
    assert call(server, "POST", "/pause?mode=keep", {})[0] == 200
    status, body = call(server, "POST", "/update_weights", {"weight_dir": path, "in_flight": "wait"})
    assert status == 400 and body["error"]["param"] == "in_flight"  # waiting for frozen rows would never end
    assert call(server, "POST", "/sleep", {})[0] == 409
    assert call(server, "POST", "/update_weights", {"weight_dir": path})[1]["policy_version"] == 1
    assert call(server, "POST", "/resume", {})[0] == 200
    row = running()
    assert row["versions"][-1] == 1
    assert_exact(models, row)
    assert call(server, "POST", "/pause?mode=later", {})[1]["error"]["param"] == "mode"


def test_sleep_wake_up_and_reset_prefix_cache_round_trips(admin, versions):
    worker, server = admin
    models, _ = versions
    first = complete(server)
    assert call(server, "POST", "/sleep?level=1", {}) == (200, {"status": "sleeping"})
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": True}) and worker.is_sleeping
    assert call(server, "POST", "/sleep?level=3", {})[1]["error"]["param"] == "level"
    assert call(server, "POST", "/wake_up?tags=kv_cache", {}) == (200, {"status": "awake"})
    assert call(server, "GET", "/is_sleeping") == (200, {"is_sleeping": False})
    assert complete(server) == first
    reused = worker.metrics().prefix_cache_reused_tokens
    assert call(server, "POST", "/reset_prefix_cache", {}) == (200, {"status": "ok"})
    again = complete(server)
    assert again == first and worker.metrics().prefix_cache_reused_tokens == reused  # nothing was matched
    assert_exact(models, again)


# ---------------------------------------------------------------------------------------------- the worker's pause
def test_the_workers_pause_holds_across_a_sleep_and_refuses_what_would_never_end(tiny_path):
    sampling = SamplingParams(max_new_tokens=16, seed=1, ignore_eos=True)
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64)) as worker:
        expected = worker.generate([PROMPT], sampling).completion_token_lists()
        with pytest.raises(ValueError, match="in_flight='recompute' is invalid"):
            worker.pause("recompute")
        worker.resume()  # not paused: nothing happens
        worker.sleep()
        worker.pause("keep")
        worker.pause("wait")  # already paused: nothing happens
        future = worker.submit([PROMPT], sampling)  # wakes the engine, whose loop stays paused
        time.sleep(0.5)
        assert not future.done() and worker.is_paused and not worker.is_sleeping
        with pytest.raises(ValueError, match="in_flight='wait' is invalid: the engine is paused with 1 requests"):
            worker.update_weights(worker.state_dict(), in_flight="wait")
        with pytest.raises(RuntimeError, match="cannot sleep"):
            worker.sleep()
        worker.resume()
        assert future.result(60).completion_token_lists() == expected
        worker.pause("abort")  # closing a paused worker does not hang
