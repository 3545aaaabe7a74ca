"""The episode runtime: the request queue that batches a round of episodes' generate and reward calls, and the token-in/token-out `Trajectory`."""
