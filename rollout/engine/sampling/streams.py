"""Counter-based random streams: one uniform in [0, 1) per (key, counter), from an integer hash, with no generator
state.

A row's key names its stream (built once per request on the host by `stream_key`); the counter is the position of the
token being sampled. `uniforms` computes the hash with int64 tensor ops on the device, so sampling needs neither a
`torch.Generator` per row nor a host round trip, and a row's draws depend on nothing but its key and its positions:
the same whatever else is in the batch, whatever the timing, after a preemption (its positions are the same) or an
engine restart. The hash is splitmix64 (Steele, Lea, Flood 2014): for one key, the draws at counters 0, 1, 2, ... are
exactly the sequence of a splitmix64 generator seeded with the key (a generator that passes BigCrush).

int64 multiply and add wrap modulo 2^64 on every torch device, so the tensor version equals the integer reference
bit for bit; right shifts are arithmetic on int64 tensors, so the logical shifts mask the sign bits back out.
"""

from __future__ import annotations

import torch

MASK64 = 2**64 - 1
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    return x - 2**64 if x >= 2**63 else x


def mix64(x: int) -> int:
    """splitmix64's finaliser on a 64-bit int (the integer reference of `mix`)."""
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def stream_key(*words: int) -> int:
    """Fold ints into one 64-bit key (as an int64 value): each word (taken modulo 2^64, so a negative int64 seed
    differs from every other int64) is added to the running state and mixed, so every word and its place count."""
    state = 0
    for word in words:
        state = mix64((state + GOLDEN + word) & MASK64)
    return _signed(state)


def uniform_reference(key: int, counter: int) -> float:
    """What `uniforms` computes for one (key, counter), with Python ints: the top 53 bits of the hash, / 2^53."""
    return (mix64((key + (counter + 1) * GOLDEN) & MASK64) >> 11) / 2**53


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (elementwise; a bijection of 64-bit patterns)."""
    x = (x ^ _shr(x, 30)) * _signed(MIX1)
    x = (x ^ _shr(x, 27)) * _signed(MIX2)
    return x ^ _shr(x, 31)


def spread(words: torch.Tensor, first_counter: int) -> torch.Tensor:
    """mix(word + counter x golden) for counters first_counter, first_counter + 1, ...: each word mixed with its
    place. int64 [N] -> int64 [N]."""
    counters = torch.arange(first_counter, first_counter + words.numel(), dtype=torch.int64, device=words.device)
    return mix(words + counters * _signed(GOLDEN))


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """keys, counters: int64 [N] (counters >= 0) -> float64 [N] in [0, 1), one per row."""
    bits = mix(keys + (counters + 1) * _signed(GOLDEN))
    return _shr(bits, 11).double() * 2.0**-53
