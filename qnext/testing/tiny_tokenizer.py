"""A tiny Qwen-style tokenizer for tests: byte-level BPE trained on a built-in English text, Qwen chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

TINY_EOS_TOKEN = "<|im_end|>"
TINY_PAD_TOKEN = "<|endoftext|>"
# The last ids of the vocabulary, in this order: with `vision`, Qwen3.5's vision tokens (a picture's placeholder and
# pads, in Qwen's order: vision_start, vision_end, image_pad, video_pad), then the five chat tokens. All but <think>
# and </think> are special (skipped when decoding; text that does not spell one never encodes to it), as in Qwen's
# tokenizer where <think> and </think> are plain added tokens. Without `vision` the tokenizer is the text-only one
# of earlier releases, byte for byte (the text checkpoints' tests keep their token ids).
TINY_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_ADDED_TOKENS = ("<think>", "</think>")
_NUM_BYTES = 256

# Qwen3.5's chat format, in a template of our own: a content list renders as Qwen3.5's does (text parts joined
# directly; an image part, one with `image` or `image_url` or of type "image", as
# <|vision_start|><|image_pad|><|vision_end|>; a video part, `video` or type "video", with <|video_pad|>), tools in
# the first system turn, XML tool calls, tool results merged into one user turn, reasoning shown only for assistant
# turns after the last user query. As in
# Qwen3.5-0.8B, thinking is off unless `enable_thinking=true` (the prompt then ends inside `<think>`);
# `enable_thinking=false` writes the empty think block.
TINY_CHAT_TEMPLATE = """\
{%- macro text(content) %}
{%- if content is string %}{{- content }}
{%- elif content is none %}
{%- else %}
{%- for item in content %}
{%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif 'video' in item or item.type == 'video' %}
{{- '<|vision_start|><|video_pad|><|vision_end|>' }}
{%- elif 'text' in item %}
{{- item.text }}
{%- else %}
{{- raise_exception('Unexpected item type in content.') }}
{%- endif %}
{%- endfor %}
{%- endif %}
{%- endmacro %}
{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
{%- if message.role == 'user' and not (message.content is string and message.content.startswith('<tool_response>')) %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou may call one or more of these functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply with exactly this format and nothing after it:\\n\\n<tool_call>\\n'
    '<function=example_function_name>\\n<parameter=example_parameter>\\nvalue\\n</parameter>\\n</function>\\n'
    '</tool_call>\\n\\n<IMPORTANT>\\nCalls MUST use this format. Give every required parameter.\\n</IMPORTANT>' }}
{%- if messages and messages[0].role == 'system' %}
{{- '\\n\\n' + text(messages[0].content) }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- raise_exception('a system message must be the first message') }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + text(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content) %}
{%- set reasoning = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1] %}
{%- endif %}
{%- set content = content.strip() %}
{{- '<|im_start|>assistant\\n' }}
{%- if loop.index0 > ns.last_query and reasoning.strip() %}
{{- '<think>\\n' + reasoning.strip() + '\\n</think>\\n\\n' }}
{%- endif %}
{{- content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if loop.first %}{{- '\\n\\n' if content else '' }}{%- else %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}
{%- if call.arguments is mapping %}
{%- for key, value in call.arguments.items() %}
{{- '<parameter=' + key + '>\\n' }}
{{- value if value is string else (value | tojson) }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{%- elif call.arguments %}
{{- raise_exception('tool call arguments must be an object') }}
{%- endif %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if ns.last_query < 0 %}
{{- raise_exception('a tool result needs a user query before it') }}
{%- endif %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unsupported role ' + message.role + '; use system, user, assistant or tool') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is true %}
{{- '<think>\\n' }}
{%- elif enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""

# Qwen3-Next-Instruct's format (for tests): tools as JSON lines, calls as JSON in <tool_call>, no thinking.
TINY_HERMES_CHAT_TEMPLATE = """\
{%- macro text(content) %}
{%- if content is string %}{{- content }}
{%- elif content is none %}
{%- else %}{{- content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') }}
{%- endif %}
{%- endmacro %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}
{{- text(messages[0].content) + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments inside '
    '<tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    '</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + text(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- raise_exception('a system message must be the first message') }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + text(message.content) + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{%- set content = text(message.content).strip() %}
{{- '<|im_start|>assistant\\n' + content }}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{%- if loop.first %}{{- '\\n' if content else '' }}{%- else %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}
{{- call.arguments if call.arguments is string else (call.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + text(message.content) + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- else %}
{{- raise_exception('unsupported role ' + message.role + '; use system, user, assistant or tool') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time there was a small village at the edge of a great forest. The people of the village
worked in the fields during the day and told stories by the fire at night. Children played in the
streets, and the old men sat in the shade and talked about the weather, the harvest and the news from
the city. Every morning the baker opened his shop before the sun came up, and the smell of fresh bread
filled the air.
Hello! How are you today? I am fine, thank you. What is your name? My name is Anna, and I live in a
house with a red door. Where do you come from? I come from a country far away, across the sea.
Can you help me with this question? Of course, I would be happy to help. Please tell me what you need.
The answer is simple: water boils at one hundred degrees, and ice melts when it gets warm.
Computers process information very quickly. A program is a list of instructions that tells the computer
what to do. Engineers write code, test it, and fix the bugs they find. Good software is easy to read,
easy to change, and it does exactly what the user expects. The model reads the text, predicts the next
word, and then repeats the process until the answer is complete.
In the spring the flowers bloom and the birds return from the south. Summer brings long days and warm
evenings. In autumn the leaves turn yellow, orange and red, and in winter the snow covers the hills.
The river flows from the mountains to the ocean, and the wind carries the clouds over the land.
She said that she would come back tomorrow, but nobody knew whether she really meant it. They waited
for a long time, and then they went home. He thought about the problem for hours before he found a
solution that worked. We should always try to learn something new every day.
The system is a helpful assistant. The user asks a question and the assistant gives a clear answer.
Think step by step, explain your reasoning, and keep the final answer short. Thank you very much!
One, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday, Wednesday, Thursday, Friday.
"""

# Frequent English words, repeated in training so that the few hundred merges go to them first.
_COMMON_WORDS = """\
the be to of and a in that have I it for not on with he as you do at this but his by from they we say her she
or an will my one all would there their what so up out if about who get which go me when make can like time no
just him know take people into year your good some could them see other than then now look only come its over
think also back after use two how our work first well way even new want because any these give day most us is
are was were has had been said did made write story answer question help please thank yes here where why
"""


def _reserved_tokens(vision: bool) -> tuple[str, ...]:
    return (TINY_VISION_TOKENS if vision else ()) + TINY_SPECIAL_TOKENS + TINY_ADDED_TOKENS


def tiny_special_token_ids(vocab_size: int = 512, vision: bool = False) -> dict[str, int]:
    """Ids of the reserved tokens (the last five of the vocabulary; nine with `vision`)."""
    names = _reserved_tokens(vision)
    return {name: vocab_size - len(names) + i for i, name in enumerate(names)}


def tiny_vision_token_ids(vocab_size: int = 512) -> dict[str, int]:
    """The config.json entries of a tiny vision-language checkpoint (its tokenizer built with `vision`): image /
    video pad and vision start / end ids."""
    ids = tiny_special_token_ids(vocab_size, vision=True)
    return {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"]}


def tiny_eos_token_id(vocab_size: int = 512) -> int:
    return tiny_special_token_ids(vocab_size)[TINY_EOS_TOKEN]


def build_tiny_tokenizer(vocab_size: int = 512, vision: bool = False) -> tokenizers.Tokenizer:
    """vision: with Qwen3.5's four vision tokens (for a vision-language checkpoint)."""
    reserved = _reserved_tokens(vision)
    num_reserved = len(reserved)
    if vocab_size < _NUM_BYTES + num_reserved:
        raise ValueError(f"vocab_size must be >= {_NUM_BYTES + num_reserved} (256 bytes + {num_reserved} "
                         f"special tokens), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - num_reserved, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) + [_COMMON_WORDS] * 2, trainer=trainer)
    # A corpus too small for the requested size leaves a gap: fill it with reserved (special) tokens so that
    # the named tokens keep their fixed ids at the end.
    filler = [f"<|reserved_{i}|>" for i in range(vocab_size - num_reserved - tok.get_vocab_size())]
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in filler + [name for name in reserved if name not in TINY_ADDED_TOKENS]])
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in TINY_ADDED_TOKENS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512,
                         chat_template: str = TINY_CHAT_TEMPLATE, vision: bool = False) -> None:
    """Writes tokenizer.json and tokenizer_config.json (Qwen3.5-style template unless another is given, eos
    <|im_end|>, pad <|endoftext|>; with `vision`, Qwen3.5's vision tokens) to out_dir. The same arguments always
    give byte-identical files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size, vision)
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    added = {str(i): {"content": t.content, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t.special}
             for i, t in sorted(tok.get_added_tokens_decoder().items())}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": TINY_EOS_TOKEN,
        "pad_token": TINY_PAD_TOKEN,
        "unk_token": None,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
