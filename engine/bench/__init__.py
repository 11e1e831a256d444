"""`baton bench`: the serving benchmark (client, workload, metrics), the HF `transformers` baseline,
and `compare`, which runs engine variants and the baseline side by side in one run."""
