"""A stand-in for an OpenAI-compatible vLLM rollout server, to kill, hang and restart in tests.

``python rollout_server_stub.py --port P [--vocab-size V] [--die-once FILE [--die-after K]]`` serves on 127.0.0.1:P the routes
`VLLMServerRolloutEngine` uses. Completions are deterministic in (prompt, seed, weight version),
so a resent request returns what the first one would have. With ``--die-once FILE``, the first
completion request after the first K that finds FILE deletes it and kills the process mid-request (SIGKILL-like
``os._exit``): a rollout server that dies with requests in flight. ``GET /stub/state`` returns
``{"pid": ..., "version": ..., "calls": [every POST path, with its query]}``. With ``--enable-sleep-mode`` it
emulates vLLM's sleep mode: ``/sleep`` puts weights and KV cache to sleep, ``/wake_up?tags=...`` wakes them; a
weight update into sleeping weights, or a completion while anything sleeps, fails (HTTP 500); without the flag
``/sleep`` fails (HTTP 400), as vLLM without ``--enable-sleep-mode``. Each start prints one line ``stub server PID listening on port P``
(the engine appends it to the server's log: the tests count restarts there).
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
                         "calls": [], "sleep_mode": False, "asleep": set()}  # fmt: skip


def completion(body: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(f"{body['prompt']}|{body['seed']}|{STATE['version']}")
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
            self.reply({"pid": os.getpid(), "version": STATE["version"], "calls": STATE["calls"]})
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
        elif self.path == "/update_weights":
            STATE["version"] = int(body["update_info"]["version"])
            self.reply({})
        else:  # weight-transfer init, start/finish update, prefix-cache reset
            self.reply({})

    def reply(self, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(200)
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
    parser.add_argument("--enable-sleep-mode", action="store_true")
    args, _ = parser.parse_known_args()  # the vLLM flags the engine passes are ignored
    STATE["die_once"], STATE["die_after"], STATE["vocab_size"] = args.die_once, args.die_after, args.vocab_size
    STATE["sleep_mode"] = args.enable_sleep_mode
    ThreadingHTTPServer.allow_reuse_address = True  # a restart binds the same port at once
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"stub server {os.getpid()} listening on port {args.port}", flush=True)  # one line per start (in its log)
    server.serve_forever()


if __name__ == "__main__":
    main()
