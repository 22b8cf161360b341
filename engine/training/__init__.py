"""Trainer for the embedded default model (reuses engine.models.qwen35 layers)."""
