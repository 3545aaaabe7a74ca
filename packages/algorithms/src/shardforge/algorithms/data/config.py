"""The ``data:`` config section: named sources, weighted mixtures and a chat-template override.

    data:
      train: {source: me/gsm8k-mini, subset: main, split: train, columns: {prompt: question, completion: answer}}
      eval: data/eval.jsonl
      mix:                                  # instead of train: a weighted mixture
        - {source: data/math.jsonl, weight: 0.7}
        - {source: data/chat_ds, split: train, weight: 0.3}
      chat_template: templates/chatml.jinja  # or an inline Jinja string

``train_file``/``eval_file`` (plain paths) keep working and mean ``data.train``/``data.eval``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardforge.algorithms.data.mixture import check_weights
from shardforge.algorithms.data.sources import SourceConfig, as_source

__all__ = [
    "DataConfig",
    "apply_chat_template_override",
    "check_data_fields",
    "eval_source",
    "labelled_sources",
    "refuse_chat_template",
    "required_train_file",
    "train_sources",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Where the rows come from; see the module docstring for the YAML shape."""

    train: str | SourceConfig | None = None
    """The training source (a path string or a source mapping); or set train_file, or mix."""
    eval: str | SourceConfig | None = None
    """Held-out source for periodic evaluation (or eval_file)."""
    mix: tuple[SourceConfig, ...] = ()
    """Weighted training mixture (instead of train): sources are interleaved by weight, deterministically
    (seeded by ``seed``), and each source's position is saved with the checkpoint."""
    chat_template: str | None = None
    """Override the tokenizer's own chat template for ``messages`` rows: a Jinja string or a path to a
    file holding one. None = the tokenizer's template (as HF ``apply_chat_template`` uses it)."""

    def __post_init__(self) -> None:
        if self.train is not None and self.mix:
            raise ValueError("set data.train or data.mix, not both (a single source is a mix of one)")
        if self.mix:
            labels = [s.label for s in self.mix]
            if len(set(labels)) != len(labels):
                raise ValueError(
                    f"data.mix has repeated sources {labels}; give each a distinct name: (e.g. name: math_a)"
                )
            check_weights([s.weight for s in self.mix], labels)

    @property
    def is_set(self) -> bool:
        return self.train is not None or self.eval is not None or bool(self.mix)


def train_sources(config: Any) -> list[SourceConfig]:
    """The training sources of a trainer config: ``data.mix``, else ``data.train``, else ``train_file``."""
    data: DataConfig = config.data
    if data.mix:
        return list(data.mix)
    value = data.train if data.train is not None else config.train_file
    return [as_source(value)] if value is not None else []


def labelled_sources(config: Any) -> list[tuple[str, SourceConfig]]:
    """Every source of a trainer config with the key that set it (``train_file``, ``data.train``,
    ``data.mix[i]``, ``eval_file``, ``data.eval``), for the pre-launch checks and the dry run."""
    data: DataConfig | None = getattr(config, "data", None)
    out: list[tuple[str, SourceConfig]] = []
    if data is not None and data.mix:
        out += [(f"data.mix[{i}]", s) for i, s in enumerate(data.mix)]
    elif data is not None and data.train is not None:
        out.append(("data.train", as_source(data.train)))
    elif getattr(config, "train_file", None) is not None:
        out.append(("train_file", as_source(config.train_file)))
    if data is not None and data.eval is not None:
        out.append(("data.eval", as_source(data.eval)))
    elif getattr(config, "eval_file", None) is not None:
        out.append(("eval_file", as_source(config.eval_file)))
    return out


def eval_source(config: Any) -> SourceConfig | None:
    """The held-out source: ``data.eval``, else ``eval_file`` (None when neither is set)."""
    value = config.data.eval if config.data.eval is not None else config.eval_file
    return as_source(value) if value is not None else None


def apply_chat_template_override(tokenizer: Any, chat_template: str | None) -> None:
    """Set ``tokenizer.chat_template`` from a Jinja string or a file path (None: keep the tokenizer's own)."""
    if chat_template is None:
        return
    looks_like_path = "{" not in chat_template and "\n" not in chat_template
    if looks_like_path:
        path = Path(chat_template)
        if not path.is_file():
            raise FileNotFoundError(
                f"data.chat_template={chat_template!r} is neither a Jinja template (no '{{' in it) nor an existing "
                "file; give the template inline or the path of a .jinja file"
            )
        chat_template = path.read_text(encoding="utf-8")
    tokenizer.chat_template = chat_template


def check_data_fields(config: Any, trainer: str, reads_data_sources: bool) -> None:
    """A trainer config's data fields agree: one training source, and ``data`` only where it is read."""
    data: DataConfig = config.data
    if not reads_data_sources:
        if data.is_set or data.chat_template is not None:
            raise ValueError(
                f"{trainer} reads train_file/eval_file only (data.train/eval/mix/chat_template are read by sft, rm, dpo, grpo, ppo, distill); "
                "set train_file: <path.jsonl> instead"
            )
        if config.train_file is None:
            raise ValueError(f"missing required config key train_file in {trainer}")
        return
    if config.train_file is not None and (data.train is not None or data.mix):
        raise ValueError("set train_file or data.train/data.mix, not both (train_file is data.train for one path)")
    if config.eval_file is not None and data.eval is not None:
        raise ValueError("set eval_file or data.eval, not both")
    if config.train_file is None and data.train is None and not data.mix:
        raise ValueError(
            f"{trainer} needs training data: set train_file: <path.jsonl>, data.train: <source> or data.mix: [...]"
        )


def refuse_chat_template(config: Any, trainer: str) -> None:
    """Preference rows are plain text: a ``data.chat_template`` there would be silently unused."""
    if config.data.chat_template is not None:
        raise ValueError(
            f"{trainer} does not use data.chat_template: its rows are plain prompt/chosen/rejected text, tokenised "
            "as they are (no messages); remove data.chat_template or apply the template to the rows beforehand"
        )


def required_train_file(config: Any) -> str:
    """``train_file`` of a trainer that reads only it (its config's checks guarantee it is set)."""
    if config.train_file is None:
        raise ValueError(f"missing required config key train_file in {type(config).__name__}")
    return str(config.train_file)
