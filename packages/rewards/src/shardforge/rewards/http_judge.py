"""A remote reward over HTTP: an LLM judge behind an OpenAI-compatible server, or a plain JSON reward service.

``api: openai`` (default) POSTs ``{url}/chat/completions`` with the filled-in ``template`` as the
user message (temperature 0) and reads the score from the reply with ``score_pattern`` (the last
match; its first group), times ``scale``. ``api: json`` POSTs ``{"prompt", "response",
"reference"}`` to ``url`` and reads ``{"reward": x}``.

Connection errors, timeouts, 429 and 5xx answers are retried ``max_retries`` times with exponential
backoff (``backoff_s * 2**attempt``); other 4xx answers and unparseable replies fail at once. A
failure raises, so the reward runner (`GuardedReward`, the ``reward:`` key) scores it 0.0 and counts
it, or stops the step under ``on_error: raise``. Counters: ``requests``, ``retries``, ``unparseable``.
Standard library only (urllib): no extra dependency.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Literal

__all__ = ["DEFAULT_JUDGE_TEMPLATE", "HTTPJudgeReward", "JudgeReplyError"]

DEFAULT_JUDGE_TEMPLATE = (
    "You grade answers. Question:\n{prompt}\n\nReference answer:\n{reference}\n\nCandidate answer:\n{response}\n\n"
    "Reply with 'Score: 1' if the candidate answer is correct, else 'Score: 0'."
)
"""``{prompt}``, ``{response}`` and ``{reference}`` are replaced (other braces are left alone)."""

_RETRIABLE_STATUS = {408, 429, 500, 502, 503, 504}


class JudgeReplyError(ValueError):
    """The judge answered, but no score could be read from the answer."""


class HTTPJudgeReward:
    """``fn(prompt, response, reference) -> float`` backed by an HTTP judge (see the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        api: Literal["openai", "json"] = "openai",
        model: str = "judge",
        template: str = DEFAULT_JUDGE_TEMPLATE,
        score_pattern: str = r"(-?\d+(?:\.\d+)?)",
        scale: float = 1.0,
        max_tokens: int = 64,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float = 20.0,
        api_key_env: str | None = None,
    ) -> None:
        if api not in ("openai", "json"):
            raise ValueError(f"http_judge api={api!r} is not one of ['openai', 'json']")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"http_judge url={url!r} must start with http:// or https://")
        if max_retries < 0 or backoff_s < 0 or request_timeout_s <= 0:
            raise ValueError(
                f"http_judge needs max_retries >= 0, backoff_s >= 0, request_timeout_s > 0 "
                f"(got {max_retries}, {backoff_s}, {request_timeout_s})"
            )
        try:
            self.pattern = re.compile(score_pattern)
        except re.error as exc:
            raise ValueError(f"http_judge score_pattern={score_pattern!r} is not a regular expression: {exc}") from exc
        if self.pattern.groups < 1:
            raise ValueError(f"http_judge score_pattern={score_pattern!r} needs one group around the number")
        self.url, self.api, self.model, self.template = url.rstrip("/"), api, model, template
        self.scale, self.max_tokens = scale, max_tokens
        self.max_retries, self.backoff_s, self.request_timeout_s = max_retries, backoff_s, request_timeout_s
        self.api_key = os.environ.get(api_key_env) if api_key_env else None
        if api_key_env and not self.api_key:
            raise ValueError(f"http_judge api_key_env={api_key_env!r} is not set in the environment")
        self.__name__ = f"http_judge({self.url})"
        self._lock = threading.Lock()
        self._counts = {"requests": 0, "retries": 0, "unparseable": 0}

    def __call__(self, prompt: str, response: str, reference: str) -> float:
        if self.api == "json":
            reply = self._post(self.url, {"prompt": prompt, "response": response, "reference": reference})
            try:
                return float(reply["reward"]) * self.scale
            except (KeyError, TypeError, ValueError) as exc:
                self._count("unparseable")
                raise JudgeReplyError(f"{self.url} answered {reply!r}; expected {{'reward': <number>}}") from exc
        content = _fill(self.template, prompt=prompt, response=response, reference=reference)
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "temperature": 0.0,
            "max_tokens": self.max_tokens,
        }
        reply = self._post(f"{self.url}/chat/completions", body)
        try:
            text = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            self._count("unparseable")
            raise JudgeReplyError(f"{self.url} answered {str(reply)[:200]!r}, not a chat completion") from exc
        matches = self.pattern.findall(text or "")
        if not matches:
            self._count("unparseable")
            raise JudgeReplyError(f"no score matching {self.pattern.pattern!r} in the judge's reply {text!r}")
        last = matches[-1]
        return float(last[0] if isinstance(last, tuple) else last) * self.scale

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.max_retries + 1):
            self._count("requests")
            request = urllib.request.Request(url, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout_s) as answer:
                    return json.loads(answer.read().decode())
            except urllib.error.HTTPError as exc:
                if exc.code not in _RETRIABLE_STATUS or attempt == self.max_retries:
                    detail = exc.read().decode(errors="replace")[:200]
                    raise RuntimeError(
                        f"{url} answered HTTP {exc.code} ({detail!r}) after {attempt + 1} tries"
                    ) from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                if attempt == self.max_retries:
                    raise RuntimeError(f"{url} unreachable after {attempt + 1} tries: {exc}") from exc
            self._count("retries")
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _count(self, key: str) -> None:
        with self._lock:
            self._counts[key] += 1

    def pop_stats(self) -> dict[str, float]:
        """``requests``, ``retries``, ``unparseable`` since the last call."""
        with self._lock:
            counts, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return {k: float(v) for k, v in counts.items()}


def _fill(template: str, **values: str) -> str:
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template
