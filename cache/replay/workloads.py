"""Request traces for the prefix-cache replay: built-in synthetic workloads and JSONL traces."""
import json
import random
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]


def _toks(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, 150_000) for _ in range(n))


def chat_workload(rng: random.Random, scale=1.0, users=48, turns=5, system_len=600) -> list[Request]:
    """Multi-turn chats of many users, rounds interleaved: turn t+1 = turn t's prompt + its answer + a new message."""
    users = max(2, int(users * scale))
    system = _toks(rng, system_len)
    history = [system + _toks(rng, rng.randint(30, 200)) for _ in range(users)]
    out = []
    for _ in range(turns):
        order = list(range(users))
        rng.shuffle(order)
        for u in order:
            answer = _toks(rng, rng.randint(50, 400))
            out.append(Request(history[u], answer))
            history[u] = history[u] + answer + _toks(rng, rng.randint(30, 200))
    return out


def system_prompt_workload(rng: random.Random, scale=1.0, questions=160, system_len=2000) -> list[Request]:
    """One shared system prompt followed by many different questions."""
    system = _toks(rng, system_len)
    return [Request(system + _toks(rng, rng.randint(20, 200)), _toks(rng, rng.randint(50, 250)))
            for _ in range(max(4, int(questions * scale)))]


def long_document_workload(rng: random.Random, scale=1.0, questions=48, doc_len=16000) -> list[Request]:
    """One long document with many questions about it."""
    doc = _toks(rng, int(doc_len * max(scale, 0.25)))
    return [Request(doc + _toks(rng, rng.randint(20, 120)), _toks(rng, rng.randint(50, 250)))
            for _ in range(max(4, int(questions * scale)))]


def mixed_workload(rng: random.Random, scale=1.0) -> list[Request]:
    """Chats, a system prompt and a document at once, interleaved (each stream keeps its own order)."""
    streams = [deque(chat_workload(rng, scale * 0.5, turns=4)), deque(system_prompt_workload(rng, scale * 0.4)),
               deque(long_document_workload(rng, scale * 0.4, doc_len=8000))]
    out = []
    while any(streams):
        s = rng.choice([s for s in streams if s])
        out.append(s.popleft())
    return out


WORKLOADS = {"chat": chat_workload, "system-prompt": system_prompt_workload,
             "long-document": long_document_workload, "mixed": mixed_workload}


def load_trace(path: str) -> list[Request]:
    """One request a line: {"prompt_token_ids": [...], "output_token_ids": [...]}."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                d = json.loads(line)
                if not d.get("prompt_token_ids"):
                    raise ValueError(f"{path}:{i}: prompt_token_ids is missing or empty")
                out.append(Request(tuple(d["prompt_token_ids"]), tuple(d.get("output_token_ids", ()))))
    return out
