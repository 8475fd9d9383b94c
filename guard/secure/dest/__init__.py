"""Destinations of secured checkpoints: one ``Store`` protocol (``base``), one module per store."""
