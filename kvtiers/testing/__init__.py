"""The test kit kvtiers ships, for its own tests and for anyone writing a tier or a store.

- :mod:`~kvtiers.testing.conformance`: the ``OffloadingManager`` contract as tests.
- :mod:`~kvtiers.testing.objects`: the ``ObjectStore`` contract as tests, the object-tier
  helpers of the manager suite, a small cache identity.
- :mod:`~kvtiers.testing.driver`: :class:`TierDriver`, stores and loads through a built
  lower tier the way the composite does.
- :mod:`~kvtiers.testing.doubles`, :mod:`~kvtiers.testing.memory_tier`: test doubles and
  the in-memory tier.
- :mod:`~kvtiers.testing.s3`: moto servers (an address; one in a process of its own) and a
  botocore fault injector.
- :mod:`~kvtiers.testing.seaweed`: SeaweedFS as a second, real S3 server (one process or
  a small cluster).
- :mod:`~kvtiers.testing.crash`: the file tier's kill-and-restart harness.
- :mod:`~kvtiers.testing.models`: random-weight Llama models with a word-level tokenizer.
- :mod:`~kvtiers.testing.serve`: a real ``vllm serve`` process (route 1 or none) and a
  Prometheus scrape.

Modules here import pytest and the tiers they test; ``import kvtiers`` never imports them.
"""
