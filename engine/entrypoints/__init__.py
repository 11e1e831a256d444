"""Process entry points: `baton serve` CLI, process launch, the HTTP server and its OpenAI routes, the demo."""
