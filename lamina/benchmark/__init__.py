"""lamina.benchmark."""
