"""Ray rollout actors (embedded HF engine, vLLM server), the actor pool and their placement. Ray is imported only where an actor is built (extra ``[ray]``)."""
