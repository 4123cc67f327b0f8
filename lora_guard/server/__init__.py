"""The HTTP server: TGI- and OpenAI-compatible routes on the engine (``lora-guard serve``)."""
