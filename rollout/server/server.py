"""Server: the OpenAI-compatible endpoint over a RolloutWorker or a RolloutFleet, on uvicorn.

    server = rollout.serve(worker, host="127.0.0.1", port=8000)   # background thread; returns once it listens
    client = openai.OpenAI(base_url=server.url, api_key="-")       # server.url ends with /v1
    ...                                                            # the trainer keeps training and updating
    batch = server.take_episode("ep-17")                           # the episode's exact tokens, as a RolloutBatch
    server.close()

The server shares the rollout side with the trainer: a worker's weights updated in place keep serving, and calls in
flight during an update behave as its `in_flight` mode says (each response says which version made every token).
`rollout serve MODEL` (rollout/cli/serve.py) runs the same server in the foreground.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from ..base.rollouts import Rollouts, request_limit
from ..model.loading import pad_token_id
from .completions.chat import ChatFormat
from .completions.prompts import PromptScorer
from .completions.service import Limits, Service
from .rollouts.backend import backend_for
from .rollouts.episodes import EpisodeBatch, EpisodeRecorder
from .transport.limits import RequestLimits

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
KEEP_ALIVE_S = 75  # seconds an idle client connection stays open


class Server:
    """host / port: where to listen (loopback by default; port 0 picks a free one, see `port`). api_key: when set,
    /v1/* needs `Authorization: Bearer <api_key>`. model_name: the name clients pass as `model` (default: the
    checkpoint directory's name, else the model's `name_or_path`). limits: how much one request may ask
    (RequestLimits: n, prompts, stop strings, JSON nesting). admin: mount the RL control plane (admin/routes.py: pause,
    sleep, weight updates; off by default), behind `admin_key` (else `api_key`); a key is required beyond loopback."""

    def __init__(self, rollouts: Rollouts, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
                 model_name: str | None = None, log_level: str = "warning",
                 limits: RequestLimits | None = None, admin: bool = False, admin_key: str | None = None) -> None:
        uvicorn = _import("uvicorn")
        from .admin import routes as control_plane
        from .app import build_app

        if admin:
            control_plane.check_admin_key(host, admin_key or api_key)

        tokenizer = rollouts.tokenizer
        self.rollouts = rollouts
        self.recorder = EpisodeRecorder(tokenizer, pad_token_id(tokenizer))
        self.backend = backend_for(rollouts)
        self.model_name = model_name or rollouts.model_name
        self.scorer = PromptScorer(rollouts)
        service = Service(self.backend, ChatFormat(tokenizer), self.recorder, self.model_name, limits_of(rollouts),
                          self.scorer, limits or RequestLimits())
        app = build_app(service, api_key, lambda: int(rollouts.policy_version))
        self.control = control_plane.Control(rollouts) if admin else None
        if self.control is not None:
            control_plane.mount(app, self.control, admin_key or api_key, service.request_limits)
        # keep-alive longer than clients keep idle connections (httpx, under openai: 5 s), so the client is the one
        # that closes them: at uvicorn's own 5 s the two race, and a request sent on a connection the server is
        # closing fails with "Server disconnected without sending a response" (the agent example hit it after a
        # training step longer than 5 s)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=2, timeout_keep_alive=KEEP_ALIVE_S, lifespan="off")
        self._uvicorn = uvicorn.Server(config)
        self.host, self.port = host, port
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (`http://HOST:PORT/v1`)."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> "Server":
        """Serve on a background thread; returns once the socket listens (or raises what stopped it)."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self._uvicorn.run()
            except BaseException as error:  # noqa: BLE001  (reported to start(), which raises it)
                errors.append(error)

        self._thread = threading.Thread(target=run, daemon=True, name="rollout-serve")
        self._thread.start()
        while not self._uvicorn.started and self._thread.is_alive():
            self._thread.join(0.01)
            timeout -= 0.01
            if timeout <= 0:
                self.close()
                raise TimeoutError("the server did not start listening in time")
        if not self._uvicorn.started:
            raise RuntimeError(f"the server could not start on {self.host}:{self.port}: "
                               f"{errors[0] if errors else 'uvicorn exited (is the port in use?)'}")
        self.port = self._uvicorn.servers[0].sockets[0].getsockname()[1]
        return self

    def run(self) -> None:
        """Serve in this thread until Ctrl-C / SIGTERM (`rollout serve`)."""
        self._uvicorn.run()
        self.backend.close()

    def episodes(self) -> EpisodeRecorder:
        """The collector of recorded episodes: `ids()`, `get(ids)`, `take(ids)`, `discard(id)`, `len()`."""
        return self.recorder

    def take_episode(self, episode_id: str | Sequence[str]) -> EpisodeBatch:
        """The recorded episode (or episodes, rows in the order given) as a RolloutBatch, forgotten here."""
        return self.recorder.take(episode_id)

    def close(self) -> None:
        """Stop listening; requests in flight are cancelled (the rollout side is the caller's: it stays open)."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.backend.close()
        self.scorer.close()
        if self.control is not None:
            self.control.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(rollouts: Rollouts, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, api_key: str | None = None,
          model_name: str | None = None, *, max_n: int = 128, max_prompts: int = 2048, max_stop: int = 64,
          max_json_depth: int = 64, admin: bool = False, admin_key: str | None = None) -> Server:
    """Serve `rollouts` (a RolloutWorker or RolloutFleet) over OpenAI's HTTP API on a background thread. The max_*
    bound one request (RequestLimits; a request past one is a 400 naming it); `admin`: the control plane (admin/routes.py)."""
    limits = RequestLimits(max_n, max_prompts, max_stop, max_json_depth)
    return Server(rollouts, host, port, api_key, model_name, limits=limits, admin=admin, admin_key=admin_key).start()


def limits_of(rollouts: Rollouts) -> Limits:
    """What the rollout side holds: vocabulary, the longest request, the model's EOS ids."""
    return Limits(int(rollouts.vocab_size), request_limit(rollouts.max_context, rollouts.max_request_tokens),
                  tuple(rollouts.default_stop_ids))


def _import(name: str):
    try:
        return __import__(name)
    except ImportError:
        raise ImportError(f"rollout's server needs {name}. Fix: pip install 'rollout[serve]' (fastapi, "
                          "uvicorn)") from None
