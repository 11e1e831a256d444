"""Image input: loading media from the sources a request names (media.py), the image processor and the
placeholder expansion in the tokenizer process (processor.py), M-RoPE positions (mrope.py), and the
vision embeddings' cache (embedding_cache.py)."""
