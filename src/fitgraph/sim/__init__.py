"""The simulator (no torch): peak bytes, memory timeline and latency of a Plan."""

from .simulate import SimResult, Simulator, TensorAtPeak, simulate

__all__ = ["SimResult", "Simulator", "TensorAtPeak", "simulate"]
