"""The `rollout` command: generate, score, demo. Argparse and wiring only; streaming, resume and error locating
live in `rollout.cli.jsonl`, shared by both JSONL commands.

Exit codes: 0 done, 2 a usage or input error (one `rollout: error: FILE:LINE: field F: ...` line on stderr, no row
already written lost), 130 interrupted (the output holds only whole lines; re-run the same command to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from importlib.metadata import entry_points
from typing import Any

from .. import __version__
from . import records
from .jsonl import Job, JsonlError, Process, Record, Stats, run


class UsageError(ValueError):
    """A bad flag or path: `rollout: error: <message>`, exit 2."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in plugin_commands():
        return _run_plugin(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    stats = Stats()
    try:
        with contextlib.ExitStack() as resources, _sigterm_as_interrupt():
            job = args.build(args, resources)
            run(job, stats)
    except (JsonlError, UsageError) as e:
        print(f"rollout: error: {e}", file=sys.stderr)
        if stats.num_new:
            print(f"rollout: {stats.num_resumed + stats.num_new} complete rows kept in {args.output}; fix the input "
                  "and re-run the same command to resume", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nrollout: interrupted; {stats.num_resumed + stats.num_new} complete rows in {args.output}; re-run "
              "the same command to resume", file=sys.stderr)
        return 130
    print(stats.summary(job.verb, args.output), file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------- commands
def build_generate(args: argparse.Namespace, resources: contextlib.ExitStack) -> Job:
    from ..base.config import WorkerConfig
    from ..base.params import SamplingParams

    _check_paths(args)
    base = {k: getattr(args, k, None) for k in records.SAMPLING_FIELDS if getattr(args, k, None) is not None}
    try:
        SamplingParams(**base)
    except ValueError as e:
        raise UsageError(f"--{records.field_of(e).replace('_', '-')}: {e}") from None
    try:
        config = WorkerConfig(max_batch_tokens=args.max_batch_tokens, kv_cache_memory_mb=args.kv_cache_mb)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.metrics_port is not None:  # a port in use fails now, before the input is read or the model loaded
        _metrics_port_free(args)
    status = LiveStatus()

    def start() -> Process:
        backend, tokenizer = _generate_backend(args, config, resources)
        status.source = backend.metrics
        if args.metrics_port is not None:
            try:
                server = backend.serve_metrics(args.metrics_port, args.metrics_host)
            except (OSError, ValueError) as e:
                raise UsageError(f"--metrics-port {args.metrics_port}: {e}") from None
            print(f"rollout: serving metrics on {server.url}", file=sys.stderr)

        def process(chunk: list[Record]) -> tuple[list[dict], int]:
            params = [records.sampling_for(r.data, base, r.index) for r in chunk]
            batch = backend.generate([records.generate_prompt(r.data) for r in chunk], sampling=params,
                                     chat_template=args.chat_template)
            return records.generate_rows(chunk, batch, tokenizer), batch.num_tokens

        return process

    return Job(args.input, args.output, lambda data: records.check_generate(data, base, args.chat_template), start,
               args.batch_size, args.overwrite, not args.no_progress, "generated", status)


def build_score(args: argparse.Namespace, resources: contextlib.ExitStack) -> Job:
    _check_paths(args)
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(f"--temperature {args.temperature} is invalid: must be a finite number >= 0 (0 = the raw "
                         "distribution)")
    if args.max_batch_tokens < 1:
        raise UsageError(f"--max-batch-tokens {args.max_batch_tokens} is invalid: must be >= 1")

    def start() -> Process:
        from ..model.loading import load_model
        from ..scoring import score

        model, tokenizer = load_model(args.model, field="--model")

        def process(chunk: list[Record]) -> tuple[list[dict], int]:
            prompts, completions, temperatures = records.score_inputs(chunk, args.temperature)
            scores = score(model, prompts, completions, temperature=temperatures, tokenizer=tokenizer,
                           max_batch_tokens=args.max_batch_tokens)
            return records.score_rows(chunk, scores), sum(len(s) for s in scores)

        return process

    return Job(args.input, args.output, records.check_score, start, args.batch_size, args.overwrite,
               not args.no_progress, "scored")


def _generate_backend(args: argparse.Namespace, config, resources: contextlib.ExitStack):
    if args.workers > 1:
        from ..fleet import RolloutFleet

        backend = RolloutFleet(args.model, num_workers=args.workers, config=config)
    else:
        from ..worker.worker import RolloutWorker

        backend = RolloutWorker(args.model, config=config)
    resources.callback(backend.close)
    return backend, backend.tokenizer


def _metrics_port_free(args: argparse.Namespace) -> None:
    from ..metrics.prometheus import check_port

    try:
        check_port(args.metrics_port, args.metrics_host)
    except (OSError, ValueError) as e:
        raise UsageError(f"--metrics-port {args.metrics_port}: {e}") from None


class LiveStatus:
    """The generate progress bar's status: engine tokens/s since the last read and KV use, from `source()` (a
    worker's or a fleet's `metrics`, set once the backend is up)."""

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.source: Any = None
        self.clock = clock
        self._last: tuple[float, int] | None = None

    def __call__(self) -> str:
        if self.source is None:
            return ""
        snapshot = self.source()
        m = getattr(snapshot, "total", snapshot)  # a fleet's totals
        now = self.clock()
        rate = 0.0 if self._last is None else (m.sampled_tokens - self._last[1]) / max(now - self._last[0], 1e-9)
        self._last = (now, m.sampled_tokens)
        return (f"{rate:.1f} tok/s, KV {100 * m.kv_cache_usage:.0f}% ({m.kv_pages_used}/{m.kv_pages_total} pages, "
                f"peak {m.kv_pages_peak})")


# ---------------------------------------------------------------------------------------------- shared
def _check_paths(args: argparse.Namespace) -> None:
    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model}: not a directory. Fix: pass a local checkpoint directory (the one "
                         "written by save_pretrained); nothing is downloaded")
    if args.input != "-" and not os.path.exists(args.input):
        raise UsageError(f"input {args.input}: no such file. Fix: check the path, or pass - to read stdin")
    if args.input != "-" and os.path.abspath(args.input) == os.path.abspath(args.output):
        raise UsageError(f"output {args.output}: same file as the input. Fix: write to a new path")
    if getattr(args, "workers", 1) < 1:
        raise UsageError(f"--workers {args.workers} is invalid: must be >= 1")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size} is invalid: must be >= 1")


PLUGIN_GROUP = "rollout.commands"


def plugin_commands() -> dict[str, Any]:
    """Commands other packages register under the `rollout.commands` entry-point group (`rollout demo` comes from
    trainers_integration this way, so nothing under rollout/ imports the trainers)."""
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def _run_plugin(name: str, argv: list[str]) -> int:
    try:
        command = plugin_commands()[name].load()
    except ImportError as e:
        print(f"rollout: error: `rollout {name}` cannot start: {e}. Fix: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    return int(command(argv) or 0)


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM (a scheduler's kill) stops a run like Ctrl-C: the output keeps only whole lines."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------- argparse
GENERATE_HELP = """\
Each input line is a JSON object with "prompt" (text) or "prompt_ids" (token ids), and may carry its own
sampling fields (n, temperature, top_k, top_p, max_new_tokens, stop_token_ids, ignore_eos, seed, top_logprobs, min_p,
repetition_penalty, presence_penalty, frequency_penalty, min_new_tokens, logit_bias {"id": bias})
that override the flags. Every other field is kept. Each output line is the input line plus, one entry per sample:
  completions (text), completion_ids, logprobs (per token, log_softmax(logits / temperature)),
  finish_reason ("stop" or "length"), policy_version, and with top_logprobs K > 0: alternatives (per token, the
  K most likely [token_id, logprob] pairs of that same distribution, most likely first).

The input is read --batch-size lines at a time; rows are appended in input order after each chunk. Re-running
the same command resumes after the last complete output line. Exit codes: 0 done, 2 bad input or flag (the
message names FILE:LINE and the field; rows already written are kept), 130 interrupted.

example:
  rollout generate --model ./ckpt --input prompts.jsonl --output out.jsonl --n 4 --temperature 0.8 --seed 0
"""
SCORE_HELP = """\
Each input line is a JSON object with "prompt" or "prompt_ids", and "completion" or "completion_ids" (text is
encoded without special tokens), and may carry its own "temperature". Every other field is kept. Each output
line adds "logprobs" (one per completion token, teacher-forced log_softmax(logits / temperature), float32) and
"logprob_sum". Streaming, resume and exit codes as for `rollout generate`.

example:
  rollout score rollouts.jsonl scored.jsonl --model ./ref_ckpt
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description="Exact, fast, unkillable RL rollouts on "
                                     "transformers' continuous-batching engine: JSONL in, JSONL out.",
                                     epilog="Run `rollout COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"rollout {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    gen = commands.add_parser("generate", help="sample completions for a JSONL file of prompts",
                              description=GENERATE_HELP, formatter_class=fmt)
    gen.add_argument("--model", required=True, metavar="PATH", help="local checkpoint directory (save_pretrained)")
    gen.add_argument("--input", required=True, metavar="FILE", help="JSONL prompts; - reads stdin")
    gen.add_argument("--output", required=True, metavar="FILE", help="JSONL results (appended to, to resume)")
    sampling = gen.add_argument_group("sampling (defaults for every line; a line's own fields win)")
    sampling.add_argument("--n", type=int, metavar="N", help="samples per prompt (default 1)")
    sampling.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-k", dest="top_k", type=int, metavar="K",
                          help="keep the k most likely tokens; 0 or -1 = off (default)")
    sampling.add_argument("--top-p", dest="top_p", type=float, metavar="P",
                          help="nucleus sampling; 1.0 = off (default)")
    sampling.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, metavar="N",
                          help="completion budget (default 64)")
    sampling.add_argument("--stop-token-ids", dest="stop_token_ids", type=_int_list, metavar="IDS",
                          help="comma-separated ids that end a completion (default: the model's EOS)")
    sampling.add_argument("--ignore-eos", dest="ignore_eos", action="store_true", default=None,
                          help="always generate max_new_tokens")
    sampling.add_argument("--top-logprobs", dest="top_logprobs", type=int, metavar="K",
                          help="also write each token's K most likely alternatives, K <= 20 (default 0)")
    sampling.add_argument("--min-p", dest="min_p", type=float, metavar="P",
                          help="drop tokens below P x the most likely one's probability; 0 = off (default)")
    sampling.add_argument("--repetition-penalty", dest="repetition_penalty", type=float, metavar="R",
                          help="HF/vLLM: prompt and completion tokens' logits / R (x R if negative); 1 = off (default)")
    sampling.add_argument("--presence-penalty", dest="presence_penalty", type=float, metavar="P",
                          help="OpenAI: minus P for tokens already in the completion, in [-2, 2]; 0 = off (default)")
    sampling.add_argument("--frequency-penalty", dest="frequency_penalty", type=float, metavar="F",
                          help="OpenAI: minus F x a token's count in the completion, in [-2, 2]; 0 = off (default)")
    sampling.add_argument("--min-new-tokens", dest="min_new_tokens", type=int, metavar="N",
                          help="no stop id before N tokens (default 0)")
    sampling.add_argument("--seed", type=int, metavar="SEED", help="line i samples with seed SEED + i: reproducible "
                          "whatever the batch size, resume point or number of workers (default: unseeded)")
    gen.add_argument("--chat-template", action="store_true", help="wrap text prompts (or a list of chat messages "
                     "in \"prompt\") in the tokenizer's chat template")
    gen.add_argument("--workers", type=int, default=1, metavar="N", help="N > 1: run on a RolloutFleet of N "
                     "workers (needs ray)")
    gen.add_argument("--max-batch-tokens", type=int, default=512, metavar="T", help="engine tokens per step "
                     "(default 512; 2048-8192 on GPU)")
    gen.add_argument("--kv-cache-mb", type=int, default=256, metavar="MB", help="KV cache budget (default 256)")
    gen.add_argument("--metrics-port", type=int, default=None, metavar="N", help="serve Prometheus metrics on "
                     "http://HOST:N/metrics while it runs (docs/observability.md; 0 picks a free port)")
    gen.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address the metrics endpoint "
                     "listens on (default 127.0.0.1: this machine only)")
    _common(gen, batch_size=64)
    gen.set_defaults(build=build_generate)

    score = commands.add_parser("score", help="teacher-forced logprobs of stored completions",
                                description=SCORE_HELP, formatter_class=fmt)
    score.add_argument("input", metavar="INPUT", help="JSONL pairs; - reads stdin")
    score.add_argument("output", metavar="OUTPUT", help="JSONL results (appended to, to resume)")
    score.add_argument("--model", required=True, metavar="PATH", help="local checkpoint directory")
    score.add_argument("--temperature", type=float, default=1.0, metavar="T", help="score under log_softmax(logits "
                       "/ T) (default 1.0; 0 = the raw distribution); a line's own temperature wins")
    score.add_argument("--max-batch-tokens", type=int, default=2048, metavar="T",
                       help="tokens per packed forward (default 2048)")
    _common(score, batch_size=256)
    score.set_defaults(build=build_score)

    for name, ep in sorted(plugin_commands().items()):
        commands.add_parser(name, add_help=False, help=f"from {ep.value.split(':')[0]}; `rollout {name} --help` "
                            "lists its options")
    return parser


def _common(parser: argparse.ArgumentParser, batch_size: int) -> None:
    parser.add_argument("--batch-size", type=int, default=batch_size, metavar="K", help="input lines per chunk: "
                        f"memory bound and write granularity (default {batch_size})")
    parser.add_argument("--overwrite", action="store_true", help="start again instead of resuming an existing "
                        "output (it is replaced only once the input has validated)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the summary line stays)")


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None


if __name__ == "__main__":
    sys.exit(main())
