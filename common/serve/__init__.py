"""`zoo serve`: an OpenAI-compatible HTTP server over the engine (docs/serving.md).

`app` holds the endpoints, `worker` the thread that drives the engine, `protocol` the request
fields and their errors, `text` detokenizing and stop strings, `metrics` the Prometheus text,
`model` what is loaded, `server` the process (uvicorn, loading in the background, SIGTERM). The
tool-call parsers, keyed by the chat template, are common/tasks/tool_calls.py (GRPO's episodes
and `zoo chat --tools` read calls with them too)."""
