"""A stand-in for an OpenAI-compatible vLLM rollout server, to kill, hang and restart in tests.

``python rollout_server_stub.py --port P [--vocab-size V] [--die-once FILE [--die-after K]]`` serves on 127.0.0.1:P the routes
`VLLMServerRolloutEngine` uses. Completions are deterministic in (prompt, seed, weight version),
so a resent request returns what the first one would have. With ``--die-once FILE``, the first
completion request after the first K that finds FILE deletes it and kills the process mid-request (SIGKILL-like
``os._exit``): a rollout server that dies with requests in flight. ``GET /stub/state`` returns
``{"pid": ..., "version": ..., "calls": [every POST path, with its query], "received": [...], "checksums": {...}}``.
With ``--enable-sleep-mode`` it emulates vLLM's sleep mode: ``/sleep`` puts weights and KV cache to sleep,
``/wake_up?tags=...`` wakes them; a weight update into sleeping weights, or a completion while anything sleeps, fails
(HTTP 500); without the flag ``/sleep`` fails (HTTP 400), as vLLM without ``--enable-sleep-mode``. Each start prints
one line ``stub server PID listening on port P`` (the engine appends it to the server's log: the tests count restarts
there).

``rollout.vllm.weight_transport: collective``: ``/init_weight_transfer_engine`` with ``transport="collective"`` joins the
trainer's weight group as vLLM's workers do (weight-sync's `CollectiveReceiver`, torch imported then), and each
``/update_weights`` receives one version, checks it against its manifest (every tensor, shapes, dtypes, crc32: what
weight-sync's vLLM backend checks) and keeps it: ``checksums`` are the received tensors' crc32, ``received`` the
versions in order. ``--update-delay S``: answer ``/update_weights`` S seconds after the version arrived (a slow load);
``--weights``: import torch before serving (a fast ``/init_weight_transfer_engine``); ``--die-in-transfer FILE``: the first transfer that finds FILE deletes it and exits after the first bucket;
``--corrupt-once FILE``: the first version that finds FILE deletes it and gets a bit flipped before the check (the
server refuses it with HTTP 500).
``--completion-delay S``: answer each completion S seconds after it arrived (requests overlap); a completion
whose weight version changed while it was in flight counts in ``switched_under_requests`` of ``/stub/state`` (what
a version switch under another rank's requests would do to a real server's samples).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 64
STATE: dict[str, Any] = {"version": 0, "die_once": None, "die_after": 0, "completions": 0, "vocab_size": 50,
                         "calls": [], "sleep_mode": False, "asleep": set(),
                         "receiver": None, "received": [], "checksums": {}, "args": None,
                         "switched_under_requests": 0}  # fmt: skip


class ManifestChecked:
    """A weight-sync receiver that checks a version against its manifest and keeps the tensors' checksums."""

    def __init__(self) -> None:
        self.version = 0

    def apply(self, manifest: Any, tensors: Any) -> None:
        import torch

        from shardforge.weight_sync import WeightVersionError
        from shardforge.weight_sync.manifest import checksum_matches, tensor_checksum

        if manifest.version <= self.version:  # as vLLM's backend: stale versions are refused
            raise WeightVersionError(f"version {manifest.version} is not newer than {self.version}")
        staged = dict(tensors)
        marker = STATE["args"].corrupt_once
        if marker is not None and marker.exists():
            marker.unlink()
            name = sorted(staged)[0]
            staged[name] = staged[name].clone()
            staged[name].view(-1)[:1].view(torch.uint8)[0] ^= 1
        for info in manifest.tensors:
            tensor = staged.get(info.name)
            if tensor is None or list(tensor.shape) != list(info.shape) or str(tensor.dtype) != info.dtype:
                raise WeightVersionError(f"version {manifest.version}: {info.name} is missing or misshapen")
            if not checksum_matches(tensor, info.checksum):
                raise WeightVersionError(f"version {manifest.version}: checksum mismatch for {info.name}")
        STATE["checksums"] = {name: tensor_checksum(tensor) for name, tensor in staged.items()}
        self.version = manifest.version


def init_collective(info: dict[str, Any]) -> None:
    from shardforge.weight_sync import CollectiveReceiver

    stand_in: Any = ManifestChecked()  # the receiver's two methods, checked against the manifest
    receiver = CollectiveReceiver(stand_in, info["host"], info["port"], info["rank_offset"], info["world_size"],
                                  timeout_s=info["timeout_s"])  # fmt: skip
    receiver.connect()  # blocks until the trainer's rank 0 joins too
    STATE["receiver"] = receiver


def receive(version: int) -> None:
    args = STATE["args"]

    def on_bucket(index: int) -> None:
        if args.die_in_transfer is not None and args.die_in_transfer.exists():
            args.die_in_transfer.unlink()
            os._exit(1)

    received = STATE["receiver"].receive_version(on_bucket)
    if received != version:
        raise RuntimeError(f"announced version {version}, received {received}")
    time.sleep(args.update_delay)
    STATE["version"] = version
    STATE["received"].append(version)


def completion(body: dict[str, Any]) -> dict[str, Any]:
    version = STATE["version"]
    delay = STATE["args"].completion_delay if STATE["args"] is not None else 0.0
    if delay:
        time.sleep(delay)
        if STATE["version"] != version:  # the weights changed under this request
            STATE["switched_under_requests"] += 1
    rng = random.Random(f"{body['prompt']}|{body['seed']}|{version}")
    choices = []
    for index in range(body["n"]):
        tokens = [rng.randrange(3, STATE["vocab_size"]) for _ in range(body["max_tokens"])]
        choices.append({"index": index, "token_ids": tokens, "finish_reason": "length",
                        "logprobs": {"token_logprobs": [-1.0] * len(tokens)}})  # fmt: skip
    return {"choices": choices}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/health":
            self.reply({})
        elif self.path == "/v1/models":
            self.reply({"data": [{"id": "policy", "max_model_len": MAX_MODEL_LEN}]})
        elif self.path == "/stub/state":
            self.reply({"pid": os.getpid(), "version": STATE["version"], "calls": STATE["calls"],
                        "received": STATE["received"], "checksums": STATE["checksums"],
                        "switched_under_requests": STATE["switched_under_requests"]})  # fmt: skip
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        STATE["calls"].append(self.path)
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        if url.path == "/sleep":
            if not STATE["sleep_mode"]:
                return self.send_error(400, "sleep mode is not enabled (--enable-sleep-mode)")
            STATE["asleep"] = {"weights", "kv_cache"}
            return self.reply({})
        if url.path == "/wake_up":
            STATE["asleep"] -= set(query.get("tags", ["weights", "kv_cache"]))
            return self.reply({})
        if STATE["asleep"] and url.path in ("/v1/completions", "/update_weights"):
            if url.path == "/v1/completions" or "weights" in STATE["asleep"]:
                return self.send_error(500, f"asleep: {sorted(STATE['asleep'])}")
        if self.path == "/v1/completions":
            marker = STATE["die_once"]
            STATE["completions"] += 1
            if marker is not None and STATE["completions"] > STATE["die_after"] and marker.exists():
                marker.unlink()
                time.sleep(0.2)  # let the other requests of the batch arrive too
                os._exit(1)
            self.reply(completion(body))
        elif self.path == "/update_weights" and STATE["receiver"] is not None:
            try:
                receive(int(body["update_info"]["version"]))
            except Exception as exc:  # as vLLM: the worker's error in an HTTP 500
                self.reply({"error": f"{type(exc).__name__}: {exc}"}, status=500)
                return
            self.reply({})
        elif self.path == "/update_weights":
            STATE["version"] = int(body["update_info"]["version"])
            self.reply({})
        elif self.path == "/init_weight_transfer_engine" and body["init_info"]["transport"] == "collective":
            init_collective(body["init_info"])
            self.reply({})
        else:  # weight-transfer init, start/finish update, prefix-cache reset
            self.reply({})

    def reply(self, answer: dict[str, Any], status: int = 200) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--die-once", type=Path, default=None)
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=50)
    parser.add_argument("--update-delay", type=float, default=0.0)
    parser.add_argument("--die-in-transfer", type=Path, default=None)
    parser.add_argument("--corrupt-once", type=Path, default=None)
    parser.add_argument("--weights", action="store_true")
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--completion-delay", type=float, default=0.0)
    args, _ = parser.parse_known_args()  # the vLLM flags the engine passes are ignored
    STATE["args"] = args
    STATE["sleep_mode"] = args.enable_sleep_mode
    if args.weights:  # the trainer sends weights over the collective transport: import torch before serving
        import shardforge.weight_sync  # noqa: F401
    STATE["die_once"], STATE["die_after"], STATE["vocab_size"] = args.die_once, args.die_after, args.vocab_size
    ThreadingHTTPServer.allow_reuse_address = True  # a restart binds the same port at once
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"stub server {os.getpid()} listening on port {args.port}", flush=True)  # one line per start (in its log)
    server.serve_forever()


if __name__ == "__main__":
    main()
