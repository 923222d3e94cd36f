"""Tables sharded by rows over MPI processes (optional extra ``embedcore[mpi]``)."""

from .engine import ShardedEmbedding, ShardedLookupContext
from .exchange import DistributedError
from .sharding import Shard, rotation, shard_of

__all__ = ["ShardedEmbedding", "ShardedLookupContext", "DistributedError", "Shard", "rotation", "shard_of"]
