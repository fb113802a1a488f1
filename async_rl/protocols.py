"""The seams between components, as `typing.Protocol`s.

Each protocol has more than one implementation, or will (docs/architecture.md): the embedded
engine's HTTP client and SGLang behind `GenerationClient`; the ZeroMQ queue behind
`TrajectorySink`; disk, ZeroMQ and
torch.distributed weight transports behind `WeightPublisher` / `WeightReceiver`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from async_rl.types import GenerationOutput, SamplingParams, Trajectory


@runtime_checkable
class GenerationClient(Protocol):
    """Token-in, token-out access to one generation server."""

    address: str

    async def generate(self, input_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None) -> GenerationOutput: ...

    async def pause_generation(self) -> None: ...

    async def continue_generation(self) -> None: ...

    async def update_weights_from_disk(self, model_path: str, weight_version: int) -> dict[str, Any]: ...

    async def abort_request(self, request_id: str) -> None: ...

    async def health(self) -> bool: ...

    async def get_model_info(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class TrajectorySink(Protocol):
    """Where finished trajectories go; `put_group` blocks while the consumer is full."""

    async def put_group(self, trajectories: list[Trajectory]) -> None: ...


@runtime_checkable
class WeightPublisher(Protocol):
    """Makes a trainer's weights of one version available to the rollout side."""

    def publish(self, weights: Any, version: int) -> dict[str, Any] | None:
        """Make `version` available (raising, with the old version still in use, on any failure or
        after `weight_sync.deadline_s`); return the "weights" control message that tells the rollout
        side, or None when the publisher already sent it (dist: it must precede the collective).
        `weights`: `trainer.weights()` (a `utils.weights.WeightSource`, read from the parameters tensor
        by tensor: no copy of the model) or a state dict.

        Implementations: disk (a file on a shared file system), zmq (checksummed buckets over the
        trajectory queue), dist (one broadcast per flattened bucket over a torch.distributed group)."""
        ...


@runtime_checkable
class WeightReceiver(Protocol):
    """The rollout side of a weight transport: a trainer's "weights" message -> weights loaded in servers.

    `prepare` runs once per version (e.g. assemble streamed buckets into a local file, or
    learn the tensor manifest); `load` then runs once per generation server, concurrently
    and each under the update deadline, so a slow server can be fenced without holding
    the others; `release` frees what `prepare` made once every server is done."""

    async def prepare(self, msg: dict[str, Any]) -> Any:
        """What `load` needs for the version in `msg`; raises `WeightsSuperseded` when a newer
        version already replaced it (skipped: the newer one's message follows)."""
        ...

    async def load(self, client: GenerationClient, prepared: Any, version: int) -> None: ...

    async def release(self, prepared: Any) -> None: ...

    def superseded(self, prepared: Any, version: int) -> bool:
        """After a failed `load`: whether it failed only because a newer version replaced this one
        (pruned by `keep_last`), so the server is fine and the update is skipped, not fenced."""
        ...
