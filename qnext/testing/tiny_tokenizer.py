"""A tiny Qwen-style tokenizer for tests: byte-level BPE trained on a built-in English text, ChatML template."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

TINY_EOS_TOKEN = "<|im_end|>"
TINY_PAD_TOKEN = "<|endoftext|>"
# The last five ids of the vocabulary, in this order. Only the first three are special (skipped when decoding),
# as in Qwen's tokenizer where <think> and </think> are plain added tokens.
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_ADDED_TOKENS = ("<think>", "</think>")
_NUM_BYTES = 256

TINY_CHAT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant'] %}
{{- raise_exception('unsupported role ' + message.role + '; use system, user or assistant') }}
{%- endif %}
{%- if message.content is string %}
{%- set content = message.content %}
{%- else %}
{%- set content = message.content | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
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


def tiny_special_token_ids(vocab_size: int = 512) -> dict[str, int]:
    """Ids of the five reserved tokens (the last five of the vocabulary)."""
    names = TINY_SPECIAL_TOKENS + TINY_ADDED_TOKENS
    return {name: vocab_size - len(names) + i for i, name in enumerate(names)}


def tiny_eos_token_id(vocab_size: int = 512) -> int:
    return tiny_special_token_ids(vocab_size)[TINY_EOS_TOKEN]


def build_tiny_tokenizer(vocab_size: int = 512) -> tokenizers.Tokenizer:
    num_reserved = len(TINY_SPECIAL_TOKENS) + len(TINY_ADDED_TOKENS)
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
    # the five named tokens keep their fixed ids at the end.
    filler = [f"<|reserved_{i}|>" for i in range(vocab_size - num_reserved - tok.get_vocab_size())]
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t in filler + list(TINY_SPECIAL_TOKENS)])
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in TINY_ADDED_TOKENS])
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def write_tiny_tokenizer(out_dir: str | Path, vocab_size: int = 512) -> None:
    """Writes tokenizer.json and tokenizer_config.json (ChatML template, eos <|im_end|>, pad <|endoftext|>) to
    out_dir. The same arguments always give byte-identical files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size)
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
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
