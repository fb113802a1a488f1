"""The generation client of each `engine.backend`: who speaks to its servers (launched or in rollout.server_addrs).

    client = GENERATION_CLIENTS[cfg.engine.backend](url, api_key=key, pause_mode=mode)

The embedded server speaks SGLang's native API, so both share `HttpGenerationClient`; vLLM has
its own routes (`VllmGenerationClient`). A backend registers here and in `async_rl.launch.servers`.
"""

from __future__ import annotations

from async_rl.engine.client import HttpGenerationClient
from async_rl.engine.vllm_client import VllmGenerationClient

GENERATION_CLIENTS: dict[str, type[HttpGenerationClient]] = {
    "embedded": HttpGenerationClient, "sglang": HttpGenerationClient, "vllm": VllmGenerationClient}
