"""Operator fission: regions of the graph run in parts along a dimension, found by search."""
