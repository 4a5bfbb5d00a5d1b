"""Shared fixtures: a tiny model built locally once per session, loaded back through from_pretrained; and the helpers
more than one test module uses (imported as `from conftest import ...`: a test module never imports another)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from rollout import RolloutWorker, Turn, WorkerConfig
from rollout.testing import build_chat_tokenizer, build_tiny_model, load_tiny_model


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


# ---------------------------------------------------------------------------------------------- prompts, weights
TOL = 1e-5  # an engine logprob against a plain teacher-forced forward (tests/test_worker.py)
PAGE = 16  # the episodes worker's page size


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lengths]


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t + 0.3 * torch.randn(t.shape, generator=gen) * t.std() if t.is_floating_point() and t.numel() > 1
            else t.clone() for name, t in model.state_dict().items()}


def gaps_by_version(models: dict, batch) -> dict[int, float]:
    """Max |logprob - teacher-forced forward under the weights of the token's own version|, per version."""
    worst: dict[int, float] = {}
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        ids = batch.completion_ids[r, :n].tolist()
        versions = batch.token_versions[r, :n]
        for version, model in models.items():
            at = versions == version
            if at.any():
                full, _ = reference_logprobs(model, batch.prompt_ids[r], ids)
                gap = float((batch.logprobs[r, :n][at] - full[at]).abs().max())
                worst[version] = max(worst.get(version, 0.0), gap)
    return worst


# ---------------------------------------------------------------------------------------------- in flight
def wait_for_tokens(worker, at_least: int, timeout: float = 30.0) -> None:
    """Until every in-flight request has sampled `at_least` tokens (so a switch now lands mid-generation)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # the requests that have sampled tokens (those waiting to be scheduled have none yet)
        counts = [n for n in worker.engine.in_flight().requests.values() if n]
        if counts and min(counts) >= at_least:
            return
        time.sleep(0.001)
    raise AssertionError("the requests never got going")


def settled(engine) -> bool:
    """No engine request in flight, no ledger entry kept and no call unsettled (one `Engine.in_flight` snapshot)."""
    state = engine.in_flight()
    return not state.requests and state.ledger_entries == 0 and state.calls == 0


def wait_until(condition, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


class Slowish:
    """An environment whose steps take 50 ms (an update lands while episodes are in them); turn k is answered with
    `observation(k)`."""

    @staticmethod
    def observation(turn: int) -> list[int]:
        return [11, 12, 13 + turn]

    def __init__(self, prompt_index: int, sample_index: int) -> None:
        self.turns = 0

    def step(self, completion_ids: list[int]) -> Turn:
        self.turns += 1
        time.sleep(0.05)
        return Turn(self.observation(self.turns))


@pytest.fixture()
def slow_steps(monkeypatch):
    """From now on every engine step takes 30 ms more: the 900 tokens a test asks for would take ~30 s, so a request
    that ends early was cancelled, not run to its end."""
    from rollout.engine.upstream.runner import RolloutModelRunner

    original = RolloutModelRunner._forward_process_and_sample

    def slow(self, *args):  # 30 ms a step: the 900 tokens asked for would take ~30 s
        time.sleep(0.03)
        return original(self, *args)

    monkeypatch.setattr(RolloutModelRunner, "_forward_process_and_sample", slow)


# ---------------------------------------------------------------------------------------------- episodes
@pytest.fixture(scope="module")
def episodes_worker(tiny_path):
    """The episodes tests' worker (tests/test_episodes.py, tests/test_segments.py): the tiny model, page size PAGE."""
    model, tok = load_tiny_model(tiny_path)
    with RolloutWorker(model, WorkerConfig(page_size=PAGE, max_batch_tokens=256), tokenizer=tok) as w:
        yield w


# ---------------------------------------------------------------------------------------------- mixtures of experts
def row_tokens(batch, r: int) -> list[int]:
    return list(batch.prompt_ids[r]) + batch.completion_ids[r, : int(batch.completion_lengths[r])].tolist()


def own_routing(model, tokens: list[int]) -> torch.Tensor:
    """The trainer's routing of one row: a plain forward, (positions, layers, top_k) sorted expert ids."""
    from rollout.moe import capture_routing

    with torch.no_grad(), capture_routing(model) as captured:
        model(torch.tensor([tokens]))
    return captured[0].sort(dim=-1).values


def agreement(batch, model) -> float:
    """Fraction of (row, position, layer) whose recorded top-k set is the trainer's own."""
    same = total = 0
    for r in range(len(batch)):
        tokens = row_tokens(batch, r)
        recorded = batch.routing.rows[r].long().sort(dim=-1).values
        assert recorded.shape[0] == len(tokens) - 1, "every fed position is recorded, no hole"
        mine = own_routing(model, tokens)[: len(tokens) - 1]
        equal = (recorded == mine).all(dim=-1)
        same, total = same + int(equal.sum()), total + equal.numel()
    return same / total


# ---------------------------------------------------------------------------------------------- the server
# The served model is taught (sharper logits than a normally initialised one, init std 0.02, for which the rule is
# 1e-5: tests/test_worker.py): its engine logprobs sit up to 1.2e-5 from a plain forward on an AVX-512 EPYC core
# (n = 3, T = 0.9) where another core measured under 1e-5, so the bound here is the taught model's floor.
SERVED_TOL = 3e-5
USER = [{"role": "user", "content": "what is two plus three"}]
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|end|>'


@pytest.fixture(scope="module")
def tok():
    """The tool-speaking chat tokenizer (rollout.testing.build_chat_tokenizer)."""
    return build_chat_tokenizer()


@contextlib.contextmanager
def serving(model, tok):
    """(worker, server, client) over `model`, shared in place by a worker, served on a free port."""
    import openai

    import rollout

    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=128), tokenizer=tok)
    server = rollout.serve(worker, port=0, model_name="tiny")
    try:
        yield worker, server, openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    finally:
        server.close()
        worker.close()


def http(url: str, data: bytes | None = None) -> tuple[int, dict]:
    """A raw request (what the openai client would never send), without the client: (status, JSON body)."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def post_json(server, path: str, body: dict | None, key: str | None = None) -> tuple[int, object]:
    """POST a JSON body to a served route (the server's root, not /v1), with the admin key as a bearer token where
    given: (status, the JSON answer), an error status included."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": USER, **kwargs})


def assert_served_exact(model, prompt_ids, token_ids, logprobs, temperature=1.0):
    full, _ = reference_logprobs(model, prompt_ids, token_ids, temperature=temperature)
    gap = float((torch.tensor(logprobs) - full).abs().max())
    assert gap <= SERVED_TOL, gap


def assert_alternatives_exact(model, prompt, ids, alternatives, k, temperature):
    """Each position's alternatives ("token_id:<id>", logprob) are the k most likely tokens of a teacher-forced
    log_softmax(logits / T), most likely first, each with its own logprob there. The bound is the engine's forward
    against a plain one on this taught model (larger logits than the untaught one): the sampled tokens' own logprobs
    of the request below are up to 1.2e-5 off at T = 0.8, its alternatives up to 1.7e-5; the untaught model's lists
    meet 1e-5 (tests/test_worker.py). That they come from the sampled token's own log-softmax is checked bit for bit
    by the caller."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
    reference = torch.log_softmax(logits / temperature, dim=-1)
    assert len(alternatives) == len(ids) and all(len(a) == k for a in alternatives)
    listed = torch.tensor([[int(name.removeprefix("token_id:")) for name, _ in a] for a in alternatives])
    values = torch.tensor([[v for _, v in a] for a in alternatives])
    assert float((values - reference.topk(k, dim=-1).values).abs().max()) <= 3e-5  # the k largest, in order
    assert float((values - reference.gather(1, listed)).abs().max()) <= 3e-5  # each id's own logprob


# ---------------------------------------------------------------------------------------------- admin routes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def background(fn, *args):
    """Run fn(*args) on a thread; returns a function that joins it and gives its result."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()

    def result():
        thread.join(120)
        return out[0]

    result.running = thread.is_alive
    return result
