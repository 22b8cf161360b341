"""Storage: GGUF files read and written, tensors kept in their ggml block formats, file pages. No arithmetic
beyond unpacking blocks: products are engine.ops' business."""
