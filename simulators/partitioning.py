"""Kafka's default key partitioner, so the simulator can name each record's partition when producing it.

Naming the partition lets the publisher match delivery reports to sends: with idempotence on, librdkafka
reports the deliveries of one partition in produce order. The hash is the Java client's ``Utils.murmur2``
(librdkafka's ``murmur2_random`` partitioner is the same function), so the choice is the one any client
would make for the same key.
"""

from __future__ import annotations

_MASK32 = 0xFFFFFFFF
_SEED = 0x9747B28C
_M = 0x5BD1E995
_R = 24


def murmur2(data: bytes) -> int:
    """Kafka's 32-bit murmur2 of ``data``, as the signed int Java returns."""
    length = len(data)
    h = (_SEED ^ length) & _MASK32
    whole = length & ~3
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * _M) & _MASK32
        k ^= k >> _R
        k = (k * _M) & _MASK32
        h = ((h * _M) & _MASK32) ^ k
    tail = length & 3
    if tail:
        h ^= int.from_bytes(data[whole:], "little")
        h = (h * _M) & _MASK32
    h ^= h >> 13
    h = (h * _M) & _MASK32
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for_key(key: bytes, partitions: int) -> int:
    """``toPositive(murmur2(key)) % partitions``: the partition Kafka's default partitioner picks."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions
