"""The ``shardforge`` command: `main` (subcommands), its preflight checks and the dry run.

``python -m shardforge.algorithms.cli`` runs `main` (how the launchers start each rank).
"""
