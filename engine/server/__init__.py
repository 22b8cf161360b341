"""The OpenAI-compatible HTTP server (`python -m engine serve`): starlette routes over one engine.

Modules: `protocol` (request validation, response shapes), `reasoning` (thinking text → `reasoning_content`),
`metrics` (Prometheus counters), `scheduler` (one generation at a time, a bounded queue), `app` (the routes),
`run` (uvicorn in the foreground for the CLI or on a background thread for the app and tests). Importing this
package imports nothing heavy: the CLI builds its parser from `run.add_arguments` without starlette.
"""
