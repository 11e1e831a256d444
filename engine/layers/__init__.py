"""Model building blocks: norms, rotary embeddings, activations, MoE, attention backends, sampler, logits helpers."""
