"""Offline tools over a persistent store: ``kvtiers inspect | verify | gc``."""
