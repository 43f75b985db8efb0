"""Multimodal inputs: media loading, vision preprocessing, M-RoPE positions."""
