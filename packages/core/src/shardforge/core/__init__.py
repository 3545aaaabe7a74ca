"""shardforge.core: the torch-free pieces every shardforge package shares (no dependencies).

- `Registry`, `import_path`, `all_registries`: names -> functions/classes, a user's by import path;
- `get_logger`, `setup_logging`, `rank_log_file`, `RankZeroFilter`: the ``shardforge`` logger;
- `shardforge.core.hooks`: hook points production code fires and tests fill.
"""

from shardforge.core.log import RankZeroFilter, get_logger, rank_log_file, setup_logging
from shardforge.core.registry import Registry, all_registries, import_path

__version__ = "0.1.0"

__all__ = [
    "RankZeroFilter",
    "Registry",
    "all_registries",
    "get_logger",
    "import_path",
    "rank_log_file",
    "setup_logging",
]
