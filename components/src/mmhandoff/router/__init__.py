"""Picks the decode replica (router)."""
