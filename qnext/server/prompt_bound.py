"""Text prompts that cannot fit max_model_len are refused before they are tokenized.

No token of the vocabulary decodes to more than `max_chars_per_token` characters, so a text of n characters has
at least n / max_chars_per_token tokens: past max_model_len * max_chars_per_token characters it cannot fit, and
tokenizing it (seconds and gigabytes for a 50 MB string) would only confirm that."""
from __future__ import annotations

from qnext.server.errors import bad_request


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters one token decodes to: the longest vocabulary entry. Byte-level BPE spells
    each byte as one character, so an entry is at least as long as the text it decodes to."""
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    return max(1, max((len(token) for token in vocab), default=1))


class PromptBound:
    def __init__(self, tokenizer, max_model_len: int):
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * max_chars_per_token(tokenizer) if tokenizer is not None else None

    def check(self, text: str, param: str = "prompt") -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise bad_request(f"the prompt has {len(text)} characters, which is more than max_model_len "
                              f"{self.max_model_len} tokens can hold with this tokenizer (at most "
                              f"{self.max_chars} characters); shorten it", param)

    def check_messages(self, messages: list[dict], param: str = "messages") -> None:
        """Chat messages whose text alone is too long, before the template renders them (the prompt holds every
        message's content at least)."""
        if self.max_chars is None:
            return
        total = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        if total > self.max_chars:
            raise bad_request(f"the messages hold {total} characters, which is more than max_model_len "
                              f"{self.max_model_len} tokens can hold with this tokenizer (at most "
                              f"{self.max_chars} characters); shorten them", param)
