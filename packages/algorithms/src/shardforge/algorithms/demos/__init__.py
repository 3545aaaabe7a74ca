"""The demos (`shardforge demo`, `shardforge demo-rl`) and their YAML configs."""
