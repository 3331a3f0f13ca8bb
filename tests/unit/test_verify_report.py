from ingest.verify import PartitionCheck, Reconciliation, TruthCheck


def _exact() -> Reconciliation:
    return Reconciliation(
        topic="t",
        partitions=[PartitionCheck(0, 0, 10, 10, 0, 0, 0), PartitionCheck(1, 5, 8, 7, 0, 0, 0)],
        bronze_malformed=2,
        quarantine_rows=2,
        quarantine_not_in_bronze=0,
        quarantine_duplicates=0,
        truth=TruthCheck(sends=17, delivered=17, missing_from_bronze=0, parsed_differently=0, malformed_accepted=0),
    )


def test_exact_reconciliation_has_no_problems() -> None:
    result = _exact()
    assert result.problems == []
    assert "RESULT: exact" in result.report()


def test_each_kind_of_mismatch_is_reported() -> None:
    result = _exact()
    result.partitions[0] = PartitionCheck(0, 0, 10, 11, missing=1, duplicates=2, beyond_high=0)
    result.quarantine_rows = 1
    result.rejects_repeated = 2
    result.truth = TruthCheck(17, 17, missing_from_bronze=1, parsed_differently=0, malformed_accepted=3)
    problems = result.problems
    assert any("partition 0: 1 Kafka records missing, 2 duplicated" in p for p in problems)
    assert any("quarantine holds 1 rows but bronze has 2" in p for p in problems)
    assert "2 rejected readings are quarantined more than once" in problems
    assert any("1 delivered sends missing" in p and "3 corrupted sends accepted" in p for p in problems)
    assert "RESULT: MISMATCH" in result.report()


def test_a_table_comparison_counts_each_kind_of_difference_in_one_pass(spark) -> None:
    from pyspark.sql import functions as F

    from streaming.verify import compare_tables

    schema = "k string, v double, n long, late boolean"
    expected = spark.createDataFrame(
        [
            ("same", 1.0, 1, False),
            ("close", 3.0, 2, False),
            ("off", 2.0, 3, False),
            ("gone", 4.0, 4, False),
            ("pending", 5.0, 5, True),
        ],
        schema,
    )
    actual = spark.createDataFrame(
        [
            ("same", 1.0, 1, None),
            ("close", 3.0 * (1 + 1e-12), 2, None),
            ("off", 2.5, 3, None),
            ("new", 6.0, 6, None),
            ("twice", 7.0, 7, None),
            ("twice", 7.0, 7, None),
        ],
        schema,
    )
    rows, problems = compare_tables(
        expected, actual, ("k",), "t", optional=F.col("e.late"), close=("v",), ignored=("late",)
    )
    assert rows == 5
    assert problems == [
        "t: 1 keys written more than once",
        "t: 1 rows of the batch recomputation are missing",  # "gone"; "pending" may be absent
        "t: 3 rows have no counterpart in the batch recomputation",  # "new" and "twice" twice
        "t: 1 rows differ from the batch recomputation, e.g. Row(k='off')",  # "close" is within the tolerance
    ]
    assert compare_tables(expected, expected, ("k",), "t", close=("v",)) == (5, [])


def test_a_latest_rows_comparison_accepts_the_expected_or_the_alternative_row_and_counts_the_rest(spark) -> None:
    from streaming.verify import _compare_latest_rows

    schema = "k string, status string, since long"
    expected = spark.createDataFrame(
        [("same", "ok", 1), ("behind", "offline", 2), ("off", "ok", 3), ("gone", "ok", 4), ("twice", "ok", 5)],
        schema,
    )
    alternative = spark.createDataFrame([("behind", "ok", 1)], schema)  # where the stream may not be yet
    actual = spark.createDataFrame(
        [
            ("same", "ok", 1),
            ("behind", "ok", 1),
            ("off", "offline", 3),
            ("new", "ok", 6),
            ("twice", "ok", 5),
            ("twice", "ok", 5),
        ],
        schema,
    )
    rows, problems = _compare_latest_rows("t", expected, alternative, actual, ("k",))
    assert rows == 5
    assert problems == [
        "t: 1 keys written more than once",
        "t: 1 rows of the batch recomputation are missing",
        "t: 1 rows have no counterpart in the batch recomputation",
        "t: 1 rows differ from the batch recomputation, e.g. Row(k='off')",
    ]
    assert _compare_latest_rows("t", expected, alternative, expected, ("k",)) == (5, [])
    without_alternative = _compare_latest_rows("t", expected, alternative.limit(0), actual, ("k",))[1]
    assert without_alternative[-1].startswith("t: 2 rows differ from the batch recomputation")  # "behind" too
