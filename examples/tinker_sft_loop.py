"""A plain tinker SDK training loop against `shardforge serve` (docs/tinker.md): SFT on a few additions,
then sampling from the trained adapter. Nothing here is shardforge code: point any tinker script at the
service by its base_url and an API key of yours.

    shardforge prepare-tiny                                   # the tiny demo model under outputs/
    shardforge serve --model outputs/demo/model --name tiny --api-key me=tml-local-0123456789 &
    python examples/tinker_sft_loop.py --base-url http://127.0.0.1:8000 --api-key tml-local-0123456789
"""

from __future__ import annotations

import argparse

import tinker
from tinker import types

DATA = ["12+34=46", "7+8=15", "25+25=50", "3+4=7", "60+9=69", "11+11=22"]


def datum(tokenizer: object, text: str) -> types.Datum:
    """Next-token targets over the line and its EOS, no loss on the prompt ``a+b=``."""
    ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]  # type: ignore[operator,attr-defined]
    answer_from = text.index("=") + 2  # +1 for the BOS token, +1 to start after '='
    weights = [0.0 if i + 1 < answer_from else 1.0 for i in range(len(ids) - 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", required=True, help="a tml-... key given to shardforge serve --api-key")
    parser.add_argument("--base-model", default="tiny", help="the name shardforge serve --name gave the model")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()

    service = tinker.ServiceClient(base_url=args.base_url, api_key=args.api_key)
    trainer = service.create_lora_training_client(base_model=args.base_model, rank=args.rank, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    batch = [datum(tokenizer, text) for text in DATA]
    adam = types.AdamParams(learning_rate=1e-2)
    for step in range(args.steps):
        # Submit both before waiting: the service queues them in order.
        fwdbwd, optim = trainer.forward_backward(batch, "cross_entropy"), trainer.optim_step(adam)
        tokens = sum(float(w) for d in batch for w in d.loss_fn_inputs["weights"].tolist())
        print(f"step {step}: loss/token {fwdbwd.result().metrics['loss:sum'] / tokens:.4f}")
        optim.result()

    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer("12+34=")["input_ids"])
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=["\n"])
    result = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    print("12+34=" + tokenizer.decode(result.sequences[0].tokens, skip_special_tokens=True))
    print("saved:", trainer.save_state("final").result().path)


if __name__ == "__main__":
    main()
