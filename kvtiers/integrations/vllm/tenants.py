"""Route 1's tenants: what a ``tenants:`` section changes in :class:`KVTiersManager`.

With a ``tenants:`` section the manager drives the stack's
:class:`~kvtiers.stack.tenants.TenantStack` instead of its composite, so every key vLLM
names is scoped by the request's tenant before a tier sees it, and stores and promotions
keep that tenant's quotas (docs/tenants.md). What that takes of the manager:

* Every request call (lookup, loads, stores, touches, request start and end) goes to the
  tenant layer with vLLM's keys translated to kvtiers' as before; the layer scopes them
  and answers with the keys it was given, so what vLLM is told to store, load and skip is
  in its own keys. The found keys kept against eviction (``ctx.keep``) are scoped by the
  composite's lookup itself, so a tenant's store never evicts what its lookups found.
* The spec of stored or loaded keys is the tenant layer's ``get_spec`` (the primary's
  addressing of the scoped keys), not the primary's own, which knows only scoped keys.
* ``promotion_source`` is the tenant layer's, which asks for the scoped key.
* The one-tier direct manager is never picked (its calls skip the tenant layer): see
  :func:`~kvtiers.integrations.vllm.direct.direct_eligible`.
* The tenant is the one ``kv_transfer_params`` names (or the default): vLLM's offloading
  request context carries no ``cache_salt`` (0.32 to 0.34), so a section whose tenants
  list ``salts`` warns once that they select no one here. A salted request still gets
  vLLM's own isolation (its salt enters every block hash); it is counted as the default
  tenant's, or as the tenant its ``kv_transfer_params`` names.
* Removed and stored events of a non-default tenant carry its scoped keys, which vLLM has
  never seen (docs/tenants.md: prefix-aware routing works for the default tenant only).

* A sharded engine (tensor or pipeline parallel ranks sharing the primary, a cpu tier or
  the node service's pool) checks each stored chunk's slot in the shard ledger by the
  scoped key the tenant layer handed the primary
  (:meth:`~kvtiers.stack.tenants.TenantStack.scoped_keys`): every rank's shard of a
  tenant's chunk is checked in that tenant's slot, for that tenant's store, and a chunk a
  rank failed to write is published for no tenant.
"""

from __future__ import annotations

import logging

from kvtiers.stack.builder import Stack
from kvtiers.stack.tenants import TenantStack

logger = logging.getLogger(__name__)


def route1_tenants(stack: Stack) -> TenantStack | None:
    """The tenant layer a route-1 manager over ``stack`` drives instead of the composite
    (see the module docstring), or ``None`` without a ``tenants:`` section."""
    tenants = stack.tenants
    if tenants is None:
        return None
    salted = [member.name for member in tenants.keys.config.members if member.salts]
    if salted:
        logger.warning(
            "kvtiers: tenants %s are selected by cache_salt, which vLLM does not hand its "
            "offloading manager: under vLLM only kv_transfer_params[%r] names a tenant",
            ", ".join(salted),
            tenants.keys.config.param,
        )
    return tenants
