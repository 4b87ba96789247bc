"""``kvtiers serve``: one KV pool per node, shared by its engines (docs/service.md).

Modules: :mod:`~kvtiers.service.pool` (the shared-memory pool and its checked slot
headers), :mod:`~kvtiers.service.protocol` (msgspec messages; the ``service`` extra),
:mod:`~kvtiers.service.server` (the service's loop), :mod:`~kvtiers.service.client` and
:mod:`~kvtiers.service.tier` (an engine's ``kind: service`` primary). Nothing here is
imported by ``import kvtiers``.
"""
