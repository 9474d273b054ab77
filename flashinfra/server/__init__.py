"""OpenAI-compatible HTTP server: protocol, tokenizer and detokenizer, engine client, app, CLI, load generator, and
the router in front of disaggregated prefill and decode servers (``router``).

The server process tokenizes, renders chat templates, detokenizes and streams; the engine process (started
by ``engine_client``) schedules and runs the model. They talk over ZeroMQ with ``flashinfra.engine.sched.messages``.
"""
