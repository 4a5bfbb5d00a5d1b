"""An OpenAI-compatible HTTP server over a RolloutWorker or RolloutFleet: token ids, exact logprobs and versions.

    server = rollout.serve(worker, host="127.0.0.1", port=8000)   # or: rollout serve MODEL
    batch = server.take_episode(episode_id)                        # what an agent harness sampled, token-exact

May import rollout's public modules (`batch`, `params`, `loading`, the worker's public API), fastapi, starlette and
uvicorn (lazily: `rollout[serve]`); never the engine's internals, Ray or trainers_integration. Files, one concept
each: `protocol.py` (request bodies, checked), `chat.py` (chat template in, parse_response out, episode
continuations), `choices.py` (rows to choices: stop strings, streaming deltas), `responses.py` (response and chunk
bodies), `backend.py` (the rollout side seen from the event loop), `episodes.py` (episode recording, segments),
`service.py` (one request, start to end), `prompts.py` (prompt logprobs, teacher-forced by the rollout side's
`score`), `tokens.py` (vLLM's token-in/token-out endpoints), `turns.py` (a Responses API request, read as the chat
request it runs as), `items.py` (Responses items and tools in chat shapes, and back), `replies.py` (the Responses
object and its events), `store.py` (the responses kept for `previous_response_id`), `limits.py` (how much one
request may ask), `app.py` (the FastAPI routes), `admin.py` and `transfer.py` (the RL control plane, only with
`--admin`: pause, sleep, weight updates, and where their tensors come from), `server.py` (the handle and `serve`),
`errors.py` (OpenAI's error shape). Docs: docs/serve.md.
"""

from .episodes import EpisodeBatch, EpisodeRecorder
from .server import Server, serve

__all__ = ["EpisodeBatch", "EpisodeRecorder", "Server", "serve"]
