"""`shardforge serve`'s request decoding and result encoding for a whole request at once (the fast path) equal
the datum-by-datum versions, and bad datums are still named."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("tinker")

from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from shardforge.algorithms.serve.codecs import (
    _tensor,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_packed_forward_backward_output,
)
from shardforge.algorithms.serve.futures import UserError
from shardforge.algorithms.serve.training import check_datums


def _body(datums: list[types.Datum], loss_fn: str = "importance_sampling") -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn=loss_fn), model_id="m", seq_id=1
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def _datum(tokens: list[int], seed: int, *, advantages: bool = True) -> types.Datum:
    rng = np.random.default_rng(seed)
    n = len(tokens)
    inputs: dict[str, object] = {
        "target_tokens": [(t + 1) % 50 for t in tokens],
        "logprobs": rng.normal(size=n).astype(np.float32).tolist(),
    }
    if advantages:
        inputs["advantages"] = rng.normal(size=n).astype(np.float32).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)  # type: ignore[arg-type]


def _per_datum(body: bytes) -> list[tuple[list[int], dict[str, torch.Tensor]]]:
    """The reference: each datum decoded on its own."""
    msg = pb.ForwardBackwardRequest.FromString(body)
    out = []
    for datum in msg.data:
        tokens = [t for chunk in datum.model_input for t in np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist()]
        out.append((tokens, {name: _tensor(t, name) for name, t in datum.loss_fn_inputs.items()}))
    return out


@pytest.mark.parametrize("mixed", [False, True])
def test_request_decode_equals_datum_by_datum(mixed: bool) -> None:
    """Datums of different lengths (and, ``mixed``, one without ``advantages``: that input decodes per datum)
    get exactly their own tokens and loss inputs, as views of one tensor or one tensor each."""
    lengths = [3, 9, 1, 6]
    datums = [_datum(list(range(i, i + n)), seed=i, advantages=not (mixed and i == 2)) for i, n in enumerate(lengths)]
    body = _body(datums)
    request = decode_forward_backward(body)
    reference = _per_datum(body)
    assert len(request.data) == len(reference) == len(lengths)
    for datum, (tokens, inputs) in zip(request.data, reference, strict=True):
        assert datum.tokens == tokens
        assert sorted(datum.inputs) == sorted(inputs)
        for name, value in inputs.items():
            assert datum.inputs[name].dtype == value.dtype, name
            assert torch.equal(datum.inputs[name], value), name
    assert request.data[1].inputs["target_tokens"].tolist() == [(t + 1) % 50 for t in range(1, 10)]


def test_a_datum_whose_values_do_not_fill_its_shape_is_refused() -> None:
    body = _body([_datum([1, 2, 3], seed=0), _datum([4, 5], seed=1)])
    msg = pb.ForwardBackwardRequest.FromString(body)
    msg.data[1].loss_fn_inputs["logprobs"].shape[:] = [3]  # holds 2 values
    with pytest.raises(ValueError, match="'logprobs': shape \\[3\\] does not hold its 2 values"):
        decode_forward_backward(msg.SerializeToString())


def test_packed_output_encodes_as_the_per_datum_one() -> None:
    lengths = [2, 5, 1]
    logprobs_T, loss_T = torch.randn(sum(lengths)), torch.randn(sum(lengths))
    outputs = [
        {"logprobs": lp, "elementwise_loss": el}
        for lp, el in zip(logprobs_T.split(lengths), loss_T.split(lengths), strict=True)
    ]
    packed = encode_packed_forward_backward_output(
        {"logprobs": logprobs_T, "elementwise_loss": loss_T}, lengths, {"loss:sum": 1.5}
    )
    assert pb.ForwardBackwardOutput.FromString(packed) == pb.ForwardBackwardOutput.FromString(
        encode_forward_backward_output(outputs, {"loss:sum": 1.5})
    )


def test_check_datums_names_the_datum_with_a_bad_target() -> None:
    request = decode_forward_backward(_body([_datum([1, 2], seed=i) for i in range(4)]))
    check_datums(request.data, "importance_sampling", vocab_size=50, max_context=None, max_tokens=100)
    request.data[2].inputs["target_tokens"][1] = 50  # one past the vocabulary
    with pytest.raises(UserError, match=r"datum 2: target_tokens must be int64 ids in \[0, 50\)"):
        check_datums(request.data, "importance_sampling", vocab_size=50, max_context=None, max_tokens=100)
    request.data[2].inputs["target_tokens"][1] = 0
    request.data[3].inputs["target_tokens"] = request.data[3].inputs["target_tokens"].float()
    with pytest.raises(UserError, match="datum 3: target_tokens"):
        check_datums(request.data, "importance_sampling", vocab_size=50, max_context=None, max_tokens=100)
