"""The KV pool's bookkeeping: blocks, block tables, prefix cache (block_manager) and the pool's
size (budget). Below both the engine and the proposers that keep their own draft caches."""
