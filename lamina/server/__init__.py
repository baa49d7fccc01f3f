"""lamina.server."""
