"""The embedded HF ``generate`` engine: KV reuse across turns, shared prefill of a group's prompt, per-row sampling."""
