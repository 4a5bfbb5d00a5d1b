"""JSONL in, JSONL out, for the command line: streamed in chunks, resumable, never a torn line.

Contract (shared by `rollout generate` and `rollout score`):
- A record is one non-blank input line holding a JSON object. Output line i answers input record i, so a re-run
  resumes after the last complete output line: a torn last line (a crash mid-write) is truncated away, the first
  `done` input records are skipped unparsed, and the last row written is checked against its input record (so a
  different input file is refused rather than silently mixed in).
- Memory is bounded by one chunk (`batch_size` records and their rows), whatever the input's length.
- A regular input file is pre-validated first (JSON and the command's per-record field check, no model needed), so
  a malformed line 999,999 fails in seconds, before any compute. Checks that need the model (a prompt too long
  for its context) run per chunk, before that chunk's compute; rows of earlier chunks are already on disk.
- A chunk's rows are written with one append and flushed; an exception or Ctrl-C during the write truncates the
  file back to its last whole line, so the output is always whole lines.
- Every input problem is a `JsonlError` naming the file, the line and the field.
"""

from __future__ import annotations

import itertools
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..base.errors import InvalidArgument

READ_BLOCK = 1 << 20  # bytes read at a time when scanning an existing output
LIVE_S = 1.0  # how often the progress bar's live status is refreshed


class JsonlError(ValueError):
    """A problem with one input line: `FILE:LINE: field F: message`."""

    def __init__(self, path: str, line: int | None, field: str | None, message: str) -> None:
        self.path, self.line, self.field, self.message = path, line, field, message
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: field {field}: {message}" if field else f"{where}: {message}")


class FieldError(ValueError):
    """Raised by a per-record check; the driver adds the file and line."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"field {field}: {message}")


@dataclass(frozen=True)
class Record:
    index: int  # 0-based record number in the input (blank lines are not records)
    line: int  # 1-based physical line number, for messages
    data: dict


# ---------------------------------------------------------------------------------------------- reading
def read_records(path: str, skip: int = 0) -> Iterator[Record]:
    """Yield the input's records in order; the first `skip` records are passed over without being parsed."""
    stream = sys.stdin if path == "-" else open(path, encoding="utf-8")
    index = 0
    try:
        for number, text in enumerate(stream, start=1):
            if not text.strip():
                continue
            if index >= skip:
                yield Record(index, number, parse(text, path, number))
            index += 1
    finally:
        if stream is not sys.stdin:
            stream.close()


def parse(text: str, path: str, line: int) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise JsonlError(path, line, None, f"malformed JSON: {e.msg} (column {e.colno}). Fix: write one JSON "
                                           "object per line") from None
    if not isinstance(data, dict):
        raise JsonlError(path, line, None, f"expected a JSON object, got {type(data).__name__}. Fix: write one "
                                           "object per line, e.g. {\"prompt\": \"...\"}")
    return data


def chunked(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def is_regular_file(path: str) -> bool:
    return path != "-" and stat.S_ISREG(os.stat(path).st_mode)


# ---------------------------------------------------------------------------------------------- resuming
@dataclass(frozen=True)
class Resume:
    num_rows: int  # complete lines already in the output
    size: int  # bytes of those lines (anything after is a torn line)
    last_row: dict | None


def scan_output(path: str) -> Resume:
    """Count an existing output's complete lines without loading it; nothing is changed on disk."""
    if not os.path.exists(path):
        return Resume(0, 0, None)
    count, offset, last_end, prev_end = 0, 0, 0, 0
    with open(path, "rb") as f:
        while block := f.read(READ_BLOCK):
            if (found := block.count(b"\n")):
                last = block.rfind(b"\n")
                before = block.rfind(b"\n", 0, last) if found > 1 else -1
                prev_end = offset + before + 1 if before != -1 else last_end
                last_end, count = offset + last + 1, count + found
            offset += len(block)
        last = None
        if count:
            f.seek(prev_end)
            text = f.read(last_end - prev_end).decode("utf-8", errors="replace")
            try:
                last = json.loads(text)
            except json.JSONDecodeError:
                raise JsonlError(path, count, None, "the output's last complete line is not JSON. Fix: pass "
                                                    "--overwrite, or a new output path") from None
    return Resume(count, last_end, last)


def check_resumable(resume: Resume, record: Record | None, src: str, dst: str) -> None:
    """The last row written must answer input record `num_rows - 1`: it keeps that record's fields."""
    if resume.num_rows == 0:
        return
    fix = "Fix: pass the same input as before, --overwrite to start again, or a new output path"
    if record is None:
        raise JsonlError(dst, resume.num_rows, None, f"the output already has {resume.num_rows} rows but {src} has "
                                                     f"fewer records. {fix}")
    if not isinstance(resume.last_row, dict) or any(resume.last_row.get(k) != v for k, v in record.data.items()):
        raise JsonlError(dst, resume.num_rows, None, f"the last row written does not answer {src}:{record.line}. "
                                                     f"{fix}")


class Writer:
    """Appends whole lines: a chunk is written with one unbuffered append, or not at all."""

    def __init__(self, path: str, keep_bytes: int) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        os.ftruncate(self._fd, keep_bytes)  # drop a torn line (or everything, for --overwrite)
        self.size = keep_bytes

    def write(self, rows: list[dict]) -> None:
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8")
        try:
            view = memoryview(data)
            while view:
                written = os.pwrite(self._fd, view, self.size + len(data) - len(view))
                view = view[written:]
        except BaseException:  # Ctrl-C or a full disk mid-write: back to the last whole line
            os.ftruncate(self._fd, self.size)
            raise
        self.size += len(data)

    def close(self) -> None:
        os.close(self._fd)


# ---------------------------------------------------------------------------------------------- the driver
Check = Callable[[dict], None]
Process = Callable[[list[Record]], tuple[list[dict], int]]  # records -> (one row per record, tokens)


@dataclass(frozen=True)
class Job:
    """One JSONL run. `start` loads the model after validation and returns the chunk function."""

    src: str
    dst: str
    check: Check
    start: Callable[[], Process]
    batch_size: int = 64
    overwrite: bool = False
    progress: bool = True
    verb: str = "processed"
    live: Callable[[], str] | None = None  # the progress bar's status, read every LIVE_S (default: tok/s so far)


@dataclass
class Stats:
    num_resumed: int = 0
    num_new: int = 0
    num_tokens: int = 0
    seconds: float = 0.0

    def summary(self, verb: str, dst: str) -> str:
        rate = self.num_tokens / self.seconds if self.seconds > 0 else 0.0
        return (f"rollout: {verb} {self.num_new} rows ({self.num_resumed} already done) in {self.seconds:.1f}s, "
                f"{self.num_tokens} tokens ({rate:.1f} tok/s) -> {dst}")


def run(job: Job, stats: Stats) -> Stats:
    """Validate, resume, then process the input chunk by chunk, appending rows in order. Fills `stats` as it goes
    (so a caller that catches Ctrl-C can still report what was written). The model is loaded (`job.start`) only
    once there is a chunk to process."""
    resume = Resume(0, 0, None) if job.overwrite else scan_output(job.dst)
    stats.num_resumed = resume.num_rows
    records = read_records(job.src, skip=max(resume.num_rows - 1, 0))
    if resume.num_rows:
        check_resumable(resume, next(records, None), job.src, job.dst)
    total = prevalidate(job, resume.num_rows) if is_regular_file(job.src) else None
    writer = Writer(job.dst, resume.size)
    process, bar, ticker, begin = None, None, None, time.perf_counter()
    try:
        for chunk in chunked(records, job.batch_size):
            for record in chunk:
                checked(job.check, record, job.src)
            if process is None:  # load the model only once there is work, and start the clock after it
                process = job.start()
                bar, begin = _bar(job, total, resume.num_rows), time.perf_counter()
                ticker = Ticker(bar, job.live) if job.live is not None and job.progress else None
            try:
                rows, tokens = process(chunk)
            except ValueError as e:  # a model check failed on one line: keep every row before it, then stop
                bad, error = locate(e, chunk, job.src)
                if bad:
                    _commit(writer, stats, bar, begin, *process(chunk[:bad]))
                raise error from None
            _commit(writer, stats, bar, begin, rows, tokens, live=ticker is not None)
    finally:
        if ticker is not None:
            ticker.stop()
        if bar is not None:
            bar.close()
        writer.close()
        stats.seconds = time.perf_counter() - begin
    return stats


def prevalidate(job: Job, skip: int) -> int:
    """Parse and check every record not yet done, before any compute; returns the input's record count."""
    total = skip
    for record in read_records(job.src, skip=skip):
        checked(job.check, record, job.src)
        total += 1
    return total


def checked(check: Check, record: Record, path: str) -> None:
    try:
        check(record.data)
    except FieldError as e:
        raise JsonlError(path, record.line, e.field, e.message) from None


def locate(error: ValueError, chunk: list[Record], path: str) -> tuple[int, JsonlError]:
    """Map an InvalidArgument located at `index` N of the call ("prompt N" / "pair N", N within the chunk) to
    (N, a JsonlError on that line naming its field); any other ValueError to (0, an error on the chunk's lines)."""
    index = error.index if isinstance(error, InvalidArgument) else None
    if index is None or not 0 <= index < len(chunk):
        return 0, JsonlError(path, None, None, f"lines {chunk[0].line}-{chunk[-1].line}: {error}")
    record, field = chunk[index], error.field
    if field not in record.data and f"{field}_ids" in record.data:  # e.g. "completion" given as completion_ids
        field = f"{field}_ids"
    return index, JsonlError(path, record.line, field, error.detail)


def _commit(writer: Writer, stats: Stats, bar, begin: float, rows: list[dict], tokens: int,
            live: bool = False) -> None:
    writer.write(rows)
    stats.num_new += len(rows)
    stats.num_tokens += tokens
    stats.seconds = time.perf_counter() - begin
    if not live:  # else the ticker's live status stands
        bar.set_postfix_str(f"{stats.num_tokens / max(stats.seconds, 1e-9):.1f} tok/s", refresh=False)
    bar.update(len(rows))


class Ticker:
    """Refreshes the bar's status from `live()` every LIVE_S on a daemon thread, while chunks run (a chunk may take
    minutes: the bar still moves). A failing `live()` leaves the status as it was."""

    def __init__(self, bar, live: Callable[[], str]) -> None:
        self.bar, self.live = bar, live
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rollout-progress")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(LIVE_S):
            try:
                self.bar.set_postfix_str(self.live())
            except Exception:  # noqa: BLE001 - the status is cosmetic; the run goes on
                pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _bar(job: Job, total: int | None, initial: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="req", desc=job.verb, file=sys.stderr, dynamic_ncols=True,
                disable=not job.progress, smoothing=0.1)
