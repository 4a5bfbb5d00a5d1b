"""Delivery: what the engine does on its engine thread as upstream reports a step (mixed into `Engine`).

Every sampled token is recorded in the ledger with the version whose weights ran its step (`_record`); a finished
request becomes a `Row` exactly once, on the sample that asked for it (`_on_output` -> `_make_row`), or an episode's
turn handed to its driver (`_turn_done`); a streamed request's progress goes to its call's `on_tokens`. Each row's
`RowSpec` (its params and the key of its random stream) is made here too (`_make_row_spec`): the tokens depend on
nothing but the seed and the sample's place (batch, timing, preemption and restarts aside).

Uses the engine's lock (`_cond`), bookkeeping (`_requests`), counters, routing recorder, speculator and driver.
"""

from __future__ import annotations

import time

from ..base.batch import Row
from ..base.params import SamplingParams
from ..moe import Routing
from .observe.recorder import RoutingHole
from .requests.call import Sample
from .requests.ledger import Entry, split_tops
from .sampling.sampler import RowSpec
from .sampling.streams import stream_key
from .upstream import GenerationOutput, RequestStatus, TopReader

# The first word of a random stream's key (streams.py): seeded and unseeded samples never share a stream. A stream's
# counter is the position sampled at, so the turns of an episode (new requests, later positions) never replay it.
SEEDED, UNSEEDED = 1, 2


class Delivery:
    """The engine-thread callbacks (`upstream.Hooks`) of `Engine`."""

    def _row_spec(self, request_id: str) -> RowSpec:
        spec = self._requests.ledger.specs.get(request_id)
        if spec is None:  # a forked child: inherits its parent's params, with its own stream key
            sample = self._requests.pending.get(request_id)
            if sample is None:  # abandoned (aborted, timed out) while the engine forks it: output is dropped
                return RowSpec(SamplingParams(temperature=0.0))
            spec = self._make_row_spec(sample)
            self._requests.ledger.specs[request_id] = spec
        return spec

    def _draftable(self, request_id: str) -> bool:
        """May the speculator draft for this request (speculator.py): tracked, its sampling reads no counts of its
        own earlier tokens (penalties, bias, min_new_tokens are counted once per step) and no grammar."""
        if not self._requests.is_pending(request_id):
            return False
        params = self._row_spec(request_id).params
        return not params.adjusts_logits and not params.is_constrained  # a grammar advances once per step

    def _drafted(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify row's counts, on its sample (engine thread; a forked child's on its own sample); the routing
        recorder keeps the positions of the drafts it accepted."""
        if self._recorder is not None:
            self._recorder.verified(request_id, accepted)
        sample = self._requests.pending.get(request_id)
        if sample is not None:
            sample.draft_tokens += drafted
            sample.accepted_tokens += accepted

    def _make_row_spec(self, sample: Sample) -> RowSpec:
        """A seeded sample's stream is keyed on (seed, sample index), an unseeded one's on (worker seed, call order,
        prompt index, sample index): the tokens depend on nothing else (batch, timing, preemption, restarts)."""
        seed = sample.params.seed
        if seed is not None:
            return RowSpec(sample.params, stream_key(SEEDED, seed, sample.sample_index), sample.stop_ids)
        return RowSpec(sample.params, stream_key(UNSEEDED, self.config.seed, sample.call.index, sample.prompt_index,
                                                 sample.sample_index), sample.stop_ids)

    def _record(self, request_ids: list[str], values: list[float], top: TopReader) -> None:
        # the version changes only inside a pause of the loop, so it is the one whose weights ran this step
        self._requests.ledger.record(request_ids, values, self.version, top)
        self.counters.sampled(len(request_ids))
        trace = self.trace
        if trace is not None:
            trace.sampled(request_ids, time.perf_counter())

    def _trace_step(self, start: float, end: float) -> None:
        trace = self.trace
        if trace is not None:
            trace.step(start, end)

    def _on_output(self, output: GenerationOutput) -> None:
        if output.error is None and output.status != RequestStatus.FINISHED and self._on_progress(output):
            return
        if self._speculator is not None:  # a finished turn feeds the drafts of later samples of its prompt
            finished = output.status == RequestStatus.FINISHED and output.error is None
            self._speculator.done(output.request_id, output.prompt_ids, output.generated_tokens if finished else None)
        with self._cond:
            sample, entry = self._requests.take(output.request_id)
            if sample is None:  # cancelled by an abort fence, or already re-run
                if self._recorder is not None:
                    self._recorder.drop(output.request_id)
                return
            routing, error = self._take_routing(sample, output)
            if output.status == RequestStatus.FINISHED and output.error is None and error is None:
                if sample.episode is None:
                    sample.call.finish(sample, self._make_row(sample, output, entry, routing))
                else:
                    self._turn_done(sample, output, entry, routing)
            else:
                sample.error = output.error or error or f"request ended with status {output.status!r}"
                self._requests.rerun.append(sample)
            self._cond.notify_all()

    def _on_progress(self, output: GenerationOutput) -> bool:
        """A streamed request's tokens so far (engine thread, after each of its steps): handed to its call's
        `on_tokens`. False when the output is not a streamed one's progress (it is then handled as an output)."""
        with self._cond:
            sample = self._requests.pending.get(output.request_id)
            if sample is None or sample.call.on_tokens is None:
                return sample is None  # a cancelled request's last progress is dropped
            ledger = self._requests.ledger
            versions = list(ledger.versions.get(output.request_id, ()))
            tops = list(ledger.tops.get(output.request_id, ())) if sample.params.top_logprobs else None
        tokens, logprobs = output.generated_tokens, output.logprobs
        count = min(len(tokens), len(logprobs), len(versions), len(versions) if tops is None else len(tops))
        sample.call.on_tokens(sample, tokens[:count], logprobs[:count], versions[:count],
                              None if tops is None else tops[:count])
        return True

    def _take_routing(self, sample: Sample, output: GenerationOutput) -> tuple[Routing | None, str | None]:
        """The request's recorded routing for every position it fed (prompt and completion but the last token), or
        why it has a hole (the request then re-runs)."""
        if self._recorder is None:
            return None, None
        if output.status != RequestStatus.FINISHED or output.error is not None:
            self._recorder.drop(output.request_id)
            return None, None
        num_positions = len(sample.context()) + len(output.generated_tokens) - 1
        try:
            experts = self._recorder.take(output.request_id, num_positions)
        except RoutingHole as hole:
            return None, str(hole)
        first = self._routers[0]
        return Routing(tuple(r.name for r in self._routers), first.num_experts, first.top_k, (experts,)), None

    def _make_row(self, sample: Sample, output: GenerationOutput, entry: Entry, routing: Routing | None = None
                  ) -> Row:
        tokens = list(output.generated_tokens)
        _check_logprobs(tokens, output.logprobs, entry)
        finish = "stop" if tokens and tokens[-1] in sample.stop_ids else "length"
        versions = entry.versions[: len(tokens)]
        self.counters.row(finish, versions, self.version)
        top_ids, top_logprobs = split_tops(entry.tops, len(tokens))
        return Row(sample.prompt_index, sample.sample_index, sample.prompt_ids, tokens, list(output.logprobs),
                   entry.sampling[: len(tokens)], finish, min(versions), **sample.counts(),
                   token_versions=versions, routing=routing,
                   top_ids=top_ids, top_logprobs=top_logprobs)

    def _turn_done(self, sample: Sample, output: GenerationOutput, entry: Entry, routing: Routing | None) -> None:
        """A model turn of an episode finished (lock held): the driver records it and steps its environment."""
        tokens = list(output.generated_tokens)
        _check_logprobs(tokens, output.logprobs, entry)
        count = len(tokens)
        self._driver.turn_done(sample, tokens, list(output.logprobs), entry.sampling[:count], entry.versions[:count],
                               None if entry.tops is None else entry.tops[:count], routing)

    def _on_prefix_hit(self, request_id: str, num_tokens: int) -> None:
        with self._cond:
            self._requests.prefix_hit(request_id, num_tokens)

    def _on_preempt(self, request_ids: list[str]) -> None:
        """Requests soft reset under KV pressure (engine thread): counted, and their routing re-recorded at their
        re-prefill."""
        self.counters.preempted(len(request_ids))
        if self._recorder is not None:
            self._recorder.soft_reset(request_ids)

    def _on_split(self, request_id: str, num_tokens: int) -> None:
        with self._cond:
            self._requests.split(request_id, num_tokens)


def _check_logprobs(tokens: list[int], logprobs: list[float], entry: Entry) -> None:
    tops = len(tokens) if entry.tops is None else len(entry.tops)
    if len(logprobs) != len(tokens) or min(len(entry.sampling), len(entry.versions), tops) < len(tokens):
        raise RuntimeError(f"rollout: {len(tokens)} tokens but {len(logprobs)}/{len(entry.sampling)} logprobs, "
                           f"{len(entry.versions)} versions, {tops} top lists")

