"""LoRA adapters served over one base model (docs/lora.md)."""
