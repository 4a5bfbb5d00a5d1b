"""The engine layer: transformers' continuous-batching engine, made exact and unkillable.

Owns everything that touches transformers' continuous-batching engine; its private parts only through `upstream/`
(the one room for them: every hook listed in `upstream.HOOKS`, installed by `upstream.install()`, which the engine
calls; importing rollout changes nothing in transformers). May import: torch, transformers, and rollout's `base` and
`moe`. Knows nothing about tokenizers (but the grammar compiler a worker hands it, `grammar.Grammars`), Ray or
trainers.

One request, hop by hop, from `RolloutWorker.generate` to its row:
1. submit (`core.py`, `Engine.submit` / `Engine._submit`): the samples of one prompt become one `RequestState` whose
   children are the other samples; each gets a `RowSpec` (its params and the key of its random stream,
   `streams.py`), and the state goes to the manager (`upstream/manager.py`, `RolloutManager.submit`).
2. schedule (`upstream/scheduler.py`, `RolloutScheduler`): upstream's FIFO scheduler picks prefill chunks and decodes
   under the token budget; the 1-token fork that would crash upstream becomes separate children sharing cached blocks.
3. forward (`upstream/manager.py` runs upstream's loop on the engine thread, with every hook plugged in at
   construction; `upstream/attention.py` + `upstream/plan.py` are the mask-free `rollout_paged` attention that reads
   the paged cache; `sizing.py` sizes the cache, `upstream/memory.py` fits upstream's memory plan to it; `cuda.py`
   picks what a CUDA device turns on: flash, the decode fast path, CUDA graphs).
4. sample (`upstream/runner.py`: the step's inputs carry each row's slot in a device table of per-request parameters,
   `slots.py`; `RolloutModelRunner._forward_process_and_sample` -> `sampler.py`, `sample_rows`): per-row
   penalties / logit bias / min_new_tokens (`penalties.py`, rows counted on the device), the grammar masks of
   constrained rows (`grammar.py`, matchers advanced on the host as each step's inputs are prepared), temperature /
   min-p / top-k / top-p and both logprobs from the one set of logits, on the device, written into the step's output
   tensor and read back with the tokens; `requests.py` tracks what is in flight, `ledger.py` each request's logprobs and
   versions.
5. deliver (`upstream/router.py` -> `Engine._on_output`): each finished request becomes a `Row`, exactly once, on the
   sample that asked for it; an episode's turn goes to its driver (`driver.py`), which runs the environment step off
   the engine thread (`stepper.py`) and submits the next turn.
6. heal (`core.py`, `Engine._heal`): if the engine thread died or a request failed, the manager is rebuilt and
   every unfinished sample re-runs (up to `max_retries`), logged on the "rollout" logger; weight changes go through
   `Engine.exclusive`, which drains or aborts in-flight work and forgets every prefix-cache hash
   (`upstream/switch.py`). `Engine.sleep` drops the manager (cache and buffers) for a trainer sharing the device;
   the next call builds a fresh one.
7. count (`counters.py`): along the way the engine counts what `RolloutWorker.metrics()` reports (tokens sampled
   per step, rows as they finish, the KV peak after scheduling, soft resets through `upstream/preemption.py`, weight
   switches in `Engine.exclusive`), in one object kept across restarts and sleeps.
"""

from .engine import Call, Engine, Sample
from .speculation.draft_model import DraftModel
from .episodes.episode import Episode
from .sampling.grammar import Grammars
from .observe.trace import TurnTrace
from .attention import install, resolve_attn_implementation, set_attn_implementation
from .upstream import current_attn_implementation

__all__ = ["Call", "DraftModel", "Engine", "Episode", "Grammars", "Sample", "TurnTrace", "current_attn_implementation",
           "install", "resolve_attn_implementation", "set_attn_implementation"]
