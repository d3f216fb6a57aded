"""megatrain: MegaScale-style LLM pretraining. The engine; it never imports Prefect."""

__version__ = "0.1.0"
