"""OpenAI-compatible HTTP server over the qnext engine: `qnext serve [MODEL]` (docs/serving.md).

cli: the command; app.build_app(engine, model_name=...): the FastAPI app; serving: the two generation endpoints;
engine_loop.AsyncEngine: the one thread that owns the engine; request_stream: a request's outputs as an async
iterator; protocol / responses: OpenAI request and response shapes; errors: OpenAI error bodies; metrics:
Prometheus; launch: a `qnext serve` subprocess (bench, tests)."""
