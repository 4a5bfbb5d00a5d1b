"""Which constrained-decoding library works here (issue 31, item 3), and what a token mask costs: xgrammar,
llguidance and outlines-core against the byte-level BPE tokenizers rollout.testing builds in-process.

    pip install xgrammar llguidance outlines-core    # not dependencies of rollout: measured, not used
    python benchmarks/features/bench_grammars.py               # vocab 512 (the chat tokenizer) and 8192

For each library: build its tokenizer view from the HF tokenizer, compile a JSON schema, then walk the tokens of a
valid answer (every one must be allowed by the mask computed before it, and the grammar must accept at the end) and
of an invalid one (some token must be refused). Reports the set-up times, the mean time to compute one row's mask
per token, and whether the walk was right; a library that fails to install or to run says why. Last line: JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from rollout.testing import build_tokenizer
from rollout.testing.chat import TOOL_TOKENS

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age"], "additionalProperties": False}
VALID = json.dumps({"name": "bob smith", "age": 42, "tags": ["a", "b"]}, separators=(",", ":"))
INVALID = '{"name":"bob","age":"old"}'


def allowed(mask, token: int) -> bool:
    return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)


def walk_xgrammar(tok, vocab: int) -> Callable[[list[int]], tuple[bool, bool, float]]:
    import xgrammar as xgr
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))

    def walk(ids):
        matcher, mask, spent = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab), 0.0
        for token in ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            spent += time.perf_counter() - start
            if not allowed(mask, token) or not matcher.accept_token(token):
                return False, False, spent / len(ids)
        return True, matcher.is_terminated() or matcher.accept_token(tok.eos_token_id), spent / len(ids)
    return walk


def walk_llguidance(tok, vocab: int) -> Callable[[list[int]], tuple[bool, bool, float]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})

    def walk(ids):
        matcher, mask, spent = llguidance.LLMatcher(tokenizer, grammar), llt.allocate_token_bitmask(1, vocab), 0.0
        for token in ids:
            start = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, mask, 0)
            spent += time.perf_counter() - start
            if not allowed(mask, token) or not matcher.consume_token(token):
                return False, False, spent / len(ids)
        return True, matcher.is_accepting(), spent / len(ids)
    return walk


def walk_outlines(tok, vocab: int) -> Callable[[list[int]], tuple[bool, bool, float]]:
    import outlines_core
    # its Vocabulary wants each token's text; a byte-level BPE's token strings are byte codes ("Ġ" for a space)
    byte_decoder = {c: b for b, c in _byte_encoder().items()}
    words: dict[str, list[int]] = {}
    for text, token in tok.get_vocab().items():
        if token != tok.eos_token_id and token < vocab and text not in tok.all_special_tokens:
            words.setdefault(bytes(byte_decoder[c] for c in text).decode("latin-1"), []).append(token)
    vocabulary = outlines_core.Vocabulary(tok.eos_token_id, words)
    index = outlines_core.Index(outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)

    def walk(ids):
        guide, spent = outlines_core.Guide(index), 0.0
        for token in ids:
            start = time.perf_counter()
            tokens = guide.get_tokens()
            spent += time.perf_counter() - start
            if token not in tokens:
                return False, False, spent / len(ids)
            guide.advance(token)
        return True, guide.is_finished() or tok.eos_token_id in guide.get_tokens(), spent / len(ids)
    return walk


def _byte_encoder() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel pre-tokenizer writes)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


LIBRARIES = {"xgrammar": walk_xgrammar, "llguidance": walk_llguidance, "outlines-core": walk_outlines}


def measure(name: str, vocab: int) -> dict:
    tok = build_tokenizer(vocab, extra_special_tokens=TOOL_TOKENS)
    start = time.perf_counter()
    try:
        walk = LIBRARIES[name](tok, vocab)
    except Exception as error:  # not installed, or refuses this tokenizer: the reason is the result
        return {"library": name, "vocab": vocab, "error": f"{type(error).__name__}: {str(error)[:160]}"}
    setup = time.perf_counter() - start
    try:
        valid = walk(tok.encode(VALID, add_special_tokens=False))
        invalid = walk(tok.encode(INVALID, add_special_tokens=False))
    except Exception as error:
        return {"library": name, "vocab": vocab, "error": f"{type(error).__name__}: {str(error)[:160]}"}
    return {"library": name, "vocab": vocab, "setup_s": round(setup, 3), "valid_allowed": valid[0],
            "valid_accepted": valid[1], "invalid_refused": not invalid[0], "mask_us": round(1e6 * valid[2], 1)}


def main() -> None:
    results = [measure(name, vocab) for vocab in (512, 8192) for name in LIBRARIES]
    print("# constrained decoding libraries on rollout.testing's byte-level BPE tokenizers, one JSON schema")
    for r in results:
        if "error" in r:
            print(f"{r['library']:<14} vocab {r['vocab']:<5} FAILED {r['error']}")
            continue
        ok = r["valid_allowed"] and r["valid_accepted"] and r["invalid_refused"]
        print(f"{r['library']:<14} vocab {r['vocab']:<5} set-up {r['setup_s']:7.3f} s  mask {r['mask_us']:8.1f} us/token"
              f"  {'right' if ok else 'WRONG'} (valid allowed {r['valid_allowed']}, accepted {r['valid_accepted']}, "
              f"invalid refused {r['invalid_refused']})")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
