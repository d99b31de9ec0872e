"""Linen building blocks of the Llama-family decoder, one concept per module."""
