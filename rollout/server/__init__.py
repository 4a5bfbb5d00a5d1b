"""An OpenAI-compatible HTTP server over a RolloutWorker or RolloutFleet: token ids, exact logprobs and versions.

    server = rollout.serve(worker, host="127.0.0.1", port=8000)   # or: rollout serve MODEL
    batch = server.take_episode(episode_id)                        # what an agent harness sampled, token-exact

May import rollout's public modules (`batch`, `params`, `loading`, the worker's public API), fastapi, starlette and
uvicorn (lazily: `rollout[serve]`); never the engine's internals, Ray or trainers_integration. Grouped by the API
each part serves, every subpackage importing only the ones below it (tests/test_layout.py checks both):
`transport/` (OpenAI's error shape, request limits and the JSON body), `rollouts/` (the rollout side as the event
loop sees it, rows to choices, episode recording), `completions/` (Chat Completions, Completions, and vLLM's
token-in/token-out endpoints), `responses/` (the Responses API and its store), `sglang/` (SGLang's native
`/generate`, as AReaL and slime send it), `admin/` (the RL control plane, only
with `--admin`: pause, sleep, weight updates, and where their tensors come from). On top: `app.py` (the FastAPI
routes of every API) and `server.py` (the handle and `serve`). Docs: docs/serve.md.
"""

from .rollouts.episodes import EpisodeBatch, EpisodeRecorder
from .server import Server, serve

__all__ = ["EpisodeBatch", "EpisodeRecorder", "Server", "serve"]
