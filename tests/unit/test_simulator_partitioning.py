"""Kafka's murmur2 partitioner, re-implemented so the simulator can name each record's partition."""

from __future__ import annotations

import pytest

from simulators.partitioning import murmur2, partition_for_key


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        # Kafka's UtilsTest.testMurmur2 (clients/src/test/java/org/apache/kafka/common/utils/UtilsTest.java)
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
        # every tail length (0-3 bytes after the last whole word)
        (b"1", -1993445489),
        (b"12", 126087238),
        (b"123", -267702483),
        (b"1234", -1614185708),
        (b"12345", -1188365604),
    ],
)
def test_murmur2_matches_the_java_client(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected


def test_partition_is_the_positive_hash_modulo_the_count() -> None:
    # toPositive(-973932308) = -973932308 & 0x7fffffff = 1173551340
    assert partition_for_key(b"21", 7) == 1173551340 % 7
    assert partition_for_key(b"abc", 4) == 479470107 % 4
    keys = [f"dev-{i:06d}".encode() for i in range(1, 2001)]
    counts = [0] * 4
    for key in keys:
        counts[partition_for_key(key, 4)] += 1
    assert min(counts) > 400, counts
