"""LoRA adapters that compose with FSDP2 and tensor parallel."""

__all__: list[str] = []
