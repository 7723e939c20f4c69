"""Text prompts that cannot fit max_model_len are refused before the whole text is tokenized.

Two checks, both cheaper than tokenizing a long text (seconds and gigabytes for a 50 MB string):
- a hard bound: no token of the vocabulary decodes to more than `max_chars_per_token` characters, so a text of n
  characters has at least n / max_chars_per_token tokens; past max_model_len * max_chars_per_token characters it
  cannot fit, whatever it says;
- a probe: a longer text than PROBE_CHARS_PER_TOKEN characters a token would need has a prefix of that many
  characters, cut at a space, tokenized; the prefix's tokens are (pre-tokenizers split at spaces) the first tokens
  of the whole text, so if they are already more than max_model_len the whole text cannot fit."""
from __future__ import annotations

from qnext.server.errors import bad_request

PROBE_CHARS_PER_TOKEN = 4         # typical English text; a denser text just gets tokenized whole


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry. Byte-level BPE spells
    each byte as one character, so an entry is at least as long as the text it decodes to."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(1, max((len(token) for token in vocab), default=1))


class PromptBound:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.max_chars = max_model_len * max_chars_per_token(tokenizer) if tokenizer is not None else None
        self.probe_chars = max_model_len * PROBE_CHARS_PER_TOKEN

    def check(self, text: str, param: str = "prompt") -> None:
        """A 400 if `text` cannot fit max_model_len tokens (without tokenizing more than probe_chars of it)."""
        if self.max_chars is None:
            return
        limit = self.max_model_len
        if len(text) > self.max_chars:
            raise bad_request(f"the prompt has {len(text)} characters, which is more than max_model_len {limit} "
                              f"tokens can hold with this tokenizer (at most {self.max_chars} characters); shorten "
                              "it", param)
        if len(text) > self.probe_chars:
            cut = text.rfind(" ", 0, self.probe_chars)
            num_tokens = len(self.tokenizer.encode(text[:cut if cut > 0 else self.probe_chars],
                                                   add_special_tokens=False))
            if num_tokens > limit:
                raise bad_request(f"the prompt has {len(text)} characters, and its first {self.probe_chars} "
                                  f"characters are already {num_tokens} tokens, more than max_model_len {limit}; "
                                  "shorten it", param)

    def check_messages(self, messages: list[dict], param: str = "messages") -> None:
        """Chat messages whose text alone cannot fit, before the template renders them (a prompt holds every
        message's content)."""
        self.check("\n".join(m["content"] for m in messages if isinstance(m.get("content"), str)), param)
