"""Token-in/token-out endpoints in vLLM's shapes: a client that tokenizes itself (verifiers' RendererClient through the
`renderers` package, prime-rl) talks to the engine in ids only.

    POST /inference/v1/generate  {"model"?, "token_ids": [...], "sampling_params": {...}, "request_id"?}
        -> {"request_id", "choices": [{"index", "token_ids", "logprobs": {"content": [{"token": "token_id:<id>",
            "logprob", "bytes", "top_logprobs": [...]}]} | null, "finish_reason", "token_versions",
            "policy_version"}], "prompt_token_ids", "prompt_logprobs", "usage", "kv_transfer_params": null}
    POST /tokenize    {"prompt", "add_special_tokens"?: true} or {"messages", "add_generation_prompt"?: true, "tools"?}
                      (+ "return_token_strs"?) -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize  {"tokens": [...]} -> {"prompt"}
    GET  /tokenizer_info  -> {"tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "chat_template",
                      "model_max_length"} (what lm-eval's remote tokenizer reads)

The shapes follow vLLM's `GenerateRequest` / `GenerateResponse` (vllm/entrypoints/serve/disagg/protocol.py) and
`TokenizeCompletionRequest` / `TokenizeChatRequest` / `DetokenizeRequest`, and what renderers' `generate` (the client
verifiers uses) sends and reads: `sampling_params.logprobs: k` for the sampled token's logprob and k alternatives, each
named "token_id:<id>". A generate request is a completions request on the same path (checks, limits, episodes):
`sampling_params` are vLLM's names for the completions fields, and errors name them as `sampling_params.<name>`.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..transport.errors import ApiError, bad_request
from .bodies import chat_logprobs, extensions, usage
from .prompts import vllm_prompt_logprobs
from .protocol import Request, messages_of, parse
from .service import Prepared, Service

GENERATE = {"model", "token_ids", "sampling_params", "request_id", "stream", "cache_salt", "priority", "episode_id"}
SAMPLING = {"n", "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
            "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
            "min_tokens", "logit_bias", "include_stop_str_in_output"}
# include_stop_str_in_output (checked as the completions field) shapes vLLM's text only: vLLM's token ids run to the
# token that completes a stop string whatever it says, and so do this endpoint's, the stop string's tokens included
# how vLLM writes the text or stores logprobs; this endpoint returns no text and writes logprobs one way (JSON)
PRESENTATION = {"skip_special_tokens", "spaces_between_special_tokens", "detokenize", "flat_logprobs", "extra_args"}
NEUTRAL = {"stream": (False,), "cache_salt": (None,), "priority": (0,)}


def generate_request(service: Service, body: Any, headers: dict[str, str]) -> tuple[Request, Prepared, str]:
    """The generate body as a checked completions request (400s raised here, before anything is submitted)."""
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - GENERATE)
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    for name, neutral in NEUTRAL.items():
        if body.get(name, neutral[0]) not in neutral:
            raise bad_request(name, f"{name}={body[name]!r} is not supported on this endpoint. Fix: leave it out")
    sampling = body.get("sampling_params", {})
    if not isinstance(sampling, dict):
        raise bad_request("sampling_params", "sampling_params must be an object of vLLM sampling parameters")
    unknown = sorted(set(sampling) - SAMPLING - PRESENTATION)
    if unknown:
        raise bad_request(f"sampling_params.{unknown[0]}", f"Unrecognized sampling parameter: {unknown[0]}")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("token_ids", "token_ids must be a non-empty list of integer token ids")
    completion = {k: v for k, v in sampling.items() if k in SAMPLING and v is not None}
    completion |= {"model": body.get("model") or service.model_name, "prompt": ids, "return_tokens_as_token_ids": True}
    if body.get("episode_id") is not None:
        completion["episode_id"] = body["episode_id"]
    try:
        request = parse("completion", completion, headers, service.request_limits)
        prepared = service.prepare(request)
    except ApiError as error:
        raise _renamed(error) from None
    request_id = body.get("request_id")
    return request, prepared, request_id if isinstance(request_id, str) and request_id else uuid.uuid4().hex


def _renamed(error: ApiError) -> ApiError:
    """An error of the translated request, naming the field as the generate body spells it."""
    names = {"prompt": "token_ids", "prompt_token_ids": "token_ids"} | {k: f"sampling_params.{k}" for k in SAMPLING}
    if error.param in names:
        error.message = error.message.replace(f"{error.param}=", f"{names[error.param]}=", 1)
        error.param = names[error.param]
    return error


async def generate_response(service: Service, request: Request, prepared: Prepared, generation,
                            request_id: str) -> dict:
    outcome = await service.outcome(request, prepared, generation)
    prompt, detok = prepared.prompts[0], prepared.detok
    choices = [{"index": c.index, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, detok, c.top) if request.logprobs else None,
                **{k: v for k, v in extensions(request, c.token_ids, c.token_versions, c).items() if k != "token_ids"}}
               for c in outcome.choices]
    prompt_logprobs = None
    if request.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(prompt, outcome.prompt_scores[0].first(request.prompt_logprobs), detok)
    return {"request_id": request_id, "choices": choices, "prompt_token_ids": prompt,
            "prompt_logprobs": prompt_logprobs, "kv_transfer_params": None,
            "usage": usage(len(prompt), sum(c.sampled for c in outcome.choices), outcome.cached_tokens)}


def tokenize(service: Service, body: Any) -> dict:
    tokenizer = _tokenizer(service, body, {"model", "prompt", "add_special_tokens", "messages", "tools",
                                           "add_generation_prompt", "return_token_strs"})
    strs = body.get("return_token_strs", False)
    if "messages" in body:
        if "prompt" in body or body.get("add_special_tokens", False):
            raise bad_request("prompt" if "prompt" in body else "add_special_tokens", "the chat form takes messages "
                              "(the template writes the special tokens). Fix: send prompt or messages, not both, "
                              "and leave add_special_tokens out")
        ids = service.chat.render(messages_of(body), body.get("tools"), bool(body.get("add_generation_prompt", True)))
    else:
        if not isinstance(body.get("prompt"), str):
            raise bad_request("prompt", "prompt must be a string (or send messages for the chat template)")
        ids = list(tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
                   ["input_ids"])
    return {"count": len(ids), "max_model_len": service.limits.max_tokens, "tokens": ids,
            "token_strs": tokenizer.convert_ids_to_tokens(ids) if strs else None}


def detokenize(service: Service, body: Any) -> dict:
    tokenizer = _tokenizer(service, body, {"model", "tokens"})
    ids = body.get("tokens")
    vocab = service.limits.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in ids):
        raise bad_request("tokens", f"tokens must be a list of integer token ids in [0, {vocab})")
    return {"prompt": tokenizer.decode(ids)}


def tokenizer_info(service: Service) -> dict:
    """vLLM's `GET /tokenizer_info`: what a client that tokenizes through the server (lm-eval's remote tokenizer,
    its default for local-completions) reads to know the special tokens and render chats itself."""
    tokenizer = _tokenizer(service, {}, set())
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    template = getattr(tokenizer, "chat_template", None)
    return {"tokenizer_class": type(tokenizer).__name__, **{k: str(v) if v is not None else None
                                                             for k, v in special.items()},
            "chat_template": template if isinstance(template, str) else None,
            "model_max_length": service.limits.max_tokens}


def _tokenizer(service: Service, body: Any, fields: set[str]) -> Any:
    """The served tokenizer, once the body is an object of known fields naming the served model (if any)."""
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - fields)
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    model = body.get("model")
    if model is not None and model != service.model_name:
        raise ApiError(404, f"The model `{model}` does not exist. Fix: use `{service.model_name}` (GET /v1/models)",
                       "model", "model_not_found")
    if service.tokenizer is None:
        raise bad_request(None, "this server has no tokenizer. Fix: serve a worker built with tokenizer=...")
    return service.tokenizer
