"""From a scheduled batch to device tensors and a forward pass: ForwardBatch, ModelRunner, weight loading."""
