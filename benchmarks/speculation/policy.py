"""A policy that behaves like one: a small Llama trained here, for a few minutes, on the Python standard library.

A random model's next-token distribution is nearly flat, so nothing about it predicts what a trained policy repeats
(identifiers, indentation, idioms, the text of its own prompt). This one is trained on text that ships with every
Python: the top-level `.py` modules of the standard library, every `HOLD_OUT`-th file (sorted by name) held out for
prompts. A byte-level BPE tokenizer is trained in-process on the training files; the model (4 layers, 192 wide, vocab
2048, trained on 256-token windows, files separated by <eos>) is trained for `steps` AdamW steps with a fixed seed,
saved with `save_pretrained` under benchmarks/.cache/ (gitignored) and loaded back through `from_pretrained`.

    python benchmarks/speculation/policy.py                 # build (or reuse) the cached policy, print its held-out loss
    python benchmarks/speculation/policy.py --steps 500     # a longer-trained one (its own cache directory)

`load_policy()` returns (model, tokenizer, card: what training measured); `held_out_prompts` cuts the prompts:
snippets of the held-out files that start at a line, 48-128 tokens long.

Cost: 16k tokens a step; ~0.7 s a step on a quiet 2-core box (150 steps in under 2 minutes plus ~10 s for the
tokenizer), but 938 s for the 150 steps of the cached policy on this project's machine shared at load 9-12 (a run of
500 steps there was stopped at step 150 after 15 minutes). At 150 steps the held-out loss is 5.78 nats per token: a
weak policy (see benchmarks/results/speculation.md, "Speculation: draft acceptance offline").
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parents[1] / ".cache"  # benchmarks/.cache/
HOLD_OUT = 8  # every 8th stdlib module (sorted by name) is held out: prompts and the held-out loss come from them
VOCAB = 2048
CONTEXT = 256
BATCH = 8
STEPS = 150
SPECIALS = ["<pad>", "<bos>", "<eos>"]
# (hidden, layers, heads, kv_heads, intermediate)
SHAPE = (192, 4, 6, 2, 512)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): the standard library's top-level modules, every HOLD_OUT-th held out."""
    files = sorted(Path(p) for p in glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    held = [f for i, f in enumerate(files) if i % HOLD_OUT == HOLD_OUT - 1]
    return [f for f in files if f not in held], held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>")


def token_stream(tokenizer, files: list[Path]) -> torch.Tensor:
    """Every file's ids, each followed by <eos>, as one 1-D tensor."""
    ids: list[int] = []
    for f in files:
        ids += tokenizer(read(f))["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def build_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, inter = SHAPE
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=inter, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def windows(stream: torch.Tensor, gen: torch.Generator, batch: int) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - CONTEXT - 1, (batch,), generator=gen)
    return torch.stack([stream[s: s + CONTEXT] for s in starts.tolist()])


def train(model, stream: torch.Tensor, steps: int, seed: int = 0, lr: float = 3e-3) -> float:
    """AdamW with linear warm-up and cosine decay over `steps` batches of BATCH random windows; the last loss."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min((s + 1) / warmup, 0.5 * (
        1 + math.cos(math.pi * min(s / steps, 1.0)))))
    model.train()
    start, loss = time.monotonic(), torch.tensor(0.0)
    for step in range(steps):
        ids = windows(stream, gen, BATCH)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  loss {float(loss.detach()):.3f}  {time.monotonic() - start:.0f} s",
                  flush=True)
    model.eval()
    return float(loss.detach())


@torch.no_grad()
def held_out_loss(model, stream: torch.Tensor, batches: int = 8) -> float:
    """Mean next-token loss (nats) on `batches` x BATCH fixed windows of the held-out files."""
    gen = torch.Generator().manual_seed(1234)
    losses = [float(model(input_ids=(ids := windows(stream, gen, BATCH)), labels=ids).loss) for _ in range(batches)]
    return sum(losses) / len(losses)


def policy_dir(steps: int, seed: int) -> Path:
    return CACHE / f"stdlib-llama-{SHAPE[0]}x{SHAPE[1]}-v{VOCAB}-s{steps}-seed{seed}"


def build_policy(steps: int = STEPS, seed: int = 0) -> Path:
    """Train and save the policy, or reuse the cached one; returns its directory (a `from_pretrained` path)."""
    path = policy_dir(steps, seed)
    card = path / "policy.json"
    if card.exists():
        return path
    train_files, held_files = stdlib_files()
    print(f"training a policy on {len(train_files)} stdlib modules ({len(held_files)} held out), {steps} steps "
          f"of {BATCH}x{CONTEXT} tokens", flush=True)
    torch.manual_seed(seed)
    tokenizer = train_tokenizer(train_files)
    stream = token_stream(tokenizer, train_files)
    model = build_model(tokenizer)
    start = time.monotonic()
    last = train(model, stream, steps, seed)
    seconds = time.monotonic() - start
    held = held_out_loss(model, token_stream(tokenizer, held_files))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    card.write_text(json.dumps(dict(steps=steps, seed=seed, train_tokens=len(stream), train_seconds=round(seconds, 1),
                                    last_train_loss=round(last, 4), held_out_loss=round(held, 4))))
    return path


def load_policy(steps: int = STEPS, seed: int = 0):
    """(model, tokenizer, card): the cached policy loaded back through `from_pretrained` (fp32, CPU), and what its
    training measured (steps, tokens, seconds, last training loss, held-out loss in nats per token)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_policy(steps, seed)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(path), json.loads((path / "policy.json").read_text())


def held_out_prompts(tokenizer, count: int, seed: int = 0, lengths: tuple[int, int] = (48, 128)) -> list[list[int]]:
    """`count` prompts cut from the held-out modules: each starts at a line of a file, `lengths` tokens long."""
    _, held_files = stdlib_files()
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    while len(prompts) < count:
        text = read(held_files[int(torch.randint(0, len(held_files), (1,), generator=gen))])
        lines = text.splitlines(keepends=True)
        first = int(torch.randint(0, max(len(lines) - 40, 1), (1,), generator=gen))
        ids = tokenizer("".join(lines[first: first + 60]))["input_ids"]
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        if len(ids) >= length:
            prompts.append(ids[:length])
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    _, _, card = load_policy(args.steps, args.seed)
    print(f"policy: {policy_dir(args.steps, args.seed)}")
    print(json.dumps(card))


if __name__ == "__main__":
    main()
