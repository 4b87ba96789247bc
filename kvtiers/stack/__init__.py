"""Tier stacks: the composite manager and the YAML → stack builder."""
