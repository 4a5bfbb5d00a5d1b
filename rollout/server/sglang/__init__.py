"""SGLang's native dialect, as the RL stacks that drive an SGLang server speak it (AReaL's SGLangBackend, slime):
`POST /generate` with `input_ids` (or `text`) and SGLang's `sampling_params`, answered in SGLang's shape (`output_ids`,
`text`, `meta_info` with `output_token_logprobs` as [logprob, token id, text or null] per token, `finish_reason`
{"type": "stop" | "length", ...}, token counts and the weight version). The request runs as a completions request on
the same path (checks, limits, exact logprobs, versions). SGLang's control routes (/pause_generation,
/release_memory_occupation, /update_weights_from_distributed, ...) are admin routes: admin/sglang.py.

Files: `generate.py` (the /generate body read as a completions request, and the answer in SGLang's shape).
May import: the server's `transport`, `rollouts` and `completions`; never `responses`, `admin` or the server's top
modules (tests/test_layout.py checks it).
"""
