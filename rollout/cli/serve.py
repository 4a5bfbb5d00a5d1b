"""`rollout serve MODEL`: the OpenAI-compatible server (rollout.server) in the foreground, until Ctrl-C / SIGTERM.

Registered through the `rollout.commands` entry point like `rollout demo`. Every WorkerConfig field is a flag of the
same name (`--kv-cache-memory-mb 512`, `--in-flight recompute`, `--no-prefix-caching`); `--workers N` serves a
RolloutFleet of N workers instead (needs ray). Exit codes: 0 stopped, 2 a bad flag or path (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..base.config import WorkerConfig
from ..base.speculation import Speculation
from ..server.transport.limits import FLAGS, RequestLimits
from .main import _sigterm_as_interrupt

EPILOG = """\
example:
  rollout serve ./ckpt --port 8000 --api-key secret --in-flight recompute
  # then, from any OpenAI client:
  #   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret").chat.completions.create(model="ckpt", ...)
"""


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = WorkerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(WorkerConfig)
                                 if getattr(args, f.name) is not None})
    except ValueError as error:
        return _fail(str(error))
    if not os.path.isdir(args.model):
        return _fail(f"MODEL {args.model}: not a directory. Fix: pass a local checkpoint directory (the one written by "
                     "save_pretrained); nothing is downloaded")
    if args.workers < 1:
        return _fail(f"--workers {args.workers} is invalid: must be >= 1")
    try:
        limits = RequestLimits(**{name: getattr(args, name) for name in FLAGS})
    except ValueError as error:
        return _fail(str(error))
    try:
        from ..server import Server
        from ..server.admin.routes import check_admin_key

        if args.admin:  # before the model loads: a server beyond loopback needs the key
            check_admin_key(args.host, args.admin_key or args.api_key)
    except (ImportError, ValueError) as error:
        return _fail(str(error))
    rollouts = _rollouts(args, config)
    try:
        server = Server(rollouts, args.host, args.port, args.api_key, args.served_model_name, args.log_level, limits,
                        admin=args.admin, admin_key=args.admin_key)
        print(f"rollout: serving {server.model_name!r} on http://{args.host}:{args.port}/v1"
              f"{' (API key required)' if args.api_key else ''}{' with the admin routes' if args.admin else ''}; "
              "Ctrl-C stops", file=sys.stderr)
        with _sigterm_as_interrupt():
            server.run()  # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again
    except KeyboardInterrupt:
        pass
    finally:
        rollouts.close()
    print("rollout: server stopped", file=sys.stderr)
    return 0


def _rollouts(args: argparse.Namespace, config: WorkerConfig):
    if args.workers > 1:
        from ..fleet import RolloutFleet

        return RolloutFleet(args.model, num_workers=args.workers, config=config)
    from ..worker.worker import RolloutWorker

    return RolloutWorker(args.model, config=config)


def _fail(message: str) -> int:
    print(f"rollout: error: {message}", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout serve", description="Serve a checkpoint over OpenAI's HTTP API "
                                     "(chat and completions, streaming, tools), with token ids, exact logprobs and "
                                     "policy versions in every response. See docs/serve.md.", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="local checkpoint directory (save_pretrained)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: loopback "
                        "only; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get("ROLLOUT_API_KEY"), metavar="KEY",
                        help="require Authorization: Bearer KEY on /v1/* (default: $ROLLOUT_API_KEY, else none)")
    parser.add_argument("--admin", action="store_true", help="mount the RL control plane (/pause, /resume, /sleep, "
                        "/wake_up, /update_weights, ...: docs/serve.md, 'Admin routes')")
    parser.add_argument("--admin-key", default=os.environ.get("ROLLOUT_ADMIN_KEY"), metavar="KEY",
                        help="with --admin: require Authorization: Bearer KEY on the admin routes (default: "
                        "$ROLLOUT_ADMIN_KEY, else the --api-key; required when --host is not loopback)")
    parser.add_argument("--served-model-name", metavar="NAME", help="the `model` clients pass (default: the "
                        "checkpoint directory's name)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="N > 1: a RolloutFleet of N workers "
                        "(needs ray)")
    parser.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                        help="uvicorn's log level (default warning)")
    bounds = parser.add_argument_group("per-request limits (a request past one is a 400 naming it)")
    for name, flag in FLAGS.items():
        bounds.add_argument(flag, dest=name, type=int, default=getattr(RequestLimits, name), metavar="N",
                            help=f"default {getattr(RequestLimits, name)}")
    group = parser.add_argument_group("engine (WorkerConfig; defaults as in the README)")
    for f in dataclasses.fields(WorkerConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type)
        if kind == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        elif f.name == "speculation":  # the mode of the default Speculation (docs/speculation.md)
            group.add_argument(flag, dest=f.name, type=_speculation, default=None, metavar="MODE",
                               help="speculative decoding with context and history drafts: auto, always or off")
        else:
            convert, metavar = (int, "N") if kind.startswith("int") else (float, "X") if kind.startswith("float") \
                else (str, "NAME")
            group.add_argument(flag, dest=f.name, type=convert, default=None, metavar=metavar)
    return parser


def _speculation(mode: str) -> Speculation | None:
    if mode not in ("auto", "always", "off"):
        raise argparse.ArgumentTypeError(f"{mode!r} is not one of auto, always, off")
    return None if mode == "off" else Speculation(mode=mode)


if __name__ == "__main__":
    sys.exit(main())
