"""Rollout servers: health checks and counters, HTTP helpers, restarts agreed across ranks."""
