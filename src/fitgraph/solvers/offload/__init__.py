"""Offloading to host memory with prefetch: where the copies go, and offloading weighed against remat."""
