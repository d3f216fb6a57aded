"""What a checkpoint can do, measured: held-out loss (``heldout``, also run during training) and
text sampled with a KV cache (``generate``)."""
