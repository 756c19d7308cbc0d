"""Adapters to inference frameworks (optional extras): ``integrations.transformers``."""
