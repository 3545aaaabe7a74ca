"""Per-request sampling seeds on the embedded engine: a request samples the same whatever else shares its call
(other prompts, their order, ``batch_size``, chunked generation), and the per-row sampler draws from the
softmax at the temperature (top-p as HF's warper), so the behaviour log-probs describe what was sampled."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardforge.rollout import SamplingParams
from shardforge.rollout.chunked import ChunkedGeneration
from shardforge.rollout.seeds import prompt_seeds, request_seed


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.rollout.testing.tiny import tiny_model

    return tiny_model(tmp_path_factory.mktemp("seeds"), seed=5)


def _engine(tiny: dict[str, Any], **kwargs: Any) -> Any:
    from shardforge.rollout import HFRolloutEngine

    return HFRolloutEngine(tiny["model"], tiny["tokenizer"], **kwargs)


def test_a_request_samples_the_same_in_any_call(tiny: dict[str, Any]) -> None:
    engine = _engine(tiny)
    ids = [tiny["tokenizer"](text, add_special_tokens=False)["input_ids"] for text in ("1+2=", "13+29=", "7+7+7=")]
    seeds = (request_seed(9, 0, 2), request_seed(9, 1, 2), request_seed(9, 2, 2))
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.9, seeds=seeds)
    together = engine.generate(ids, params)
    # The third prompt alone (no left padding: other logits by float rounding only), one row per generate call.
    alone = _engine(tiny, batch_size=1).generate(
        ids[2:], SamplingParams(n=2, max_new_tokens=6, temperature=0.9, seeds=seeds[2:])
    )
    chunked = _engine(tiny, chunks=ChunkedGeneration(2))  # reversed order, generated 2 tokens at a time
    reordered = chunked.generate(ids[::-1], SamplingParams(n=2, max_new_tokens=6, temperature=0.9, seeds=seeds[::-1]))
    # Exact token ids: each row's uniforms are the same, and its logits differ by float rounding only, which moves
    # a token only if a uniform falls within ~1e-6 of a CDF boundary (odds ~1e-5 here, fixed per machine).
    for a, b in ((together[4:], alone), (together[4:], reordered[:2]), (together[:2], reordered[4:])):
        assert [r.response_ids for r in a] == [r.response_ids for r in b]
        for x, y in zip(a, b, strict=True):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert together[0].response_ids != together[1].response_ids, "the samples of one prompt differ"
    # ``seed`` = per-prompt seeds by position in the call (what the vLLM engines send as each request's seed).
    assert prompt_seeds(SamplingParams(n=2, seed=9), 3) == list(seeds)
    by_call = engine.generate(ids, SamplingParams(n=2, max_new_tokens=6, temperature=0.9, seed=9))
    assert [r.response_ids for r in by_call] == [r.response_ids for r in together]
    with pytest.raises(ValueError, match="seeds has 2 seeds for 3 prompts"):
        engine.generate(ids, SamplingParams(n=2, seeds=seeds[:2]))
    with pytest.raises(ValueError, match=r"seeds\[0\]=-1 must be in \[0, 2\*\*63 - n\)"):
        SamplingParams(seeds=(-1,))
    with pytest.raises(ValueError, match=r"top_k=-1 must be >= 0 \(0 = off\)"):
        SamplingParams(top_k=-1)


@pytest.mark.parametrize(("top_p", "top_k"), [(1.0, 0), (0.5, 0), (1.0, 3)])
def test_the_row_sampler_draws_from_the_tempered_softmax(
    tiny: dict[str, Any], tmp_path: Path, top_p: float, top_k: int
) -> None:
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny)
    prompt = tiny["tokenizer"]("12+5=", add_special_tokens=False)["input_ids"]
    num = 3000
    params = SamplingParams(n=num, max_new_tokens=1, temperature=0.7, top_p=top_p, top_k=top_k, seed=1)
    out = engine.generate([prompt], params)
    model = AutoModelForCausalLM.from_pretrained(tiny["model"])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / 0.7, dim=-1)
    if top_p < 1:  # the nucleus: the most likely tokens until their mass reaches top_p, renormalised
        ordered, order = probs.sort(descending=True)
        keep = order[: int((ordered.cumsum(0) < top_p).sum()) + 1]
        probs = torch.zeros_like(probs).index_fill_(0, keep, 1.0) * probs
        probs /= probs.sum()
    if top_k > 0:  # the top_k most likely tokens, renormalised
        keep = probs.topk(top_k).indices
        probs = torch.zeros_like(probs).index_fill_(0, keep, 1.0) * probs
        probs /= probs.sum()
    counts = torch.bincount(torch.tensor([r.response_ids[0] for r in out]), minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "no token outside the nucleus / the top k"
    if top_k > 0:
        assert (counts > 0).sum() == top_k
    # A fixed seed makes this deterministic; the bound is 5 binomial standard deviations per token.
    bound = 5 * (probs * (1 - probs) / num).sqrt() + 1e-3
    assert ((counts / num - probs).abs() <= bound).all(), (counts / num - probs).abs().max()
    # The behaviour log-prob is the full softmax's at the temperature (documented: keep top_p = 1 for PPO).
    full = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double() / 0.7, dim=-1)
    got = torch.tensor([r.logprobs[0] for r in out[:20]], dtype=torch.float64)
    assert torch.allclose(got, full[[r.response_ids[0] for r in out[:20]]], atol=1e-4)
