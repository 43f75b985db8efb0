"""This process's place among the tensor- and pipeline-parallel ranks, and the collectives and sends the layers
and the runner use."""
