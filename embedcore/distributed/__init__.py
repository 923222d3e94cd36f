"""Tables sharded by rows (dynamic tables: by a hash of the key) over MPI processes (optional extra
``embedcore[mpi]``)."""

from .dynamic import key_owners, rank_capacity
from .engine import ShardedEmbedding, ShardedLookupContext
from .exchange import DistributedError
from .sharding import Shard, rotation, shard_of

__all__ = ["ShardedEmbedding", "ShardedLookupContext", "DistributedError", "Shard", "rotation", "shard_of",
           "key_owners", "rank_capacity"]
