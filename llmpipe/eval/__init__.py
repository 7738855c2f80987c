"""Measuring quality: sliding-window perplexity on a text that ships with llmpipe."""
