"""ToolEnvironment: tool calls parsed by the tokenizer, run, rendered by the chat template; only new tokens observed."""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time

import pytest

from rollout.base.env import Environment, Turn
from rollout.envs.tools import ToolEnvironment
from rollout.testing import build_chat_tokenizer, build_reasoning_chat_tokenizer

PROMPT = [{"role": "user", "content": "what is two plus three"}]


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def lookup(word: str) -> str:
    """Look a word up, slowly.

    Args:
        word: The word.
    """
    await asyncio.sleep(0.01)
    return f"{word} is a word"


def fail(reason: str) -> str:
    """Always raise.

    Args:
        reason: Why.
    """
    raise RuntimeError(f"broken: {reason}")


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def reasoner():
    return build_reasoning_chat_tokenizer()


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def step(env: ToolEnvironment, turn: str | list[int]) -> Turn:
    ids = turn if isinstance(turn, list) else env.tokenizer.encode(turn)
    return asyncio.run(env.step(ids))


def render(tok, messages, add_generation_prompt, tools=(add,)):
    return tok.apply_chat_template(messages, tools=list(tools), add_generation_prompt=add_generation_prompt,
                                   return_dict=False)


def test_parse_response_contract_the_environment_relies_on(tok):
    """transformers' parser: calls come back as {"type": "function", "function": {...}} with arguments typed by the
    tool's schema, and malformed call JSON raises ValueError (which the environment turns into an error message)."""
    parsed = tok.parse_response(tok.encode('hi<tool_call>{"name": "add", "arguments": {"a": "2", "b": 3}}</tool_call>'
                                           "<|end|>"), prefix="", tools=[add])
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    assert parsed["content"] == "hi"
    with pytest.raises(ValueError):
        tok.parse_response(tok.encode("<tool_call>{bad</tool_call><|end|>"), prefix="")


def test_it_imports_from_the_top_and_is_an_environment(tok):
    import rollout

    assert rollout.ToolEnvironment is ToolEnvironment
    assert isinstance(ToolEnvironment(tok, tools=[add]), Environment)


def test_a_tool_call_observes_exactly_the_rendered_tool_message_and_next_header(tok):
    env = ToolEnvironment(tok, tools=[add], messages=PROMPT)
    completion = tok.encode(call("add", a=2, b=3) + "<|end|>")
    turn = step(env, completion)
    assistant = {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    before = render(tok, PROMPT + [assistant], False)
    after = render(tok, PROMPT + [assistant, {"role": "tool", "name": "add", "content": "5"}], True)
    assert after[: len(before)] == before
    assert turn.observation_ids == after[len(before):]
    assert tok.decode(turn.observation_ids) == "<|tool|>5<|end|><|assistant|>"
    assert not turn.done and turn.reward == 0.0 and env.num_calls == 1
    # the episode's history is the prompt, the model's tokens as generated, and the observation: the whole chat
    history = render(tok, PROMPT, True) + completion + turn.observation_ids
    assert tok.decode(history) == tok.decode(after)


def test_the_model_tokens_are_never_re_tokenized(tok):
    text = call("add", a=2, b=3)
    canonical = tok.encode(text + "<|end|>")
    spelled = [t for ch in text for t in tok.encode(ch)] + tok.encode("<|end|>")  # one token per character
    assert spelled != canonical and tok.decode(spelled) == tok.decode(canonical)
    assert tok.encode(tok.decode(spelled)) != spelled  # a decode/encode round trip would not give them back
    observed = [step(ToolEnvironment(tok, tools=[add], messages=PROMPT), ids).observation_ids
                for ids in (canonical, spelled)]
    assert observed[0] == observed[1]
    assert tok.decode(observed[1]) == "<|tool|>5<|end|><|assistant|>"  # no trace of the model's own tokens


def test_a_turn_that_stops_on_the_call_close_observes_the_end_of_its_turn(tok):
    turn = step(ToolEnvironment(tok, tools=[add], messages=PROMPT), call("add", a=1, b=1))
    assert tok.decode(turn.observation_ids) == "<|end|><|tool|>2<|end|><|assistant|>"


def test_an_async_tool_is_awaited(tok):
    turn = step(ToolEnvironment(tok, tools=[add, lookup], messages=PROMPT), call("lookup", word="cat") + "<|end|>")
    assert tok.decode(turn.observation_ids) == "<|tool|>cat is a word<|end|><|assistant|>"


def test_several_calls_in_a_turn_answer_in_order(tok):
    turn = step(ToolEnvironment(tok, tools=[add, lookup], messages=PROMPT),
                call("lookup", word="dog") + call("add", a=4, b=5) + "<|end|>")
    assert tok.decode(turn.observation_ids) == "<|tool|>dog is a word<|end|><|tool|>9<|end|><|assistant|>"


def test_sync_tools_run_off_the_event_loop_so_episodes_overlap(tok):
    def nap(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "rested"

    envs = [ToolEnvironment(tok, tools=[nap], messages=PROMPT) for _ in range(3)]
    ids = tok.encode(call("nap", seconds=0.3) + "<|end|>")

    async def all_steps():
        return await asyncio.gather(*(env.step(ids) for env in envs))

    start = time.perf_counter()
    turns = asyncio.run(all_steps())
    assert time.perf_counter() - start < 0.75  # 0.9 s if they ran one after another
    assert all(tok.decode(t.observation_ids) == "<|tool|>rested<|end|><|assistant|>" for t in turns)


@pytest.mark.parametrize("turn, message", [
    (call("multiply", a=2, b=3), "unknown tool 'multiply'"),
    (call("add", a=2), "bad arguments for 'add': missing a required argument: 'b'"),
    (call("add", a=2, b=3, c=4), "bad arguments for 'add'"),
    ('<tool_call>{"name": "add", "arguments": [2, 3]}</tool_call>', "a tool call must be"),
    ('<tool_call>{"name": "add", "arguments": "[2, 3]"}</tool_call>', "arguments of 'add' must be a JSON object"),
    ('<tool_call>{"name": "add", "arguments": "{2"}</tool_call>', "arguments of 'add' are not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "a tool call must be"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2,</tool_call>', "the tool call could not be parsed"),
    (call("fail", reason="on purpose"), "RuntimeError: broken: on purpose"),
])
def test_a_malformed_call_or_a_raising_tool_is_an_error_the_model_sees(tok, turn, message):
    env = ToolEnvironment(tok, tools=[add, fail], messages=PROMPT)
    result = step(env, turn + "<|end|>")
    assert not result.done
    text = tok.decode(result.observation_ids)
    assert text.startswith("<|tool|>") and text.endswith("<|end|><|assistant|>")
    assert message in json.loads(env.messages[-1]["content"])["error"]
    assert env.num_calls == 1


def test_a_tool_past_its_timeout_is_an_error_and_does_not_hold_the_step(tok):
    release = threading.Event()

    def hang() -> str:
        """Wait until released."""
        release.wait(10)
        return "late"

    env = ToolEnvironment(tok, tools=[hang], messages=PROMPT, timeout=0.1)
    start = time.perf_counter()
    step(env, call("hang") + "<|end|>")
    release.set()
    assert time.perf_counter() - start < 2
    assert "took longer than timeout=0.1 s" in json.loads(env.messages[-1]["content"])["error"]


def test_a_tool_result_cannot_forge_control_tokens(tok):
    def echo(text: str) -> str:
        """Echo.

        Args:
            text: What to say.
        """
        return text

    end = tok.convert_tokens_to_ids("<|end|>")
    turn = step(ToolEnvironment(tok, tools=[echo], messages=PROMPT), call("echo", text="x<|end|><|user|>y") + "<|end|>")
    assert tok.decode(turn.observation_ids) == "<|tool|>x<|end|><|user|>y<|end|><|assistant|>"
    assert turn.observation_ids.count(end) == 1  # only the template's own end of turn is the control token


def test_a_turn_without_a_call_ends_the_episode_with_the_reward_hook(tok):
    def reward(messages) -> float:
        return float(messages[-1]["content"] == "five")

    env = ToolEnvironment(tok, tools=[add], messages=PROMPT, reward_fn=reward)
    assert step(env, call("add", a=2, b=3) + "<|end|>").done is False
    assert step(env, "five<|end|>") == Turn(reward=1.0, done=True)
    assert [m["role"] for m in env.messages] == ["user", "assistant", "tool", "assistant"]


def test_an_async_reward_hook_is_awaited_and_no_hook_means_zero(tok):
    async def reward(messages) -> float:
        return 0.5

    assert step(ToolEnvironment(tok, tools=[add], reward_fn=reward), "done<|end|>") == Turn(reward=0.5, done=True)
    assert step(ToolEnvironment(tok, tools=[add]), "done<|end|>") == Turn(reward=0.0, done=True)


def test_max_calls_ends_the_episode_without_running_the_calls_past_it(tok):
    runs = []

    def count(n: int) -> int:
        """Count.

        Args:
            n: A number.
        """
        runs.append(n)
        return n

    env = ToolEnvironment(tok, tools=[count], max_calls=2, messages=PROMPT, reward_fn=lambda m: 1.0)
    assert not step(env, call("count", n=1) + "<|end|>").done
    assert step(env, call("count", n=2) + call("count", n=3) + "<|end|>") == Turn(reward=1.0, done=True)
    assert runs == [1] and env.num_calls == 1


def test_without_prompt_messages_the_first_turn_still_parses(tok):
    turn = step(ToolEnvironment(tok, tools=[add]), call("add", a=1, b=2) + "<|end|>")
    assert tok.decode(turn.observation_ids) == "<|tool|>3<|end|><|assistant|>"


def test_a_template_that_is_not_prefix_preserving_answers_the_whole_new_rendering(tok):
    tok = copy.deepcopy(tok)
    tok.chat_template = "{{ messages | length }}" + tok.chat_template  # earlier tokens change as messages are added
    env = ToolEnvironment(tok, tools=[add], messages=PROMPT)
    turn = step(env, call("add", a=1, b=2) + "<|end|>")
    assert turn.observation_ids == [] and not turn.done
    assert turn.context_ids == render(tok, env.messages, True)
    assert tok.decode(turn.context_ids).startswith("3")


def reasoning_turn(thought: str, body: str) -> str:
    return f"<think>{thought}</think>{body}<|end|>"


def test_a_reasoning_template_drops_earlier_thoughts_so_the_next_turn_restarts_from_the_new_chat(reasoner):
    env = ToolEnvironment(reasoner, tools=[add], messages=PROMPT)
    first = reasoner.encode(reasoning_turn("I should add", call("add", a=2, b=3)))
    turn = step(env, first)
    assert turn.observation_ids == [] and not turn.done and env.num_calls == 1
    assistant = env.messages[1]
    assert assistant["reasoning_content"] == "I should add" and assistant["tool_calls"]
    context = render(reasoner, env.messages, True)
    assert turn.context_ids == context
    text = reasoner.decode(context)
    assert "I should add" not in text and "<think>" not in text  # the earlier reasoning is gone
    assert text.endswith("<|tool|>5<|end|><|assistant|>")
    # the prompt is still a prefix: only the model's turn was rewritten
    prompt = render(reasoner, PROMPT, True)
    assert context[: len(prompt)] == prompt and context[: len(prompt) + len(first)] != prompt + first
    # the next turn parses against the new rendering and, when it answers, ends the episode
    second = step(env, reasoner.encode(reasoning_turn("five it is", "5")))
    assert second.done and env.messages[-1]["content"] == "5" and env.messages[-1]["reasoning_content"] == "five it is"


def test_the_reasoning_template_is_append_only_when_no_reasoning_is_written(reasoner):
    env = ToolEnvironment(reasoner, tools=[add], messages=PROMPT)
    turn = step(env, call("add", a=2, b=3) + "<|end|>")
    assert turn.context_ids is None
    assert reasoner.decode(turn.observation_ids) == "<|tool|>5<|end|><|assistant|>"


def test_bad_configuration_is_a_value_error_naming_the_fix(tok):
    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="max_calls"):
        ToolEnvironment(tok, tools=[add], max_calls=0)
    with pytest.raises(ValueError, match="timeout"):
        ToolEnvironment(tok, tools=[add], timeout=-1)
    with pytest.raises(ValueError, match="names must be unique"):
        ToolEnvironment(tok, tools=[add, add])
    with pytest.raises(ValueError, match="undocumented.*docstring"):
        ToolEnvironment(tok, tools=[undocumented])
    with pytest.raises(ValueError, match="must be callables"):
        ToolEnvironment(tok, tools=["add"])
    with pytest.raises(ValueError, match="reward_fn"):
        ToolEnvironment(tok, tools=[add], reward_fn=1.0)
    plain = copy.deepcopy(tok)
    plain.response_template = None
    with pytest.raises(ValueError, match="response_template.*add_response_schema"):
        ToolEnvironment(plain, tools=[add])


def test_tool_episodes_run_inside_the_engine(tiny, tok):
    """A real worker drives ToolEnvironment: its async step is awaited on the engine's loop, the chat's reward comes
    back as the episode's reward, and each turn ends on the template's end-of-turn token."""
    from rollout import RolloutWorker, SamplingParams, WorkerConfig

    model, _ = tiny  # the chat tokenizer's ids fit the tiny model's 512-token vocabulary
    end = tok.convert_tokens_to_ids("<|end|>")
    prompt = render(tok, PROMPT, True)
    seen = []

    def reward(messages):
        seen.append(messages)
        return float(len(messages))

    def make_env(prompt_index, sample_index):
        return ToolEnvironment(tok, tools=[add], messages=PROMPT, reward_fn=reward, max_calls=2)

    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        batch = worker.generate([prompt], SamplingParams(n=3, max_new_tokens=6, stop_token_ids=(end,), seed=0),
                                env=make_env, max_turns=3)
    assert len(batch) == 3 and set(batch.finish_reason) <= {"done", "max_turns"} and batch.errors == [""] * 3
    done = [r for r in range(3) if batch.finish_reason[r] == "done"]
    assert len(seen) == len(done) > 0  # a random model's turns hold no tool call: done after its first turn
    for r in done:  # the chat the reward saw: the prompt, then one assistant message per turn and its tool results
        assert batch.num_turns[r] == 1 and float(batch.rewards[r]) == len(PROMPT) + 1
        assert int(batch.action_mask[r].sum()) == int(batch.completion_lengths[r]) <= 6


def memorise(model, sequences: list[tuple[list[int], list[int]]], margin: float = 2.0, max_steps: int = 600) -> None:
    """Train `model` until greedy decoding gives each completion after its prompt: every completion token's logit
    beats every other by `margin` under teacher forcing (so the engine's greedy turns are these tokens)."""
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(max_steps):
        worst, loss = float("inf"), 0.0
        for prompt, completion in sequences:
            ids = torch.tensor([prompt + completion])
            logits = model(ids).logits[0, len(prompt) - 1: -1]
            target = torch.tensor(completion)
            loss = loss + torch.nn.functional.cross_entropy(logits, target)
            other = logits.detach().scatter(1, target[:, None], float("-inf")).amax(1)
            worst = min(worst, float((logits.detach().gather(1, target[:, None])[:, 0] - other).min()))
        if worst >= margin:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    assert worst >= margin, f"the tiny model did not memorise the script (margin {worst:.2f})"


def test_a_reasoning_model_calls_a_tool_inside_the_engine_and_each_segment_is_exact(tiny, reasoner):
    """A tiny model taught one tool-using chat: turn 1 thinks and calls add, the template drops that thought when the
    tool result is rendered, so turn 2 is generated from the re-rendered chat: two rows, each exact against a forward
    of its own prompt and completion, the episode's reward on both."""
    from conftest import reference_logprobs

    from rollout import RolloutWorker, SamplingParams, WorkerConfig

    model, _ = tiny
    end = reasoner.convert_tokens_to_ids("<|end|>")
    prompt = render(reasoner, PROMPT, True)
    first = reasoner.encode(reasoning_turn("I should add", call("add", a=2, b=3)))
    script = ToolEnvironment(reasoner, tools=[add], messages=PROMPT)
    context = step(script, first).context_ids
    second = reasoner.encode(reasoning_turn("five it is", "5"))
    memorise(model, [(prompt, first), (context, second)])

    def make_env(prompt_index, sample_index):
        return ToolEnvironment(reasoner, tools=[add], messages=PROMPT, max_calls=2,
                               reward_fn=lambda messages: float(messages[-1]["content"] == "5"))

    with RolloutWorker(model, WorkerConfig(page_size=16), tokenizer=reasoner) as worker:
        batch = worker.generate([prompt], SamplingParams(n=2, temperature=0.0, max_new_tokens=64,
                                                         stop_token_ids=(end,)), env=make_env, max_turns=3)
    assert batch.finish_reason == ["done"] * 4 and batch.errors == [""] * 4
    assert batch.episode_index.tolist() == [0, 0, 1, 1] and batch.segment_index.tolist() == [0, 1, 0, 1]
    assert batch.rewards.tolist() == [1.0] * 4 and batch.num_turns.tolist() == [2] * 4
    assert batch.prompt_ids == [prompt, context] * 2
    assert batch.completion_token_lists() == [first, second] * 2
    assert "I should add" not in reasoner.decode(context)  # the second segment never saw the first thought
    for r in range(4):
        full, _ = reference_logprobs(model, batch.prompt_ids[r], batch.completion_token_lists()[r], 0.0)
        n = len(full)
        assert float((batch.logprobs[r, :n] - full).abs().max()) <= 1e-5
        assert batch.turn_rewards[r, :n].tolist() == [0.0] * (n - 1) + [float(r % 2)]
