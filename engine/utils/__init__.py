"""Small shared helpers: logging, process management, GGUF conversion."""
