"""Physical tables: the storage of stacked tables and the one lookup and update every engine runs.

:class:`PhysicalTable` (:mod:`.physical`) owns a :class:`Storage` (:mod:`.storage`; :class:`DenseStorage`:
float32 rows and slots), its scratch, kernel, grouping and prefetch policies; :func:`physical_tables`
(:mod:`.factory`) makes them from the engine's tables by the stacking rule. A dynamic (hash-keyed) table is a
:class:`DynamicTable` (:mod:`.dynamic`: a key map over row slots, with the admission and eviction of
:mod:`.policies`); dynamic tables stack into a :class:`DynamicPhysicalTable` (:mod:`.dynamic_physical`).
"""

from .dynamic import DynamicTable, DynamicTableView
from .dynamic_physical import DynamicPhysicalTable
from .factory import physical_tables, read_only_tables, stack
from .physical import NOTHING_FLAGGED, PhysicalTable, TablePlace, TableUpdate
from .storage import DenseStorage, Storage

__all__ = ["PhysicalTable", "TablePlace", "TableUpdate", "NOTHING_FLAGGED", "Storage", "DenseStorage",
           "DynamicTable", "DynamicPhysicalTable", "DynamicTableView", "physical_tables", "read_only_tables", "stack"]
