"""The Strata gateway: one OpenAI endpoint in front of many instances (never imports the engine,
the model or the server)."""
