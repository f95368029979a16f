"""Hugging Face interop: the mapping between our model and transformers' Llama (mapping.py)."""
