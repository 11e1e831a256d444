"""Where workers come from besides flags and `/workers`: Kubernetes pods by label selector.

`pods.py` turns a pod (API JSON) into a WorkerSpec or None (pure, unit-tested); `kubernetes.py`
keeps the registry in step with the API server (list, watch, periodic full resync).
"""
