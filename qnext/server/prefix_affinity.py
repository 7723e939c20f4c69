"""Prefix affinity: which of N servers most likely holds a request's prefix in its cache. One router for both users:
the data parallel replicas behind one server (data_parallel.py: keys are the engine's own chained block hashes) and
the PD router's prefill and decode servers (pd_router.py, pd_choice.py: keys chain a request body's messages or
text, the router having no tokenizer).

A request's prefix is a chain of keys (key k covers pieces 0..k, so equal keys mean equal prefixes). Each instance
remembers the keys it was sent (and, for a replica, what came back: the next chat turn's prefix), least recently
used forgotten first beyond `capacity_keys`. Instances rank by the longest run of leading keys they hold, then by
load (`load_of(i)`: requests in flight), then by the longest time since chosen, then by index. A hint, never a
correctness matter: any instance serves any request. `round_robin` (to compare against) takes turns instead.
Thread-safe."""
from __future__ import annotations

import collections
import itertools
import threading
from typing import Callable

POLICIES = ("cache_aware", "round_robin")


class PrefixAffinity:
    def __init__(self, num_instances: int, capacity_keys: int, load_of: Callable[[int], int] = lambda i: 0,
                 policy: str = "cache_aware"):
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {policy!r}")
        if num_instances < 1:
            raise ValueError(f"prefix affinity needs at least one instance, got {num_instances}")
        self.num_instances, self.capacity_keys, self.policy = num_instances, capacity_keys, policy
        self._load_of = load_of
        self._held = [collections.OrderedDict() for _ in range(num_instances)]   # key -> None, LRU order
        self._last_chosen = [0] * num_instances
        self._clock = itertools.count(1)
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def matched(self, instance: int, chain: list[bytes]) -> int:
        """How many of the chain's leading keys `instance` holds."""
        with self._lock:
            return self._matched(instance, chain)

    def _matched(self, instance: int, chain: list[bytes]) -> int:
        held, n = self._held[instance], 0
        while n < len(chain) and chain[n] in held:
            n += 1
        return n

    def order(self, chain: list[bytes]) -> list[int]:
        """Every instance, best first (module docstring)."""
        n = self.num_instances
        if self.policy == "round_robin":
            first = next(self._turn) % n
            return [(first + i) % n for i in range(n)]
        with self._lock:
            matched = [self._matched(i, chain) for i in range(n)]
            last = list(self._last_chosen)
        loads = [self._load_of(i) for i in range(n)]
        return sorted(range(n), key=lambda i: (-matched[i], loads[i], last[i], i))

    def choose(self, chain: list[bytes]) -> int:
        """The best instance, which is then sent the chain (`sent`)."""
        best = self.order(chain)[0]
        self.sent(best, chain)
        return best

    def sent(self, instance: int, chain: list[bytes]) -> None:
        """`instance` was chosen for this chain: it holds the keys now, and it was chosen last."""
        with self._lock:
            self._last_chosen[instance] = next(self._clock)
        self.record(instance, chain)

    def record(self, instance: int, chain: list[bytes]) -> None:
        """`instance` holds these keys now (a reply finished there: prompt + reply)."""
        if self.policy == "round_robin":
            return
        with self._lock:
            held = self._held[instance]
            for key in chain:
                held[key] = None
                held.move_to_end(key)
            while len(held) > self.capacity_keys:
                held.popitem(last=False)
