"""This process's place in a tensor-parallel group, and the collectives the layers and the runner use."""
