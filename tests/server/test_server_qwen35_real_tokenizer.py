"""Qwen3.5's real tokenizer (248,320 ids; `<tool_call>`, `</tool_call>`, `<think>`, `</think>` single tokens; eos
<|im_end|> / <|endoftext|>) through the official openai and anthropic SDKs against one `qnext serve` (tiny random
weights, 4096 positions):

- forced tool calls on all three APIs, streamed and not, at temperature 1: every call parses and validates;
- a forced tool call cut by max_tokens is never reported as a finished call, on chat completions, Anthropic
  Messages and Responses, streamed and not: the calls that ended are reported, the cut one is not, and the finish
  says the output was cut (finish_reason `length`, stop_reason `max_tokens`, status `incomplete`);
- reasoning and the thinking budget (which forces the single `</think>` token), structured outputs after the
  reasoning, generation stopping at either eos token, count_tokens;
- chat completions clamps max_tokens to the room the prompt leaves (Qwen Code asks for 32000 on every turn);
- an unknown tool, an invalid schema and a prompt too long in real tokens are 400s that say what is wrong, on
  every API."""
from __future__ import annotations

import json
import random

import anthropic
import jsonschema
import openai
import pytest

from qnext.server.launch import running_server
from qnext.testing.tiny_checkpoint import write_tiny_checkpoint
from qnext.tokenizer import Tokenizer
from tests.support.agent_server_cases import ANSWER, MESSAGES, SCHEMAS, TOOLS, assemble_stream

MODEL = "qwen35-tiny"
MAX_MODEL_LEN = 4096
SERVER_ARGS = ["--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4",
               "--max-num-batched-tokens", "512", "--no-warm-up", "--log-level", "warning"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 5}},
           "required": ["city", "days"], "additionalProperties": False}
DESCRIPTION = "The weather in a city."
QUESTION = "Weather in Oslo?"
# One forced request, the same prompt on every API (the tool's keys in the order each translation writes them):
# sampled with this seed, the output is three whole calls and a fourth cut right after its header. eos is ignored,
# so the parallel-call grammar goes on to the next call until max_tokens.
CUT = {"seed": 5, "ignore_eos": True}
CUT_MAX_TOKENS = 120
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                              "description": DESCRIPTION}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": DESCRIPTION, "input_schema": WEATHER}
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
TOOL_CALL, THINK_END, IM_END, ENDOFTEXT = 248058, 248069, 248046, 248044
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": DESCRIPTION, "parameters": WEATHER}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("qwen35") / "ckpt", "qwen3_5", seed=0, tokenizer="qwen3.5",
                                 max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    with running_server([str(checkpoint), *SERVER_ARGS], timeout=300, log_path=tmp / "server.log",
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


def chat_kwargs(**extra) -> dict:
    return dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], tools=[CHAT_TOOL],
                tool_choice="required", max_tokens=CUT_MAX_TOKENS,
                extra_body={**CUT, "chat_template_kwargs": {"enable_thinking": False}, **extra})


@pytest.fixture(scope="module")
def whole_calls(oai, checkpoint):
    """The calls the cut output holds that ended, read from its tokens: [(name, arguments object)]."""
    choice = oai.chat.completions.create(**chat_kwargs(return_token_ids=True)).choices[0]
    text = Tokenizer.from_pretrained(checkpoint).decode(choice.model_extra["token_ids"])
    ended = text.count("</tool_call>")
    assert ended >= 1 and text.count("<tool_call>") == ended + 1, f"the output should end inside a call: {text!r}"
    assert text.rsplit("<tool_call>", 1)[1].startswith("\n<function=get_weather>"), text   # its header was read
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert choice.finish_reason == "length" and len(calls) == ended
    return calls


def check_calls(calls: list[tuple[str, dict]], expected: list[tuple[str, dict]]) -> None:
    for _, arguments in calls:
        jsonschema.validate(arguments, WEATHER)
    assert calls == expected


# ---- A call cut by max_tokens ----------------------------------------------------------------------------------
def test_chat_cut_call(oai, whole_calls):
    choice = oai.chat.completions.create(**chat_kwargs()).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    check_calls([(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls],
                whole_calls)


def test_chat_cut_call_streamed(oai, whole_calls):
    calls, finish = {}, None
    for chunk in oai.chat.completions.create(stream=True, **chat_kwargs()):
        for tc in chunk.choices[0].delta.tool_calls or []:
            if tc.id:
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length"
    check_calls([(name, json.loads(args)) for name, args in calls.values()], whole_calls)


def anthropic_kwargs() -> dict:
    return dict(model=MODEL, max_tokens=CUT_MAX_TOKENS, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"},
                thinking={"type": "disabled"}, messages=[{"role": "user", "content": QUESTION}], extra_body=CUT)


def test_anthropic_cut_call(claude, whole_calls):
    message = claude.messages.create(**anthropic_kwargs())
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == CUT_MAX_TOKENS
    assert all(b.type == "tool_use" for b in message.content)
    check_calls([(b.name, b.input) for b in message.content], whole_calls)


def test_anthropic_cut_call_streamed(claude, whole_calls):
    with claude.messages.stream(**anthropic_kwargs()) as stream:
        events = list(stream)
        message = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    stops = [e for e in events if e.type == "content_block_stop"]
    assert len(starts) == len(stops) == len(whole_calls)         # no block was opened for the cut call
    assert message.stop_reason == "max_tokens"
    check_calls([(b.name, b.input) for b in message.content], whole_calls)


def responses_kwargs() -> dict:
    return dict(model=MODEL, input=QUESTION, tools=[RESPONSES_TOOL], tool_choice="required",
                max_output_tokens=CUT_MAX_TOKENS, reasoning={"effort": "none"}, extra_body=CUT)


def test_responses_cut_call(oai, whole_calls):
    response = oai.responses.create(**responses_kwargs())
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert all(item.type == "function_call" and item.status == "completed" for item in response.output)
    check_calls([(item.name, json.loads(item.arguments)) for item in response.output], whole_calls)


def test_responses_cut_call_streamed(oai, whole_calls):
    events = list(oai.responses.create(stream=True, **responses_kwargs()))
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert len(added) == len(done) == len(whole_calls)            # no item was added for the cut call
    assert events[-1].type == "response.incomplete"
    check_calls([(item.name, json.loads(item.arguments)) for item in done], whole_calls)
    assert [(i.name, json.loads(i.arguments)) for i in events[-1].response.output] == whole_calls


# ---- max_tokens and the room left ------------------------------------------------------------------------------
def long_question(tokenizer_words: int) -> str:
    return "Tell me about the sea." + " sea" * tokenizer_words


def test_chat_max_tokens_is_clamped_to_the_room_left(oai):
    """Qwen Code sends max_tokens 32000 whatever the context: a long session gets the room that is left."""
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": long_question(MAX_MODEL_LEN - 40)}],
                      max_tokens=32000, temperature=0.0, extra_body={"ignore_eos": True,
                                                                     "chat_template_kwargs": {"enable_thinking": False}})
        if stream:
            chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            usage = chunks[-1].usage
            finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        else:
            reply = oai.chat.completions.create(**kwargs)
            usage, finish = reply.usage, reply.choices[0].finish_reason
        assert MAX_MODEL_LEN - 60 < usage.prompt_tokens < MAX_MODEL_LEN
        assert finish == "length" and usage.prompt_tokens + usage.completion_tokens == MAX_MODEL_LEN


def test_completions_keep_the_strict_check(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=MODEL, prompt="The sea", max_tokens=MAX_MODEL_LEN)
    assert "max_model_len" in e.value.body["message"] and e.value.body["param"] == "max_tokens"


# ---- bad input: one clear 400 per API --------------------------------------------------------------------------
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "bogus"}}}
TOO_LONG = long_question(MAX_MODEL_LEN + 100)       # ~4100 tokens in fewer characters than the bound's probe


def bad_chat(oai, case):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    if case == "unknown tool":
        kwargs.update(tools=[CHAT_TOOL], tool_choice={"type": "function", "function": {"name": "book_flight"}})
    elif case == "invalid schema":
        kwargs.update(tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
                      tool_choice="required")
    else:
        kwargs.update(messages=[{"role": "user", "content": TOO_LONG}])
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(**kwargs)
    return e.value.body["message"]


def bad_anthropic(claude, case):
    kwargs = dict(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": QUESTION}])
    if case == "unknown tool":
        kwargs.update(tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "book_flight"})
    elif case == "invalid schema":
        kwargs.update(tools=[{"name": "f", "input_schema": BAD_SCHEMA}], tool_choice={"type": "any"})
    else:
        kwargs.update(messages=[{"role": "user", "content": TOO_LONG}])
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**kwargs)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    return e.value.body["error"]["message"]


def bad_responses(oai, case):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=4)
    if case == "unknown tool":
        kwargs.update(tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "book_flight"})
    elif case == "invalid schema":
        kwargs.update(tools=[{"type": "function", "name": "f", "parameters": BAD_SCHEMA}], tool_choice="required")
    else:
        kwargs.update(input=TOO_LONG)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**kwargs)
    return e.value.body["message"]


WORDS = {"unknown tool": ["book_flight", "not in tools"], "invalid schema": ["'f'", "bogus"],
         "prompt too long": ["tokens", "max_model_len", str(MAX_MODEL_LEN)]}


@pytest.mark.parametrize("case", list(WORDS))
def test_bad_requests_say_what_is_wrong_on_every_api(oai, claude, case):
    for message in (bad_chat(oai, case), bad_anthropic(claude, case), bad_responses(oai, case)):
        assert all(w in message for w in WORDS[case]), (case, message)


# ---- forced calls, reasoning, structured outputs, stop tokens, count_tokens ------------------------------------
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


@pytest.mark.parametrize("stream", [False, True])
def test_auto_mode_parses_a_call_written_with_the_single_tag_tokens(oai, stream):
    """tool_choice auto: the model's own text, then a call. A grammar stands in for a model that writes one; the
    output must start the call with the single token `<tool_call>` and the parsers must find the call in it."""
    grammar = ('start: "Let me check.\\n\\n" "<tool_call>\\n<function=search>\\n<parameter=query>\\n" Q '
               '"\\n</parameter>\\n</function>\\n</tool_call>"\nQ: /[a-z]{1,6}/')
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=60, temperature=1.0,
                  seed=3, extra_body={"structured_outputs": {"grammar": grammar}, "return_token_ids": True})
    if stream:
        out = assemble_stream(oai.chat.completions.create(stream=True, **kwargs))
        content, calls, finish = out["content"], out["tool_calls"], out["finish_reason"]
    else:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        assert TOOL_CALL in choice.model_extra["token_ids"]
        content, finish = choice.message.content, choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls" and content.strip() == "Let me check."
    assert len(calls) == 1 and calls[0][0] == "search"
    query = json.loads(calls[0][1])["query"]
    assert query.isalpha() and query.islower()
