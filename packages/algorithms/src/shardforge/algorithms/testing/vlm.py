"""Tiny, locally built vision-language assets for tests: a Qwen2.5-VL or Qwen3-VL with its tokenizer
and image processor, and coloured-square images with chat rows that ask for the colour. No model hub.

    assets = tiny_vlm_assets(tmp_path, seed=0)
    assets["model"]    # directory: config.json, model.safetensors, tokenizer + chat template,
                       # preprocessor_config.json (Qwen2-VL image processor)
    assets["train"]    # JSONL chat rows with {"type": "image", "image": "images/<name>.png"} content parts
                       # (paths relative to the JSONL file's directory)

The model loads with ``AutoModelForImageTextToText.from_pretrained``; the tokenizer with
``AutoTokenizer`` and the image processor with ``AutoImageProcessor`` from the same directory.
``AutoProcessor`` also needs torchvision in transformers 5 (its video processor); see
docs/packages/algorithms-vlm.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

__all__ = [
    "VLM_CHAT_TEMPLATE",
    "VLM_FAMILIES",
    "VLM_SPECIALS",
    "build_vlm_tokenizer",
    "colour_overlap_reward",
    "make_color_rows",
    "tiny_qwen2_5_vl_config",
    "tiny_qwen3_vl_config",
    "tiny_vlm_assets",
    "vlm_grpo_steps",
    "vlm_sft_steps",
]

VLM_SPECIALS = [
    "<pad>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<unk>",
]
# Qwen2.5-VL's layout of image parts (vision_start, one image_pad that the processor expands, vision_end);
# string or list-of-parts content. Prefix-stable, so assistant tokens are found by rendering prefixes.
VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 60, 220), "yellow": (230, 220, 20)}


def build_vlm_tokenizer() -> Any:
    """A printable-ASCII character tokenizer with Qwen2.5-VL's special tokens and `VLM_CHAT_TEMPLATE`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(VLM_SPECIALS + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("(?m).|\n"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VLM_SPECIALS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>"
    )
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2_5_vl_config(
    tokenizer: Any,
    *,
    hidden: int = 32,
    layers: int = 2,
    vision_depth: int = 2,
    initializer_range: float = 0.02,
    vocab_size: int | None = None,
) -> Any:
    """A Qwen2.5-VL config: ``layers`` text layers of width ``hidden``, a ``vision_depth``-block vision
    tower (patch 14, 2x2 merge: a 56x56 image is 16 patches and 4 image tokens). A larger
    ``initializer_range`` (e.g. 0.2) makes an untrained model's outputs depend visibly on positions and
    images (parity tests); the default 0.02 gives near-uniform outputs that train quickly."""
    from transformers import Qwen2_5_VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VLM_SPECIALS}
    if hidden % 32:
        raise ValueError(f"hidden={hidden} must be a multiple of 32 (4 heads, 1:1:2 mRoPE split of head_dim / 2)")
    q = hidden // 4 // 2 // 4
    text = {
        "vocab_size": vocab_size or len(tokenizer), "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        # head_dim / 2 rotary frequencies (hidden 32: 4), split 1:1:2 over (temporal, height, width)
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [q, q, 2 * q]},
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"],
        "initializer_range": initializer_range,
    }  # fmt: skip
    vision = {
        "depth": vision_depth, "hidden_size": hidden, "intermediate_size": hidden * 2, "num_heads": 2,
        "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 56, "fullatt_block_indexes": [vision_depth - 1], "initializer_range": initializer_range,
    }  # fmt: skip
    # Generic PretrainedConfig attributes the typed signature does not list (generation and weight init read them).
    common: dict[str, Any] = {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"],
        "initializer_range": initializer_range,
    }  # fmt: skip
    return Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, **common,
    )  # fmt: skip


def tiny_qwen3_vl_config(
    tokenizer: Any,
    *,
    hidden: int = 32,
    layers: int = 2,
    vision_depth: int = 2,
    initializer_range: float = 0.02,
    vocab_size: int | None = None,
) -> Any:
    """A Qwen3-VL config, shaped like `tiny_qwen2_5_vl_config` but with Qwen3-VL's differences: patch 16
    (a 64x64 image is 16 patches, 4 image tokens), interleaved mRoPE, learned vision position
    embeddings, and DeepStack (the first vision block's features are added to the first text layer's
    hidden states at the image tokens)."""
    from transformers import Qwen3VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VLM_SPECIALS}
    if hidden % 32:
        raise ValueError(f"hidden={hidden} must be a multiple of 32 (4 heads, 1:1:2 mRoPE split of head_dim / 2)")
    q = hidden // 4 // 2 // 4
    common: dict[str, Any] = {
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<pad>"],
        "initializer_range": initializer_range,
    }  # fmt: skip
    text = {
        "vocab_size": vocab_size or len(tokenizer), "hidden_size": hidden, "intermediate_size": hidden * 2,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
        "max_position_embeddings": 2048, "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [q, q, 2 * q],
                            "mrope_interleaved": True},
        **common,
    }  # fmt: skip
    vision = {
        "depth": vision_depth, "hidden_size": hidden, "intermediate_size": hidden * 2, "num_heads": 2,
        "out_hidden_size": hidden, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "initializer_range": initializer_range,
    }  # fmt: skip
    return Qwen3VLConfig(
        text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, **common,
    )  # fmt: skip


VLM_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_5_vl": {"config": tiny_qwen2_5_vl_config, "patch": 14, "sizes": ((56, 56), (84, 56), (56, 84))},
    "qwen3_vl": {"config": tiny_qwen3_vl_config, "patch": 16, "sizes": ((64, 64), (96, 64), (64, 96))},
}
"""The families `tiny_vlm_assets` builds: config builder, vision patch size, the test image sizes
(multiples of patch x merge, so each image is a whole number of merged tokens)."""


def make_color_rows(
    image_dir: Path, count: int, *, seed: int, sizes: tuple[tuple[int, int], ...], relative_to: Path | None = None
) -> list[dict]:
    """``count`` chat rows: one or two solid-colour PNGs of the given (width, height) sizes, the user asks
    for the colour(s), the assistant answers. Images are written to ``image_dir``; rows name them relative
    to ``relative_to`` (the data file's directory) when given, else by absolute path."""
    from PIL import Image

    image_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        parts: list[dict[str, str]] = []
        names = []
        for j in range(1 + (i % 3 == 2)):  # every third row has two images
            name = rng.choice(sorted(COLORS))
            width, height = rng.choice(sizes)
            path = image_dir / f"img{i}_{j}.png"
            Image.new("RGB", (width, height), COLORS[name]).save(path)
            parts.append({"type": "image", "image": str(path.relative_to(relative_to) if relative_to else path)})
            names.append(name)
        parts.append({"type": "text", "text": "colour?" if len(names) == 1 else "colours?"})
        rows.append(
            {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": " ".join(names)}]}
        )
    return rows


def tiny_vlm_assets(
    root: str | Path,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    vision_depth: int = 2,
    num_train: int = 12,
    num_eval: int = 4,
    data_seed: int = 1,
    initializer_range: float = 0.02,
    sizes: tuple[tuple[int, int], ...] | None = None,
    family: str = "qwen2_5_vl",
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """Build a tiny VLM of ``family`` (`VLM_FAMILIES`: Qwen2.5-VL or Qwen3-VL; weights from ``seed``), its
    tokenizer + image processor, and colour chat rows (train / eval JSONL) under ``root``; ``sizes``
    default to the family's; ``vocab_size`` (default: the tokenizer's 105 tokens) pads the embedding,
    e.g. to 112 so tensor parallelism can split it.

    Returns ``{"root": Path, "model": str (model dir), "tokenizer", "image_processor", "train": Path,
    "eval": Path}``.
    """
    import torch
    from transformers import AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    root = Path(root)
    model_dir = root / "model"
    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown VLM family {family!r}; built here: {sorted(VLM_FAMILIES)}")
    spec = VLM_FAMILIES[family]
    sizes = sizes or spec["sizes"]
    tokenizer = build_vlm_tokenizer()
    # One merged token (2x2 patches) .. 16 image tokens per image keeps sequences short.
    merged = spec["patch"] * 2
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=spec["patch"], min_pixels=merged * merged, max_pixels=merged * merged * 16
    )
    config = spec["config"](
        tokenizer,
        hidden=hidden,
        layers=layers,
        vision_depth=vision_depth,
        initializer_range=initializer_range,
        vocab_size=vocab_size,
    )
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    image_processor.save_pretrained(str(model_dir))
    data_dir = root / "data"
    rows = make_color_rows(data_dir / "images", num_train + num_eval, seed=data_seed, sizes=sizes, relative_to=data_dir)
    files = {}
    for split, chunk in (("train", rows[:num_train]), ("eval", rows[num_train:])):
        files[split] = data_dir / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return {"root": root, "model": str(model_dir), "tokenizer": tokenizer, "image_processor": image_processor} | files


def vlm_sft_steps(
    model_dir: str,
    train: str,
    layout: str,
    freeze: tuple[str, ...],
    steps: int = 4,
    sequence_parallel: bool = True,
    eps: float = 1e-6,
) -> dict[str, Any]:
    """``steps`` SFT updates of a `TrainEngine` on this rank's share of the rows in ``train`` (lr 3e-3, AdamW
    ``eps``); returns the losses and the full trained weights (layout-parity tests run it in a rank pool).

    ``eps`` 1e-6, not AdamW's 1e-8: with 1e-8 Adam turns the rounding noise of near-zero gradients (e.g. a key
    bias's, exactly 0 in exact arithmetic) into updates of up to ~lr, so world 1 and FSDP 2 weights differed by
    3e-5 on an AMD EPYC after 4 steps; with 1e-6 they differ by < 2e-6 there and the losses still fall."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.config import OptimizerConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = load_vlm_examples(
        train, tokenizer, AutoImageProcessor.from_pretrained(model_dir), image_token="<|image_pad|>"
    )
    config = EngineConfig(
        optimizer=OptimizerConfig(lr=3e-3, eps=eps),
        max_tokens_per_microbatch=96,
        freeze_module_prefix=freeze,
        sequence_parallel=sequence_parallel,
    )
    engine = TrainEngine(model_dir, layout, config)
    mine = list(range(engine.dp_rank, len(examples), engine.dp_size))
    batch = pack_vlm_examples(examples, mine)
    losses = [engine.train_batch(batch)["loss"] for _ in range(steps)]
    return {"losses": losses, "weights": engine.full_state_dict()}


def colour_overlap_reward(prompt: str, response: str, reference: str) -> float:
    """1.0 for the exact answer, else the share of the reference's characters the response uses: a reward
    that varies within a group even for an untrained model (tests need a learning signal)."""
    if response.strip() == reference:
        return 1.0
    return len(set(response) & set(reference)) / max(len(set(reference)), 1) / 2


def vlm_grpo_steps(model_dir: str, train: str, layout: str, steps: int = 2, group_size: int = 4) -> dict[str, Any]:
    """``steps`` GRPO updates on the image prompts of ``train`` (chat rows; the last assistant message is the
    reference): each step the embedded HF rollout engine samples ``group_size`` responses per prompt with a
    seed that does not depend on the layout (every rank samples every prompt, then keeps its share), this
    rank's `TrainEngine` recomputes the old log-probs and takes one PPO-clip step (lr 3e-3), and the new
    weights are published in memory to the rollout engine. Returns the losses, the largest gap between the
    trainer's old log-probs and the engine's behaviour log-probs, and the full trained weights (layout-parity
    tests run it in a rank pool)."""
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.prompts import load_image_prompts
    from shardforge.algorithms.trainers.rl.batch import trajectories_to_batch
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.config import OptimizerConfig
    from shardforge.engine.objectives import PPOActorLossFn
    from shardforge.engine.objectives.advantages import group_advantages
    from shardforge.engine.objectives.loss_fns import OLD_LOGPROBS
    from shardforge.engine.objectives.rollout_correction import BEHAVIOUR_LOGPROBS
    from shardforge.rollout import SamplingParams
    from shardforge.rollout.hf.engine import HFRolloutEngine
    from shardforge.rollout.publish import InProcessPublisher
    from shardforge.rollout.workflows import PromptRow, WorkflowConfig, run_episodes
    from shardforge.rollout.workflows.rlvr import RLVRWorkflow

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    prompts = load_image_prompts(train, tokenizer, processor, image_token="<|image_pad|>")
    config = EngineConfig(optimizer=OptimizerConfig(lr=3e-3), max_tokens_per_microbatch=128)
    engine = TrainEngine(model_dir, layout, config)
    rollout = HFRolloutEngine(model_dir, tokenizer)
    workflow = RLVRWorkflow(WorkflowConfig(), tokenizer, colour_overlap_reward)
    actor = PPOActorLossFn()
    rows = [PromptRow.from_prompts(prompts, i, index=i) for i in range(len(prompts))]
    mine = [i for i in range(len(rows) * group_size) if (i // group_size) % engine.dp_size == engine.dp_rank]
    losses, gaps, rewards = [], [], []
    for step in range(steps):
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=1000 + step)
        trajectories = run_episodes(workflow, rollout, rows, group_size, params, drop_failed=False)
        reward = torch.tensor([t.reward for t in trajectories])
        advantages = group_advantages(reward, group_size, "grpo")
        batch = trajectories_to_batch([trajectories[i] for i in mine], advantages[mine])
        batch.extras[OLD_LOGPROBS] = engine.forward(batch)
        mask = batch.loss_mask != 0
        gaps.append(float((batch.extras[OLD_LOGPROBS] - batch.extras[BEHAVIOUR_LOGPROBS])[mask].abs().max()))
        losses.append(engine.train_batch(batch, actor, actor.loss_weight)["loss"])
        rewards.append(float(reward.mean()))
        InProcessPublisher(rollout.receiver, "float32").publish(engine, None)
    return {"losses": losses, "gaps": gaps, "rewards": rewards, "weights": engine.full_state_dict()}


class EntropySFTLoss:
    """SFT loss minus 0.05 x the entropy at the target positions (layout tests: the entropy's gradient
    flows too, vocab-parallel under TP)."""

    wants_entropy = True

    def __call__(self, logprobs: Any, batch: Any, entropy: Any = None) -> Any:
        return -((logprobs + 0.05 * entropy) * batch.loss_mask).sum()


def vlm_tp_steps(model_dir: str, train: str, layout: str, sequence_parallel: bool, steps: int = 2) -> dict[str, Any]:
    """For TP parity tests: log-probs of the first 4 image rows of ``train`` and of a text-only row, then
    ``steps`` SFT steps with `EntropySFTLoss` (lr 3e-3). With dp 2, rank 0 trains on the image rows and
    rank 1 on the text-only row alone (its micro-batch runs the dummy image); else every rank on all 5."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from shardforge.algorithms.data.vlm import load_vlm_examples, pack_vlm_examples, tokenize_vlm_row
    from shardforge.engine import EngineConfig, TrainEngine
    from shardforge.engine.config import OptimizerConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    processor = AutoImageProcessor.from_pretrained(model_dir)
    examples = load_vlm_examples(train, tokenizer, processor, image_token="<|image_pad|>")[:4]
    text_row = {"messages": [{"role": "user", "content": "say red"}, {"role": "assistant", "content": "red"}]}
    examples.append(tokenize_vlm_row(text_row, tokenizer, processor, image_token="<|image_pad|>"))  # index 4
    config = EngineConfig(optimizer=OptimizerConfig(lr=3e-3), sequence_parallel=sequence_parallel)
    engine = TrainEngine(model_dir, layout, config)
    images = engine.forward(pack_vlm_examples(examples, [0, 1, 2, 3]))
    text = engine.forward(pack_vlm_examples(examples, [4]))
    mine = [[0, 1, 2, 3], [4]][engine.dp_rank] if engine.dp_size == 2 else [0, 1, 2, 3, 4]
    batch = pack_vlm_examples(examples, mine)
    losses = [engine.train_batch(batch, loss_fn=EntropySFTLoss())["loss"] for _ in range(steps)]
    return {"images": images, "text": text, "losses": losses, "weights": engine.full_state_dict()}


def check_vlm_parity(single: dict[str, Any], sharded: dict[str, Any], initial: dict[str, Any]) -> None:
    """`vlm_tp_steps` results of a sharded layout vs one process. fp32; TP sums partial matmuls and the
    vocab-parallel softmax in another order: rounding only (the HSDP VLM test's tolerances)."""
    import torch

    torch.testing.assert_close(sharded["images"], single["images"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sharded["text"], single["text"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
    assert sharded["weights"].keys() == single["weights"].keys()
    for key, value in sharded["weights"].items():
        torch.testing.assert_close(value, single["weights"][key], rtol=0, atol=2e-5, msg=_named(key))
    moved = [k for k in initial if k.startswith("model.visual.") and not torch.equal(single["weights"][k], initial[k])]
    assert moved, "the vision tower trains"


def _named(key: str) -> Any:
    return lambda message: f"{key}: {message}"
