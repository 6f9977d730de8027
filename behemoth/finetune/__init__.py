"""Parameter-efficient fine-tuning: LoRA adapters on a frozen base, saved and read in PEFT's layout, merged on export."""
