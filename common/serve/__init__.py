"""`zoo serve`: an OpenAI-compatible HTTP server over the engine (docs/serving.md).

`app` holds the endpoints, `worker` the thread that drives the engine, `protocol` the request
fields and their errors, `text` detokenizing and stop strings, `tool_calls` the tool-call parsers
keyed by the chat template, `metrics` the Prometheus text, `model` what is loaded, `server` the
process (uvicorn, loading in the background, SIGTERM)."""
