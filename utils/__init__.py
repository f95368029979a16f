"""Shared library code for the pipeline stages. Importing it has no side effects."""
