"""Code that runs inside a vLLM server (its own environment): the launcher puts this folder on its PYTHONPATH.

Nothing here imports async_rl: vLLM's environment does not have it."""
