"""``python -m shardforge.algorithms.cli ...`` = the ``shardforge`` command (and each rank torchrun starts)."""

import atexit
import logging
import os
import sys

from shardforge.algorithms.cli.main import main

code = main()
if "TORCHELASTIC_RUN_ID" in os.environ:
    # A rank under torchrun's agent: the run is over (process group destroyed, checkpoints committed, loggers
    # closed, exit code decided). Leave without the C++ static destructors: a native thread still joinable at
    # that point (seen as "terminate called without an active exception" after a finished run) aborts the
    # process, and the agent then reports a finished run as failed (SIGABRT here, SIGTERM for its peers).
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
