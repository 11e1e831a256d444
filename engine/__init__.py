"""The engine: HTTP server, scheduler, model execution (`baton serve`)."""
