"""`baton fetch-model`: fill a model cache folder from the Hugging Face Hub or S3, once, resumably.

`source.py` parses `spec.model.source` (the operator validates with it too); `hub.py` and `s3.py` list
a source's files; `download.py` downloads them into the cache (atomic, resumable, verified, locked) and
marks the folder complete; `cli.py` is the command the operator runs as the engine pods' init container.
"""
