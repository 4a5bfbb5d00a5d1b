"""The `rollout` command line: `generate` and `score` over JSONL, and commands other packages register (`demo`).

May import every layer of rollout, never trainers_integration (plugins arrive through the `rollout.commands`
entry-point group). Files: `main.py` (argparse and wiring), `jsonl.py` (streaming, resume, error locating),
`records.py` (what one JSONL line may hold).
"""

from .main import main

__all__ = ["main"]
