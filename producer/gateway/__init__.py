"""The OpenAI-compatible HTTP gateway (`redline serve`): files, batches and online completions as jobs on
the queue, for services in any language. It runs no engine and keeps no state of its own.

`app.create_app(GatewaySettings(...))` is the ASGI app; `cli` is the command.
"""
