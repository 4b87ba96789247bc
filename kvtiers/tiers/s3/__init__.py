"""The ``s3`` tier: the shared object-tier manager and mover over an S3 bucket (boto3).

Nothing heavy is imported here; boto3 and moto load with :mod:`kvtiers.tiers.s3.store`,
:mod:`kvtiers.tiers.s3.embedded` and the factory, when a stack builds the tier."""
