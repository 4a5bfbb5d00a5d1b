"""The `rollout` command: the real console script on the tiny model (generate, resume after a torn line and a bad
line, score), the JSONL driver's invariants with a fake model, and error/interrupt handling in-process.

Each subprocess pays ~10 s of imports on 2 cores, so there are three (two of them concurrent); the rest runs
in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from conftest import reference_logprobs

from rollout import __version__, cli
from rollout.base.errors import invalid
from rollout.cli import jsonl, records
from rollout.cli.jsonl import FieldError, Job, JsonlError, Stats

TOL = 1e-5
ROLLOUT = str(Path(sys.executable).with_name("rollout"))  # the console script pyproject.toml installs
GENERATE_FLAGS = ["--n", "2", "--temperature", "0.9", "--top-k", "50", "--max-new-tokens", "6", "--seed", "11"]
INPUT = [  # blank lines are not records; fields other than the prompt and sampling ones are kept
    {"id": "a", "prompt": "the cat is", "meta": {"split": "test"}},
    {"id": "b", "prompt_ids": [5, 6, 7, 8], "n": 3, "temperature": 0},
    None,
    {"id": "c", "prompt": "one two three", "max_new_tokens": 3, "seed": 4, "top_logprobs": 2},
    {"id": "d", "prompt_ids": [40, 41], "top_p": 0.5, "logit_bias": {"7": 100}},
    {"id": "e", "prompt": "what is the answer", "ignore_eos": True},
]
PAIRS = [{"prompt": "the cat is", "completion": " a red dog", "k": 1},
         {"prompt_ids": [5, 6, 7], "completion_ids": [8, 9, 10, 11], "temperature": 0.5},
         {"prompt_ids": [3], "completion_ids": [4]}]


def write_jsonl(path: Path, items: list) -> Path:
    path.write_text("".join("\n" if item is None else json.dumps(item) + "\n" for item in items))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def rollout(*args: str) -> subprocess.Popen:
    """Start the real console script; two run at once where they are independent (imports dominate their cost)."""
    return subprocess.Popen([ROLLOUT, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def call(argv: list, capsys) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module", autouse=True)
def launched(tiny_path, tmp_path_factory):
    """`rollout generate` and `rollout score`, started together on small files when the module starts; the tests
    that read their results come last, so the in-process tests run meanwhile."""
    tmp = tmp_path_factory.mktemp("cli")
    src, dst = write_jsonl(tmp / "in.jsonl", INPUT), tmp / "out.jsonl"
    pairs, scored = write_jsonl(tmp / "pairs.jsonl", PAIRS), tmp / "scored.jsonl"
    generate = rollout("generate", "--model", tiny_path, "--input", src, "--output", dst, *GENERATE_FLAGS,
                       "--batch-size", "2")
    score = rollout("score", pairs, scored, "--model", tiny_path, "--temperature", "0.8", "--batch-size", "2")
    yield {"generate": (src, dst, generate), "score": (pairs, scored, score)}
    for proc in (generate, score):
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def generated(launched):
    src, dst, proc = launched["generate"]
    done = finish(proc)
    assert done.returncode == 0, done.stderr
    return src, dst, done


# ---------------------------------------------------------------------------------------------- in-process
def test_version_and_every_help_are_complete(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"rollout {__version__}"
    wanted = {(): ["generate", "score", "demo"],
              ("generate",): ["--model", "--input", "--output", "--n", "--temperature", "--top-k", "--top-p",
                              "--max-new-tokens", "--stop-token-ids", "--ignore-eos", "--seed", "--chat-template",
                              "--workers", "--batch-size", "--overwrite", "prompt_ids", "finish_reason", "Exit codes",
                              "--metrics-port", "--metrics-host"],
              ("score",): ["INPUT", "OUTPUT", "--model", "--temperature", "completion_ids", "logprob_sum"]}
    for command, words in wanted.items():
        with pytest.raises(SystemExit) as done:
            cli.main([*command, "--help"])
        text = capsys.readouterr().out
        assert done.value.code == 0 and all(w in text for w in words), (command, text)


def test_demo_forwards_every_argument(monkeypatch):
    seen = []
    fake = types.ModuleType("trainers_integration.demo")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "trainers_integration.demo", fake)
    assert cli.main(["demo", "--steps", "3", "--help"]) == 7
    assert seen == [["--steps", "3", "--help"]]


@pytest.mark.parametrize("line, field, words", [
    ('{"id": 1, "prompt": "x"', None, "malformed JSON"),
    ('[1, 2]', None, "expected a JSON object"),
    ('{"id": 1}', "prompt", "exactly one of"),
    ('{"id": 1, "prompt": "x", "max_tokens": 5}', "max_tokens", "use max_new_tokens"),
    ('{"id": 1, "prompt": "x", "min_p": 1.1}', "min_p", "must be a finite number in [0, 1]"),
    ('{"id": 1, "prompt": "x", "logit_bias": {"a": 1}}', "logit_bias", "non-negative token id"),
    ('{"id": 1, "prompt_ids": [1, -2]}', "prompt_ids", "non-negative"),
    ('{"id": 1, "prompt": "x", "temperature": "hot"}', "temperature", "finite number"),
    ('{"id": 1, "prompt": "x", "logprobs": []}', "logprobs", "this command writes"),
])
def test_bad_line_fails_before_any_compute_and_keeps_the_output(tmp_path, capsys, line, field, words):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 0, "prompt": "x"}\n\n{"id": 2, "prompt": "y"}\n' + line + "\n")
    dst = tmp_path / "out.jsonl"
    dst.write_text('{"id": 0, "prompt": "x", "done": true}\n')
    empty_model = tmp_path / "model"  # a directory with no checkpoint: loading it would fail differently
    empty_model.mkdir()
    code, err = call(["generate", "--model", empty_model, "--input", src, "--output", dst], capsys)
    where = f"{src}:4: field {field}:" if field else f"{src}:4: "
    assert code == 2 and err.startswith(f"rollout: error: {where}") and words in err, err
    assert len(err.strip().splitlines()) == 1
    assert dst.read_text() == '{"id": 0, "prompt": "x", "done": true}\n'


def test_usage_errors_exit_2_with_one_line(tiny_path, tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    cases = {("--model", tmp_path / "missing"): "--model", ("--top-p", "2"): "--top-p: top_p=2.0 is invalid",
             ("--workers", "0"): "--workers 0"}
    for extra, words in cases.items():
        args = ["generate", "--model", tiny_path, "--input", src, "--output", tmp_path / "o.jsonl", *extra]
        code, err = call(args, capsys)
        assert code == 2 and err.startswith("rollout: error: ") and words in err and err.count("\n") == 1, err
    code, err = call(["score", tmp_path / "nope.jsonl", tmp_path / "o.jsonl", "--model", tiny_path], capsys)
    assert code == 2 and "no such file" in err
    assert not (tmp_path / "o.jsonl").exists()


def test_sigterm_mid_run_leaves_whole_rows_and_a_rerun_completes(tiny_path, tmp_path, capsys, monkeypatch):
    src = write_jsonl(tmp_path / "in.jsonl", [{"i": i, "prompt_ids": [10 + i, 20]} for i in range(6)])
    dst = tmp_path / "out.jsonl"
    argv = ["generate", "--model", tiny_path, "--input", src, "--output", dst, "--max-new-tokens", "3",
            "--batch-size", "2", "--seed", "0", "--no-progress"]
    real, calls = records.generate_rows, []

    def killed_on_second_chunk(*args):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's kill: handled like Ctrl-C
        return real(*args)

    monkeypatch.setattr(records, "generate_rows", killed_on_second_chunk)
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or e.g. Ray's if an earlier test started Ray
    code, err = call(argv, capsys)
    assert code == 130 and "interrupted; 2 complete rows" in err, err
    assert [r["i"] for r in read_jsonl(dst)] == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is only installed during a run
    monkeypatch.setattr(records, "generate_rows", real)
    code, err = call(argv, capsys)
    assert code == 0 and "generated 4 rows (2 already done)" in err, err
    assert [r["i"] for r in read_jsonl(dst)] == list(range(6))


def test_metrics_port_in_use_fails_before_the_input_is_read(tiny_path, tmp_path, capsys):
    import socket

    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = call(["generate", "--model", tiny_path, "--input", src, "--output", tmp_path / "o.jsonl",
                          "--metrics-port", port], capsys)
    assert code == 2 and err.startswith(f"rollout: error: --metrics-port {port}: cannot serve metrics on 127.0.0.1 "
                                        f"port {port}: Address already in use. Fix:"), err
    assert not (tmp_path / "o.jsonl").exists()


def test_generate_serves_exact_metrics_while_it_runs_and_stops_after(tiny_path, tmp_path, capsys, monkeypatch):
    import urllib.error
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from rollout.worker.worker import RolloutWorker

    servers, scraped, tokens = [], [], [0]
    serve = RolloutWorker.serve_metrics
    monkeypatch.setattr(RolloutWorker, "serve_metrics", lambda self, *a: servers.append(serve(self, *a)) or
                        servers[-1])
    real = records.generate_rows

    def scrape_after_each_chunk(chunk, batch, tokenizer):  # the endpoint, while the command runs
        tokens[0] += int(batch.completion_lengths.sum())
        text = urllib.request.urlopen(servers[0].url, timeout=10).read().decode()
        values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
        scraped.append((values["rollout_generated_tokens_total"], tokens[0]))
        return real(chunk, batch, tokenizer)

    monkeypatch.setattr(records, "generate_rows", scrape_after_each_chunk)
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [10 + i, 20, 30], "n": 2} for i in range(5)])
    code, err = call(["generate", "--model", tiny_path, "--input", src, "--output", tmp_path / "o.jsonl",
                      "--max-new-tokens", "4", "--batch-size", "2", "--metrics-port", "0", "--no-progress"], capsys)
    assert code == 0, err
    assert f"rollout: serving metrics on {servers[0].url}" in err and servers[0].url.startswith("http://127.0.0.1:")
    assert len(scraped) == 3 and all(got == want for got, want in scraped), scraped  # exact after every chunk
    with pytest.raises(urllib.error.URLError):  # the run is over: so is its endpoint
        urllib.request.urlopen(servers[0].url, timeout=5)


def test_the_progress_bar_shows_the_engines_tok_s_and_kv_use(monkeypatch):
    import threading

    from rollout.cli.main import LiveStatus
    from rollout.metrics.snapshot import WorkerMetrics

    clock = iter([100.0, 102.0])
    snapshots = iter([WorkerMetrics(sampled_tokens=50, kv_pages_total=64, kv_pages_used=16, kv_pages_peak=20),
                      WorkerMetrics(sampled_tokens=650, kv_pages_total=64, kv_pages_used=48, kv_pages_peak=48)])
    status = LiveStatus(clock=lambda: next(clock))
    assert status() == ""  # before the model is loaded
    status.source = lambda: next(snapshots)
    assert status() == "0.0 tok/s, KV 25% (16/64 pages, peak 20)"
    assert status() == "300.0 tok/s, KV 75% (48/64 pages, peak 48)"  # 600 tokens in 2 s

    class Bar:
        def __init__(self):
            self.shown, self.event = [], threading.Event()

        def set_postfix_str(self, text):
            self.shown.append(text)
            self.event.set()

    monkeypatch.setattr(jsonl, "LIVE_S", 0.01)
    bar = Bar()
    ticker = jsonl.Ticker(bar, lambda: "42.0 tok/s, KV 1%")
    assert bar.event.wait(5)
    ticker.stop()
    assert bar.shown[0] == "42.0 tok/s, KV 1%"


# ---------------------------------------------------------------------------------------------- jsonl driver
def fake_job(src: Path, dst: Path, calls: list, fail_on: str | None = None, **kwargs) -> Job:
    """Doubles `x`; raises the worker's InvalidArgument ("prompt N: field=...", index N) for the record with
    x == fail_on."""
    def check(data: dict) -> None:
        if not isinstance(data.get("x"), int):
            raise FieldError("x", "must be an int")

    def process(chunk):
        calls.append([r.data["x"] for r in chunk])
        for i, r in enumerate(chunk):
            if r.data["x"] == fail_on:
                raise invalid("max_new_tokens", 9, "too long", "shorten it", f"prompt {i}", i)
        return [dict(r.data, y=2 * r.data["x"]) for r in chunk], len(chunk)

    return Job(str(src), str(dst), check, lambda: process, progress=False, **kwargs)


def test_driver_streams_chunks_in_order_and_resumes_only_new_records(tmp_path):
    src, dst, calls = tmp_path / "in.jsonl", tmp_path / "out.jsonl", []
    write_jsonl(src, [{"x": 0}, None, {"x": 1}, {"x": 2}, {"x": 3}, {"x": 4}])
    stats = jsonl.run(fake_job(src, dst, calls, batch_size=2), Stats())
    assert calls == [[0, 1], [2, 3], [4]] and (stats.num_new, stats.num_resumed) == (5, 0)
    assert read_jsonl(dst) == [{"x": i, "y": 2 * i} for i in range(5)]
    with src.open("a") as f:
        f.write('{"x": 5}\n')
    calls.clear()
    stats = jsonl.run(fake_job(src, dst, calls, batch_size=2), Stats())
    assert calls == [[5]] and (stats.num_new, stats.num_resumed) == (6 - 5, 5)
    calls.clear()
    jsonl.run(fake_job(src, dst, calls, batch_size=4, overwrite=True), Stats())
    assert calls == [[0, 1, 2, 3], [4, 5]] and len(read_jsonl(dst)) == 6


def test_driver_refuses_to_resume_from_another_input(tmp_path):
    src, dst = write_jsonl(tmp_path / "in.jsonl", [{"x": 0}, {"x": 1}]), tmp_path / "out.jsonl"
    dst.write_text('{"x": 7, "y": 14}\n')
    with pytest.raises(JsonlError, match="does not answer"):
        jsonl.run(fake_job(src, dst, []), Stats())
    dst.write_text('{"x": 0, "y": 0}\n{"x": 1, "y": 2}\n{"x": 2, "y": 4}\n')
    with pytest.raises(JsonlError, match="already has 3 rows"):
        jsonl.run(fake_job(src, dst, []), Stats())


def test_model_error_keeps_the_rows_before_the_bad_line(tmp_path):
    src, dst, calls = tmp_path / "in.jsonl", tmp_path / "out.jsonl", []
    write_jsonl(src, [{"x": i} for i in range(7)])
    with pytest.raises(JsonlError) as error:
        jsonl.run(fake_job(src, dst, calls, fail_on=5, batch_size=3), Stats())
    assert (error.value.line, error.value.field) == (6, "max_new_tokens")
    assert str(error.value).startswith(f"{src}:6: field max_new_tokens: max_new_tokens=9 is invalid")
    assert calls == [[0, 1, 2], [3, 4, 5], [3, 4]] and [r["x"] for r in read_jsonl(dst)] == [0, 1, 2, 3, 4]


def test_a_model_error_that_names_no_line_is_not_pinned_on_one(tmp_path):
    """Only an InvalidArgument's index locates a line: a plain ValueError that reads like the worker's is the
    chunk's."""
    src, dst = write_jsonl(tmp_path / "in.jsonl", [{"x": i} for i in range(4)]), tmp_path / "out.jsonl"

    def process(chunk):
        if any(r.data["x"] == 3 for r in chunk):
            raise ValueError("prompt 1: max_new_tokens=9 is what the tokenizer said")
        return [dict(r.data, y=0) for r in chunk], len(chunk)

    job = Job(str(src), str(dst), lambda data: None, lambda: process, batch_size=2, progress=False)
    with pytest.raises(JsonlError) as error:
        jsonl.run(job, Stats())
    assert (error.value.line, error.value.field) == (None, None)
    assert str(error.value) == f"{src}: lines 3-4: prompt 1: max_new_tokens=9 is what the tokenizer said"
    assert [r["x"] for r in read_jsonl(dst)] == [0, 1]  # the chunk before; nothing of the failed one


def test_score_pins_a_refused_pair_on_its_line_and_names_the_field_the_line_used(tiny_path, tmp_path, capsys):
    pairs = [{"id": 0, "prompt_ids": [1, 2], "completion_ids": [3]},
             {"id": 1, "prompt_ids": [4], "completion_ids": [5]},
             {"id": 2, "prompt_ids": [6], "completion_ids": [7, 10**6]}]
    src, dst = write_jsonl(tmp_path / "in.jsonl", pairs), tmp_path / "out.jsonl"
    code, err = call(["score", src, dst, "--model", tiny_path, "--no-progress"], capsys)
    assert code == 2, err
    assert f"rollout: error: {src}:3: field completion_ids: completion='token id 1000000 at position 1' is invalid: " \
           "ids must be in [0, 512)" in err  # after the loading bar
    assert [r["id"] for r in read_jsonl(dst)] == [0, 1]


def test_bad_field_found_by_prevalidation_before_the_model_loads(tmp_path):
    src, dst = write_jsonl(tmp_path / "in.jsonl", [{"x": 0}, {"x": 1}, {"x": "two"}]), tmp_path / "out.jsonl"
    job = fake_job(src, dst, [])
    job = Job(job.src, job.dst, job.check, lambda: pytest.fail("model loaded before validation"), progress=False)
    with pytest.raises(JsonlError, match=r"in.jsonl:3: field x: must be an int"):
        jsonl.run(job, Stats())
    assert not dst.exists()


def test_input_is_read_one_chunk_at_a_time(tmp_path, monkeypatch):
    """A pipe (no pre-validation pass): when chunk k is processed, at most k + 1 chunks have been read."""
    consumed = []

    def lines():
        for i in range(100):
            consumed.append(i)
            yield json.dumps({"x": i}) + "\n"

    monkeypatch.setattr(sys, "stdin", lines())
    calls, seen_at_call = [], []
    job = fake_job(Path("-"), tmp_path / "out.jsonl", calls, batch_size=10)
    inner = job.start()
    job = Job("-", job.dst, job.check, lambda: lambda chunk: (seen_at_call.append(len(consumed)), inner(chunk))[1],
              batch_size=10, progress=False)
    jsonl.run(job, Stats())
    assert len(calls) == 10 and all(seen <= 10 * (k + 1) + 1 for k, seen in enumerate(seen_at_call)), seen_at_call


@pytest.mark.parametrize("block", [4, jsonl.READ_BLOCK])  # lines spanning reads, and whole-file reads
def test_scan_output_ignores_a_torn_tail_and_the_writer_drops_it(tmp_path, monkeypatch, block):
    monkeypatch.setattr(jsonl, "READ_BLOCK", block)
    dst = tmp_path / "out.jsonl"
    dst.write_bytes(b'{"x": 0}\n{"x": 1}\n{"x": 2, "y"')
    resume = jsonl.scan_output(str(dst))
    assert (resume.num_rows, resume.size, resume.last_row) == (2, 18, {"x": 1})
    writer = jsonl.Writer(str(dst), resume.size)
    writer.write([{"x": 2}])
    writer.close()
    assert dst.read_text() == '{"x": 0}\n{"x": 1}\n{"x": 2}\n'
    assert jsonl.scan_output(str(tmp_path / "none.jsonl")) == jsonl.Resume(0, 0, None)


def test_interrupt_mid_write_leaves_only_whole_lines(tmp_path, monkeypatch):
    dst = tmp_path / "out.jsonl"
    writer = jsonl.Writer(str(dst), 0)
    writer.write([{"x": 0}])
    real = os.pwrite

    def torn(fd, data, offset):
        real(fd, bytes(data[: len(data) // 2]), offset)
        raise KeyboardInterrupt

    monkeypatch.setattr(jsonl.os, "pwrite", torn)
    with pytest.raises(KeyboardInterrupt):
        writer.write([{"x": 1}, {"x": 2}])
    monkeypatch.setattr(jsonl.os, "pwrite", real)
    writer.write([{"x": 3}])
    writer.close()
    assert dst.read_text() == '{"x": 0}\n{"x": 3}\n'


# ---------------------------------------------------------------------------------------------- real command
def test_generate_writes_one_row_per_line_keeping_its_fields(generated, tiny):
    _, dst, proc = generated
    _, tokenizer = tiny
    rows, inputs = read_jsonl(dst), [item for item in INPUT if item is not None]
    assert len(rows) == len(inputs)
    for row, item in zip(rows, inputs):
        assert {k: row[k] for k in item} == item
        n = item.get("n", 2)
        assert [len(row[k]) for k in records.GENERATE_OUTPUT] == [n] * 5
        assert row["policy_version"] == [0] * n
        for ids, logprobs, finish, text in zip(row["completion_ids"], row["logprobs"], row["finish_reason"],
                                               row["completions"]):
            assert 1 <= len(ids) <= item.get("max_new_tokens", 6) and len(logprobs) == len(ids)
            assert finish == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
    assert rows[1]["completion_ids"][0] == rows[1]["completion_ids"][2]  # greedy line: every sample the same
    assert all(set(ids) == {7} for ids in rows[3]["completion_ids"])  # its bias; its logprobs stay raw (next test)
    assert rows[0]["completion_ids"][0] != rows[0]["completion_ids"][1]
    assert all(f == "length" and len(ids) == 6 for f, ids in zip(rows[4]["finish_reason"], rows[4]["completion_ids"]))
    assert "generated 5 rows (0 already done)" in proc.stderr and "req" in proc.stderr  # summary and progress bar


def test_generated_logprobs_equal_a_plain_forward(generated, tiny):
    _, dst, _ = generated
    model, tokenizer = tiny
    for row in read_jsonl(dst):
        prompt = row.get("prompt_ids") or tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        for ids, logprobs in zip(row["completion_ids"], row["logprobs"]):
            full, _ = reference_logprobs(model, prompt, ids, row.get("temperature", 0.9))
            assert torch.allclose(torch.tensor(logprobs), full, atol=TOL, rtol=0), row["id"]


def test_a_line_asking_top_logprobs_gets_the_exact_alternatives_of_each_token(generated, tiny):
    _, dst, _ = generated
    model, tokenizer = tiny
    rows = read_jsonl(dst)
    assert [records.ALTERNATIVES in row for row in rows] == [False, False, True, False, False]  # only line "c"
    row = rows[2]
    prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    assert len(row[records.ALTERNATIVES]) == 2  # one per sample
    for ids, logprobs, alternatives in zip(row["completion_ids"], row["logprobs"], row[records.ALTERNATIVES]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
        reference = torch.log_softmax(logits.float() / 0.9, dim=-1)  # the flags' temperature
        assert len(alternatives) == len(ids) and all(len(a) == 2 for a in alternatives)
        listed = torch.tensor([[t for t, _ in a] for a in alternatives])
        values = torch.tensor([[v for _, v in a] for a in alternatives])
        assert torch.allclose(values, reference.topk(2, dim=-1).values, atol=TOL, rtol=0)
        assert torch.allclose(reference.gather(1, listed), values, atol=TOL, rtol=0)
        for token, value, pairs in zip(ids, logprobs, alternatives):  # listed: the very same number
            assert all(v == value for t, v in pairs if t == token)


def test_rerun_resumes_after_a_torn_line_and_stops_at_a_bad_line_keeping_rows(generated, tiny_path, tmp_path):
    _, full, _ = generated
    lines = full.read_text().splitlines(keepends=True)
    dst = tmp_path / "out.jsonl"
    dst.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed mid-write of row 3
    inputs = [item for item in INPUT if item is not None]
    longer = write_jsonl(tmp_path / "in.jsonl", INPUT + [{"id": "f", "prompt_ids": [3] * 20, "max_new_tokens": 1010},
                                                        {"id": "g", "prompt": "never reached"}])
    # different chunks than the first run (3 lines, from line 4): [c, d, e] then [f (too long), g]
    proc = finish(rollout("generate", "--model", tiny_path, "--input", longer, "--output", dst, *GENERATE_FLAGS,
                          "--batch-size", "3"))
    assert proc.returncode == 2, proc.stderr
    assert f"rollout: error: {longer}:7: field max_new_tokens: max_new_tokens=1010 is invalid" in proc.stderr
    assert "5 complete rows kept" in proc.stderr
    rows, expected = read_jsonl(dst), read_jsonl(full)
    assert [r["id"] for r in rows] == [item["id"] for item in inputs]  # each row once, in order, none after line 7
    for row, want in zip(rows, expected):  # seed S + line index: resumed rows equal the uninterrupted run's
        assert row["completion_ids"] == want["completion_ids"]
        assert torch.allclose(torch.tensor(sum(row["logprobs"], [])), torch.tensor(sum(want["logprobs"], [])),
                              atol=TOL, rtol=0)


def test_score_adds_teacher_forced_logprobs(launched, tiny):
    model, tokenizer = tiny
    _, dst, proc = launched["score"]
    proc = finish(proc)
    assert proc.returncode == 0, proc.stderr
    assert "scored 3 rows" in proc.stderr
    for row, item in zip(read_jsonl(dst), PAIRS, strict=True):
        assert {k: row[k] for k in item} == item
        ids = {name: item.get(f"{name}_ids") or tokenizer(item[name], add_special_tokens=False)["input_ids"]
               for name in ("prompt", "completion")}
        full, _ = reference_logprobs(model, ids["prompt"], ids["completion"], item.get("temperature", 0.8))
        assert torch.allclose(torch.tensor(row["logprobs"]), full, atol=TOL, rtol=0)
        assert row["logprob_sum"] == pytest.approx(float(full.sum()), abs=1e-4)
