"""Tokenizer over a HuggingFace tokenizer.json, chat templates, streaming detokenization and stop strings."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

from qnext.sampling_params import SamplingParams


def _token_content(token: str | dict | None) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as serialised AddedToken dicts.
    return token.get("content") if isinstance(token, dict) else token


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers does: sandboxed, trim_blocks + lstrip_blocks, loop
    controls, a non-escaping `tojson`, and `raise_exception` / `strftime_now` helpers."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str | None = None,
                 bos_token: str | None = None, pad_token: str | None = None, chat_template: str | None = None,
                 extra_eos_token_ids: Sequence[int] = ()):
        self.backend = tokenizer
        self.eos_token, self.bos_token, self.pad_token = eos_token, bos_token, pad_token
        self.eos_token_id = self.token_to_id(eos_token)
        self.bos_token_id = self.token_to_id(bos_token)
        self.pad_token_id = self.token_to_id(pad_token)
        # Every id that ends generation: the eos token plus generation_config.json's eos ids.
        eos_ids = [] if self.eos_token_id is None else [self.eos_token_id]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys([*eos_ids, *extra_eos_token_ids]))
        self.chat_template = chat_template
        self._compiled_template: jinja2.Template | None = None
        added = tokenizer.get_added_tokens_decoder()
        self.all_special_ids = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Reads tokenizer.json, tokenizer_config.json (special tokens, `chat_template`), chat_template.jinja
        and generation_config.json (`eos_token_id`) from model_dir; only tokenizer.json is required."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}; qnext needs a HuggingFace fast-tokenizer "
                                    "file (save one with transformers' tokenizer.save_pretrained)")
        config = _read_json(model_dir / "tokenizer_config.json")
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default", next(iter(named.values()), None))
        template_file = model_dir / "chat_template.jinja"
        if template_file.is_file():
            chat_template = template_file.read_text(encoding="utf-8")
        eos_ids = _read_json(model_dir / "generation_config.json").get("eos_token_id") or []
        return cls(tokenizers.Tokenizer.from_file(str(path)),
                   eos_token=_token_content(config.get("eos_token")),
                   bos_token=_token_content(config.get("bos_token")),
                   pad_token=_token_content(config.get("pad_token")),
                   chat_template=chat_template,
                   extra_eos_token_ids=[eos_ids] if isinstance(eos_ids, int) else eos_ids)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(t) for t in token_ids], skip_special_tokens=skip_special_tokens)

    def decode_token(self, token_id: int) -> str:
        """One token's text (special tokens included), e.g. for Logprob.decoded_token."""
        return self.backend.decode([int(token_id)], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """Renders messages with the model's chat template; extra kwargs (tools, enable_thinking, ...) are passed
        to the template. tokenize=True returns token ids (no special tokens added beyond the template's)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no `chat_template` in tokenizer_config.json "
                             "and no chat_template.jinja); pass a prompt string instead")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                    "pad_token": self.pad_token or ""}
        text = self._compiled_template.render(**{**specials, **kwargs}, messages=messages,
                                              add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def find_stop_string(text: str, stop: Sequence[str], search_from: int = 0) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string starting at or after `search_from` (ties: the longer string).
    -> (index, stop string) or None."""
    best: tuple[int, str] | None = None
    for s in stop:
        i = text.find(s, search_from)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
            best = (i, s)
    return best


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string: text a stream must hold
    back because the next token may complete a stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive, and applies its stop strings.

    Text is released only when it is final: never while the decoded tail ends in U+FFFD (an incomplete
    multi-byte character whose remaining bytes come in later tokens), and, while streaming, never a tail
    that could still become a stop string."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self._prefix_offset = 0  # token_ids[prefix:read] is already in output_text; decoded again as context
        self._read_offset = 0
        self._num_sent = 0  # chars of output_text already returned by get_next_output_text(delta=True)

    def update(self, new_token_ids: Sequence[int], finished: bool = False,
               stop_token_terminated: bool = False) -> str | None:
        """Appends tokens; `finished` also flushes a held U+FFFD tail. With stop_token_terminated (the last token
        is eos or a stop token id) that token's text is left out unless include_stop_str_in_output, as in vLLM.
        Returns the stop string that matched, after which output_text is truncated (keeping the stop string only
        with include_stop_str_in_output) and later updates are ignored. Stop strings count only once more than
        min_tokens tokens have been generated."""
        if self.stop_reason is not None:
            return None
        num_tokens = len(self.token_ids) + len(new_token_ids)
        if stop_token_terminated and not self.include_stop_str_in_output:
            new_token_ids = new_token_ids[:-1]
        num_chars_before = len(self.output_text)
        self.token_ids.extend(new_token_ids)
        self.output_text += self._decode_new_text(finished or stop_token_terminated)
        if not self.stop or num_tokens <= self.min_tokens:
            return None
        longest = max(len(s) for s in self.stop)
        match = find_stop_string(self.output_text, self.stop, max(0, num_chars_before - longest + 1))
        if match is None:
            return None
        index, self.stop_reason = match
        end = index + len(self.stop_reason) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        return self.stop_reason

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """All text so far (delta=False) or what is new since the last call (delta=True). Unless finished, a tail
        that may still grow into a stop string is held back."""
        end = len(self.output_text)
        if not finished and self.stop_reason is None and not self.include_stop_str_in_output:
            end -= partial_stop_length(self.output_text, self.stop)
        if not delta:
            return self.output_text[:end]
        start, self._num_sent = self._num_sent, max(self._num_sent, end)
        return self.output_text[start:end]

    def _decode_new_text(self, finished: bool) -> str:
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        text = decode(self.token_ids[self._prefix_offset:], self.skip_special_tokens)
        if len(text) <= len(prefix_text) or (text.endswith("\ufffd") and not finished):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return text[len(prefix_text):]
