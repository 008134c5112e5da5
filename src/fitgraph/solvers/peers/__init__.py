"""What the systems fitgraph succeeds plan (DTR, Rotor/Rockmate's chain, per-block checkpointing): baselines."""
