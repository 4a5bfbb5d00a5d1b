"""The Chat Completions and Completions APIs (`POST /v1/chat/completions`, `POST /v1/completions`), and the same
requests in vLLM's token-in/token-out shapes.

Files: `protocol.py` (request bodies, checked), `formats.py` (response_format and forced tool calls: constrained
decoding), `chat.py` (ChatFormat: chat template in, parse_response out, episode continuations), `prompts.py` (prompt
logprobs, teacher-forced by the rollout side's `score`), `service.py` (one request, start to end), `bodies.py` (the
chat.completion / text_completion bodies and their chunks), `tokens.py` (vLLM's /inference/v1/generate, /tokenize,
/detokenize). May import: `base` of rollout's folders, and the server's `transport` and `rollouts`; never `responses`,
`admin` or the server's top modules (tests/test_layout.py checks it).
"""
