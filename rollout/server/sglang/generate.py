"""SGLang's `POST /generate`, as AReaL's SGLangBackend and slime send it, run as a completions request.

    {"input_ids": [...] | [[...], ...], "text"?: str | [str, ...], "sampling_params": {...}, "return_logprob"?: false,
     "top_logprobs_num"?: 0, "return_text_in_logprobs"?: false, "rid"?: str, "stream"?: false, "episode_id"?: str}
    -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop", "matched": id | str} |
        {"type": "length", "length": max_new_tokens}, "prompt_tokens", "completion_tokens", "weight_version": "N",
        "policy_version", "token_versions", "output_token_logprobs"?: [[logprob, id, text | null], ...],
        "output_top_logprobs"?: [[[logprob, id, text | null], ...], ...]}}

One prompt with n = 1 is answered with one object; a batch of prompts, or n > 1, with a list of them, prompt-major
(all samples of prompt 0, then prompt 1, ...). `sampling_params` takes SGLang's names (`max_new_tokens`, default 128,
`min_new_tokens`, `sampling_seed`, `no_stop_trim`, `top_k` -1 = off, ...); each is the completions field of the
same meaning, so every check, limit and error applies, naming the field as the body spells it
(`sampling_params.max_new_tokens`). `text` is tokenized as SGLang does (`tokenizer.encode`, special tokens added).
Fields that change nothing here are accepted only at their neutral value (`stream: false`, `image_data: null`, ...),
anything else is refused by name.

`GET /health_generate` (SGLang's, slime's engine health check): SGLang's probe, one greedy token after token id 0,
run as a /generate; an empty 200 once it is generated, else a 503 saying why: the rollout side is asleep (a probe never
re-allocates a released KV cache), or no token came within SGLang's 20 s (paused, or the engine failing).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

from ..completions.protocol import Request, flag, parse  # flag: null or left out is false, as SGLang's
from ..completions.service import Prepared, Service
from ..rollouts.choices import Choice
from ..transport.errors import ApiError, bad_request

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default
# SGLang's sampling names -> the completions field of the same meaning
SAMPLING = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed",
            "no_stop_trim": "include_stop_str_in_output", "n": "n", "temperature": "temperature", "top_p": "top_p",
            "top_k": "top_k", "min_p": "min_p", "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty", "repetition_penalty": "repetition_penalty", "stop": "stop",
            "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "logit_bias": "logit_bias",
            "skip_special_tokens": "skip_special_tokens"}
# SGLang sampling fields with no counterpart here: accepted at these values only (stream_interval: streaming only)
SAMPLING_NEUTRAL = {"spaces_between_special_tokens": (True,), "json_schema": (None,), "regex": (None,),
                    "ebnf": (None,), "structural_tag": (None,), "custom_params": (None,)}
SAMPLING_INERT = {"stream_interval"}
# top-level fields with no meaning here: accepted at these values only
NEUTRAL = {"stream": (False,), "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []),
           "lora_path": (None,), "logprob_start_len": (None, -1), "token_ids_logprob": (None, []),
           "return_hidden_states": (False,), "return_routed_experts": (False,), "custom_logit_processor": (None,),
           "input_embeds": (None,), "session_params": (None,), "priority": (None, 0), "data_parallel_rank": (None,)}
FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "return_text_in_logprobs",
          "rid", "episode_id", "log_metrics", *NEUTRAL}
FIX = {"logprob_start_len": "prompt logprobs are /v1/completions' echo or prompt_logprobs here",
       "return_routed_experts": "MoE routing is recorded in-process: WorkerConfig(record_routing=True)",
       "stream": "send stream=false (or stream from /v1/completions)"}


HEALTH_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
HEALTH_PROBE = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}  # SGLang's probe


@dataclass(frozen=True)
class Plan:
    """How the answer is shaped: one object or a list, which ids the request gave, what it asked to see."""

    single: bool
    rid: str
    return_logprob: bool
    text_in_logprobs: bool
    max_new_tokens: int


def generate_request(service: Service, body: Any, headers: dict[str, str]) -> tuple[Request, Prepared, Plan]:
    """The /generate body as a checked completions request (every 400 raised here, before anything is submitted)."""
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    _neutral(body, NEUTRAL, "")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params", "sampling_params must be an object of SGLang sampling parameters (one "
                          "for every prompt)")
    unknown = sorted(set(sampling) - set(SAMPLING) - set(SAMPLING_NEUTRAL) - SAMPLING_INERT)
    if unknown:
        raise bad_request(f"sampling_params.{unknown[0]}", f"Unrecognized sampling parameter: {unknown[0]}")
    _neutral(sampling, SAMPLING_NEUTRAL, "sampling_params.")
    prompts, single, field = _prompts(service, body)
    completion = {SAMPLING[k]: v for k, v in sampling.items() if k in SAMPLING and v is not None}
    completion.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    return_logprob = flag(body, "return_logprob", False)
    top = body.get("top_logprobs_num") or 0
    if top and not return_logprob:
        raise bad_request("top_logprobs_num", "top_logprobs_num needs return_logprob=true")
    if return_logprob:
        completion["logprobs"] = top
    completion |= {"model": service.model_name, "prompt": prompts, "return_tokens_as_token_ids": True}
    if body.get("episode_id") is not None:
        completion["episode_id"] = body["episode_id"]
    try:
        request = parse("completion", completion, headers, service.request_limits)
        prepared = service.prepare(request)
    except ApiError as error:
        raise _renamed(error, field) from None
    rid = body.get("rid")
    plan = Plan(single and request.n == 1, rid if isinstance(rid, str) and rid else uuid.uuid4().hex,
                return_logprob, flag(body, "return_text_in_logprobs", False), request.max_tokens)
    return request, prepared, plan


def _neutral(body: dict, neutral: dict[str, tuple], prefix: str) -> None:
    for name, values in neutral.items():
        value = body.get(name)
        if name in body and not any(value == v and type(value) is type(v) for v in values):
            fix = FIX.get(name, f"leave it out (or at {values[0]!r})")
            raise bad_request(f"{prefix}{name}", f"{prefix}{name}={value!r} is not supported by this server's "
                              f"/generate. Fix: {fix}")


def _prompts(service: Service, body: dict) -> tuple[list[list[int]], bool, str]:
    """(token-id prompts, whether one prompt was sent, the field they came from)."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise bad_request("input_ids", "send either input_ids (token ids, or a list of them) or text, not both")
    if ids is not None:
        single = isinstance(ids, list) and bool(ids) and not isinstance(ids[0], list)
        lists = [ids] if single else ids
        if not isinstance(lists, list) or not lists or not all(
                isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in lists):
            raise bad_request("input_ids", "input_ids must be a non-empty list of integer token ids, or a non-empty "
                              "list of them")
        return [list(p) for p in lists], single, "input_ids"
    texts = [text] if isinstance(text, str) else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad_request("text", "text must be a non-empty string or a non-empty list of them")
    if service.tokenizer is None:
        raise bad_request("text", "this server has no tokenizer. Fix: send input_ids")
    return [list(service.tokenizer.encode(t)) for t in texts], isinstance(text, str), "text"


def _renamed(error: ApiError, field: str) -> ApiError:
    """An error of the translated request, naming the field as the /generate body spells it."""
    names = {"prompt": field, "prompt_token_ids": field, "logprobs": "top_logprobs_num", "max_new_tokens":
             "sampling_params.max_new_tokens", "min_new_tokens": "sampling_params.min_new_tokens"}
    names |= {ours: f"sampling_params.{theirs}" for theirs, ours in SAMPLING.items()}
    if error.param in names:
        error.message = error.message.replace(f"{error.param}=", f"{names[error.param]}=", 1)
        error.param = names[error.param]
    return error


async def generate_response(service: Service, request: Request, prepared: Prepared, generation,
                            plan: Plan) -> dict | list[dict]:
    outcome = await service.outcome(request, prepared, generation)
    outputs = [_output(service, request, prepared, plan, c, i) for i, c in enumerate(outcome.choices)]
    return outputs[0] if plan.single else outputs


def _output(service: Service, request: Request, prepared: Prepared, plan: Plan, choice: Choice,
            index: int) -> dict:
    version = choice.policy_version
    meta = {"id": plan.rid if plan.single else f"{plan.rid}_{index}",
            "finish_reason": _finish_reason(service, request, plan, choice),
            "prompt_tokens": len(choice.prompt_ids), "completion_tokens": len(choice.token_ids),
            "weight_version": str(version),  # every choice has a token: max_new_tokens >= 1
            "policy_version": version, "token_versions": choice.token_versions}
    if plan.return_logprob:
        meta["output_token_logprobs"] = [[lp, t, _piece(service, plan, t)]
                                         for lp, t in zip(choice.logprobs, choice.token_ids)]
        if request.top_logprobs:
            meta["output_top_logprobs"] = [[[float(lp), int(t), _piece(service, plan, int(t))]
                                            for t, lp in zip(ids[:request.top_logprobs], lps[:request.top_logprobs])]
                                           for ids, lps in choice.top]
    return {"text": choice.text, "output_ids": choice.token_ids, "meta_info": meta}


def _piece(service: Service, plan: Plan, token: int) -> str | None:
    return service.tokenizer.decode([token]) if plan.text_in_logprobs and service.tokenizer is not None else None


def _finish_reason(service: Service, request: Request, plan: Plan, choice: Choice) -> dict:
    """SGLang's FINISH_* as JSON: the stop string or token that matched, or the length budget."""
    if choice.finish_reason != "stop":
        return {"type": "length", "length": plan.max_new_tokens}
    if request.stop and service.tokenizer is not None and choice.token_ids:
        written = service.tokenizer.decode(choice.token_ids, skip_special_tokens=False)
        found = [(written.find(s), s) for s in request.stop if s in written]
        if found:
            return {"type": "stop", "matched": min(found)[1]}
    return {"type": "stop", "matched": choice.token_ids[-1] if choice.token_ids else None}


async def health_generate(service: Service) -> dict:
    """SGLang's probe generated (its answer: the /generate object), or a 503 ApiError saying why not."""
    timeout = HEALTH_TIMEOUT_S
    if getattr(service.backend.rollouts, "is_sleeping", False):
        raise ApiError(503, "the rollout side is asleep (its KV cache released: /release_memory_occupation or /sleep); "
                       "a health probe does not wake it. Fix: POST /resume_memory_occupation", code="unhealthy",
                       type="server_error")
    request, prepared, plan = generate_request(service, HEALTH_PROBE, {})

    async def probe() -> dict:
        return await generate_response(service, request, prepared, await service.start(request, prepared), plan)

    try:
        return await asyncio.wait_for(probe(), timeout)
    except asyncio.TimeoutError:
        raise ApiError(503, f"no token generated within {timeout:g} s (generation paused, or the engine failing)",
                       code="unhealthy", type="server_error") from None
    except RuntimeError as error:  # the rollout side gave up on the probe (its retries spent)
        raise ApiError(503, f"the probe failed: {error}", code="unhealthy", type="server_error") from None
