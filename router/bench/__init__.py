"""Router benchmark: baton router vs sglang-router vs calling the backend directly, side by side in one
run, against a fast fake backend (`backend.py`). Run `python -m baton.router.bench --help`."""
