"""The checkpoint directory format: writing (io), reading (read), verification (verify), asynchronous
saves (async_save), sharded DCP save/load (dcp) and its safe reading (dcp_safe)."""
