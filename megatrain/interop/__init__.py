"""Models that leave megatrain and come back: checkpoints as plain models, Hugging Face export and import."""
