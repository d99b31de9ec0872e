"""A MaxText-style JAX pretraining stack: exact vocabulary tiling and layer-wise remat."""
