"""Test aids for code that talks to a rollout server: `STUB_SERVER`, a stand-in for ``vllm serve`` (the OpenAI
completions API, weight updates from disk or over weight-sync's collective transport, sleep mode, scripted
deaths) that starts in a fraction of a second. Run it as ``python STUB_SERVER --port P ...`` (see its ``--help``)."""

from pathlib import Path

__all__ = ["STUB_SERVER"]

STUB_SERVER = Path(__file__).with_name("stub_server.py")
"""The stub server's script."""
