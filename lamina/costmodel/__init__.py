"""lamina.costmodel."""
