"""Push a trainer's weights into a running vLLM engine, version after version (CPU is fine).

    pip install -e "packages/weight-sync[vllm]"   # or: nox -s vllm (installs the same)
    VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=1 python examples/weight_sync_vllm.py [--transport disk]

Builds a small Qwen3 and a character tokenizer locally (no downloads), serves them with an
in-process ``vllm.LLM`` that has the ``"shardforge"`` weight-transfer backend, then trains
an HF copy of the model for a few AdamW steps between publishes. After every publish
vLLM's greedy output follows the trainer (checked against HF ``generate``).

With a vLLM server instead of ``LLM``: start it with ``VLLM_SERVER_DEV_MODE=1 vllm serve
MODEL --weight-transfer-config '{"backend": "shardforge"}'`` and pass
``vllm.distributed.weight_transfer.HTTPVLLMWeightSyncClient("http://host:8000")`` as the client.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
import time
from pathlib import Path

import torch


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def train_steps(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> float:
    """A few AdamW steps of next-token prediction on one fixed string."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    return float(loss.detach())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transport", choices=["collective", "disk"], default="collective")
    parser.add_argument("--versions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15, help="AdamW steps between publishes")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    from shardforge.algorithms.testing.tiny import build_char_tokenizer, build_tiny_qwen3
    from shardforge.weight_sync.vllm import LLMClient, connect_vllm

    work = Path(tempfile.mkdtemp(prefix="weight-sync-vllm-"))
    tokenizer = build_char_tokenizer(work / "model")
    num_params = build_tiny_qwen3(work / "model", tokenizer, hidden=128, layers=2)
    print(f"model: {num_params / 1e6:.2f}M parameters in {work / 'model'}")

    start = time.perf_counter()
    llm = LLM(
        model=str(work / "model"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=64,
        weight_transfer_config={"backend": "shardforge"},  # our engine, registered by the plugin
    )
    print(f"vLLM started in {time.perf_counter() - start:.1f}s")

    trainer = AutoModelForCausalLM.from_pretrained(str(work / "model"), dtype=torch.float32)
    start = time.perf_counter()
    sync = connect_vllm(
        trainer,
        LLMClient(llm),
        transport=args.transport,
        port=free_port(),  # collective: trainer rank 0 hosts the rendezvous here
        root=str(work / "weights"),  # disk: versions are committed here
        dtype=torch.float32,  # publish in vLLM's serving dtype
    )
    print(f"connected ({args.transport}) in {time.perf_counter() - start:.2f}s")

    prompts = ["12+3", "7+7", "40+2"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    text = "12+34=46 7+7=14 40+2=42 12+3=15 " * 2
    ids = torch.tensor([tokenizer(text).input_ids])

    def show(tag: str) -> list[str]:
        outputs = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        print(f"  {tag:<10} vLLM: {outputs}")
        return outputs

    show("version 0")
    for version in range(1, args.versions + 1):
        loss = train_steps(trainer, ids, args.steps)
        start = time.perf_counter()
        stats = sync.publish(version)
        seconds = time.perf_counter() - start
        assert stats is not None
        vllm_out = show(f"version {version}")
        with torch.no_grad():
            hf_out = []
            for prompt in prompts:
                prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
                out = trainer.generate(prompt_ids, max_new_tokens=8, do_sample=False)
                hf_out.append(tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True))
        print(
            f"  loss {loss:.3f}; published {stats.bytes / 1e6:.1f} MB in {stats.buckets} bucket(s), "
            f"{seconds:.3f}s (gather + transfer {stats.seconds:.3f}s); vLLM serves version {llm.get_weight_version()}; "
            f"matches HF generate: {vllm_out == hf_out}"
        )
    sync.shutdown()


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep the guard
    main()
