"""Rematerialization: which activations a plan drops and recomputes, and the order it runs in."""
