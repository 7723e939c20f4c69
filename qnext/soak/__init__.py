"""The soak (scripts/soak.py): `qnext serve` and its multi-process shapes under long mixed load from the real SDKs,
with faults injected, judged on what production needs: no 5xx but the designed 503s, no request left hanging,
memory, file descriptors and threads flat, the cache's pools empty when idle, greedy answers unchanged by load.

requests.py   the request mix: each kind, sent with the openai / anthropic SDKs or a raw socket, and its outcome
shapes.py     the server shapes (one server, data-parallel replicas, prefill/decode) and their fault actions
monitor.py    RSS, file descriptors and threads of the server processes, sampled over the run
judge.py      the pass criteria over the outcomes, the samples and the idle check"""
