"""Tables sharded by rows over MPI processes (optional extra ``embedcore[mpi]``)."""

from .engine import ShardedEmbedding
from .exchange import DistributedError
from .sharding import Shard, rotation, shard_of

__all__ = ["ShardedEmbedding", "DistributedError", "Shard", "rotation", "shard_of"]
