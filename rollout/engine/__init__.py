"""The engine layer: transformers' continuous-batching engine, made exact and unkillable.

Owns everything that touches transformers' continuous-batching engine; its private parts only through `upstream/`
(the one room for them and for every process-wide patch: each private name listed in `upstream.HOOKS`, each patch
done once by a function of `upstream/patches.py`, called by the engine; importing rollout changes nothing in
transformers). May import: torch, transformers, and rollout's `base` and `moe`. Knows nothing about tokenizers (but
the grammar compiler a worker hands it, `Grammars`), Ray or trainers.

Rooms (each `__init__` says what it owns and may import; tests/test_layout.py checks the arrows, which point one way:
the top-level modules wire the rooms, and `upstream/` imports nothing of the engine outside it):
  upstream/     transformers' private code subclassed and hooked; every process-wide patch
  kernels/      CPU kernels: the paged decode kernel, fused norms and rotary, oneDNN linears, OpenMP
  device/       the KV cache's size, what a CUDA device turns on
  attention/    `rollout_paged`, the mask-free paged attention, and which attention runs where
  sampling/     per-row sampling on the device: sampler, slot table, penalties, grammars, random streams, the step
  observe/      counters, turn traces, MoE routing records
  requests/     calls, samples, what is in flight, the ledger of logprobs and versions
  episodes/     multi-turn episodes: their state, the driver, environment steps
  speculation/  drafts, the speculator, the verifier
  engine.py (lifecycle, submission, inspection), delivery.py (engine-thread callbacks), supervisor.py (healing),
  fence.py (the weight fence, hold and release)

One request, hop by hop, from `RolloutWorker.generate` to its row (docs/architecture.md draws the same path across
the threads):
1. submit (`engine.py`, `Engine.submit` / `Engine._submit`): the samples of one prompt become one `RequestState` whose
   children are the other samples; each gets a `RowSpec` (its params and the key of its random stream,
   `sampling/streams.py`; made in `delivery.py`), and the state goes to the manager (`upstream/manager.py`,
   `RolloutManager.submit`).
2. schedule (`upstream/scheduler.py`, `RolloutScheduler`): upstream's FIFO scheduler picks prefill chunks and decodes
   under the token budget; the 1-token fork that would crash upstream becomes separate children sharing cached blocks;
   a speculating engine's decoding rows get their drafts (`speculation/verifier.py`).
3. forward (`upstream/manager.py` runs upstream's loop on the engine thread, with every hook plugged in at
   construction; `attention/paged.py` + `attention/plan.py` are the mask-free `rollout_paged` attention that reads the
   paged cache, on `kernels/decode_kernel.py` where it builds; `device/sizing.py` sizes the cache,
   `upstream/memory.py` fits upstream's memory plan to it; `device/cuda.py` picks what a CUDA device turns on).
4. sample (`upstream/runner.py` plugs in the engine's `sampling/step.py`, `StepSampler`: the step's inputs carry each
   row's slot in a device table of per-request parameters, `sampling/slots.py`, and the step's typed `StepChoice`
   goes from its inputs to its forward and read-back; `sampling/sampler.py`, `sample_rows`): per-row penalties /
   logit bias / min_new_tokens (`sampling/penalties.py`, rows counted on the device), the grammar masks of
   constrained rows (`sampling/grammar.py`, matchers advanced on the host as each step's inputs are prepared),
   temperature / min-p / top-k / top-p and both logprobs from the one set of logits, on the device, written into the
   step's output tensor and read back with the tokens; `requests/inflight.py` tracks what is in flight,
   `requests/ledger.py` each request's logprobs and versions.
5. deliver (`upstream/router.py` -> `delivery.py`, `Engine._on_output`): each finished request becomes a `Row`,
   exactly once, on the sample that asked for it; an episode's turn goes to its driver (`episodes/driver.py`), which
   runs the environment step off the engine thread (`episodes/stepper.py`) and submits the next turn.
6. heal (`supervisor.py`, `Engine._heal`): if the engine thread died or a request failed, the manager is rebuilt and
   every unfinished sample re-runs (up to `max_retries`), logged on the "rollout" logger; weight changes go through
   `Engine.exclusive` (`fence.py`), which drains or aborts in-flight work and forgets every prefix-cache hash
   (`upstream/switch.py`). `Engine.sleep` drops the manager (cache and buffers) for a trainer sharing the device;
   the next call builds a fresh one.
7. count (`observe/counters.py`): along the way the engine counts what `RolloutWorker.metrics()` reports (tokens
   sampled per step, rows as they finish, the KV peak after scheduling, soft resets through `upstream/preemption.py`,
   weight switches in `Engine.exclusive`), in one object kept across restarts and sleeps.
"""

from .attention import install, resolve_attn_implementation, set_attn_implementation
from .engine import Call, Engine, InFlight, Sample
from .episodes.episode import Episode
from .observe.trace import TurnTrace
from .sampling.grammar import Grammars
from .speculation.draft_model import DraftModel
from .upstream import current_attn_implementation

__all__ = ["Call", "DraftModel", "Engine", "Episode", "Grammars", "InFlight", "Sample", "TurnTrace",
           "current_attn_implementation", "install", "resolve_attn_implementation", "set_attn_implementation"]
