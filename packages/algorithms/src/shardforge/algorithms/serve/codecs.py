"""The Tinker wire format's protobuf bodies, read and written with the SDK's own generated messages
(``tinker.proto.tinker_public_pb2``): a `forward_backward` request in, `ForwardBackwardOutput` and
`SampleResponse` results out (the SDK asks for those two as ``application/x-protobuf`` and refuses JSON).

Legend: N = tokens of one datum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb

__all__ = [
    "PROTO_CONTENT_TYPE",
    "FwdBwdRequest",
    "SampledSequenceOut",
    "WireDatum",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_packed_forward_backward_output",
    "encode_sample_response",
]

PROTO_CONTENT_TYPE = "application/x-protobuf"

_NUMPY_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass(frozen=True, kw_only=True, slots=True)
class WireDatum:
    """One training example: its input tokens and its loss inputs (``target_tokens``, ``weights``, ...)."""

    tokens: list[int]
    """The model input, [N] token ids."""
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Loss inputs by name, each [N] (float32 or int64)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    loss_fn_config: dict[str, float]
    data: list[WireDatum]


def _tensor(msg: pb.Tensor, name: str) -> torch.Tensor:
    dtype = _NUMPY_DTYPES.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"loss input {name!r}: dtype enum {msg.dtype} is not float32, int64 or int32")
    shape = list(msg.shape)
    if msg.WhichOneof("encoding") == "sparse_csr":
        csr = msg.sparse_csr
        if len(shape) != 2:
            raise ValueError(f"loss input {name!r}: a sparse CSR tensor must be 2-D, got shape {shape}")
        dense = torch.sparse_csr_tensor(
            torch.from_numpy(np.frombuffer(csr.crow_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.col_indices, dtype=np.int64).copy()),
            torch.from_numpy(np.frombuffer(csr.values, dtype=dtype).copy()),
            size=tuple(shape),
        ).to_dense()
        return dense
    values = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape and int(np.prod(shape)) != values.size:
        raise ValueError(f"loss input {name!r}: shape {shape} does not hold its {values.size} values")
    return torch.from_numpy(values.reshape(shape) if shape else values)


def _datum_token_bytes(i: int, datum: pb.Datum) -> bytes:
    """The int32 token bytes of a datum's model input (its token chunks joined)."""
    parts = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ValueError(f"datum {i}: {kind} chunks are not supported yet (only token chunks)")
        parts.append(chunk.encoded_text.tokens)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _packed_inputs(data: Sequence[pb.Datum], name: str) -> list[torch.Tensor] | None:
    """Loss input ``name`` of every datum as views of one tensor, when every datum has it dense, 1-D and of one
    dtype (what the SDK sends): one decode for the request instead of one per datum. None: decode per datum."""
    msgs = [datum.loss_fn_inputs.get(name) for datum in data]
    first = msgs[0]
    if first is None or first.dtype not in _NUMPY_DTYPES:
        return None
    sizes = []
    for msg in msgs:
        if msg is None or msg.dtype != first.dtype or msg.WhichOneof("encoding") != "dense" or len(msg.shape) != 1:
            return None
        sizes.append(msg.shape[0])
    dtype = _NUMPY_DTYPES[first.dtype]
    values = np.frombuffer(b"".join(msg.dense for msg in msgs), dtype=dtype)
    if values.size != sum(sizes) or any(len(m.dense) != n * values.itemsize for m, n in zip(msgs, sizes, strict=True)):
        return None  # a datum's shape does not hold its values: the per-datum decode says which
    return list(torch.from_numpy(values.copy()).split(sizes))


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """Parse a ``/api/v1/forward_backward`` body; ValueError says what is malformed.

    The datums' tokens and loss inputs are decoded for the whole request at once (one ``frombuffer`` per field,
    each datum's tensors views of one tensor), falling back to one datum at a time for mixed encodings."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise ValueError(f"the body is not a ForwardBackwardRequest protobuf ({exc})") from exc
    token_bytes = [_datum_token_bytes(i, datum) for i, datum in enumerate(msg.data)]
    flat = np.frombuffer(b"".join(token_bytes), dtype=np.int32).tolist()
    offsets = np.cumsum([0] + [len(b) // 4 for b in token_bytes]).tolist()
    names = sorted({name for datum in msg.data for name in datum.loss_fn_inputs})
    packed = {name: _packed_inputs(msg.data, name) for name in names} if msg.data else {}
    data = []
    for i, datum in enumerate(msg.data):
        inputs = {
            name: values[i] if (values := packed.get(name)) is not None else _tensor(t, name)
            for name, t in datum.loss_fn_inputs.items()
        }
        data.append(WireDatum(tokens=flat[offsets[i] : offsets[i + 1]], inputs=inputs))
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = float(value.number)
    return FwdBwdRequest(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        forward_only=msg.forward_only,
        loss_fn_config=config,
        data=data,
    )


def _batched(arrays: Sequence[np.ndarray]) -> pb.BatchedTensor:
    offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
    dtype = pb.DTYPE_INT64 if arrays and arrays[0].dtype == np.int64 else pb.DTYPE_FLOAT32
    return pb.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=dtype, trailing_shape=[]
    )


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, torch.Tensor]], metrics: Mapping[str, float]
) -> bytes:
    """One ``ArrayRecord`` with a 1-D field per output name (``logprobs``, ...) over every datum."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        arrays = [
            o[name].detach().cpu().numpy().astype(np.float32 if o[name].is_floating_point() else np.int64)
            for o in outputs
        ]
        record.fields[name].CopyFrom(_batched(arrays))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=dict(metrics))
    return msg.SerializeToString()


def encode_packed_forward_backward_output(
    fields: Mapping[str, torch.Tensor], lengths: Sequence[int], metrics: Mapping[str, float]
) -> bytes:
    """`encode_forward_backward_output` for outputs packed end to end: each field [T] (T = sum of ``lengths``),
    datum i its i-th ``lengths`` piece; one conversion per field instead of one per datum."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(lengths))
    for name, packed_T in fields.items():
        values = packed_T.detach().cpu().numpy()
        values = values.astype(np.float32 if packed_T.is_floating_point() else np.int64, copy=False)
        offsets = np.cumsum([0, *lengths], dtype=np.int64) * values.itemsize
        dtype = pb.DTYPE_INT64 if values.dtype == np.int64 else pb.DTYPE_FLOAT32
        record.fields[name].CopyFrom(
            pb.BatchedTensor(data=values.tobytes(), offsets=offsets.tobytes(), dtype=dtype, trailing_shape=[])
        )
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=dict(metrics))
    return msg.SerializeToString()


@dataclass(frozen=True, kw_only=True, slots=True)
class SampledSequenceOut:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool
    """True: ended on a stop sequence or EOS; False: ran into max_tokens."""


def encode_sample_response(sequences: Sequence[SampledSequenceOut], prompt_logprobs: Sequence[float] | None) -> bytes:
    msg = pb.SampleResponse()
    for seq in sequences:
        msg.sequences.add(
            stop_reason=pb.STOP_REASON_STOP if seq.stopped else pb.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
