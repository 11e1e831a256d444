"""The scheduler process: requests, batches, admission policy, the event loop, result processing."""
