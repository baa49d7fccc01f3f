"""Import lamina before anything loads torch, so the test processes get Lamina's OpenMP wait
policy like a user's (lamina/omp.py)."""
import lamina  # noqa: F401
