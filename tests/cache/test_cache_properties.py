"""Random interleavings of admit / step (prefill, capture, decode) / finish / abort / evict / clear against a
simulated device that records what every KV block and state row really holds. After every step: no leaks, exact
ref counts and available-block count, nothing handed out twice, and nothing stale is matchable or restorable, also
under a hash that ignores the parent (equal blocks under different prefixes collide)."""
from hypothesis import settings

from tests.support.cache_machine import CacheMachine

CacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestCacheMachine = CacheMachine.TestCase
