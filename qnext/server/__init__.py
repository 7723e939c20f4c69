"""OpenAI-compatible HTTP server over the qnext engine: `qnext serve [MODEL]` (docs/serving.md).

cli: the command; app.build_app(engine, model_name=...): the FastAPI app; serving (chat completions, completions)
and agent_serving (Anthropic Messages, Responses): the routes, each a translator (protocol, anthropic_request,
responses_request) onto admission (the one way into the engine) and stream_driver (the one stream loop), with a
sink per API (openai_sinks, anthropic_response, responses_response); engine_loop.AsyncEngine: the one thread that
owns the engine; request_stream: a request's outputs as an async iterator; errors: error bodies and the engine
errors' HTTP statuses; metrics: Prometheus; launch: a `qnext serve` subprocess (bench, tests)."""
