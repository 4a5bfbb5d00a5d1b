"""Choice: one sampled completion of a request as the API returns it, built from the engine's row.

The engine stops on token ids (the model's EOS, the chat template's end of turn, `stop_token_ids`, and every `stop`
string that is one token). A `stop` string is text, though, and may span tokens or sit inside one: `Detokenizer.cut`
finds the first stop string in the decoded text and keeps the tokens up to the one that completes it (their ids and
logprobs are exact; the text ends before the stop string, as OpenAI's does; the tokens sampled after it are dropped,
from the response and from a recorded episode alike, and counted in `usage`: `Choice.sampled`). `StreamedChoice`
does the same while the tokens arrive, holding back text that could still turn out to be the start of a stop string
(or half of a UTF-8 character). It decodes incrementally (`IncrementalText`) and searches only the new text for stop
strings, so a streamed row costs time linear in its length; its last chunk is checked against the whole row's
decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...base.batch import Row

Top = tuple[list[int], list[float]]  # one position's alternatives: token ids and their logprobs, most likely first


class Diverged(Exception):
    """A streamed row came back with other tokens than those already sent (an "abort" weight update re-ran it)."""


class Detokenizer:
    """Text of tokens, stop strings, and how logprobs name a token (`name`: its text, or "token_id:<id>" when
    `as_ids`, vLLM's `return_tokens_as_token_ids`). vLLM's `skip_special_tokens` (`skip_special`),
    `include_stop_str_in_output` (`include_stop`: the text runs to the end of the stop string) and `min_tokens` (a
    stop string that ends within the first `min_tokens` tokens does not stop the row). `hidden`: stop ids whose text
    is left out when one ends the row (with skip_special false and include_stop false, as vLLM leaves them out)."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...] = (), as_ids: bool = False, skip_special: bool = True,
                 include_stop: bool = False, min_tokens: int = 0, hidden: tuple[int, ...] = ()) -> None:
        self.tokenizer, self.stops, self.as_ids = tokenizer, stops, as_ids
        self.skip_special, self.include_stop, self.min_tokens = skip_special, include_stop, min_tokens
        self.hidden = frozenset(hidden)

    def text(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        if ids and ids[-1] in self.hidden:  # a stop id is only ever a row's last token
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def name(self, token: int) -> str:
        """What logprobs call the token."""
        return f"token_id:{token}" if self.as_ids else self.piece(token)

    def piece(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def cut(self, ids: list[int], text: str | None = None, start: int = 0) -> tuple[int, str, bool]:
        """(tokens kept, their text, whether a stop string ended them). `text`: the text of `ids` when known;
        `start`: the first position of it where a stop string may begin (the text before was searched already)."""
        text = self.text(ids) if text is None else text
        while True:
            hits = [(pos, s) for s in self.stops if (pos := text.find(s, start)) >= 0]
            if not hits:
                return len(ids), text, False
            pos, stop = min(hits)
            low, high = 1, len(ids)  # the fewest tokens whose text holds the stop string there
            while low < high:
                mid = (low + high) // 2
                if self.text(ids[:mid]).find(stop, pos) >= 0:
                    high = mid
                else:
                    low = mid + 1
            if low >= self.min_tokens:
                return low, text[:pos + len(stop)] if self.include_stop else text[:pos], True
            start = pos + 1  # within the first min_tokens tokens: not a stop

    def offsets(self, ids: list[int], text: str | None, decoded: "IncrementalText | None" = None,
                before: list[int] | None = None) -> list[int]:
        """Where each token's text begins in `text` (the text of `before` + `ids`, maybe cut at a stop string): the
        length of the text of the tokens before it as `text` writes them (a special token the text skips adds
        nothing; a token after half a character begins where that character does), at most len(text) (None: not
        known yet, a stream). `decoded`/`before`: the text of the tokens already streamed (kept across calls). Each
        token costs a few decodes of the window at the row's end, not of the row."""
        decoded = decoded or IncrementalText(self)
        row, out, limit = list(before or []), [], len(text) if text is not None else None
        for token in ids:
            settled = decoded.update(row)
            window = self.text(row[decoded.prefix:])
            at = len((settled + window[len(self.text(row[decoded.prefix:decoded.read])):]).rstrip("\ufffd"))
            out.append(at if limit is None else min(at, limit))
            row.append(token)
        return out

    def held_back(self, text: str) -> int:
        """Characters at the end of `text` not to stream yet: half a character, or a possible stop string start."""
        hold = len(text) - len(text.rstrip("\ufffd"))
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        return hold


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float]
    token_versions: list[int]
    finish_reason: str  # "stop", "length" or "tool_calls"
    text: str
    message: dict | None = None  # chat: the assistant message (content, tool calls)
    top: list[Top] | None = None  # per token, when the request asked for top logprobs
    sampled: int = 0  # tokens the engine sampled, those past a stop string included (what usage counts)
    tool_call_error: str | None = None  # why the parser rejected the call the model wrote (its markup is content)

    @property
    def policy_version(self) -> int | None:
        """The oldest version among its tokens (None for a choice without tokens)."""
        return min(self.token_versions) if self.token_versions else None


def choice_of(index: int, row: Row, detok: Detokenizer) -> Choice:
    """The API's view of an engine row: cut at the first stop string; "stop" when a stop token or string ended it."""
    kept, text, stopped = detok.cut(list(row.completion_ids))
    versions = list(row.token_versions) if row.token_versions is not None else [row.policy_version] * kept
    finish = "stop" if stopped or row.finish_reason == "stop" else "length"
    top = None if row.top_ids is None else list(zip(row.top_ids[:kept], row.top_logprobs[:kept]))
    return Choice(index, list(row.prompt_ids), list(row.completion_ids[:kept]), list(row.logprobs[:kept]),
                  list(row.sampling_logprobs[:kept]), versions[:kept], finish, text, top=top,
                  sampled=len(row.completion_ids))


@dataclass
class Delta:
    token_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    text: str
    top: list[Top] | None = None


class IncrementalText:
    """The text of a growing token list, decoding only a window at its end (as vLLM's incremental detokenizer): the
    text of ids[:read] is settled; each update decodes ids[prefix:] against ids[prefix:read] (the window starts a
    settled stretch back, so tokenizers that drop a leading space at a string's start see their context) and settles
    what is new unless it ends in half a character. A window whose decode does not extend its old one (a tokenizer
    that rewrites earlier text) settles the whole row from a full decode."""

    def __init__(self, detok: Detokenizer) -> None:
        self.detok, self.text, self.prefix, self.read = detok, "", 0, 0

    def update(self, ids: list[int]) -> str:
        if len(ids) > self.read:
            before = self.detok.text(ids[self.prefix:self.read])
            after = self.detok.text(ids[self.prefix:])
            if not after.startswith(before):
                self.text, self.prefix, self.read = self.detok.text(ids), len(ids), len(ids)
            elif len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(ids)
        return self.text


@dataclass
class StreamedChoice:
    """What has been sent of one choice while it streams."""

    index: int
    detok: Detokenizer
    token_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    stopped: bool = False  # a stop string ended it: later tokens are not sent
    decoded: IncrementalText | None = None
    searched: int = 0  # text positions before this cannot start a stop string (already searched)

    def advance(self, ids: list[int], logprobs: list[float], versions: list[int], top: list[Top] | None = None,
                final: bool = False) -> Delta | None:
        """The part of `ids` (the row so far) not sent yet, and the text that is safe to send; None if nothing.
        `final`: `ids` is the whole row (its text is then the whole row's decode)."""
        if self.stopped:
            return None
        sent = len(self.token_ids)
        if ids[:sent] != self.token_ids[: len(ids)]:
            raise Diverged(f"choice {self.index} was re-run after {sent} tokens had been streamed")
        if len(ids) < sent:  # a re-run (an engine restart) streaming the same tokens again: nothing new yet
            return None
        if self.decoded is None:
            self.decoded = IncrementalText(self.detok)
        whole = self.detok.text(ids) if final else self.decoded.update(ids)
        kept, text, self.stopped = self.detok.cut(ids, whole, 0 if final else self.searched)
        longest = max((len(s) for s in self.detok.stops), default=1)
        self.searched = max(0, len(whole) - longest + 1)
        if not (final or self.stopped):
            text = text[: len(text) - self.detok.held_back(text)]
        start = len(self.token_ids)
        if kept <= start and len(text) <= len(self.sent_text):
            return None
        delta = Delta(list(ids[start:kept]), list(logprobs[start:kept]), list(versions[start:kept]),
                      text[len(self.sent_text):], None if top is None else list(top[start:kept]))
        self.token_ids = list(ids[:kept])
        self.sent_text = max(self.sent_text, text, key=len)
        return delta
