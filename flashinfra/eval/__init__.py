"""Accuracy measurements through the engine's model path (perplexity on text)."""
