"""Schema-driven fuzzing of the HTTP APIs (scripts/fuzz_api.py, tests/server/test_api_fuzz.py).

    cases = generate_cases("chat", 500, seed=0)             # request_schemas.py + schemathesis + mutations.py
    results = send_all(base_url, cases, workers=4)          # client.py: each case's status, or why it failed
    failures = [r for r in results if r.failed]             # a 5xx, no answer within the deadline, a broken stream

Every case is a body for one route: schemathesis generates it from the route's JSON schema, valid ("positive") or
not ("negative": wrong types, missing fields, unknown fields, out-of-range numbers, bytes that are not JSON), and
mutations.py then spikes some with extreme numbers and odd strings and caps what valid ones may cost the engine."""
from qnext.testing.api_fuzz.cases import APIS, FuzzCase, generate_cases
from qnext.testing.api_fuzz.client import CaseResult, send_all

__all__ = ["APIS", "CaseResult", "FuzzCase", "generate_cases", "send_all"]
