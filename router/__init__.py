"""The router: OpenAI-compatible front door with PD pairing (`baton router`)."""
