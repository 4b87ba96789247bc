"""The ``fsspec`` tier: the shared object-tier manager and mover over any fsspec URL.

Nothing heavy is imported here; fsspec loads with :mod:`kvtiers.tiers.fsspec.store`."""
