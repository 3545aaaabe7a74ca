"""Client-side helper for what the `tinker` SDK 0.38 has no public call for: a full fine-tuning training
client. The wire request is the SDK's own ``CreateModelRequest`` without ``lora_config`` (the field is optional
in the SDK's types); `shardforge serve` answers it with a model that has its own full copy of the weights and
an AdamW over all of them. The returned object is the SDK's `TrainingClient`, used as any other.

This mirrors ``ServiceClient._create_lora_training_client_submit`` of tinker 0.38 (SDK internals: the
``tinker>=0.38,<0.39`` pin of the ``serve`` extra keeps them in step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tinker

__all__ = ["create_full_training_client"]


def create_full_training_client(
    service_client: tinker.ServiceClient, base_model: str, *, user_metadata: dict[str, str] | None = None
) -> tinker.TrainingClient:
    """A `tinker.TrainingClient` for full fine-tuning of ``base_model`` on a `shardforge serve` service (blocks
    until the service has created the model)."""
    from tinker import types
    from tinker.lib.api_future_impl import _APIFuture
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType
    from tinker.lib.public_interfaces.training_client import TrainingClient, fetch_training_info

    holder = service_client.holder
    session_id = holder.get_session_id()
    model_seq_id = holder.get_training_client_id()

    async def create() -> TrainingClient:
        start = time.time()
        with holder.aclient(ClientConnectionPoolType.TRAIN) as client:
            request = types.CreateModelRequest(
                session_id=session_id, model_seq_id=model_seq_id, base_model=base_model,
                user_metadata=user_metadata, lora_config=None,
            )  # fmt: skip
            future: Any = await client.models.create(request=request)
        response = await _APIFuture(
            types.CreateModelResponse, holder, future, request_start_time=start, request_type="CreateModel"
        ).result_async()
        info = await fetch_training_info(holder, response.model_id)
        return TrainingClient(holder, model_seq_id=model_seq_id, model_id=response.model_id, info=info)

    return holder.run_coroutine_threadsafe(create()).result()
