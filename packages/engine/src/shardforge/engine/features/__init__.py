"""Engine features wired into the build and the step: MoE, LoRA, offloading between calls."""
