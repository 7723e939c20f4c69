"""`qnext serve` on a tiny Qwen3.5 checkpoint with Qwen3.5's REAL tokenizer (248,320 ids; `<tool_call>`,
`</tool_call>`, `<think>`, `</think>` single tokens; eos <|im_end|> / <|endoftext|>), driven by the official openai
and anthropic SDKs: forced tool calls on all three APIs, streamed and not, at temperature 1 on random weights;
reasoning and the thinking budget; structured outputs after `</think>`; stop tokens; count_tokens; bad input.
One server for the module."""
from __future__ import annotations

import json
import random

import anthropic
import jsonschema
import openai
import pytest

from qnext.server.launch import running_server
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from tests.agent_server_cases import ANSWER, MESSAGES, SCHEMAS, TOOLS, agent_server_args, assemble_stream

MODEL = "tiny-qwen35-real-tokenizer"
TOOL_CALL, THINK_END, IM_END, ENDOFTEXT = 248058, 248069, 248046, 248044
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real_tokenizer")
    checkpoint = write_tiny_checkpoint(tmp / "ckpt", "qwen3_5", max_position_embeddings=2048, tokenizer="qwen3.5")
    with running_server([str(checkpoint), *agent_server_args(MODEL)], timeout=300, log_path=tmp / "server.log",
                        env={"JAX_PLATFORMS": "cpu"}) as proc:
        yield proc


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server):
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0) as c:
        yield c


def _chat_calls(oai, stream: bool, **kwargs) -> tuple[str, list[tuple[str, str]]]:
    if stream:
        out = assemble_stream(oai.chat.completions.create(model=MODEL, stream=True, **kwargs))
        assert out["content"] == ""
        return out["finish_reason"], out["tool_calls"]
    choice = oai.chat.completions.create(model=MODEL, **kwargs).choices[0]
    assert not choice.message.content, choice.model_dump()
    return choice.finish_reason, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]


def _anthropic_calls(claude, stream: bool, **kwargs) -> tuple[str, list[tuple[str, str]]]:
    if stream:
        with claude.messages.stream(model=MODEL, **kwargs) as s:
            message = s.get_final_message()
    else:
        message = claude.messages.create(model=MODEL, **kwargs)
    assert all(b.type == "tool_use" for b in message.content), message
    return message.stop_reason, [(b.name, json.dumps(b.input)) for b in message.content]


def _responses_calls(oai, stream: bool, **kwargs) -> tuple[str, list[tuple[str, str]]]:
    if stream:
        response = None
        for event in oai.responses.create(model=MODEL, stream=True, **kwargs):
            if event.type == "response.completed":
                response = event.response
        assert response is not None
    else:
        response = oai.responses.create(model=MODEL, **kwargs)
    calls = [(item.name, item.arguments) for item in response.output if item.type == "function_call"]
    assert all(item.type in ("function_call", "reasoning") for item in response.output), response
    return response.status, calls


def test_forced_calls_on_all_three_apis_parse_and_validate(oai, claude):
    """36 requests at temperature 1: required / named on chat completions, any / tool on Messages, required on
    Responses; streamed and not. Every call is a declared tool's, with arguments valid against its schema."""
    rng = random.Random(36)
    cases = ["chat-required", "chat-named", "anthropic-any", "anthropic-tool", "responses-required"]
    for i in range(36):
        case, stream, seed = cases[i % len(cases)], bool(i % 2), rng.randrange(1 << 30)
        if case.startswith("chat"):
            choice = "required" if case == "chat-required" else {"type": "function", "function": {"name": "search"}}
            finish, calls = _chat_calls(oai, stream, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                        temperature=1.0, max_tokens=300, seed=seed, parallel_tool_calls=False)
            assert finish == "tool_calls", (case, calls)
        elif case.startswith("anthropic"):
            choice = {"type": "any"} if case == "anthropic-any" else {"type": "tool", "name": "search"}
            choice["disable_parallel_tool_use"] = True
            finish, calls = _anthropic_calls(claude, stream, max_tokens=300, messages=MESSAGES[1:],
                                             system=MESSAGES[0]["content"], tools=ANTHROPIC_TOOLS, tool_choice=choice,
                                             extra_body={"seed": seed, "temperature": 1.0},
                                             thinking={"type": "disabled"})
            assert finish == "tool_use", (case, calls)
        else:
            finish, calls = _responses_calls(oai, stream, input=MESSAGES[1]["content"],
                                             instructions=MESSAGES[0]["content"], tools=[
                                                 {"type": "function", **t["function"]} for t in TOOLS],
                                             tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                             max_output_tokens=300, extra_body={"seed": seed})
            assert finish == "completed", (case, calls)
        assert len(calls) == 1, (case, calls)
        for name, arguments in calls:
            assert case.endswith(("required", "any")) or name == "search", (case, calls)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_thinking_budget_forces_the_single_think_end_token(oai):
    reply = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=11,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                    "thinking_token_budget": 6, "return_token_ids": True,
                                                    "min_tokens": 12})
    choice = reply.choices[0]
    ids = choice.model_extra["token_ids"]
    assert THINK_END in ids and ids.index(THINK_END) <= 6, ids
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and "</think>" not in reasoning and "</think>" not in (choice.message.content or "")


@pytest.mark.parametrize("stream", [False, True])
def test_structured_output_after_the_reasoning(oai, stream):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=23,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 8})
    if stream:
        out = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
        content, reasoning, finish = out["content"], out["reasoning"], out["finish_reason"]
    else:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        content, reasoning, finish = (choice.message.content, choice.message.model_extra["reasoning_content"],
                                      choice.finish_reason)
    assert finish == "stop" and reasoning
    jsonschema.validate(json.loads(content), ANSWER)


def test_generation_stops_at_either_eos_token_and_hides_it(oai):
    """A grammar makes the random model write a word then one of the two eos tokens (special tokens the grammar
    names): the engine stops at either, and the token is not in the text."""
    grammar = 'start: ("yes" | "no") (<|im_end|> | <|endoftext|>) "more"'
    seen = set()
    for seed in range(10):
        choice = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=1.0,
                                             seed=seed, extra_body={"structured_outputs": {"grammar": grammar},
                                                                    "return_token_ids": True}).choices[0]
        ids = choice.model_extra["token_ids"]
        assert choice.finish_reason == "stop" and choice.message.content in ("yes", "no"), choice
        assert ids[-1] in (IM_END, ENDOFTEXT), ids
        seen.add(ids[-1])
    assert seen == {IM_END, ENDOFTEXT}


def test_count_tokens_equals_the_prompt_the_model_reads(claude):
    kwargs = dict(model=MODEL, system="Be brief. 简洁地回答。", tools=ANTHROPIC_TOOLS,
                  messages=[{"role": "user", "content": "Weather in Zürich? 🌦️"}])
    counted = claude.messages.count_tokens(**kwargs).input_tokens
    reply = claude.messages.create(max_tokens=2, **kwargs)
    usage = reply.usage          # Anthropic's input_tokens leave out the tokens read from the cache
    assert counted == usage.input_tokens + usage.cache_read_input_tokens > 100


def test_bad_input_is_a_400_that_says_what_is_wrong(oai):
    with pytest.raises(openai.BadRequestError, match="nonexistent"):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                    tool_choice={"type": "function", "function": {"name": "nonexistent"}})
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": "zero"}}}}}]
    with pytest.raises(openai.BadRequestError, match="schema"):
        oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=bad_schema, tool_choice="required",
                                    max_tokens=8)
    long_text = "天气 " * 3000   # ~3k real tokens: more than the 2048-position model holds
    with pytest.raises(openai.BadRequestError, match="tokens"):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=8)
