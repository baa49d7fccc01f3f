"""lamina.engine."""
