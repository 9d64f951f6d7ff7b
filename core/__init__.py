"""The lowest layer: what the rungs (tiers/) and the harness (harness/) share.

Layers import one way: core <- tiers <- harness (tests/test_layers.py checks it). Nothing here imports tiers or
harness; docs/architecture.md shows the layers and the path of one cell."""
