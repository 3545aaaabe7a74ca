"""``data:`` sources beyond SFT (world 1): the reward-model trainer on a mixture of a JSONL file and a
`save_to_disk` dataset with its own column names (a resume mid-mixture trains the uninterrupted run's
batches), GRPO on a Parquet source with mapped columns (the rollouts are its prompts), and the RL
prompt mixture (both sources drawn; a resume with other weights is refused)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import datasets
import pytest

import shardforge.algorithms.trainers.rm as rm_module
from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.data.sources import SourceConfig
from shardforge.algorithms.trainers import TRAINERS
from shardforge.algorithms.trainers.rl.data import load_prompt_data

REWARD_MODULE = textwrap.dedent(
    """
    SEEN = []

    def has_seven(prompt, response, reference):
        SEEN.append((prompt, reference))
        return float("7" in response)
    """
)
QA = {"prompt": "question", "completion": "answer"}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from shardforge.algorithms.testing import tiny_assets

    root = tmp_path_factory.mktemp("rlpref")
    made = tiny_assets(root, seed=5, max_operand=9, num_eval=8)
    pairs = root / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "x"}) + "\n" for i in range(6))
    )
    saved = root / "prefs_saved"  # another dataset's names for the same fields, as a DatasetDict on disk
    other = [{"context": f"{i}+2=", "good": str(i + 2), "bad": "y"} for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(other)}).save_to_disk(str(saved))
    rows = [json.loads(line) for line in Path(made["eval"]).read_text().splitlines() if line.strip()]
    qa = root / "qa.parquet"
    datasets.Dataset.from_list([{"question": r["prompt"], "answer": r["completion"]} for r in rows]).to_parquet(str(qa))
    (root / "rlpref_rewards_mod.py").write_text(REWARD_MODULE)
    sys.path.insert(0, str(root))
    return {"model": str(made["model"]), "train": str(made["train"]), "pairs": str(pairs), "saved": str(saved),
            "qa": str(qa), "qa_rows": rows, "tokenizer": made["tokenizer"]}  # fmt: skip


def _pair_mix(assets: dict[str, Any]) -> list[dict[str, Any]]:
    columns = {"prompt": "context", "chosen": "good", "rejected": "bad"}
    return [
        {"source": assets["pairs"], "name": "plus1", "weight": 0.5},
        {"source": assets["saved"], "name": "plus2", "weight": 0.5, "columns": columns},
    ]


def _rm_config(assets: dict[str, Any], out: Path, steps: int) -> Any:
    data = {
        "model": assets["model"], "output_dir": str(out), "layout": "d1", "steps": steps, "save_every": 2,
        "global_batch_size": 4, "progress": False, "export_hf_at_end": False, "loggers": ["jsonl"],
        "data": {"mix": _pair_mix(assets)}, "engine": {"max_tokens_per_microbatch": 64},
    }  # fmt: skip
    return build_config(TRAINERS.get("rm").config_cls, data)


def test_rm_mixture_of_jsonl_and_save_to_disk_resumes_mid_mixture(tmp_path, assets, monkeypatch):
    seen: list[list[int]] = []
    original = rm_module.pack_pairs

    def recording(pairs: Any, indices: list[int], **kwargs: Any) -> Any:
        seen.append(list(indices))
        return original(pairs, indices, **kwargs)

    monkeypatch.setattr(rm_module, "pack_pairs", recording)
    run = TRAINERS.get("rm").run
    run(_rm_config(assets, tmp_path / "full", steps=4))
    full = list(seen)
    assert {i < 6 for batch in full for i in batch} == {True, False}  # pairs of both sources were trained
    seen.clear()
    run(_rm_config(assets, tmp_path / "cut", steps=2))
    summary = run(_rm_config(assets, tmp_path / "cut", steps=4))
    assert summary["resumed_from"] == 2
    assert seen == full  # steps 1-2, then (resumed) 3-4: the uninterrupted run's batches


def test_rm_reads_mapped_columns_and_names_a_bad_row(tmp_path, assets):
    from shardforge.algorithms.data import load_pairs

    tokenizer = assets["tokenizer"]
    mapped = SourceConfig(source=assets["saved"], columns={"prompt": "context", "chosen": "good", "rejected": "bad"})
    pairs = load_pairs(mapped, tokenizer)
    plain = load_pairs(assets["pairs"], tokenizer)
    assert len(pairs) == 5
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    assert (
        pairs[0].chosen[: pairs[0].chosen_prompt_len] == bos + tokenizer("0+2=", add_special_tokens=False)["input_ids"]
    )
    assert plain[0].chosen != pairs[0].chosen
    bad = tmp_path / "bad.parquet"
    datasets.Dataset.from_list([{"context": "1+1=", "good": "2", "bad": "x"}, {"context": "2+2=", "good": None, "bad": "x"}]).to_parquet(str(bad))  # fmt: skip
    with pytest.raises(ValueError, match=r"bad.parquet row 2: .*\(field 'chosen' is empty\)"):
        load_pairs(SourceConfig(source=str(bad), columns={"prompt": "context", "chosen": "good", "rejected": "bad"}), tokenizer)  # fmt: skip


def _grpo_config(assets: dict[str, Any], out: Path, data: dict[str, Any], **extra: Any) -> Any:
    values = {
        "model": assets["model"], "output_dir": str(out), "layout": "d1", "steps": 2, "progress": False,
        "export_hf_at_end": False, "loggers": ["jsonl"], "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 2,
        "reward_fn": "rlpref_rewards_mod:has_seven", "engine": {"max_tokens_per_microbatch": 64}, "data": data,
    } | extra  # fmt: skip
    return build_config(TRAINERS.get("grpo").config_cls, values)


def test_grpo_trains_on_a_parquet_source_with_mapped_columns(tmp_path, assets):
    import rlpref_rewards_mod  # type: ignore[import-not-found]

    rlpref_rewards_mod.SEEN.clear()
    config = _grpo_config(assets, tmp_path, {"train": {"source": assets["qa"], "columns": QA}})
    summary = TRAINERS.get("grpo").run(config)
    assert summary["steps"] == 2
    pairs = {(r["prompt"], r["completion"]) for r in assets["qa_rows"]}
    assert rlpref_rewards_mod.SEEN and set(rlpref_rewards_mod.SEEN) <= pairs  # prompts + references from the source
    assert len(rlpref_rewards_mod.SEEN) == 2 * 2 * 2  # steps x prompts x samples


def test_rl_prompt_mixture_draws_both_sources_and_keeps_its_weights_on_resume(tmp_path, assets):
    from shardforge.algorithms.trainers.base import check_data_state

    mix = [{"source": assets["train"], "name": "adds", "weight": 0.5}, {"source": assets["qa"], "name": "qa", "weight": 0.5, "columns": QA}]  # fmt: skip
    config = _grpo_config(assets, tmp_path, {"mix": mix})
    data = load_prompt_data(config, assets["tokenizer"])
    first = data.sizes[0]
    assert data.sizes[1] == len(assets["qa_rows"]) and len(data.prompts) == sum(data.sizes)
    sampler = data.sampler(8, seed=0)
    drawn = [i for step in range(4) for i in sampler.local_batch(step, 0, 1)]
    assert {i < first for i in drawn} == {True, False}
    again = data.sampler(8, seed=0)  # a function of (seed, step): a resumed run (or the async thread) replays it
    assert again.local_batch(3, 0, 1) == sampler.local_batch(3, 0, 1)
    assert data.prompts.texts[drawn[0]] in {r["prompt"] for r in assets["qa_rows"]} | set(data.prompts.texts[:first])
    mix[1]["weight"] = 0.9
    changed = load_prompt_data(_grpo_config(assets, tmp_path, {"mix": mix}), assets["tokenizer"])
    with pytest.raises(ValueError, match=r"cannot resume.*mixture_sources"):
        check_data_state(data.data_state(), changed.data_state())
