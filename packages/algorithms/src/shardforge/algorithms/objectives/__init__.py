"""Pure tensor math of the training objectives (SFT, RL losses, advantages, KL, rewards)."""
