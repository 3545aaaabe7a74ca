"""Dataset sources (files, save_to_disk dirs, data folders, HF names from the offline cache), column
mapping, bad-input errors, weighted mixtures (determinism, exact resume, changed weights), the
chat-template override and the dry run's source list. World 1, seconds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from shardforge.algorithms.config_io import build_config
from shardforge.algorithms.data import SFT_ROW_FIELDS, load_sft_examples
from shardforge.algorithms.data.config import DataConfig, apply_chat_template_override
from shardforge.algorithms.data.mixture import MixtureSampler
from shardforge.algorithms.data.sources import SourceConfig, read_source
from shardforge.algorithms.testing.tiny import build_char_tokenizer
from shardforge.algorithms.trainers.sft import SFTConfig

ROWS = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(5)]
OURS = [{"prompt": r["question"], "completion": r["answer"]} for r in ROWS]
MAPPING = {"prompt": "question", "completion": "answer"}


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`datasets` caches and looks up under tmp_path, offline (as in CI: no network)."""
    import huggingface_hub.constants

    cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_hub_dataset(cache: Path, repo_id: str, subset: str, splits: dict[str, list[dict[str, Any]]]) -> None:
    """Write ``repo_id`` into the `datasets` cache exactly where a first online ``load_dataset(repo_id,
    subset)`` leaves it (``<namespace>___<name>/<subset>/<version>/<hash>/<name>-<split>.arrow`` + info), so
    an offline ``load_dataset`` finds it ("Using the latest cached version of the dataset")."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    namespace, name = repo_id.split("/")
    files = {}
    for split, rows in splits.items():
        files[split] = str(cache.parent / f"{name}-{split}.parquet")
        datasets.Dataset.from_list(rows).to_parquet(files[split])
    Parquet(
        cache_dir=str(cache), dataset_name=name, config_name=subset, data_files=files, hash="0" * 16
    ).download_and_prepare()
    # The builder names the config dir '<subset>-<data-files hash>'; a Hub download names it '<subset>'.
    (cache / name).rename(cache / f"{namespace}___{name}")
    config_dir = next((cache / f"{namespace}___{name}").iterdir())
    config_dir.rename(config_dir.parent / subset)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------ sources
@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "save_to_disk", "folder", "hub_name"])
def test_every_source_kind_reads_the_same_rows_with_columns_mapped(tmp_path, _datasets_cache, kind):
    dataset = datasets.Dataset.from_list(ROWS)
    split, subset = "train", None
    if kind == "jsonl":
        source = str(_write_jsonl(tmp_path / "d.jsonl", ROWS))
    elif kind in ("json", "parquet", "csv"):
        source = str(tmp_path / f"d.{kind}")
        getattr(dataset, f"to_{kind}")(source)
    elif kind == "save_to_disk":
        source, split = str(tmp_path / "saved"), "test"
        datasets.DatasetDict({"train": dataset.select([0]), "test": dataset}).save_to_disk(source)
    elif kind == "folder":  # a local copy of a Hub repo: data/<split>-*.parquet
        (tmp_path / "repo" / "data").mkdir(parents=True)
        dataset.to_parquet(str(tmp_path / "repo" / "data" / "train-00000-of-00001.parquet"))
        source = str(tmp_path / "repo")
    else:
        cache_hub_dataset(_datasets_cache, "someone/tiny-add", "main", {"train": ROWS[:1], "test": ROWS})
        source, split, subset = "someone/tiny-add", "test", "main"
    spec = SourceConfig(source=source, split=split, subset=subset, columns=MAPPING)
    rows = read_source(spec, SFT_ROW_FIELDS)
    assert [n for n, _ in rows] == [1, 2, 3, 4, 5]
    assert [row for _, row in rows] == OURS


def test_hub_name_not_in_the_cache_is_a_clear_offline_error():
    with pytest.raises(
        ValueError, match=r"data source 'nobody/absent' \(dataset name.*already in the local datasets cache"
    ):
        read_source(SourceConfig(source="nobody/absent"))


def test_missing_column_names_the_columns_found(tmp_path):
    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    spec = SourceConfig(source=str(path), columns={"prompt": "query", "completion": "answer"})
    with pytest.raises(
        ValueError, match=r"has no column 'query' \(for 'prompt'\); its columns are \['question', 'answer'\]"
    ):
        read_source(spec, SFT_ROW_FIELDS)
    # no mapping at all: the fields we expect and the columns there are
    with pytest.raises(
        ValueError, match=r"has columns \['question', 'answer'\]; expected 'prompt'\+'completion' or 'messages'"
    ):
        read_source(SourceConfig(source=str(path)), SFT_ROW_FIELDS)


def test_a_bad_row_names_source_row_and_field(tmp_path):
    rows = [*ROWS[:2], {"question": "3+1=", "answer": 4}, *ROWS[3:]]
    _write_jsonl(tmp_path / "d.jsonl", rows)
    spec = SourceConfig(source=str(tmp_path / "d.jsonl"), name="adds", columns=MAPPING)
    with pytest.raises(ValueError, match=r"^adds row 3: field 'completion' must be a string, got int 4"):
        read_source(spec, SFT_ROW_FIELDS)
    chat = [{"messages": [{"role": "user", "content": "1+1="}]}, {"messages": [{"content": "x"}]}]
    _write_jsonl(tmp_path / "chat.jsonl", chat)
    with pytest.raises(ValueError, match=r"chats row 2: field 'messages' item 0 must have 'role' and 'content'"):
        read_source(SourceConfig(source=str(tmp_path / "chat.jsonl"), name="chats"), SFT_ROW_FIELDS)


def test_source_config_refuses_unknown_target_columns_and_negative_weight():
    with pytest.raises(ValueError, match=r"unknown name\(s\) \['question'\]; the keys are ours"):
        SourceConfig(source="x.jsonl", columns={"question": "prompt"})
    with pytest.raises(ValueError, match=r"weight=-1 is negative"):
        SourceConfig(source="x.jsonl", weight=-1)


# ------------------------------------------------------------------------------------------ mixtures
def test_mixture_is_deterministic_follows_weights_and_skips_zero_weight():
    def draws(seed: int) -> list[list[tuple[int, int]]]:
        sampler = MixtureSampler([10, 7, 5], [0.7, 0.3, 0.0], 20, seed=seed)
        return [sampler.global_batch(step) for step in range(50)]

    first = draws(0)
    assert first == draws(0) and first != draws(1)
    counts = [sum(s == i for batch in first for s, _ in batch) for i in range(3)]
    assert counts[2] == 0 and abs(counts[0] / 1000 - 0.7) < 0.05
    # within a source, every row once per epoch
    source0 = [row for batch in first for s, row in batch if s == 0][:10]
    assert sorted(source0) == list(range(10))


def test_mixture_resume_reproduces_the_next_batches_exactly():
    def sampler(weights: list[float] = [0.6, 0.4]) -> MixtureSampler:  # noqa: B006
        return MixtureSampler([9, 4], weights, 6, names=["math", "chat"], seed=3)

    full = sampler()
    uninterrupted = [full.local_batch(step, 1, 2) for step in range(10)]
    first = sampler()
    for step in range(4):
        first.local_batch(step, 1, 2)
    saved = json.loads(json.dumps(first.state_dict()))  # as the checkpoint stores it
    assert saved["step"] == 4 and sum(saved["positions"].values()) == 4 * 6
    resumed = sampler()
    resumed.load_state_dict(saved)
    assert [resumed.local_batch(step, 1, 2) for step in range(4, 10)] == uninterrupted[4:]


def test_mixture_resume_with_changed_weights_continues_each_source_where_it_stopped():
    old = MixtureSampler([50, 50], [0.9, 0.1], 8, names=["a", "b"], seed=0)
    seen = [pair for step in range(3) for pair in old.global_batch(step)]
    new = MixtureSampler([50, 50], [0.1, 0.9], 8, names=["a", "b"], seed=0)
    new.load_state_dict(old.state_dict())
    later = [pair for step in range(3, 6) for pair in new.global_batch(step)]
    for source in (0, 1):  # each source's rows are its one shuffled stream, no repeats across the resume
        rows = [row for s, row in seen + later if s == source]
        assert len(set(rows)) == len(rows)
    only_a = MixtureSampler([50, 50], [1.0, 0.0], 8, names=["a", "b"], seed=0)  # source a's stream, in order
    stream = [row for step in range(6) for _, row in only_a.global_batch(step)]
    drawn = [row for s, row in seen + later if s == 0]
    assert drawn == stream[: len(drawn)]


@pytest.mark.parametrize(
    ("mix", "pattern"),
    [
        ([{"source": "a.jsonl", "weight": 0}, {"source": "b.jsonl", "weight": 0.0}], r"weights sum to 0.0 \(a.jsonl=0"),
        ([{"source": "a.jsonl", "weight": -0.5}], r"a.jsonl: weight=-0.5 is negative"),
        (
            [{"source": "a.jsonl"}, {"source": "a.jsonl"}],
            r"repeated sources \['a.jsonl', 'a.jsonl'\]; give each a distinct name",
        ),
    ],
)
def test_bad_mixtures_are_refused_when_the_config_is_built(mix, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_config(SFTConfig, {"model": "m", "output_dir": "o", "data": {"mix": mix}})


def test_config_keeps_plain_paths_and_refuses_two_training_sources():
    config = build_config(SFTConfig, {"model": "m", "output_dir": "o", "train_file": "t.jsonl"})
    assert config.data == DataConfig()
    config = build_config(
        SFTConfig, {"model": "m", "output_dir": "o", "data": {"train": "t.jsonl", "eval": {"source": "e"}}}
    )
    assert config.data.train == "t.jsonl" and config.data.eval == SourceConfig(source="e")
    with pytest.raises(ValueError, match=r"set train_file or data.train/data.mix, not both"):
        build_config(SFTConfig, {"model": "m", "output_dir": "o", "train_file": "t.jsonl", "data": {"train": "u"}})
    from shardforge.algorithms.trainers.rm import RMConfig

    config = build_config(RMConfig, {"model": "m", "output_dir": "o", "train_file": "t.jsonl", "data": {"eval": "e"}})
    assert config.data.eval == "e"  # every trainer reads data: sources now
    with pytest.raises(ValueError, match=r"rm does not use data.chat_template"):
        build_config(RMConfig, {"model": "m", "output_dir": "o", "train_file": "t", "data": {"chat_template": "x"}})


# ------------------------------------------------------------------------------------------ chat templates
USER_EQ = "{% for m in messages %}{% if m['role'] == 'user' %}?{{ m['content'] }}={% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
USER_STAR = USER_EQ.replace("?{{ m['content'] }}=", "*{{ m['content'] }} ")


def test_chat_rows_use_the_tokenizer_template_unless_overridden(tmp_path):
    tokenizer = build_char_tokenizer(tmp_path / "tok")
    tokenizer.chat_template = USER_EQ
    path = _write_jsonl(
        tmp_path / "chat.jsonl",
        [{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}],
    )
    text = lambda ex: tokenizer.decode(ex.input_ids)  # noqa: E731
    assert text(load_sft_examples(path, tokenizer)[0]) == "?1+1=2<eos>"  # the tokenizer's own template
    apply_chat_template_override(tokenizer, USER_STAR)  # inline Jinja
    assert text(load_sft_examples(path, tokenizer)[0]) == "*1+1 2<eos>"
    (tmp_path / "t.jinja").write_text(USER_EQ)
    apply_chat_template_override(tokenizer, str(tmp_path / "t.jinja"))  # a file
    assert text(load_sft_examples(path, tokenizer)[0]) == "?1+1=2<eos>"
    with pytest.raises(FileNotFoundError, match=r"data.chat_template='nope.jinja' is neither a Jinja template"):
        apply_chat_template_override(tokenizer, "nope.jinja")
