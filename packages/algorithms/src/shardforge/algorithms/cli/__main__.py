"""``python -m shardforge.algorithms.cli ...`` = the ``shardforge`` command."""

import sys

from shardforge.algorithms.cli.main import main

sys.exit(main())
