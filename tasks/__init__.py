"""Prefect tasks: one side effect each, with retries and explicit timeouts. They call the engine
(``megatrain``) and never re-implement it; torch is imported only inside task bodies."""
