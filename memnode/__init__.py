"""Memory node: KV pool, slab allocator and the memory-node service logic."""
from lamina.memnode.allocator import OutOfSlots, SlabAllocator, SlotError
from lamina.memnode.kv_pool import KVPool, available_memory
from lamina.memnode.node import MemoryNode, RequestBusy, UnknownRequest, UnknownStep

__all__ = ["SlabAllocator", "OutOfSlots", "SlotError", "KVPool", "available_memory",
           "MemoryNode", "UnknownRequest", "UnknownStep", "RequestBusy"]
